"""dtype names: the one place a torch dtype becomes the name files and messages use, and back."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what stores, floors and reports record)."""
    return str(dtype).removeprefix("torch.")


def as_dtype(value: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """A torch dtype, or its name (``"bfloat16"``, ``"torch.bfloat16"``), as a torch dtype."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what} must be a torch dtype or its name (e.g. torch.bfloat16 or 'bfloat16'), got {value!r}")
    return dtype
