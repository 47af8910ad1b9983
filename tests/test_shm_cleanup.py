"""An engine's shared-memory segments are removed at its teardown, also when its processes take
longer to exit than a quick shutdown does (an interrupted engine on a loaded machine), while a
segment another live engine maps is kept (:class:`fxreplace.engines.vllm.shm.Cleanup`)."""

import subprocess
import sys
import time

from fxreplace.engines.vllm.shm import Cleanup, segments, unused

HOLD = """
import mmap, sys, time
with open(sys.argv[1], "w+b") as f:
    f.truncate(4096)
    mapped = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
time.sleep(float(sys.argv[2]))
"""


def holding(path, seconds: float, **popen) -> subprocess.Popen:
    """A process mapping the segment ``path`` for ``seconds``, then exiting without unlinking it (as an engine's do)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True,
                            **popen)
    assert proc.stdout.readline() == "mapped\n"
    return proc


def test_the_engines_slowly_exiting_process_is_waited_for_and_its_segment_removed(tmp_path):
    cleanup = Cleanup(tmp_path)
    engine = holding(tmp_path / "psm_engine", 3)  # in this process's group, as the engine's processes are
    started = time.monotonic()
    assert cleanup.after_teardown(wait_s=0.5, own_wait_s=60) == ["psm_engine"]
    assert time.monotonic() - started >= 2 and engine.wait(timeout=10) == 0
    assert not (tmp_path / "psm_engine").exists()


def test_another_live_engines_segment_is_kept(tmp_path):
    (tmp_path / "psm_before").write_bytes(b"")  # there before this engine: not its to remove
    cleanup = Cleanup(tmp_path)
    other = holding(tmp_path / "psm_other", 60, start_new_session=True)  # another command's engine
    try:
        (tmp_path / "psm_ours").write_bytes(b"")  # this engine's, unmapped once it exited
        started = time.monotonic()
        assert cleanup.after_teardown(wait_s=0.5, own_wait_s=60) == ["psm_ours"]
        assert time.monotonic() - started < 30  # not the wait for a process of our own
        assert sorted(p.name for p in tmp_path.iterdir()) == ["psm_before", "psm_other"]
    finally:
        other.kill()
        other.wait()


SEMAPHORE = """
import multiprocessing, sys
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, sem.mp-*, as an engine's processes make
print("locked", flush=True)
sys.stdin.read()  # held until told
"""


def test_another_engines_starting_lock_is_kept():
    """glibc makes a named semaphore under a temporary name and links ``sem.mp-*`` to it afterwards,
    so its creator's mapping never shows that name: the sweep after one engine's teardown must still
    see it in use (it took a sibling engine's locks while that one started, which then failed)."""
    cleanup = Cleanup()
    other = subprocess.Popen([sys.executable, "-c", SEMAPHORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)  # another command's engine, starting
    try:
        assert other.stdout.readline() == "locked\n"
        created = segments() - cleanup.before
        assert created and all(name.startswith("sem.mp-") for name in created)
        assert unused(created) == []
        assert cleanup.after_teardown(wait_s=0.2, own_wait_s=0.2) == [] and segments() >= created
    finally:
        other.communicate("")
    assert not created & segments()  # its creator's resource tracker unlinked it at exit


LEAKED = """
import sys
from multiprocessing import shared_memory
from pathlib import Path
from fxreplace.engines.vllm.shm import Cleanup, segments, unused

cleanup = Cleanup()
segment = shared_memory.SharedMemory(create=True, size=4096)  # registered with this process's resource tracker
segment.close()  # closed, not unlinked: what a torn-down engine process leaves
if sys.argv[1] == "cleanup":
    assert cleanup.after_teardown(wait_s=1, own_wait_s=1) == [segment.name.lstrip("/")]
else:
    (Path("/dev/shm") / segment.name.lstrip("/")).unlink()  # removed without telling the tracker
"""


def test_a_removed_segment_is_not_reported_leaked_after_the_commands_last_line():
    """The engine's processes register their queues with the resource tracker they share with the command;
    a segment the cleanup removes is forgotten there, so the tracker does not warn at exit that it leaked
    and then fail to unlink it."""
    told = subprocess.run([sys.executable, "-c", LEAKED, "cleanup"], capture_output=True, text=True, timeout=60)
    assert told.returncode == 0 and "resource_tracker" not in told.stderr, told.stderr
    untold = subprocess.run([sys.executable, "-c", LEAKED, "unlink"], capture_output=True, text=True, timeout=60)
    assert "leaked shared_memory objects" in untold.stderr and "No such file" in untold.stderr, untold.stderr
