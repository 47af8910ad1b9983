"""Messages in words: an exception's text as one line, numbers and counts as tables and verdicts
write them. Imports nothing, so the command line's errors, the store, the loaders and the reports
all say things the same way."""

from __future__ import annotations


def one_line(text, limit: int = 600) -> str:
    """``text`` (an exception's message may span lines) as one line of at most ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def times(value: float | None) -> str:
    """A multiple of the floor as text: ``12x``, ``0.85x``, ``-`` when unknown."""
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf x"
    return f"{value:.2g}x" if value < 0.95 else f"{value:.1f}x" if value < 10 else f"{value:.0f}x"


def fmt(v) -> str:
    """Compact number for tables: 3 significant digits, '-' for missing."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def pct(v) -> str:
    """A fraction as a whole percentage for tables and verdicts, '-' for missing."""
    return "-" if v is None else f"{0.0 if abs(v) < 0.005 else v:.0%}"  # no "-0%" for rounding noise


def plural(n: int, noun: str) -> str:
    """``1 round``, ``2 rounds``; ``pass`` -> ``passes``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"
