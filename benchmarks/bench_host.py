"""Host work per step of an instrumented model, by number of targets, against the plain model and
against the same model edited by hand to take its replacements (issue 57's scale).

On a GPU (CUDA graphs) or a Neuron device the host work is the whole cost of a replayed step: Dynamo's
guard evaluation before every compiled call and the Python of every target in eager. Host work is
the same on a CPU, so it is measured here, on models whose compute is small beside it:

- ``stack N``: N small blocks, each ``x + W2 softmax(gate(x))``, every block's ``gate`` a target
  (N = 1, 8, 48);
- ``qwen3-moe``: the tiny Qwen3-MoE with every blame component of its family instrumented.

Variants, called in turn (interleaved) in one process on one thread, over the same weights:
``plain`` (the model given), ``context`` (instrumented, ``replacements=`` a context of every target,
all rows off), for the stacks ``rows on`` (a copy of that model, a context replacing every other row),
``fed`` (instrumented, its fed buffers cleared: replacement off) and, for the stacks,
``hand`` (the same model edited by hand: each block's forward takes its gate's replacement and the
mask as arguments and applies ``torch.where(mask, replacement, computed)`` to the gate's output; its
modules and calls are the plain stack's, so it differs from it by the inputs and the ``where`` alone:
the floor of what an extra input costs).
Eager only, for the stacks, the floor of instrument()'s design, written without fxreplace: ``frames``
(each gate's class given a forward that calls the class's own, as instrument() gives each target,
and the model a forward that takes ``replacements=``: the Python frames alone, no state, no check)
and ``frames, where`` (the same, each gate reading its entry of the forward in progress from a list the
model's forward sets, and applying it with ``torch.where``: what a forward replacing rows cannot do
without), and ``frames, checked`` (the same with the checks a user of a forward replacing rows relies on,
written as plainly as Python allows: one forward at a time, each gate reached once and every gate
reached, each output fitting its replacement in shape, dtype and device before the ``where``: the floor
of a checked design). ``fed`` (cleared) is read against ``frames``, ``rows on`` against ``frames, checked``.
Compiled only, ``context, filtered`` and ``fed, filtered``: the same two variants on models compiled
with ``options={"guard_filter_fn": fxreplace.guard_filter}`` (fxreplace's own module-level guards
dropped).
Compiled (inductor): per call, torch.profiler's "TorchDynamo Cache Lookup", the guards' own check
timed directly (the compiled forward's guard manager run on the locals the call starts with: the
same guards without the profiler's own cost and variance), warm (in a loop) and cold (once right
after each call, as a step sees them), and the whole call; eager: the whole call. Medians over rounds (``--min``: the least disturbed round, on a
loaded machine); ratios to ``plain`` (and to ``hand``): the median over rounds of each round's ratio
(the variants of a round run side by side, so a slow stretch of the machine cancels out).
Prints a table and a final JSON line.

    python benchmarks/bench_host.py [--quick] [--targets 1 8 48] [--rounds R] [--min]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time

import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # no public way to reach a frame's guards
from torch.profiler import ProfilerActivity, profile

from fxreplace import ReplacementContext, guard_filter, instrument, observe
from fxreplace.models import get_family, tiny_model

HIDDEN, EXPERTS, TOKENS = 64, 8, 16
LOOKUP = "TorchDynamo Cache Lookup"
FILTERED = ", filtered"  # a variant compiled with fxreplace's guard filter (compiled only)
# the design's floors, written without fxreplace (eager only)
FRAMES, FRAMES_WHERE, FRAMES_CHECKED = "frames", "frames, where", "frames, checked"
FLOORS = (FRAMES, FRAMES_WHERE, FRAMES_CHECKED)
FLOOR_OF = {"fed": FRAMES, "rows on": FRAMES_CHECKED}  # the eager variants read against a floor
GUARD_CHECKS = 2000  # direct guard checks per round and variant


class Block(nn.Module):
    """A block whose routing-like gate is the target: small compute, so the host work shows."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.down = nn.Linear(EXPERTS, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.down(self.gate(x).softmax(-1))


class Stack(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class HandBlock(Block):
    """The block edited by hand to replace its gate's output: what a port's author would write."""

    def forward(self, x, replacement, keep):
        return x + self.down(torch.where(keep, replacement, self.gate(x)).softmax(-1))


class HandStack(Stack):
    """The stack of :class:`HandBlock`, each block called with its replacement and the mask: the same
    modules, calls and kernels as the plain stack, plus an input and a ``where`` per target."""

    def __init__(self, n: int):
        super().__init__(0)
        self.blocks = nn.ModuleList(HandBlock() for _ in range(n))

    def forward(self, x, replacements, mask):
        keep = mask.unsqueeze(-1)
        for block, replacement in zip(self.blocks, replacements):
            x = block(x, replacement, keep)
        return x


class FramedGate(nn.Linear):
    """A gate whose class forward calls the class's own, as instrument() gives each target its class: with
    the model's entries armed, it reads its own and applies it (``FRAMED_ENTRIES``, set per forward)."""

    def forward(self, *args, **kwargs):
        computed = nn.Linear.forward(self, *args, **kwargs)
        entry = FRAMED_ENTRIES[self.framed_index]
        return computed if entry is None else torch.where(entry[1], entry[0], computed)


FRAMED_ENTRIES: list = []  # per gate (replacement, mask column) or None, for the forward in progress


class FramedStack(Stack):
    """The stack with :class:`FramedGate` gates and a forward that takes ``replacements=`` (a list of
    per-gate entries, None: all off) and publishes them for the forward, as an instrumented model arms."""

    def __init__(self, plain: Stack):
        super().__init__(0)
        self.blocks = copy.deepcopy(plain.blocks)
        for index, block in enumerate(self.blocks):
            block.gate.__class__, block.gate.framed_index = FramedGate, index
        self.off = [None] * len(self.blocks)

    def forward(self, *args, replacements=None, **kwargs):
        FRAMED_ENTRIES[:] = self.off if replacements is None else replacements
        try:
            return super().forward(*args, **kwargs)
        finally:
            FRAMED_ENTRIES[:] = self.off


class CheckedGate(nn.Linear):
    """A gate whose class forward does what a target replacing rows must check, as instrument()'s targets
    do: that the forward reaches it once and that its output fits its entry (its ``checked_step``, a
    :class:`CheckedStep`)."""

    def forward(self, *args, **kwargs):
        computed = nn.Linear.forward(self, *args, **kwargs)
        step = self.checked_step
        if step.reached:
            raise RuntimeError(f"gate {step.index} reached twice in one forward")
        step.reached = True
        if step.entry is None:
            return computed
        replacement, keep, shape, dtype, device = step.entry
        if computed.shape != shape or computed.dtype is not dtype or computed.get_device() != device:
            raise ValueError(f"gate {step.index}: its output ({computed.dtype} {list(computed.shape)} on "
                             f"{computed.device}) does not fit its replacement")
        return torch.where(keep, replacement, computed)


CHECKED_RUNNING = threading.Lock()  # held by the checked forward in progress (the floor's one-at-a-time check)


class CheckedStep:
    """A checked gate's part of the forward in progress: whether it was reached, and its entry
    ``(replacement, mask column, shape, dtype, device index)`` (the fit read once, when the entry was made)."""

    __slots__ = ("index", "reached", "entry")

    def __init__(self, index: int):
        self.index, self.reached, self.entry = index, False, None


class CheckedStack(Stack):
    """The stack with :class:`CheckedGate` gates and a forward that takes ``replacements=`` (per gate an entry,
    see :class:`CheckedStep`, or None: all off): one forward at a time, every gate reached."""

    def __init__(self, plain: Stack):
        super().__init__(0)
        self.blocks = copy.deepcopy(plain.blocks)
        self.steps = [CheckedStep(index) for index in range(len(self.blocks))]
        for block, step in zip(self.blocks, self.steps):
            block.gate.__class__, block.gate.checked_step = CheckedGate, step
        self.off = [None] * len(self.blocks)

    def forward(self, *args, replacements=None, **kwargs):
        if not CHECKED_RUNNING.acquire(blocking=False):
            raise RuntimeError("a checked stack is already running a forward")
        try:
            for step, entry in zip(self.steps, self.off if replacements is None else replacements):
                step.reached, step.entry = False, entry
            output = super().forward(*args, **kwargs)
        finally:
            CHECKED_RUNNING.release()
        unreached = [step.index for step in self.steps if not step.reached]
        if unreached:
            raise RuntimeError(f"gates not reached: {unreached}")
        return output


def stack_variants(n: int) -> tuple[dict, list]:
    """The plain stack, the same weights instrumented twice (a context, fed buffers), edited by hand, and
    framed (the design's floors, see :class:`FramedStack` and :class:`CheckedStack`)."""
    torch.manual_seed(n)
    plain = Stack(n).eval()
    targets = ["blocks.*.gate"]
    with_context = instrument(copy.deepcopy(plain), targets)
    fed = instrument(copy.deepcopy(plain), targets, max_tokens=TOKENS)
    hand = HandStack(n).eval()
    hand.load_state_dict(plain.state_dict())
    names = with_context.targets
    off = ReplacementContext({name: torch.zeros(TOKENS, EXPERTS) for name in names},
                             torch.zeros(TOKENS, dtype=torch.bool))
    every_other = torch.arange(TOKENS) % 2 == 0
    on = ReplacementContext({name: torch.randn(TOKENS, EXPERTS) for name in names}, every_other)
    fed.feed(off)
    fed.clear()
    # rows on runs on a copy of its own: on the model the context variant runs, the first forward of each round
    # would check the targets anew (a model keeps the calls it checked for the context it was given last)
    rows_on = copy.deepcopy(with_context)
    # the same variants, each on its own copy compiled with the guard filter
    context_filtered, fed_filtered = copy.deepcopy(with_context), copy.deepcopy(fed)
    x = torch.randn(TOKENS, HIDDEN)
    zeros = [torch.zeros(TOKENS, EXPERTS) for _ in names]
    mask = torch.zeros(TOKENS, dtype=torch.bool)
    framed, checked = FramedStack(plain), CheckedStack(plain)
    framed_on = [(on[name], every_other.unsqueeze(-1)) for name in names]
    checked_on = [(r, keep, r.shape, r.dtype, r.get_device()) for r, keep in framed_on]
    calls = {"plain": (plain, lambda m: m(x)), "context": (with_context, lambda m: m(x, replacements=off)),
             "rows on": (rows_on, lambda m: m(x, replacements=on)),
             "fed": (fed, lambda m: m(x)), "hand": (hand, lambda m: m(x, zeros, mask)),
             FRAMES: (framed, lambda m: m(x)), FRAMES_WHERE: (framed, lambda m: m(x, replacements=framed_on)),
             FRAMES_CHECKED: (checked, lambda m: m(x, replacements=checked_on)),
             "context" + FILTERED: (context_filtered, lambda m: m(x, replacements=off)),
             "fed" + FILTERED: (fed_filtered, lambda m: m(x))}
    return calls, names


def moe_variants() -> tuple[dict, list]:
    """The tiny Qwen3-MoE and every blame component of its family instrumented."""
    arch = "Qwen3MoeForCausalLM"
    plain = tiny_model(arch)
    components = [t for t in get_family(arch).components.values()]
    with_context = instrument(copy.deepcopy(plain), components)
    fed = instrument(copy.deepcopy(plain), components, max_tokens=TOKENS)
    ids = torch.randint(4, plain.config.vocab_size, (1, TOKENS))
    widths = {}
    with torch.no_grad():
        with observe(with_context, lambda name, computed: widths.setdefault(name, computed.shape[-1])):
            with_context(input_ids=ids, use_cache=False)
    off = ReplacementContext({name: torch.zeros(TOKENS, width) for name, width in widths.items()},
                             torch.zeros(TOKENS, dtype=torch.bool))
    fed.feed(off)
    fed.clear()
    context_filtered, fed_filtered = copy.deepcopy(with_context), copy.deepcopy(fed)
    calls = {"plain": (plain, lambda m: m(input_ids=ids, use_cache=False).logits),
             "context": (with_context, lambda m: m(input_ids=ids, use_cache=False, replacements=off).logits),
             "fed": (fed, lambda m: m(input_ids=ids, use_cache=False).logits),
             "context" + FILTERED: (context_filtered,
                                    lambda m: m(input_ids=ids, use_cache=False, replacements=off).logits),
             "fed" + FILTERED: (fed_filtered, lambda m: m(input_ids=ids, use_cache=False).logits)}
    return calls, list(widths)


def forward_locals(model, call) -> dict:
    """The locals ``model``'s forward starts with for ``call`` (what Dynamo's guards read), its cells included."""
    forward = type(model).forward
    seen: dict = {}

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is forward.__code__ and not seen:
            seen.update(frame.f_locals)

    sys.settrace(tracer)
    try:
        call(model)
    finally:
        sys.settrace(None)
    seen.update(zip(forward.__code__.co_freevars, (cell.cell_contents for cell in forward.__closure__ or ())))
    return seen


def guard_check(model, call):
    """A function that runs the guards of ``model``'s compiled forward that pass for ``call``, once."""
    frame = forward_locals(model, call)
    passing = [e.guard_manager for e in _debug_get_cache_entry_list(type(model).forward.__code__)
               if e.guard_manager.check(frame)]
    if not passing:
        raise RuntimeError(f"no compiled graph of {type(model).__name__} passes its guards for this call")
    return lambda: passing[0].check(frame)


def measure(calls: dict, compiled: bool, rounds: int, per_round: int) -> dict:
    """Per variant, per round: seconds per call and, compiled, guard seconds per call: torch.profiler's
    cache lookup, and the guards' own check timed directly (``guards``)."""
    runs = {}
    for name, (model, call) in calls.items():
        options = {"guard_filter_fn": guard_filter} if name.endswith(FILTERED) else None
        runs[name] = (torch.compile(model, backend="inductor", options=options) if compiled else model, call)
    whole = {name: [] for name in runs}
    lookup = {name: [] for name in runs}
    checks = {name: [] for name in runs}
    cold = {name: [] for name in runs}  # one guard check right after each call, as a step sees it
    with torch.no_grad():
        for model, call in runs.values():  # warm up (compiles)
            for _ in range(3):
                call(model)
        guards = {name: guard_check(calls[name][0], call) for name, (_, call) in runs.items()} if compiled else {}
        for r in range(rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))  # interleaved, both orders
            for name in order:
                model, call = runs[name]
                start = time.perf_counter()
                for _ in range(per_round):
                    call(model)
                whole[name].append((time.perf_counter() - start) / per_round)
                if compiled:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        for _ in range(per_round):
                            call(model)
                    events = [e for e in prof.key_averages() if e.key == LOOKUP]
                    lookup[name].append(sum(e.cpu_time_total for e in events) / per_round / 1e6)
                    check = guards[name]
                    start = time.perf_counter()
                    for _ in range(GUARD_CHECKS):
                        check()
                    checks[name].append((time.perf_counter() - start) / GUARD_CHECKS)
                    after_call = []
                    for _ in range(per_round):
                        call(model)
                        start = time.perf_counter()
                        check()
                        after_call.append(time.perf_counter() - start)
                    cold[name].append(statistics.median(after_call))
    return {name: {"call": whole[name],
                   **({"lookup": lookup[name], "guards": checks[name], "cold": cold[name]} if compiled else {})}
            for name in runs}


def never_compiled(calls: dict) -> dict:
    """``calls`` on copies of their models (one per model, as variants share them): eager forwards of a model
    Dynamo never traced, as an eager user runs it (a traced instrumented model keeps fxreplace's forward per
    target, see fxreplace.slots.GivenForwards)."""
    copies: dict[int, nn.Module] = {}
    return {name: (copies.setdefault(id(model), copy.deepcopy(model)), call) for name, (model, call) in calls.items()}


def groups(calls: dict, compiled: bool) -> list[dict]:
    """The variants measured side by side. Compiled, each instrumented model apart (with the plain
    and hand-edited ones): instrumented models share the code of their forward, so Dynamo would check
    one model's graphs before another's on every call (a cost of two models in one process, not of
    one model's guards)."""
    if not compiled:
        return [{name: call for name, call in calls.items() if not name.endswith(FILTERED)}]
    baseline = [name for name in ("plain", "hand") if name in calls]
    models: dict[int, list[str]] = {}
    for name, (model, _) in calls.items():
        if name not in baseline and name not in FLOORS:  # the floors run eagerly only
            models.setdefault(id(model), []).append(name)
    return [{name: calls[name] for name in baseline[:1] + names + baseline[1:]} for names in models.values()]


def ratios(rounds: dict) -> tuple[dict, dict]:
    """Per variant, the median over rounds of its figure over ``plain``'s (and ``hand``'s, and its floor's)
    in the same round: pairs measured side by side, so a slower stretch of the machine cancels out; and
    the spread of those per-round ratios (first and third quartiles), against which a goal is read."""
    medians, spreads = {}, {}

    def paired(name, base, key, out):
        per_round = [a / b for a, b in zip(rounds[name][key], rounds[base][key])]
        medians[name][out] = statistics.median(per_round)
        quartiles = statistics.quantiles(per_round, n=4, method="inclusive") if len(per_round) > 1 else per_round * 3
        spreads[name][out] = (quartiles[0], quartiles[-1])

    for name, m in rounds.items():
        if name == "plain":
            continue
        medians[name], spreads[name] = {}, {}
        for key in m:
            paired(name, "plain", key, key)
        if "hand" in rounds and name != "hand":
            paired(name, "hand", "call", "call_vs_hand")
        if FLOOR_OF.get(name) in rounds:
            paired(name, FLOOR_OF[name], "call", "call_vs_floor")
    return medians, spreads


def goal_figure(variant: str, compiled: bool) -> str | None:
    """The ratio issue 57 sets a goal on for ``variant`` (None: a baseline or a floor): compiled, the
    cache lookup over plain's; eagerly, a forward given a context over the hand-edited twin's, one
    with its fed buffers cleared over plain's."""
    if variant in ("plain", "hand", *FLOORS):
        return None
    if compiled:
        return "lookup"
    return "call_vs_hand" if variant in ("rows on", "context") else "call"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--targets", type=int, nargs="+", default=[1, 8, 48], help="stack sizes (targets)")
    parser.add_argument("--no-moe", action="store_true", help="skip the tiny Qwen3-MoE")
    parser.add_argument("--rounds", type=int, help="rounds per variant (default 5 with --quick, else 11)")
    parser.add_argument("--min", action="store_true",
                        help="the least disturbed round of each variant rather than the median (a loaded machine)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, per_round = (5, 20) if args.quick else (11, 50)
    rounds = args.rounds or rounds
    statistic = min if args.min else statistics.median
    models = [(f"stack {n}", *stack_variants(n)) for n in args.targets]
    if not args.no_moe:
        models.append(("qwen3-moe", *moe_variants()))
    results = {}
    print(f"{'model (targets)':24} {'mode':8} {'variant':17} {'call us':>9} {'x plain':>8} {'lookup us':>10} "
          f"{'x plain':>8} {'guards us':>10} {'x plain':>8} {'cold us':>8} {'x plain':>8} {'x hand':>7} {'x floor':>8} "
          f"{'goal figure, quartiles':>26}")
    for label, calls, names in models:
        key = f"{label} ({len(names)})"
        results[key] = {}
        for compiled in (True, False):
            mode = "compiled" if compiled else "eager"
            measured, rel, spread = {}, {}, {}
            for group in groups(calls if compiled else never_compiled(calls), compiled):
                torch.compiler.reset()
                per = measure(group, compiled, rounds, per_round)
                m = {name: {key: statistic(v) for key, v in figures.items()} for name, figures in per.items()}
                r, q = ratios(per)
                measured.update({k: v for k, v in m.items() if k not in measured})
                rel.update({k: v for k, v in r.items() if k not in rel})
                spread.update({k: v for k, v in q.items() if k not in spread})
            results[key][mode] = {"seconds": measured, "ratios": rel, "quartiles": spread}
            for name, m in measured.items():
                r = rel.get(name, {})
                lookup = (f"{m['lookup'] * 1e6:10.1f} {r.get('lookup', 1.0):8.2f} {m['guards'] * 1e6:10.2f} "
                          f"{r.get('guards', 1.0):8.2f} {m['cold'] * 1e6:8.2f} {r.get('cold', 1.0):8.2f}"
                          ) if compiled else f"{'-':>10} {'-':>8} {'-':>10} {'-':>8} {'-':>8} {'-':>8}"
                vs_hand = f"{r['call_vs_hand']:7.2f}" if "call_vs_hand" in r else f"{'-':>7}"
                vs_floor = f"{r['call_vs_floor']:8.2f}" if "call_vs_floor" in r else f"{'-':>8}"
                goal = goal_figure(name, compiled)
                low, high = spread.get(name, {}).get(goal, (None, None))  # (no hand twin: the MoE)
                quartiles = f"{goal:>14} {low:5.2f}-{high:4.2f}" if low is not None else f"{'-':>26}"
                print(f"{key:24} {mode:8} {name:17} {m['call'] * 1e6:9.1f} {r.get('call', 1.0):8.2f} {lookup} {vs_hand} "
                      f"{vs_floor} {quartiles}")
    print(json.dumps({"bench": "host", "threads": 1, "rounds": rounds, "calls_per_round": per_round,
                      "statistic": statistic.__name__,
                      "ratios": {k: {mode: v["ratios"] for mode, v in modes.items()} for k, modes in results.items()},
                      "quartiles": {k: {mode: v["quartiles"] for mode, v in modes.items()}
                                    for k, modes in results.items()}}))


if __name__ == "__main__":
    main()
