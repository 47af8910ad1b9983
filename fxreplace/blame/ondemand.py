"""Reference on demand: capture from the clean model only the components a pass needs.

A reference captured without components (or with some) is completed as the search goes:
before a round, the components it replaces that the reference lacks are captured from the
clean model for every prompt, teacher-forced over the reference's known tokens (batched
forwards, no generation, ended after the first component the reference holds computed after
them, whose rows are checked against the reference's; forwards that run to the end are checked
to reproduce the reference's tokens), so a search costs O(rounds) captures of what each round
asks, instead of O(layers x kinds) or full captures.
Under a reference directory each capture is appended as a store of its own in
``blame-components/NNNNN/`` holding only its components (written by
:class:`~fxreplace.store.StoreWriter`, then memory-mapped), and the next run reads it back
instead of capturing again.

The store handed to the engine holds the components present so far (the reference's and the
captured ones), nothing for the others (the search never selects those): a compiled target
builds its graphs again when a capture adds components.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable, Collection, Sequence

import torch
from torch import nn

from ..store import ReferenceStore, StoreWriter
from ..store.format import BLAME_COMPONENTS_DIR as SUBDIR

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
        self.seconds = 0.0  # spent completing the reference: captures, and the store that holds them
        self._store: ReferenceStore | None = None
        if self.root is not None and self.root.is_dir():
            self.parts = [ReferenceStore.load(p) for p in sorted(self.root.iterdir()) if (p / "index.json").exists()]

    def present(self, name: str) -> bool:
        return name in self.reference.store.columns or self._part(name) is not None

    def _part(self, name: str) -> ReferenceStore | None:
        return next((part for part in self.parts if name in part.columns), None)

    def rows(self, name: str, p: int) -> torch.Tensor:
        """Prompt ``p``'s rows of component ``name`` (the reference's or a captured part's)."""
        store = self.reference.store if name in self.reference.store.columns else self._part(name)
        return store.rows(p, name)

    def ensure(self, names: Collection[str]) -> bool:
        """Capture the ``names`` not yet present; True when something was captured."""
        need = [n for n in sorted(names) if not self.present(n)]
        if not need:
            return False
        from ..capture import capture_forced

        t0 = time.perf_counter()
        ref = self.reference
        prompts = [ref.prompt_tokens(p) for p in range(ref.num_prompts)]
        # prompt + the reference's tokens but the last: one row per position the reference stored
        sequences = [prompts[p] + ref.tokens(p)[:-1] for p in range(ref.num_prompts)]
        model = self.clean if isinstance(self.clean, nn.Module) else self.clean()
        # a forward ends at the first component the reference holds computed after every asked one (a
        # witness): the layers after it are not run, and its rows, checked against the reference's, stand
        # in for the tokens a whole forward would check. In float32 only, where the batched forward's
        # rounding is far below the tolerance; otherwise (or with no witness after them) the whole forward.
        witnesses = set()
        if str(next(model.parameters()).dtype).removeprefix("torch.") == ref.metadata.get("dtype") == "float32":
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
                for p, (values, picks) in enumerate(captured):
                    self._check(p, values, picks)
                    rows[p] = {n: values[n] for n in need}
                self.parts.append(ReferenceStore.from_captures(rows, prompt_token_ids=prompts, metadata={"components": info}))
            else:
                part.parent.mkdir(parents=True, exist_ok=True)
                with StoreWriter(part, metadata={"components": info}) as writer:
                    for p, (values, picks) in enumerate(captured):
                        self._check(p, values, picks)
                        writer.add(prompts[p], {n: values[n] for n in need}, prompt_idx=p)
                self.parts.append(ReferenceStore.load(part))
        except BaseException:
            if part is not None:
                shutil.rmtree(part, ignore_errors=True)
            raise
        finally:
            captured.close()
            del model
        self.captured += need
        self._store = None
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
        """The components present (the reference's and the captured ones) as one store for the replacer:
        the reference's own until a capture adds some."""
        if not self.parts:
            return self.reference.store
        if self._store is None:
            t0 = time.perf_counter()
            ref = self.reference
            names = [n for n in self.by_name if self.present(n)]
            flat = {p: {n: self.rows(n, p) for n in names} for p in range(ref.num_prompts)}
            # rows only: the search reads the generation (tokens, logits) from the reference itself
            self._store = ReferenceStore.from_captures(
                flat, prompt_token_ids=[ref.prompt_tokens(p) for p in range(ref.num_prompts)], metadata=dict(ref.metadata))
            self.seconds += time.perf_counter() - t0
        return self._store
