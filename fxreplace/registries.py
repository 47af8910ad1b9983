"""One behaviour for every registry of fxreplace (families, engines, adapters, bypass hints).

A name is taken once: registering another value under it is an error unless ``replace=True``
(two packages must never silently take each other's entry; registering the same value again is
harmless). Entry points of installed packages load each on its own through
:func:`load_entry_point`, which never raises: a failure comes back as one message naming the
entry point, for the caller's "not found" error, so a broken package hides no other one.
"""

from __future__ import annotations

from types import ModuleType
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Values by name, in registration order; ``kind`` names them in errors ("engine", ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, value: T, *, replace: bool = False) -> T:
        """Register ``value`` as ``name``; a name taken by another value is an error unless ``replace``."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} names are non-empty strings, got {name!r}")
        if name in self._entries and not replace and self._entries[name] is not value:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to replace it")
        self._entries[name] = value
        return value

    def unregister(self, name: str) -> T | None:
        """Remove ``name`` (a test's temporary entry); returns what it held, or None."""
        return self._entries.pop(name, None)

    def copy(self) -> "Registry[T]":
        """A registry holding the same entries, which registrations to it leave alone (tests)."""
        copied = Registry(self.kind)
        copied._entries = dict(self._entries)
        return copied

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def values(self) -> list[T]:
        return list(self._entries.values())


def load_entry_point(ep, group: str) -> str | None:
    """Load one entry point of ``group``: a module registers when imported, anything else it names
    is called once. Returns None, or the failure as one message naming the entry point."""
    try:
        loaded = ep.load()
        if not isinstance(loaded, ModuleType):
            loaded()
    except Exception as exc:
        return f"the {group!r} entry point {ep.name!r} = {ep.value!r} failed to register: {type(exc).__name__}: {exc}"
    return None


def describe_failures(failures: list[str]) -> str:
    """Entry-point failures as the tail of a "not found" message ("" when there are none)."""
    return "".join(f"; {f}" for f in failures)
