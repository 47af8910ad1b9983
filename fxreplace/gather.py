"""Store rows into a context: ``dst[m, i] = src[m, rows[i]]`` for every module ``m``.

A large decode batch reads one row per slot and module at random from a store far larger
than the cache, so its time is the memory's latency rather than its bandwidth. The
package's C loop (``fxreplace/_gather.c``, built at install where a C compiler with OpenMP
is found) requests rows a few ahead of the one it copies and runs on torch's own OpenMP
threads (``index_select`` takes 1.0-1.6x its time on ``bench_context``'s decode batches).
Where it is not built, and for tensors off the host, ``index_select`` does the same work."""

from __future__ import annotations

import torch

try:
    from fxreplace import _gather
except ImportError:  # installed without a C compiler (the extension is optional)
    _gather = None

NATIVE = _gather is not None


def gather_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[:, i] = src[:, rows[i]]`` for ``[modules, rows, E]`` tensors, ``rows`` an int64
    tensor on ``src``'s device. ``dst`` may be a view into a larger context (``leading()``)."""
    if _gather is not None and _host_rows(src) and _host_rows(dst) and _no_overlap(dst) and rows.device.type == "cpu" and (
            rows.dtype == torch.int64 and rows.is_contiguous() and rows.dim() == 1 and src.dtype == dst.dtype
            and src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2] and dst.shape[1] == rows.shape[0]):
        size = src.element_size()
        _gather.gather_rows(src.data_ptr(), src.stride(0) * size, src.shape[1], dst.data_ptr(), dst.stride(0) * size,
                            src.shape[2] * size, src.shape[0], rows.data_ptr(), rows.shape[0], torch.get_num_threads())
    else:
        index_select_rows(src, dst, rows)


def index_select_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """:func:`gather_rows` by torch's ``index_select``: where the C loop is not built, and
    for tensors it does not take (off the host, strided rows)."""
    if src.is_contiguous() and dst.is_contiguous():  # one gather over all modules' rows spreads over torch's threads
        flat_rows = (torch.arange(src.shape[0], device=rows.device).unsqueeze(1) * src.shape[1] + rows).view(-1)
        torch.index_select(src.view(-1, src.shape[2]), 0, flat_rows, out=dst.view(-1, dst.shape[2]))
    else:
        torch.index_select(src, 1, rows, out=dst)


def _host_rows(t: torch.Tensor) -> bool:
    """A host ``[modules, rows, E]`` tensor whose rows are contiguous, each module's at one stride."""
    return t.device.type == "cpu" and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _no_overlap(t: torch.Tensor) -> bool:
    """No two of ``t``'s modules share memory (an expanded tensor's do: index_select refuses to write it)."""
    return t.shape[0] <= 1 or t.stride(0) >= t.shape[1] * t.shape[2]
