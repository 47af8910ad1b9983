"""Reference store: captured tensors flattened to one row per token position.

Captures arrive step-wise, as the reference model produced them::

    [ {capture_name: [step_0 [1, L, E], step_1 [1, L+1, E] or [1, 1, E], ...]}, ... ]   # one dict per prompt

or already flat, ``{prompt_idx: {capture_name: Tensor[P, E]}}``. A *capture name* is
the name a reference tensor is stored under (e.g. ``"model.layers.0.mlp.gate"``).
The store flattens them into *groups*: the capture names of one (dtype, width) share
one position-major tensor ``[rows + 1, capture names, E]``. Prompt ``p`` owns rows
``offsets[p] : offsets[p] + lengths[p]`` and the last row is zeros, so one
``index_select`` on the row dimension serves every capture name of a group for a whole
batch (padding slots point at the zero row), each row one contiguous read however
scattered a decode step's rows are; each name's result is a ``[T, E]`` column of it.

A store is one or more *shards*. Each shard is a self-contained safetensors file:
its groups, its prompts' row offsets/lengths, token ids and per-prompt extras (e.g.
generated tokens and logits), and a JSON index in its header with a SHA-256 digest
of every tensor. A directory store lists its shards in ``index.json``. Loading reads
headers and the per-prompt tables only (O(index)) and memory-maps the groups; the
index is validated against the tensors' metadata, never by reading the rows.
:class:`StoreWriter` streams prompts into shards as they finish; :func:`merge_stores`
combines stores captured by several engines; :func:`repack_store` joins a store's small
shards into fewer; :func:`describe_store` says what a folder holds.
"""

from .format import (FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, SHARD_PATTERN, TENSORS_FILE, WRITER_MARKER,
                     CaptureColumns, CaptureError, Group, Shard, StoreError)
from .rules import GENERATED_LOGITS, GENERATED_TOKENS, PER_PROMPT_METADATA
from .legacy import load_captures, load_legacy, load_token_ids
from .merge import merge_stores, repack_store
from .reference_store import ReferenceStore
from .state import describe_store
from .writer import StoreWriter, unfinished

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "GENERATED_LOGITS", "GENERATED_TOKENS", "PER_PROMPT_METADATA", "INDEX_FILE", "SHARD_PATTERN", "TENSORS_FILE", "WRITER_MARKER",
    "CaptureColumns", "CaptureError", "Group", "Shard", "StoreError", "ReferenceStore", "StoreWriter",
    "unfinished", "describe_store", "merge_stores", "repack_store", "load_captures", "load_legacy", "load_token_ids",
]
