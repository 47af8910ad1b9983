"""What a store folder holds, in words: what a command says it left on disk when it stops early."""

from __future__ import annotations

from pathlib import Path

from ..words import plural
from ..words import one_line
from .reference_store import ReferenceStore
from .writer import unfinished


def describe_store(path) -> str:
    """What a store folder holds, in a few words: nothing, a loadable store of N prompts, or
    one that does not load (and why)."""

    directory = Path(path)
    if not directory.is_dir() or not any(directory.iterdir()):
        return "nothing"
    try:
        store = ReferenceStore.load(directory)
    except Exception as e:  # noqa: BLE001 - any reason it does not load is what to report
        if unfinished(directory):
            return "an unfinished store with no prompt written yet"
        return f"a store that does not load ({one_line(e, 160)})"
    if unfinished(directory):
        return (f"an unfinished store: the {plural(store.num_prompts, 'prompt')} written so far load, "
                "the later ones are missing")
    return f"a loadable store of {plural(store.num_prompts, 'prompt')}"
