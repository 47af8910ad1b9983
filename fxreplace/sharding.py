"""The slice of a full ``[T, E]`` replacement that one rank's module computes.

Replacements enter the graph unsharded. Slicing is expressed as tensor ops so a
single SPMD graph serves every rank when the rank is a tensor input (as Neuron
compiles): no Python branch ever depends on the rank's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from .errors import ShapeError

MODES = ("sequence", "expert", "data")


@dataclass(frozen=True, eq=False)
class ShardSpec:
    """How the injection point is partitioned across ``world_size`` ranks.

    ``mode``: ``"sequence"`` (the module sees rows ``rank*T/world ...``),
    ``"expert"`` (it sees columns ``rank*E/world ...``) or ``"data"`` (each
    replica gets its own context: nothing to slice).
    ``rank``: a Python int, or a 0-d integer tensor that the graph reads at run
    time (set it in place to move a compiled graph to another rank).
    """

    mode: str
    world_size: int = 1
    rank: Union[int, torch.Tensor] = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"shard mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if isinstance(self.rank, torch.Tensor):
            if self.rank.dim() != 0 or self.rank.dtype.is_floating_point or self.rank.dtype == torch.bool:
                raise ValueError(f"a rank tensor must be a 0-d integer tensor, got {self.rank!r}")
            check_rank_value(self.rank, self.world_size)
        elif isinstance(self.rank, bool) or not hasattr(type(self.rank), "__index__"):  # 1.0, "1": fail at the forward
            raise ValueError(f"rank must be an int or a 0-d integer tensor, got {type(self.rank).__name__} {self.rank!r}")
        elif not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")

    def __repr__(self) -> str:
        rank = f"tensor({int(self.rank)})" if isinstance(self.rank, torch.Tensor) and not _tracing() else self.rank
        return f"ShardSpec({self.mode!r}, world_size={self.world_size}, rank={rank})"

    @classmethod
    def from_process_group(cls, mode: str, group=None, *, rank_as_tensor: bool = False) -> "ShardSpec":
        """The spec for this process in ``group`` (default: the world group of
        ``torch.distributed``), so world size and rank cannot disagree with the
        process group. ``rank_as_tensor=True`` gives a 0-d rank tensor: one SPMD
        graph for every rank."""
        import torch.distributed as dist  # a spec from a process group only

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardSpec.from_process_group needs an initialised torch.distributed process group")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        return cls(mode, world_size, torch.tensor(rank) if rank_as_tensor else rank)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def check_rank_value(rank: torch.Tensor, world_size: int) -> None:
    """Range-check a rank tensor in eager mode (never inside a traced graph)."""
    if not _tracing() and not 0 <= int(rank) < world_size:
        raise ValueError(f"rank {int(rank)} out of range for world_size {world_size}")


def require(condition, message: Callable[[], str]) -> None:
    """Raise :class:`ShapeError` now when ``condition`` is a concrete bool;
    for symbolic shapes, record a check that the compiled graph asserts.
    ``message`` is a callable so symbolic sizes are only formatted on failure."""
    if isinstance(condition, torch.Tensor) and torch.jit.is_tracing():  # jit.trace traces sizes as tensors
        condition = bool(condition)
    if isinstance(condition, bool):
        if not condition:
            raise ShapeError(message())
    else:
        torch._check(condition, message)


def _local_block(x: torch.Tensor, dim: int, world_size: int, rank, what: Callable[[], str]) -> torch.Tensor:
    size = x.shape[dim]
    require(size % world_size == 0, lambda: f"{what()}: size {size} is not divisible by world_size {world_size}")
    block = size // world_size
    if isinstance(rank, int):
        return x.narrow(dim, rank * block, block)
    check_rank_value(rank, world_size)
    index = rank.to(torch.long) * block + torch.arange(block, device=x.device)
    return x.index_select(dim, index)


def shard_rows(x: torch.Tensor, spec: ShardSpec | None, rank, what: Callable[[], str]) -> torch.Tensor:
    """Sequence parallel: this rank's block of rows (tokens). ``what()`` names them in an error
    (a callable: a name formatted on every call would be a constant a compiled graph guards on)."""
    if spec is None or spec.mode != "sequence" or spec.world_size == 1:
        return x
    return _local_block(x, 0, spec.world_size, rank, what)


def shard_columns(x: torch.Tensor, spec: ShardSpec | None, rank, what: Callable[[], str]) -> torch.Tensor:
    """Expert parallel: this rank's block of the last (expert) dimension."""
    if spec is None or spec.mode != "expert" or spec.world_size == 1:
        return x
    return _local_block(x, x.dim() - 1, spec.world_size, rank, what)


def layout_hint(spec: ShardSpec | None, replacement_shape, computed_shape) -> str:
    """Why a replacement does not fit a sharded module: appended to shape errors.
    Called only when formatting an error, so sizes are concrete."""
    if spec is None:
        return _missing_spec_hint(replacement_shape, computed_shape)
    if spec.mode == "data" or spec.world_size == 1:
        return ""
    world = spec.world_size
    if spec.mode == "sequence":
        local = 1
        for size in computed_shape[:-1]:
            local *= int(size)
        full = int(replacement_shape[0]) if len(replacement_shape) else 0
        hint = f" [{spec}: this rank computes {local} tokens, so the full replacement has {local * world}]"
        if full % world:
            return hint + f"; {full} tokens cannot be split evenly over world_size {world}"
        if full == local:
            return hint + (f"; the module sees all {full} tokens of the replacement, so its input is not "
                           "sequence-sharded: drop the shard spec, or scatter the tokens before this module")
        return hint + f"; a sequence-parallel split of {full} tokens gives {full // world} per rank, not {local}"
    # expert
    local = int(computed_shape[-1])
    hint = f" [{spec}: this rank computes {local} experts, so the full replacement has {local * world}]"
    full = int(replacement_shape[-1]) if len(replacement_shape) else 0
    if full == local:
        return hint + (f"; the module computes all {full} experts, so its output is not expert-sharded: drop the "
                       "shard spec, or put the target where the experts are split")
    return hint


def _missing_spec_hint(replacement_shape, computed_shape) -> str:
    """A target without a spec whose module computes a whole fraction of the
    replacement's rows or columns: name the spec that makes the shapes agree."""
    if len(replacement_shape) != 2 or not len(computed_shape):
        return ""
    local_rows = 1
    for size in computed_shape[:-1]:
        local_rows *= int(size)
    full_rows, full_columns, local_columns = int(replacement_shape[0]), int(replacement_shape[1]), int(computed_shape[-1])
    if local_rows and full_rows != local_rows and full_rows % local_rows == 0:
        world = full_rows // local_rows
        return (f"; the module computes 1/{world} of the replacement's {full_rows} tokens: if its tokens are split "
                f"over {world} ranks, give the target shard=ShardSpec(\"sequence\", {world}, rank)")
    if local_columns and full_columns != local_columns and full_columns % local_columns == 0:
        world = full_columns // local_columns
        return (f"; the module computes {local_columns} of the replacement's {full_columns} experts: if its experts "
                f"are split over {world} ranks, give the target shard=ShardSpec(\"expert\", {world}, rank)")
    return ""


def rows_before_sharding(local_rows, spec: ShardSpec | None):
    """Token count of the full replacement given the rows one rank computes."""
    if spec is not None and spec.mode == "sequence":
        return local_rows * spec.world_size
    return local_rows
