"""Griffe extension for the API reference: the docstrings' Sphinx roles become links.

The docstrings cross-reference with Sphinx roles (:class:`Target`, :meth:`~a.B.c`), which
mkdocstrings renders as their raw text. Once the package is loaded, each role is
rewritten to an autorefs element naming the object's full path (resolved in the
docstring's own scope, as Sphinx would): a link where the site documents that object,
plain code where it does not.
"""

from __future__ import annotations

import re

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?:meth|func|class|attr|mod|data|exc|obj|const):`(?P<tilde>~?)(?P<text>[^`]+?)`")
EXPLICIT = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^>]+)>$")


class SphinxRoles(Extension):
    def on_package(self, *, pkg: Object, **kwargs) -> None:
        self._rewrite(pkg, set())

    def _rewrite(self, obj: Object, seen: set) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda match: _reference(obj, match), obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite(member, seen)


def _reference(obj: Object, match: re.Match) -> str:
    text = match["text"].strip()
    explicit = EXPLICIT.match(text)
    target = (explicit["target"] if explicit else text).strip().lstrip(".").removesuffix("()")
    if explicit:
        title = explicit["title"]
    else:
        title = target.rsplit(".", 1)[-1] if match["tilde"] else target
    return f'<autoref identifier="{_full_path(obj, target)}" optional><code>{title}</code></autoref>'


def _full_path(obj: Object, target: str) -> str:
    """``target`` as the full path of what it names in ``obj``'s scope (as given when it does
    not resolve: already a full path, or an object outside the package)."""
    head, _, rest = target.partition(".")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    while scope is not None:
        try:
            return scope.resolve(head) + (f".{rest}" if rest else "")
        except Exception:  # noqa: BLE001 - griffe's NameResolutionError and alias errors alike
            scope = scope.parent
    return target
