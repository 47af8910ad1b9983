"""Reference on demand: capture from the clean model only the components a pass needs.

A reference captured without components (or with some) is completed as the search goes:
before a round, the components it replaces that the reference lacks are captured from the
clean model for every prompt (one greedy generation, checked to reproduce the
reference's tokens), so a search costs O(rounds) captures instead of O(layers x kinds).
Under a reference directory each capture is appended as a store of its own in
``blame-components/NNNNN/`` (written by :class:`~fxreplace.store.StoreWriter`) and the next
run reads it back instead of capturing again.

The store handed to the engine holds every component from the start (zero rows until
captured; the search never selects those), so its replacement contexts keep one layout and
a compiled target keeps its graphs when a capture adds components.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Collection, Sequence

import torch

from ..reference import LOGITS, TOKENS
from ..store import ReferenceStore, StoreWriter
from ..store.format import BLAME_COMPONENTS_DIR as SUBDIR


class OnDemand:
    def __init__(self, clean, reference, components: Sequence, directory: Path | None, *, progress: bool = False):
        self.clean, self.reference, self.progress = clean, reference, progress
        self.by_name = {c.capture_name: c for c in components}
        self.root = None if directory is None else Path(directory) / SUBDIR
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # capture name -> prompt -> [positions, E]
        self.captured: list[str] = []  # captured in this run
        self.seconds = 0.0  # spent completing the reference: captures, and the store that holds them
        self._store: ReferenceStore | None = None
        self._blank: dict[str, torch.Tensor] | None = None  # per component a zero row: its width and dtype
        if self.root is not None and self.root.is_dir():
            for part in sorted(p for p in self.root.iterdir() if (p / "index.json").exists()):
                saved = ReferenceStore.load(part)
                for name in saved.capture_names:
                    self.rows[name] = {p: saved.rows(p, name) for p in saved.prompt_ids}

    def present(self, name: str) -> bool:
        return name in self.reference.store.columns or name in self.rows

    def ensure(self, names: Collection[str]) -> bool:
        """Capture the ``names`` not yet present; True when something was captured."""
        need = [n for n in sorted(names) if not self.present(n)]
        if not need:
            return False
        from ..capture import capture_reference

        t0 = time.perf_counter()
        ref = self.reference
        prompts = [ref.prompt_tokens(p) for p in range(ref.num_prompts)]
        steps = max(ref.num_generated(p) for p in range(ref.num_prompts))
        fresh = capture_reference(self.clean, prompts, [self.by_name[n].target for n in need], steps, progress=False)
        for p in range(ref.num_prompts):
            n = ref.num_generated(p)
            if fresh.tokens(p)[:n] != ref.tokens(p):
                raise ValueError(f"the clean model does not reproduce the reference's tokens for prompt {p} "
                                 f"({fresh.tokens(p)[:n][:8]} ... vs {ref.tokens(p)[:8]} ...): it is not the model "
                                 "the reference was captured from")
        new = {name: {p: fresh.store.rows(p, name)[: len(prompts[p]) + ref.num_generated(p) - 1].clone()
                      for p in range(ref.num_prompts)} for name in need}
        if self.root is not None:
            self._append(new)
        self.rows.update(new)
        self.captured += need
        self._store = None
        self.seconds += time.perf_counter() - t0
        if self.progress:
            print(f"  captured {len(need)} components from the clean model: {', '.join(need)[:200]}")
        return True

    def _append(self, new: dict[str, dict[int, torch.Tensor]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        part = self.root / f"{len([p for p in self.root.iterdir() if p.is_dir()]):05d}"
        info = {name: {"kind": self.by_name[name].kind, "layer": self.by_name[name].layer} for name in new}
        with StoreWriter(part, metadata={"components": info}) as writer:
            for p in range(self.reference.num_prompts):
                writer.add(self.reference.prompt_tokens(p), {name: rows[p] for name, rows in new.items()}, prompt_idx=p)

    def store(self) -> ReferenceStore:
        """Every component (the reference's, the captured ones, zeros for the rest) as one store
        for the replacer."""
        if self._store is None:
            t0 = time.perf_counter()
            ref = self.reference
            blank = self._blanks()

            def rows(p, n):
                if n in self.rows:
                    return self.rows[n][p]
                if n in ref.store.columns:
                    return ref.store.rows(p, n)
                return blank[n].expand(len(ref.prompt_tokens(p)) + ref.num_generated(p) - 1, -1)

            flat = {p: {n: rows(p, n) for n in self.by_name} for p in range(ref.num_prompts)}
            extras = {TOKENS: [ref.store.extra(TOKENS, p) for p in range(ref.num_prompts)],
                      LOGITS: [ref.logits(p) for p in range(ref.num_prompts)]}
            self._store = ReferenceStore.from_captures(
                flat, prompt_token_ids=[ref.prompt_tokens(p) for p in range(ref.num_prompts)],
                metadata=dict(ref.metadata), extras=extras)
            self.seconds += time.perf_counter() - t0
        return self._store

    def _blanks(self) -> dict[str, torch.Tensor]:
        """A zero row per component: widths and dtypes from one step of the clean model on one token."""
        if self._blank is None:
            from ..capture import capture_reference

            probe = capture_reference(self.clean, [self.reference.prompt_tokens(0)[:1]],
                                      [c.target for c in self.by_name.values()], 1, progress=False)
            self._blank = {n: torch.zeros_like(probe.store.rows(0, n)[:1]) for n in self.by_name}
        return self._blank
