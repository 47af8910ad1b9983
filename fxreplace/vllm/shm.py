"""vLLM's shared-memory segments in ``/dev/shm``: removed when an engine is torn down.

A vLLM engine's processes talk through shared memory: the message queues between front
end, engine core and workers (Python ``SharedMemory`` segments, ``psm_*``, ~250 MB each)
and, for a CPU TP/PP group, one segment per rank (``<port>-<group>-cpushm_<rank>``). A
segment is unlinked only when its creator exits normally; a torn-down or killed engine
leaves them behind, filling ``/dev/shm`` (and a later engine whose rendezvous port repeats
a ``cpushm`` name fails at start-up with "create shm in SHMManager failed. errno: 17").
A segment in use is mapped or held open by a process from its creation on, so the ones no
process maps or holds open are leftovers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
PATTERNS = ("psm_*", "*-cpushm_*")


def segments(shm: Path = SHM) -> set[str]:
    """The names of vLLM's kinds of segments in ``shm`` now."""
    return {path.name for pattern in PATTERNS for path in shm.glob(pattern)}


def remove_unused(names, shm: Path = SHM) -> list[str]:
    """Unlink the segments of ``names`` that no live process maps or holds open (another
    engine's, starting or serving meanwhile, are kept); the names removed, sorted."""
    removed = []
    for name in unused(names, shm):
        try:
            (shm / name).unlink()
            removed.append(name)
        except OSError:
            pass
    return removed


def unused(names, shm: Path = SHM) -> list[str]:
    """The segments of ``names`` that no live process maps or holds open, sorted."""
    leftovers = set(names)
    if not leftovers:
        return []
    inside = f"{shm.resolve()}/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            used = [line[line.index(inside):] for line in (proc / "maps").read_text().splitlines() if inside in line]
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone meanwhile, or another user's (whose segments are not ours to unlink)
            continue
        used += [target for target in map(_link_target, fds) if target.startswith(inside)]
        leftovers.difference_update(path.removeprefix(inside).removesuffix(" (deleted)") for path in used)
    return sorted(leftovers)


class Cleanup:
    """Remove the segments an engine created once it is torn down: ``Cleanup()`` before the
    engine starts, ``.after_teardown()`` after its shutdown."""

    def __init__(self, shm: Path = SHM):
        self.shm = shm
        self.before = segments(shm)

    def after_teardown(self, wait_s: float = 10.0) -> list[str]:
        """The engine's worker processes may still be exiting when its shutdown returns, their
        segments still mapped: wait (at most ``wait_s``) until the new segments are unused, then
        remove the unused ones; one still in use then is another live engine's."""
        deadline = time.monotonic() + wait_s
        created = segments(self.shm) - self.before
        while created and len(unused(created, self.shm)) < len(created) and time.monotonic() < deadline:
            time.sleep(0.1)
            created = segments(self.shm) - self.before
        return remove_unused(created, self.shm)


def _link_target(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # closed meanwhile
        return ""
