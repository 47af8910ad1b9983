"""Engines by name, as families are: the built-in ones (imported the first time they are asked
for) and those other packages declare in the ``fxreplace.engines`` entry-point group (a module
that registers when imported, or a callable). ``fxreplace validate/blame --engine NAME`` and the
Python API open an engine through its :class:`EngineSpec` (``fxreplace capture --engine NAME``
captures through its :class:`CaptureSpec`), so a new engine is one package and
one :func:`register_engine` call (docs: "Adding an engine")."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

from ..registries import Registry, describe_failures, load_entry_point

ENTRY_POINT_GROUP = "fxreplace.engines"

#: The built-in engines and the module that registers each.
BUILTIN = {"embedded": "fxreplace.engines.embedded.spec", "vllm": "fxreplace.engines.vllm.spec"}

#: Older names of the built-in engines (``capture --engine hf``, ``--engine runner``, before one vocabulary:
#: an engine is what ``--engine`` picks, a runner side a serving engine's model runner).
ALIASES = {"hf": "embedded", "runner": "embedded"}


@dataclass
class EngineRun:
    """What a command asks of an engine: the model under test, the reference it is compared
    with, and how to run it. ``compile`` None: the engine's default. ``options``: the engine's
    own keyword arguments (``--engine-args``). ``bucket`` (the longest prefill), ``logprobs``
    (log-probs returned per step, -1: all) and ``components`` (blame's ``{kind: Target}``, None: the
    default) are for the engines that have such a knob. ``interrupted``: what the command says last
    when Ctrl-C stops the engine's start and the process must exit at once (None: the engine's words)."""

    model: str
    reference: Any  # a fxreplace.reference.Reference
    reference_dir: str
    dtype: str = "bfloat16"
    compile: bool | None = None
    targets: list | None = None
    device: str | None = None
    options: dict = field(default_factory=dict)
    bucket: int | None = None
    logprobs: int = -1
    components: dict | None = None
    interrupted: Callable[[], None] | None = None


@dataclass
class CaptureRun:
    """What ``fxreplace capture`` asks of an engine: greedy generation of ``max_new_tokens`` per
    prompt from ``model``, writing the reference into ``out`` (new or empty). ``prompts``: token
    ids, checked by the engine against its vocabulary (:func:`fxreplace.capture.checked_prompts`,
    naming ``prompts_source``). ``metadata``: what the reference records beside the captures.
    ``components`` (``{kind: Target}``), ``family_components`` (the family's), ``noise_floor``
    (a dtype: the command measures the model's noise floor in it once the engine has captured,
    :func:`fxreplace.floor.capture_floors`) and ``dispatch`` (the model's placement) are for the
    engines that take them. ``interrupted``: as :attr:`EngineRun.interrupted`."""

    model: str
    prompts: list
    prompts_source: str
    out: str
    max_new_tokens: int
    targets: list | None = None
    dtype: str = "float32"
    compile: bool | None = None
    device: str | None = None
    options: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    components: dict | None = None
    family_components: bool = False
    noise_floor: str | None = None
    dispatch: dict | None = None
    interrupted: Callable[[], None] | None = None


@dataclass
class Captured:
    """What a capture did: ``summary`` (the command adds where it went), more ``lines`` to print,
    and ``error``: it did not capture every prompt (why, and what it left)."""

    summary: str
    lines: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class CaptureSpec:
    """How an engine captures a reference (``fxreplace capture --engine NAME``).

    * ``run(capture_run)``: the capture, a :class:`Captured`;
    * ``takes``: the capture options it understands, by option name (``--component``,
      ``--components``, ``--noise-floor``, ``--device-map``, ``--max-memory``, ``--offload-folder``,
      ``--engine-args``); any other given is refused before anything loads;
    * ``check(capture_run)``: refuses, before ``out`` is made, a model or prompts it cannot capture;
    * ``replaces``: a store already at ``out`` may be replaced (the command captures beside it and
      renames the new one into place at the end); else ``out`` must be new or empty;
    * ``left(out)``: what an interrupted capture left in ``out``, in words (None: the store's state).
    """

    run: Callable[[CaptureRun], Captured]
    takes: frozenset = frozenset()
    check: Callable[[CaptureRun], None] | None = None
    replaces: bool = False
    left: Callable[[str], str] | None = None


@dataclass(frozen=True)
class EngineSpec:
    """One engine fxreplace can validate and blame through.

    * ``open_validation(run)``: an :class:`Opened` engine as :func:`fxreplace.logit_validation`
      drives it (:class:`~fxreplace.engines.protocol.Engine`); the caller closes it;
    * ``open_blame(run)``: an :class:`Opened` holding the engine :func:`fxreplace.blame` drives:
      one whose ``generate`` takes capture names and whose ``components`` lists what it replaces
      (the embedded engine's :class:`~fxreplace.engines.embedded.blame_engine.BlameRunner` picks
      and instruments them itself);
    * ``compiles``: whether it compiles when the command says neither ``--compile`` nor ``--no-compile``;
    * ``takes``: the engine-specific options it understands, by option name (``--component``,
      ``--bucket``, ``--logprobs``, ``--engine-args``; ``--clean`` for blame: components captured
      from the clean model as the search needs them); any other given is refused before anything loads;
    * ``check_options(options)``: refuses, before anything loads, engine options (``--engine-args``)
      with which the engine cannot start here;
    * ``capture``: how it captures a reference (:class:`CaptureSpec`; None: it cannot);
    * ``floor_compile``: whether the noise floor (:mod:`fxreplace.floor`, the reference model in the
      target's dtype on fxreplace's runner) that scales a target of this engine is the runner's compiled
      program: its torch.compile backend when ``run`` compiles the target, the eager floor when None
      (e.g. vLLM: its kernels are not the runner's either way).
    """

    name: str
    summary: str
    open_validation: Callable[[EngineRun], Any]
    open_blame: Callable[[EngineRun], Any]
    compiles: bool = False
    takes: frozenset = frozenset()
    check_options: Callable[[dict], None] | None = None
    capture: CaptureSpec | None = None
    floor_compile: str | None = None

    def compiled(self, run: EngineRun) -> bool:
        """Whether ``run`` compiles the target."""
        return self.compiles if run.compile is None else bool(run.compile)

    def floor_program(self, run: EngineRun) -> str | None:
        """The torch.compile backend of the noise floor that scales ``run``'s target (None: the eager floor)."""
        return self.floor_compile if self.compiled(run) else None


@dataclass
class Opened:
    """An engine a command opened, with what the command says about it: ``description`` (one line:
    what runs, or ""), ``router_topk`` (the experts each token picks, for router agreement; None: not
    measured) and ``replaced`` (the targets replacement mode "on" replaces)."""

    engine: Any
    description: str = ""
    router_topk: int | None = None
    replaced: list = field(default_factory=list)

    def close(self) -> None:
        """Close the engine when it holds resources (processes, memory)."""
        self.engine.close()


_ENGINES: Registry[EngineSpec] = Registry("engine")
_failures: dict[str, str] = {}  # why an engine declared in the entry-point group registered nothing, by name


def register_engine(spec: EngineSpec, *, replace: bool = False) -> EngineSpec:
    """Make ``spec`` available by its name. A name already registered (a built-in one included)
    is an error unless ``replace=True``: a package must not silently take over another engine."""
    return _ENGINES.register(spec.name, spec, replace=replace)


def engine_name(name: str) -> str:
    """The name of the engine ``name`` (or an older name of it) names, checked without loading
    it; KeyError names the engines there are."""
    canonical = ALIASES.get(name, name)
    if canonical not in engine_names():
        raise KeyError(f"no engine {name!r}; engines: {', '.join(engine_names())}")
    return canonical


def get_engine(name: str) -> EngineSpec:
    """The engine registered as ``name`` (or an older name of it); a built-in one or one declared
    in the entry-point group is loaded on first use. KeyError names the engines there are."""
    name = engine_name(name)
    if name not in _ENGINES:
        if name in BUILTIN:
            importlib.import_module(BUILTIN[name])
        else:
            _load_entry_point(name)
    if name not in _ENGINES:
        why = describe_failures([_failures[name]] if name in _failures else [])
        raise KeyError(f"the engine {name!r} declared in {ENTRY_POINT_GROUP} registered no engine of that name{why}")
    return _ENGINES[name]


def engine_names() -> list[str]:
    """Every engine name there is, without importing any engine (the command line lists them)."""
    declared = [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)]
    return list(dict.fromkeys([*BUILTIN, *_ENGINES, *declared]))


def _load_entry_point(name: str) -> None:
    """Load the entry point declaring ``name`` (the first, as ``engine_names`` lists it once),
    keeping its failure for the error that it registered nothing."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            failure = load_entry_point(ep, ENTRY_POINT_GROUP)
            if failure:
                _failures[name] = failure
            return
