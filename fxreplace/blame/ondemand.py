"""Reference on demand: capture from the clean model only the components a pass needs.

A reference captured without components (or with some) is completed as the search goes:
before a round, the components it replaces that the reference lacks are captured from the
clean model for every prompt, teacher-forced over the reference's known tokens (batched
forwards, no generation, ended after the first component the reference holds computed after
them, whose rows are checked against the reference's; forwards that run to the end are checked
to reproduce the reference's tokens), so a search costs O(rounds) captures of what each round
asks, instead of O(layers x kinds) or full captures.
Each capture is a store of its own holding only its components, laid out like the reference
(shards ending after the same prompts, so every prompt's rows sit in the same shard at the same
row). Under a reference directory it is appended in ``blame-components/NNNNN/`` (written by
:class:`~fxreplace.store.StoreWriter`, then memory-mapped), and the next run reads it back
instead of capturing again; otherwise it is held in memory.

The store handed to the engine is the reference joined with the captured parts
(:meth:`~fxreplace.store.ReferenceStore.join`): the components present so far side by side,
read where they lie, no row copied, nothing for the others (the search never selects those).
A compiled target builds its graphs again when a capture adds components.
"""

from __future__ import annotations

import itertools
import shutil
import time
from pathlib import Path
from typing import Callable, Collection, Sequence

import torch
from torch import nn

from ..capture import capture_forced
from ..dtypes import dtype_name
from ..store import ReferenceStore, StoreWriter
from ..store.publish import BLAME_COMPONENTS_DIR as SUBDIR
from .result import BlameError

#: the largest relative error (Frobenius, per prompt) between a witness's rows computed by the
#: batched forward and the reference's: float32 rounding gives ~1e-6, another model's weights ~1
WITNESS_TOLERANCE = 1e-3


class OnDemand:
    """``clean``: the clean model, or a function loading it (then it is in memory only while a
    capture runs)."""

    def __init__(self, clean: nn.Module | Callable[[], nn.Module], reference, components: Sequence, directory: Path | None,
                 *, progress: bool = False):
        self.clean, self.reference, self.progress = clean, reference, progress
        self.by_name = {c.capture_name: c for c in components}
        self.root = None if directory is None else Path(directory) / SUBDIR
        self.parts: list[ReferenceStore] = []  # captured components, each part holding only its own
        self.captured: list[str] = []  # captured in this run
        self.seconds = 0.0  # spent capturing
        folders = sorted(self.root.iterdir()) if self.root is not None and self.root.is_dir() else []
        for folder in folders:
            if not (folder / "index.json").exists():
                continue
            part = ReferenceStore.load(folder)
            difference = reference.store.layout_difference(part)
            if difference:  # written before parts were laid out like the reference
                raise BlameError(f"{folder} holds components captured for this reference but laid out otherwise "
                                 f"({difference}); hint: delete {self.root}: blame captures them again from the clean model")
            self.parts.append(part)
        self._store = ReferenceStore.join([reference.store, *self.parts])

    def present(self, name: str) -> bool:
        return name in self._store.columns

    def rows(self, name: str, p: int) -> torch.Tensor:
        """Prompt ``p``'s rows of component ``name`` (the reference's or a captured part's)."""
        return self._store.rows(p, name)

    def ensure(self, names: Collection[str]) -> bool:
        """Capture the ``names`` not yet present; True when something was captured."""
        need = [n for n in sorted(names) if not self.present(n)]
        if not need:
            return False
        t0 = time.perf_counter()
        ref = self.reference
        ids = ref.store.prompt_ids  # in the reference's order: the part's rows land where the reference's lie
        prompts = [ref.prompt_tokens(p) for p in ids]
        # prompt + the reference's tokens but the last: one row per position the reference stored
        sequences = [prompt + ref.tokens(p)[:-1] for p, prompt in zip(ids, prompts)]
        shard_sizes = torch.bincount(ref.store.prompt_shard).tolist()  # the reference's prompts per shard
        model = self.clean if isinstance(self.clean, nn.Module) else self.clean()
        # a forward ends at the first component the reference holds computed after every asked one (a
        # witness): the layers after it are not run, and its rows, checked against the reference's, stand
        # in for the tokens a whole forward would check. In float32 only, where the batched forward's
        # rounding is far below the tolerance; otherwise (or with no witness after them) the whole forward.
        witnesses = set()
        if dtype_name(next(model.parameters()).dtype) == ref.metadata.get("dtype") == "float32":
            witnesses = {n for n in self.by_name if n not in need and self.present(n)}

        def until(computed: list[str]) -> bool:
            return computed[-1] in witnesses and set(need) <= set(computed)

        captured = capture_forced(model, sequences, [self.by_name[n].target for n in need + sorted(witnesses)],
                                  read_from=[len(prompt) - 1 for prompt in prompts], until=until)
        info = {name: {"kind": self.by_name[name].kind, "layer": self.by_name[name].layer} for name in need}
        part = None if self.root is None else self.root / f"{len(self.parts):05d}"
        try:
            if part is None:
                rows = {}
                for p, (values, picks) in zip(ids, captured):
                    self._check(p, values, picks)
                    rows[p] = {n: values[n] for n in need}
                self.parts.append(ReferenceStore.from_captures(rows, prompt_token_ids=prompts, metadata={"components": info},
                                                               shard_sizes=shard_sizes))
            else:
                part.parent.mkdir(parents=True, exist_ok=True)
                ends = set(itertools.accumulate(shard_sizes))
                with StoreWriter(part, shard_bytes=None, metadata={"components": info}) as writer:
                    for n, (p, prompt, (values, picks)) in enumerate(zip(ids, prompts, captured), 1):
                        self._check(p, values, picks)
                        writer.add(prompt, {name: values[name] for name in need}, prompt_idx=p)
                        if n in ends:  # the reference's shard ends here: so does the part's
                            writer.sync()
                self.parts.append(ReferenceStore.load(part))
        except BaseException:
            if part is not None:
                shutil.rmtree(part, ignore_errors=True)
            raise
        finally:
            captured.close()
            del model
        self.captured += need
        self._store = ReferenceStore.join([self._store, self.parts[-1]])
        self.seconds += time.perf_counter() - t0
        if self.progress:
            print(f"  captured {len(need)} components from the clean model: {', '.join(need)[:200]}")
        return True

    def _check(self, p: int, values: dict, picks: list[int] | None) -> None:
        """The clean model is the reference's: it reproduces the reference's tokens (a whole forward)
        or, in a forward ended at a witness (the last component computed), that component's rows."""
        if picks is None:
            witness = list(values)[-1]
            want = self.rows(witness, p).to(values[witness].dtype)
            error = float((values[witness] - want).norm() / want.norm().clamp_min(1e-30))
            if not error <= WITNESS_TOLERANCE:
                raise ValueError(f"the clean model's {witness} differs from the reference's for prompt {p} (relative "
                                 f"error {error:.2g}): it is not the model the reference was captured from")
            return
        want = self.reference.tokens(p)
        if picks != want:
            raise ValueError(f"the clean model does not reproduce the reference's tokens for prompt {p} "
                             f"({picks[:8]} ... vs {want[:8]} ...): it is not the model the reference was captured from")

    def store(self) -> ReferenceStore:
        """The components present (the reference's and the captured ones) as one store for the
        replacer, joined where they lie: the reference's own until a capture adds some."""
        return self._store
