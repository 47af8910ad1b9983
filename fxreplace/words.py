"""Messages in words: an exception's text as one line. Imports nothing, so the command line's
errors, the store and the loaders all say things the same way."""

from __future__ import annotations


def one_line(text, limit: int = 600) -> str:
    """``text`` (an exception's message may span lines) as one line of at most ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
