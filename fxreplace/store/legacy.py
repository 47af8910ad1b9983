"""Legacy inputs: ``torch.save`` files of the existing tool (read safely) and token id files."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch

from .format import CaptureError, _describe, as_path
from .reference_store import ReferenceStore

def load_legacy(path: str | os.PathLike) -> Any:
    """Read a ``torch.save`` file of the existing tool with ``weights_only=True``.

    A pickle that needs anything beyond tensors and plain containers is refused
    (never executed): reference files may be handed to a server by path.
    """
    path = as_path(path, "path")
    where = _describe(path)
    if not path.exists():
        raise FileNotFoundError(f"{where}: no such file")
    if not path.is_file():
        raise CaptureError(f"{where}: not a file (a legacy reference is one torch.save file; a store is a directory "
                           f"or a .safetensors file)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CaptureError(
            f"refusing to load {where}: it is not a plain tensors/containers pickle and loading it would run "
            f"arbitrary code. Where you trust it, load it yourself (torch.load(..., weights_only=False)) and save its "
            f"tensors as a store: fxreplace.ReferenceStore.from_captures(...).save(directory). "
            f"Details: {str(e).splitlines()[0]}"
        ) from None
    except Exception as e:  # torch reports a file that is no torch.save archive with bare KeyError/IndexError/...
        raise CaptureError(f"{where}: not a torch.save file, a .safetensors store or a store directory "
                           f"({type(e).__name__}: {e})") from None


def load_captures(path: str | os.PathLike) -> ReferenceStore | Any:
    """A reference store (directory or .safetensors) or legacy captures (torch.save)."""
    path = as_path(path, "path")
    if path.is_dir() or path.suffix == ".safetensors":
        return ReferenceStore.load(path)
    return load_legacy(path)


def load_token_ids(path: str | os.PathLike) -> list[list[int]]:
    """Prompt token ids from JSON (a list of lists) or a legacy torch.save file."""
    path = as_path(path, "path")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CaptureError(f"{_describe(path)}: cannot read token ids as JSON ({e})") from None
    elif path.is_dir() or path.suffix == ".safetensors":
        data = ReferenceStore.load(path).prompt_token_ids
        if data is None:
            raise CaptureError(f"reference store {path} holds no prompt token ids")
    else:
        data = load_legacy(path)
    if isinstance(data, torch.Tensor):
        data = data.tolist()
    if not isinstance(data, list):
        raise CaptureError(f"{path}: expected a list of token id lists, got {type(data).__name__}")
    return [ids.tolist() if isinstance(ids, torch.Tensor) else ids for ids in data]
