"""dtype names: the one place a torch dtype becomes the name files and messages use, and back,
and which precisions drift. Loading it loads no torch: the CLI reads these names while parsing."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the precisions a reference may hold and be trusted as the truth: a target in them has no precision drift to scale
FULL_PRECISION = ("float32", "float64")
#: the precisions below them a target runs in, each with its noise floor
LOW_PRECISION = ("bfloat16", "float16")


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` (or ``"torch.bfloat16"``) -> ``"bfloat16"`` (what stores, floors and reports record)."""
    return str(dtype).removeprefix("torch.")


def is_full_precision(dtype: torch.dtype | str) -> bool:
    """Whether ``dtype`` (a torch dtype or its name) is float32 or float64."""
    return dtype_name(dtype) in FULL_PRECISION


def as_dtype(value: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """A torch dtype, or its name (``"bfloat16"``, ``"torch.bfloat16"``), as a torch dtype."""
    import torch  # here, not at the top: see the module docstring

    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what} must be a torch dtype or its name (e.g. torch.bfloat16 or 'bfloat16'), got {value!r}")
    return dtype
