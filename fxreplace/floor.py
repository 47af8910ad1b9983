"""The precision noise floor: the reference model itself run in the target's precision.

A bf16 target drifts from an fp32 reference even when nothing is wrong with it. How much
is the drift bf16 rounding alone causes: the clean model cast to the target's dtype,
teacher-forced against its own fp32 reference on the same prompts. A divergence is then
read as a multiple of that floor per measure (mean KL, mean top-5 error, steps to the
first divergence): about 1x is precision noise, well above :data:`FLOOR_MARGIN` is
something the precision does not explain.

The floor is measured once at capture (``fxreplace capture --noise-floor bfloat16``,
stored in the reference's metadata under ``"noise_floors"``) or when the clean model is at
hand (``validate``/``blame --clean``).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .dtypes import as_dtype, dtype_name, is_full_precision
from .engines.embedded import Runner, RunnerConfig
from .engines.protocol import Engine
from .errors import FloorFileError
from .loading import load_model
from .reference import load_reference
from .store.publish import FLOOR_FILE
from .validation import logit_validation
from .words import fmt, times

#: A divergence up to this multiple of the floor (in every measure) is precision noise: the
#: target's rounding is not the reference's cast, and compiled kernels round differently, so
#: a clean bf16 target lands anywhere from ~0.5x to ~1.5x its floor; planted faults sit at 10x-1000x.
FLOOR_MARGIN = 2.0


@dataclass(frozen=True)
class NoiseFloor:
    """What the reference model in ``dtype`` diverges from the reference, per prompt."""

    dtype: str
    prompts: dict[int, dict]  # per prompt: mean_kl, mean_top5_error, first_divergence (None: never), steps
    top5_per_step: dict[int, list[float]] = field(default_factory=dict)  # per prompt, for the reports' plots
    program: str = "the reference model in its dtype, eager, fxreplace's runner"
    seconds: float = 0.0
    compile: str | None = None  # the torch.compile backend of the program it was measured on (None: eager)

    @classmethod
    def from_dict(cls, data: dict) -> "NoiseFloor":
        return cls(data["dtype"], {int(p): v for p, v in data["prompts"].items()},
                   {int(p): v for p, v in data.get("top5_per_step", {}).items()}, data.get("program", ""),
                   data.get("seconds", 0.0), data.get("compile"))

    @property
    def key(self) -> str:
        return floor_key(self.dtype, self.compile)

    @property
    def programme(self) -> str:
        """The program in words: "the reference in bfloat16" (eager), "... compiled with inductor"."""
        return f"the reference in {self.dtype}" + (f" compiled with {self.compile}" if self.compile else "")

    def to_dict(self) -> dict:
        return asdict(self)

    def covers(self, prompts) -> bool:
        return all(p in self.prompts for p in prompts)

    def aggregate(self, prompts) -> dict:
        """The floor's measures over ``prompts`` as a validation summary averages them (per step)."""
        rows = [self.prompts[p] for p in prompts]
        steps = sum(r["steps"] for r in rows) or 1
        return {"mean_kl": sum(r["mean_kl"] * r["steps"] for r in rows) / steps,
                "mean_top5_error": sum(r["mean_top5_error"] * r["steps"] for r in rows) / steps,
                "steps_to_divergence": _steps_to_divergence(rows),
                "prompts_diverged": sum(r["first_divergence"] is not None for r in rows)}

    def multiples(self, summary: dict) -> dict:
        """``summary`` (one mode of a validation summary) as multiples of the floor over its prompts:
        ``kl`` and ``top5`` (the target's mean / the floor's), ``first_divergence`` (the floor's mean
        steps to its first divergence / the target's: 3 = the target diverges 3x sooner)."""
        prompts = [int(p) for p in summary["prompts"]]
        floor = self.aggregate(prompts)
        rows = [{"first_divergence": v["first_divergence"], "steps": self.prompts[int(p)]["steps"]}
                for p, v in summary["prompts"].items()]
        return {"kl": _ratio(summary["mean_kl"], floor["mean_kl"]),
                "top5": _ratio(summary["mean_top5_error"], floor["mean_top5_error"]),
                "first_divergence": _ratio(floor["steps_to_divergence"], _steps_to_divergence(rows))}

    def counted(self, summary: dict) -> dict:
        """The multiples that decide, the one rule the verdict, the ``floor=K`` gate and blame read: mean KL
        and mean top-5 error always; the first divergence only where the floor diverged on one of the
        prompts at least. Where it never did, the floor's steps to its first divergence are only the
        prompts' lengths (4 tokens make 5 steps), so a target diverging at once would read "5x sooner"
        from a handful of tokens: too little evidence to decide on."""
        m = self.multiples(summary)
        if not self.aggregate([int(p) for p in summary["prompts"]])["prompts_diverged"]:
            del m["first_divergence"]
        return m

    def within(self, summary: dict, margin: float = FLOOR_MARGIN) -> bool:
        """Every measure that counts (:meth:`counted`) within ``margin`` times the floor: precision noise."""
        return not self.beyond(summary, margin)

    def beyond(self, summary: dict, margin: float) -> dict:
        """The multiples that count (:meth:`counted`) beyond ``margin`` times the floor (None: unknown)."""
        return {key: m for key, m in self.counted(summary).items() if m is None or m > margin}

    def describe(self, summary: dict, margin: float = FLOOR_MARGIN) -> str:
        """"beyond precision noise: 12x its noise floor in mean KL, 4.1x in mean top-5 error, first
        divergence 3.0x sooner (the floor: the reference in bfloat16 ...)"."""
        m = self.multiples(summary)
        where = "within precision noise" if self.within(summary, margin) else "beyond precision noise"
        floor = self.aggregate([int(p) for p in summary["prompts"]])
        first = (f"first divergence {times(m['first_divergence'])} sooner" if "first_divergence" in self.counted(summary)
                 else f"first divergence not scored (the floor never diverged in these {len(summary['prompts'])} "
                      "prompts' steps: too few to tell)")
        return (f"{where}: {times(m['kl'])} its noise floor in mean KL, {times(m['top5'])} in mean top-5 error, "
                f"{first} (the floor: {self.programme}, mean KL {fmt(floor['mean_kl'])}, mean top-5 error "
                f"{fmt(floor['mean_top5_error'])}; up to {margin:g}x is precision noise)")


def floor_key(dtype: str, compile: str | None = None) -> str:
    """Where a floor is stored: by its dtype, and the compile backend of its program when compiled."""
    return dtype if compile is None else f"{dtype}+{compile}"


def measure_floor(clean: torch.nn.Module, reference, dtype: torch.dtype, *, prompts: Sequence[int] | None = None,
                  progress: bool = False, compile: str | None = None) -> NoiseFloor:
    """The reference model ``clean`` in ``dtype`` (cast when it is not: build it the way the target
    is built, e.g. loaded in ``dtype`` as the CLI loads both, for the floor to be the target's
    program), teacher-forced against ``reference`` on its prompts with nothing replaced: the
    precision noise floor, run by the embedded engine (:func:`engine_floor` for another).
    ``compile``: the torch.compile backend the target runs under (its kernels round differently from
    eager ones, so a compiled target's floor is the compiled reference's)."""
    indices = list(range(reference.num_prompts)) if prompts is None else list(prompts)
    longest = max(len(reference.prompt_tokens(p)) + reference.num_generated(p) for p in indices)
    bucket = 1 << (longest - 1).bit_length()
    # a model already in dtype runs as it is: .to() would also round its float32 buffers (rotary inv_freq), which
    # loading in the dtype keeps, and the floor would not be the target's program
    model = clean if next(clean.parameters()).dtype == dtype else copy.deepcopy(clean).to(dtype)
    runner = Runner(model, clean.config, runner_config=RunnerConfig(
        prefill_buckets=(bucket,), batch_buckets=(min(64, len(indices)),), max_len=2 * bucket, batched_prefill=True,
        teacher_forcing=True), dtype=dtype, compile=compile)
    program = f"the reference model in its dtype, {f'compiled ({compile})' if compile else 'eager'}, fxreplace's runner"
    return engine_floor(runner, reference, dtype, prompts=indices, progress=progress, program=program, compile=compile)


def engine_floor(engine: Engine, reference, dtype: torch.dtype, *, program: str, prompts: Sequence[int] | None = None,
                 progress: bool = False, compile: str | None = None) -> NoiseFloor:
    """The precision noise floor as ``engine`` measures it: an engine running the reference model
    in ``dtype`` (the target's program with the reference's weights), validated against
    ``reference`` with nothing replaced. ``program`` says what ran, for the verdict's scale."""
    started = time.perf_counter()
    indices = list(range(reference.num_prompts)) if prompts is None else list(prompts)
    result = logit_validation(engine, reference, modes=("off",), prompts=indices, progress=progress)
    summary = result.summary()["off"]
    rows = {p: {"mean_kl": s["mean_kl"], "mean_top5_error": s["mean_top5_error"],
                "first_divergence": s["first_divergence"], "steps": reference.num_generated(p)}
            for p, s in summary["prompts"].items()}
    per_step = {p: [s.top5_error for s in result.steps if s.prompt == p] for p in indices}
    return NoiseFloor(dtype_name(dtype), rows, per_step, program, time.perf_counter() - started, compile)


def capture_floors(run, compile: str | None) -> list[str]:
    """``fxreplace capture --noise-floor``: the floors of ``run.model`` in ``run.noise_floor`` against the
    reference just captured into ``run.out`` (a :class:`~fxreplace.engines.registry.CaptureRun`), stored
    with it: the eager program's, and with ``run.compile`` the one compiled with the backend ``compile``
    (validate --compile gates on that); a line saying each."""
    dtype = as_dtype(run.noise_floor)
    # the floor's model is loaded in its dtype, as validate and blame load the target
    clean, stored = load_model(run.model, dtype, run.dispatch, run.device), load_reference(run.out)
    lines = []
    for backend in (None, compile) if run.compile else (None,):
        floor = measure_floor(clean, stored, dtype, progress=True, compile=backend)
        save_floor(floor, run.out)
        whole = floor.aggregate(range(stored.num_prompts))
        lines.append(
            f"noise floor ({floor.programme.replace('the reference', 'the model')}, {floor.seconds:.1f} s): mean KL "
            f"{whole['mean_kl']:.3g}, mean top-5 error {whole['mean_top5_error']:.3g}, {whole['prompts_diverged']} "
            f"of {stored.num_prompts} prompts diverge")
    return lines


def check_reference_precision(reference, allow: bool = False, option: str = "allow_low_precision_reference=True") -> str:
    """A reference captured below float32 carries its own rounding into every measure: a target
    that drifts as much looks clean, and one that is right looks wrong. Refused (ValueError naming
    ``option``) unless ``allow``; then returns the caveat the verdict states ('' for a full-precision one)."""
    dtype = str(reference.metadata.get("dtype") or "float32")
    if is_full_precision(dtype):
        return ""
    if not allow:
        raise ValueError(f"the reference was captured in {dtype}, below float32: its own rounding would be part of every "
                         f"measure (a drifting target could look clean); capture it from the model in float32, or "
                         f"accept it with {option}")
    return (f"caution: the reference is {dtype} (accepted with {option}): its own rounding is part of every measure, "
            "so 'no divergence' here is no all-clear")


def save_floor(floor: NoiseFloor, directory) -> Path:
    """Store ``floor`` in the reference directory ``directory`` (beside floors of other dtypes and programs)."""
    path = Path(directory) / FLOOR_FILE
    floors = json.loads(path.read_text()) if path.is_file() else {}
    floors[floor.key] = floor.to_dict()
    path.write_text(json.dumps(floors))
    return path


def floor_for(reference, dtype: torch.dtype, directory=None, prompts: Sequence[int] | None = None, clean=None,
              progress: bool = False, compile: str | None = None) -> tuple[NoiseFloor | None, float]:
    """The noise floor a target in ``dtype`` (compiled with the backend ``compile``) is read against, and
    the seconds spent measuring it: none in full precision; the one of that program stored with
    ``reference`` (``capture --noise-floor``) when it covers ``prompts`` (default: all); else measured
    from ``clean`` (the clean model in ``dtype``, or a function loading it) when given; else none. A
    stored floor that cannot be read raises :class:`FloorFileError`."""
    if is_full_precision(dtype):
        return None, 0.0
    indices = list(range(reference.num_prompts)) if prompts is None else list(prompts)
    floor = stored_floors(reference, directory).get(floor_key(dtype_name(dtype), compile))
    if (floor is None or not floor.covers(indices)) and clean is not None:
        floor = measure_floor(clean if isinstance(clean, torch.nn.Module) else clean(), reference, dtype,
                              prompts=indices, progress=progress, compile=compile)
        return floor, floor.seconds
    return floor, 0.0


def stored_floors(reference, directory=None) -> dict[str, NoiseFloor]:
    """The floors stored with ``reference`` by :func:`floor_key`: in its directory (``capture
    --noise-floor``), or in its metadata's ``"noise_floors"`` (a reference built in memory)."""
    floors = dict(reference.metadata.get("noise_floors") or {})
    path = Path(directory) / FLOOR_FILE if directory is not None else None
    if path is not None and path.is_file():
        try:
            floors.update(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise FloorFileError(f"cannot read the noise floor {path}: {e}") from None
    return {key: NoiseFloor.from_dict(stored) for key, stored in floors.items()}


def _steps_to_divergence(rows) -> float:
    """Mean steps up to and including the first divergence, a prompt that never diverges counting
    one past its last step (so a divergence at step 0 counts 1, not 0)."""
    values = [(r["first_divergence"] if r["first_divergence"] is not None else r["steps"]) + 1 for r in rows]
    return sum(values) / len(values) if values else 0.0


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b <= 0:
        return 1.0 if a <= 0 else float("inf")
    return a / b
