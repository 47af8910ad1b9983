"""Placing a whole store directory in one step (written into a staging sibling, then renamed), and what a
store directory may hold: the store's files and the entries other subsystems keep in it, anything else being
someone else's and never replaced."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import uuid
from pathlib import Path

from .format import INDEX_FILE, TENSORS_FILE

# The entries other subsystems keep in a store directory are named here, in the store's lowest layer, so that
# every save and every check of a directory knows them whatever has been imported; those subsystems name them
# from here.
#: Folders fxreplace adds inside a store, derived from its prompts (``fxreplace blame --clean``
#: keeps the components it captured there, laid out like it): part of the reference, replaced
#: with it, repacked alike by repack (same prompt indices), left out by a merge (indices change;
#: blame captures again).
BLAME_COMPONENTS_DIR = "blame-components"
DERIVED_DIRS = (BLAME_COMPONENTS_DIR,)
#: A vLLM capture's counts, written beside its store (fxreplace.engines.vllm.capture_worker).
CAPTURE_STATS_FILE = "capture.json"
#: The file in a reference directory that holds its noise floors, by dtype, each with its own metadata
#: (the store's own metadata is written when its capture starts, before the floor can be measured):
#: part of the reference, replaced with it by a new capture into the same folder.
FLOOR_FILE = "noise_floors.json"


def staging_directory(directory: Path) -> Path:
    """A new empty sibling of ``directory`` to write a whole store into before :func:`publish_directory`."""
    if directory.is_symlink():
        directory = directory.resolve()
    if _is_file(directory):
        raise NotADirectoryError(f"{directory} is a file, not a directory; a store is written into a directory")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = directory.parent / f".{directory.name}.writing-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as e:
        raise OSError(f"cannot write a store at {directory}: {e.strerror or e}") from None
    return staging


def _is_file(path: Path) -> bool:
    """Whether ``path`` exists as something other than a directory, in one look: a store
    directory that another saver is replacing is missing for a moment, which is no file."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def is_store_entry(name: str) -> bool:
    """Whether a directory entry of this name is part of a store (its files, or a folder
    fxreplace derived from it): anything else is someone else's and never replaced."""
    return (name in (TENSORS_FILE, INDEX_FILE, CAPTURE_STATS_FILE, FLOOR_FILE, *DERIVED_DIRS)
            or re.fullmatch(r"shard-\d{5,}\.safetensors(\.tmp)?", name) is not None)


def foreign_entries(directory: Path) -> list[str]:
    """The entries of ``directory`` that are not a store's (see :func:`is_store_entry`)."""
    return sorted(p.name for p in directory.iterdir() if not is_store_entry(p.name))


def publish_directory(staging: Path, directory: Path, *, replace: bool) -> None:
    """Rename the complete store in ``staging`` to ``directory`` in one step, so a reader or
    another saver sees a whole store or none, never a mix. An existing non-empty
    ``directory`` is replaced only with ``replace`` and when it holds nothing but store
    files (its old content is moved aside first, then deleted)."""
    if directory.is_symlink():
        directory = directory.resolve()
    old_ones = []
    try:
        for _ in range(100):
            try:
                os.rename(staging, directory)  # replaces a missing or empty directory atomically
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
            if _is_file(directory):
                raise NotADirectoryError(f"{directory} is a file, not a directory; a store is written into a directory")
            if not replace:
                raise FileExistsError(f"{directory} is not empty; a new store needs a new or empty directory")
            try:
                foreign = foreign_entries(directory)
            except FileNotFoundError:
                continue  # another saver moved it aside meanwhile
            if foreign:
                raise FileExistsError(f"{directory} holds files that are not a store's ({foreign[:3]}); "
                                      "save into a new or empty directory")
            old = staging.with_name(f"{staging.name}.old{len(old_ones)}")
            try:
                os.rename(directory, old)
            except FileNotFoundError:
                continue
            old_ones.append(old)
        raise OSError(f"could not place the store at {directory}: other processes kept replacing it")
    finally:
        for old in old_ones:
            shutil.rmtree(old, ignore_errors=True)
