"""vLLM's shared-memory segments in ``/dev/shm``: removed when an engine is torn down.

A vLLM engine's processes talk through shared memory: the message queues between front
end, engine core and workers (Python ``SharedMemory`` segments, ``psm_*``, ~250 MB each)
and, for a CPU TP/PP group, one segment per rank (``<port>-<group>-cpushm_<rank>``). A
segment is unlinked only when its creator exits normally; a torn-down or killed engine
leaves them behind, filling ``/dev/shm`` (and a later engine whose rendezvous port repeats
a ``cpushm`` name fails at start-up with "create shm in SHMManager failed. errno: 17"). Its
processes' locks are named semaphores (``sem.mp-*``, 32 bytes each) that multiprocessing's resource
tracker unlinks at its exit: an interrupted start kills the tracker with the engine, and they stay.
A segment in use is mapped or held open by a process from its creation on, so the ones no
process maps or holds open are leftovers.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
PATTERNS = ("psm_*", "*-cpushm_*", "sem.mp-*")


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
    users = _users(names, shm)
    return sorted(name for name in users if not users[name])


def _users(names, shm: Path = SHM) -> dict[str, set[int]]:
    """For each segment of ``names``, the live processes that map it or hold it open. A segment
    is known by its inode, not its path: glibc makes a named semaphore under a temporary name,
    maps it, then links the final name (``sem.mp-*``), so its creator's mapping never shows that
    name (a sweep by path took a starting engine's locks for leftovers)."""
    users: dict[str, set[int]] = {name: set() for name in names}
    if not users:
        return users
    by_inode = {}
    for name in names:
        try:
            by_inode[(shm / name).stat().st_ino] = name
        except OSError:  # gone meanwhile
            pass
    device = shm.stat().st_dev
    inside = f"{shm.resolve()}/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            mapped = [int(line.split(maxsplit=5)[4]) for line in (proc / "maps").read_text().splitlines()
                      if inside in line]
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone meanwhile, or another user's (whose segments are not ours to unlink)
            continue
        mapped += [inode for inode in map(functools.partial(_inode_on, device), fds) if inode is not None]
        for inode in mapped:
            name = by_inode.get(inode)
            if name is not None:
                users[name].add(int(proc.name))
    return users


def _in_our_group(pid: int) -> bool:
    """Whether ``pid`` is in this process's group: the engine's processes stay in it (a Ctrl-C
    reaches them all), even once the engine core that started the workers is gone."""
    try:
        return os.getpgid(pid) == os.getpgrp()
    except OSError:  # exited meanwhile
        return False


class Cleanup:
    """Remove the segments an engine created once it is torn down: ``Cleanup()`` before the
    engine starts, ``.after_teardown()`` after its shutdown."""

    def __init__(self, shm: Path = SHM):
        self.shm = shm
        self.before = segments(shm)

    def after_teardown(self, wait_s: float = 10.0, own_wait_s: float = 120.0) -> list[str]:
        """The engine's processes may still be exiting when its shutdown returns (an interrupted
        one on a loaded machine, for tens of seconds), their segments still mapped: wait until the
        new segments are unused (at most ``own_wait_s`` while a process of this one's group maps
        one, else ``wait_s``), then remove the unused ones; one still in use then is another live
        engine's."""
        started = time.monotonic()
        while True:
            created = segments(self.shm) - self.before
            users = set().union(*_users(created, self.shm).values()) - {os.getpid()}  # waiting frees no mapping of ours
            limit = own_wait_s if any(map(_in_our_group, users)) else wait_s
            if not users or time.monotonic() - started > limit:
                removed = remove_unused(created, self.shm)
                _forget(removed)
                return removed
            time.sleep(0.1)


def _forget(names) -> None:
    """Have this process's multiprocessing resource tracker forget the ``psm_*`` segments removed here:
    the engine's processes (spawned, they share it) registered them, and at exit it would warn of each
    as leaked, then fail to unlink it ("No such file or directory") after the command's last line. A
    registration before the removal makes it forget a name it never held, too (it keeps a set)."""
    from multiprocessing import resource_tracker

    for name in names:
        if name.startswith("psm_"):
            resource_tracker.register(f"/{name}", "shared_memory")
            resource_tracker.unregister(f"/{name}", "shared_memory")


def _inode_on(device: int, fd: Path) -> int | None:
    """The inode of the file ``fd`` holds open when it is on ``device``, else None."""
    try:
        stat = fd.stat()
    except OSError:  # closed meanwhile
        return None
    return stat.st_ino if stat.st_dev == device else None
