"""Which modules to instrument: :class:`Target` specs and their resolution to
qualified module names, with errors that show the closest existing names."""

from __future__ import annotations

import difflib
import re
import string
from dataclasses import dataclass
from typing import Callable, Iterable, Union

from torch import nn

from .errors import TargetError
from .sharding import ShardSpec

#: ``"auto"``, ``"output"``, ``"output[i]"``, or ``fn(nodes) -> Node`` picking the
#: injection node among the FX nodes computed inside the module (see :mod:`fxreplace.points`).
Point = Union[str, Callable]


@dataclass(frozen=True)
class Target:
    """One injection site, or many through a glob pattern.

    ``pattern``: qualified module name; ``*`` matches one name component
    (``model.layers.*.mlp.gate``), ``**`` any number of them.
    ``point``: where inside the module the replacement goes: ``"output"`` /
    ``"output[i]"``, ``"auto"`` (the output when it is one tensor, else the
    logits node: the first linear-family op computed in the module), or a
    callable ``fn(nodes) -> Node`` given the module's FX nodes in order.
    ``adapter``: converts replacement *logits* into what the injection point
    computes (a registered name, or ``fn(logits, module)``); see
    :mod:`fxreplace.adapters`.
    ``shard``: the slice of the full ``[T, E]`` replacement this module sees.
    ``name``: the reference capture name when it differs from the module name;
    ``{}``/``{0}``... are filled with what the pattern's wildcards matched, e.g.
    ``Target("model.layers.*.mlp.router", name="model.layers.{}.mlp.gate")``.
    """

    pattern: str
    point: Point = "auto"
    adapter: Union[str, Callable, None] = None
    shard: ShardSpec | None = None
    name: str | None = None

    def __post_init__(self):
        """Checked here, where a target is made, not at the first model it meets."""
        if not isinstance(self.pattern, str) or not self.pattern:
            raise TargetError(f"Target pattern must be a qualified module name (str), got "
                              f"{type(self.pattern).__name__} {self.pattern!r}")
        if not (isinstance(self.point, str) or callable(self.point)):
            raise TargetError(f"Target {self.pattern!r}: point must be 'auto', 'output', 'output[i]' or a callable, "
                              f"got {type(self.point).__name__} {self.point!r}")
        if self.shard is not None and not isinstance(self.shard, ShardSpec):
            raise TargetError(f"Target {self.pattern!r}: shard must be a ShardSpec, got {type(self.shard).__name__}")
        if self.name is not None:
            if not isinstance(self.name, str):
                raise TargetError(f"Target {self.pattern!r}: name must be a str, got {type(self.name).__name__}")
            _check_template(self.pattern, self.name)


@dataclass(frozen=True)
class ResolvedTarget:
    """A target bound to one module of the model."""

    module_name: str
    capture_name: str
    point: Point
    adapter: Union[str, Callable, None]
    shard: ShardSpec | None

    def as_target(self) -> Target:
        """The :class:`Target` naming this module alone, with everything else kept."""
        return Target(self.module_name, point=self.point, adapter=self.adapter, shard=self.shard,
                      name=self.capture_name)

    def observed(self) -> Target:
        """The :class:`Target` observing this module's value as it computes it: a capture records that,
        so no adapter reshapes it and no shard slices it."""
        return Target(self.module_name, point=self.point, name=self.capture_name)


TargetLike = Union[str, Target]


def _check_template(pattern: str, name: str) -> None:
    """A name template may use no more ``{}`` fields than the pattern has wildcards."""
    wildcards = _glob_regex(pattern).groups
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(name) if f is not None]
    except ValueError as e:
        raise TargetError(f"Target {pattern!r}: name template {name!r} is malformed: {e}") from None
    automatic = sum(1 for f in fields if f == "")
    numbered = [int(f) for f in fields if f.isdigit()]
    other = [f for f in fields if f and not f.isdigit()]
    needed = max([automatic] + [n + 1 for n in numbered])
    if other:
        raise TargetError(f"Target {pattern!r}: name template {name!r} has named fields {other}; hint: use {{}} or "
                          "{0}, {1}... for what the pattern's wildcards matched")
    if needed > wildcards:
        raise TargetError(f"Target {pattern!r}: name template {name!r} uses {needed} field(s) but the pattern has "
                          f"{wildcards} wildcard(s); hint: one {{}} per * or ** of the pattern")


def _glob_regex(pattern: str) -> re.Pattern:
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    regex = "".join(
        {"**": "(.*)", "*": "([^.]*)", "?": "[^.]"}.get(p, re.escape(p)) for p in parts
    )
    return re.compile(regex + r"\Z")


def closest_names(query: str, names: Iterable[str], n: int = 5) -> list[str]:
    """Qualified names that look like ``query`` (wildcards read as ``0``)."""
    probe = query.replace("**", "0").replace("*", "0")
    return difflib.get_close_matches(probe, list(names), n=n, cutoff=0.4)


def _computing(modules: dict, name: str) -> str:
    """The module that computes for ``name``: the one ``torch.compile(module)`` wrapped, when the model holds
    that wrapper (its ``_orig_mod``; the wrapper's compiled call runs the inner module's forward)."""
    while isinstance(getattr(modules[name], "_orig_mod", None), nn.Module):
        name = f"{name}._orig_mod"
    return name


def resolve_targets(model: nn.Module, targets: Iterable[TargetLike] | TargetLike) -> list[ResolvedTarget]:
    """Expand patterns over ``model.named_modules()``, in model order.

    Every pattern must match at least one module and no module may be matched
    twice: a silent miss or a double injection would make results meaningless.
    """
    if isinstance(targets, (str, Target)):
        targets = [targets]  # one pattern, not its characters
    modules = dict(model.named_modules())
    names = [name for name in modules if name]
    resolved: dict[str, ResolvedTarget] = {}
    for i, target in enumerate(targets):
        if isinstance(target, str):
            target = Target(target)
        elif not isinstance(target, Target):
            raise TargetError(f"targets[{i}] must be a pattern (str) or a Target, got {type(target).__name__} {target!r:.60}")
        regex = _glob_regex(target.pattern)
        matched = False
        for name in names:
            m = regex.match(name)
            if not m:
                continue
            matched = True
            if name in resolved:
                raise TargetError(f"module {name!r} is matched by more than one target")
            capture_name = target.name.format(*m.groups()) if target.name else name
            resolved[name] = ResolvedTarget(_computing(modules, name), capture_name, target.point, target.adapter,
                                            target.shard)
        if not matched:
            raise TargetError(
                f"target {target.pattern!r} matches no module; closest qualified names: "
                f"{closest_names(target.pattern, names)}"
            )
    capture_names = [r.capture_name for r in resolved.values()]
    if len(set(capture_names)) != len(capture_names):
        raise TargetError(f"two targets share a capture name: {capture_names}")
    order = {name: i for i, name in enumerate(names)}
    return sorted(resolved.values(), key=lambda r: order[r.module_name])
