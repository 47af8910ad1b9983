"""Every difference between the torch versions fxreplace supports (2.8 to 2.13), in one place."""

try:  # torch >= 2.10
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as size_hint
except ImportError:  # torch 2.8 / 2.9: the same hint under its older name
    from torch.fx.experimental.symbolic_shapes import hint_int as size_hint

__all__ = ["size_hint"]
