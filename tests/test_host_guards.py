"""Issue 57: what a compiled instrumented model guards on does not grow with its targets, and
nothing it leaves out lets a changed context reuse a wrong graph. A context enters a compiled
graph as its group tensors and its mask (its layout checked by one identity guard); new values
reuse the graph, a new shape, set of names or dtype compiles anew or runs correctly."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule
from torch import nn

import fxreplace
from fxreplace import ReplacementContext, TargetNotHitError
from fxreplace._compat import SUBSTITUTES_MODULE_METHODS
from fxreplace.sharding import ShapeError

HIDDEN, EXPERTS, TOKENS = 16, 4, 6


class Block(nn.Module):
    """A residual block whose gate (the target) computes routing-like logits."""

    def __init__(self):
        super().__init__()
        self.gate, self.down = nn.Linear(HIDDEN, EXPERTS, bias=False), nn.Linear(EXPERTS, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.down(self.gate(x).softmax(-1))


class Stack(nn.Sequential):
    def __init__(self, n: int):
        super().__init__(*(Block() for _ in range(n)))


def reference(plain: Stack, x, values: dict, mask) -> torch.Tensor:
    """The stack with each gate's rows under ``mask`` replaced by hand."""
    for i, block in enumerate(plain):
        computed = block.gate(x)
        value = values.get(f"{i}.gate")
        gate = computed if value is None else torch.where(mask.unsqueeze(-1), value.to(computed.dtype), computed)
        x = x + block.down(gate.softmax(-1))
    return x


class Graphs:
    """A backend that counts the graphs it compiles and keeps the last one's inputs."""

    def __init__(self):
        self.count = 0
        self.inputs = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        self.inputs = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


# compiled as given, and with fxreplace's guard filter (its own module-level guards dropped): the
# same graphs, the same recompiles
FILTERS = pytest.mark.parametrize("options", [{}, {"guard_filter_fn": fxreplace.guard_filter}],
                                  ids=["all-guards", "guard-filter"])


def _model(n: int, max_tokens=None):
    torch.manual_seed(n)
    plain = Stack(n).eval()
    model = fxreplace.instrument(Stack(n).eval(), ["*.gate"], max_tokens=max_tokens)
    model.load_state_dict(plain.state_dict())
    return plain, model


def _context(names, seed, tokens=TOKENS, dtype=torch.float32, every=2):
    gen = torch.Generator().manual_seed(seed)
    values = {name: (torch.randn(tokens, EXPERTS, generator=gen) * 3).to(dtype) for name in names}
    return values, ReplacementContext(values, torch.arange(tokens) % every == 0)


@pytest.mark.parametrize("n", [2, 6])
def test_a_context_enters_as_its_groups_and_mask(n):
    """The graph's inputs: the plain model's, plus one tensor per group and the mask, whatever the targets."""
    plain, model = _model(n)
    counted = {}
    for name, m, kwargs in (("plain", plain, {}), ("context", model, {"replacements": _context(model.targets, 0)[1]})):
        graphs = Graphs()
        with torch.no_grad():
            torch.compile(m, backend=graphs)(torch.randn(TOKENS, HIDDEN), **kwargs)
        counted[name] = graphs.inputs
    assert counted["context"] == counted["plain"] + 2


def test_each_instrumented_model_is_compiled_however_many_a_process_compiles():
    """Dynamo compiles at most ``recompile_limit`` graphs per code object, then runs the frame eagerly
    with only a warning. Each instrumented model compiles graphs of its own (its guards name its slots),
    so each has a forward of its own: one model more than the limit is still compiled, and right."""
    limit = 2
    x = torch.randn(TOKENS, HIDDEN)
    with torch._dynamo.config.patch(recompile_limit=limit), torch.no_grad():
        for seed in range(limit + 1):
            plain, model = _model(2 + seed % 2)
            graphs = Graphs()
            values, ctx = _context(model.targets, seed)
            got = torch.compile(model, backend=graphs)(x, replacements=ctx)
            assert graphs.count == 1, f"instrumented model {seed + 1} of {limit + 1} ran eagerly"
            torch.testing.assert_close(got, reference(plain, x, values, ctx.mask))


@FILTERS
def test_new_values_reuse_the_graph_new_shapes_names_and_dtypes_are_right(options):
    plain, model = _model(3)
    graphs = Graphs()
    compiled = torch.compile(model, backend=graphs, options=options)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        for seed in (0, 1, 2):  # new values, new masks: one graph
            values, ctx = _context(model.targets, seed, every=seed + 1)
            torch.testing.assert_close(compiled(x, replacements=ctx), reference(plain, x, values, ctx.mask))
        assert graphs.count == 1
        cases = {
            "a new shape": _context(model.targets, 3, tokens=TOKENS + 2),
            "a new set of names": _context(model.targets[:2], 4),
            "names in another order": _context(list(reversed(model.targets)) + ["9.gate"], 5),
            "a new dtype": _context(model.targets, 6, dtype=torch.bfloat16),
        }
        for what, (values, ctx) in cases.items():
            xs = torch.randn(ctx.num_tokens, HIDDEN)
            got = compiled(xs, replacements=ctx)
            torch.testing.assert_close(got, reference(plain, xs, values, ctx.mask), msg=what)
        values, ctx = _context(model.targets, 7)
        torch.testing.assert_close(compiled(x, replacements=ctx), reference(plain, x, values, ctx.mask))
    assert graphs.count == 1 + len(cases)  # the new shapes, names and dtypes compiled graphs of their own


@FILTERS
def test_a_selection_reuses_the_graph_of_every_selection(options):
    """A SelectedContext's masks are the rows of one matrix: a new selection is new values."""
    plain, model = _model(3)
    graphs = Graphs()
    compiled = torch.compile(model, backend=graphs, options=options)
    x = torch.randn(TOKENS, HIDDEN)
    values, ctx = _context(model.targets, 0)
    with torch.no_grad():
        for names in (model.targets[:1], model.targets[1:], []):
            got = compiled(x, replacements=ctx.select(names))
            torch.testing.assert_close(got, reference(plain, x, {n: values[n] for n in names}, ctx.mask))
    assert graphs.count == 1


def test_a_target_skipped_in_a_compiled_forward_is_an_error():
    """The hits are checked at trace time: a compiled forward that skips a target raises."""
    _, model = _model(2)

    class Skip(Stack):
        def forward(self, x):
            return self[0](x)

    model.__class__ = type("Skip", (type(model), Skip), {})
    with pytest.raises(Exception, match="not reached"):
        with torch.no_grad():
            torch.compile(model, backend="eager")(torch.randn(TOKENS, HIDDEN),
                                                  replacements=_context(model.targets, 0)[1])


class Outer(nn.Module):
    """A model whose forward calls its inner stack through ``run`` (vLLM compiles ``model.model``
    on its own, with ``fullgraph=True``, below the instrumented forward that arms the targets)."""

    def __init__(self, n: int):
        super().__init__()
        self.inner = Stack(n)
        self.run = [self.inner]  # a list: the compiled inner stack is no submodule

    def forward(self, x):
        return self.run[0](x)


@FILTERS
@pytest.mark.parametrize("bind", [False, True], ids=["copied", "bound"])
@pytest.mark.parametrize("inner", [False, True], ids=["model", "inner-fullgraph"])
def test_fed_buffers_new_values_reuse_the_graph(inner, bind, options):
    """Compiled whole, or its inner stack alone with ``fullgraph=True`` (vLLM's way): the fed
    buffers are read in the graph, new values and clear() reuse it."""
    torch.manual_seed(0)
    plain = Stack(3).eval()
    model = fxreplace.instrument(Outer(3).eval(), ["inner.*.gate"], max_tokens=TOKENS)
    model.inner.load_state_dict(plain.state_dict())
    graphs = Graphs()
    call = model if inner else torch.compile(model, backend=graphs, options=options)
    if inner:
        model.run[0] = torch.compile(model.inner, backend=graphs, fullgraph=True, options=options)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        bound = _context(model.targets, 0)[1]
        if bind:  # once: the context then written into in place
            model.feed(bound, bind=True)
        for seed in (1, 2):
            values, fed = _context(model.targets, seed, every=seed + 1)
            if bind:
                for name in fed:
                    bound[name].copy_(fed[name])
                bound.mask.copy_(fed.mask)
            else:
                model.feed(fed)
            values = {name.removeprefix("inner."): value for name, value in values.items()}
            torch.testing.assert_close(call(x), reference(plain, x, values, fed.mask))
        model.clear()
        torch.testing.assert_close(call(x), plain(x))
    assert graphs.count == 1


def test_a_hand_made_context_takes_the_layout_asked_for_last():
    """A replacer made anew over a store whose layout another context of the same names displaced
    (an earlier model, an earlier test) is again the layout a hand-made context takes: one graph."""
    store_order = {"a": (0, 0), "b": (0, 1)}
    first = fxreplace.context.Layout.of(store_order)
    fxreplace.context.Layout.of({"b": (0, 0), "a": (0, 1)})
    assert fxreplace.context.Layout.of(dict(store_order)) is first  # interned: the replacer's, made anew
    ctx = ReplacementContext({"b": torch.zeros(TOKENS, EXPERTS), "a": torch.ones(TOKENS, EXPERTS)},
                             torch.ones(TOKENS, dtype=torch.bool))
    assert ctx.layout is first and torch.equal(ctx["a"], torch.ones(TOKENS, EXPERTS))


@FILTERS
def test_observing_one_model_leaves_another_models_graph_alone(options):
    """observe() is per model: a capture that observes its own model for its whole life neither
    recompiles nor reroutes the graph of another model; observing the compiled model itself is
    seen in its graph, and closing it returns to the first graph."""
    plain, model = _model(2)
    _, other = _model(2)
    graphs = Graphs()
    compiled = torch.compile(model, backend=graphs, options=options)
    x = torch.randn(TOKENS, HIDDEN)
    values, ctx = _context(model.targets, 0)
    want = reference(plain, x, values, ctx.mask)
    seen, own = [], []
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, replacements=ctx), want)
        with fxreplace.observe(other, lambda name, computed: seen.append(name)):
            torch.testing.assert_close(compiled(x, replacements=ctx), want)
            other(x)
        assert graphs.count == 1 and seen == other.targets
        with fxreplace.observe(model, lambda name, computed: own.append((name, computed.shape))):
            torch.testing.assert_close(compiled(x, replacements=ctx), want)
        assert own == [(name, (TOKENS, EXPERTS)) for name in model.targets] and graphs.count == 2
        torch.testing.assert_close(compiled(x, replacements=ctx), want)
    assert graphs.count == 2


def _scaled(x):
    """A module-level function of the user's model: rebinding it must recompile."""
    return x * 2


class ScaledStack(Stack):
    def forward(self, x):
        return _scaled(super().forward(x))


def test_the_guard_filter_keeps_every_guard_of_a_plain_model():
    kept = []

    def recording(entries):
        decisions = fxreplace.guard_filter(entries)
        kept.extend(decisions)
        return decisions

    with torch.no_grad():
        torch.compile(ScaledStack(2).eval(), backend=Graphs(), options={"guard_filter_fn": recording})(
            torch.randn(TOKENS, HIDDEN))
    assert kept and all(kept)


def test_the_guard_filter_keeps_the_users_globals_and_drops_fxreplaces(monkeypatch):
    """Rebinding a function the user's model calls recompiles a model compiled with the filter;
    fxreplace's own module-level guards are the ones it drops."""
    torch.manual_seed(0)
    plain = ScaledStack(2).eval()
    model = fxreplace.instrument(ScaledStack(2).eval(), ["*.gate"])
    model.load_state_dict(plain.state_dict())
    graphs, dropped = Graphs(), []

    def recording(entries):
        decisions = fxreplace.guard_filter(entries)
        dropped.extend(entry.name for entry, keep in zip(entries, decisions) if not keep)
        return decisions

    compiled = torch.compile(model, backend=graphs, options={"guard_filter_fn": recording})
    x = torch.randn(TOKENS, HIDDEN)
    values, ctx = _context(model.targets, 0)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, replacements=ctx), reference(plain, x, values, ctx.mask) * 2)
        monkeypatch.setattr(f"{__name__}._scaled", lambda y: y * 3)
        torch.testing.assert_close(compiled(x, replacements=ctx), reference(plain, x, values, ctx.mask) * 3)
    assert graphs.count == 2
    # what it dropped: names reached through fxreplace's modules, or globals of the frame compiled
    # (InstrumentedModel.forward's module) that fxreplace defines; never a local, an input or the user's
    instrument_globals = vars(importlib.import_module("fxreplace.instrument"))
    roots = {name.split("']")[0].removeprefix("G['") for name in dropped}
    assert dropped and all(name.startswith("G[") for name in dropped), dropped
    assert all(root.startswith("__import_fxreplace") or root in instrument_globals for root in roots), roots


def _ops(call) -> tuple[list[str], torch.Tensor]:
    """The aten ops a call runs, in order (the profiler: a dispatch mode would be a recording)."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = call()
    return [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.name.startswith("aten::")], out


@pytest.mark.parametrize("variant", ["context", "fed", "never fed"])
def test_an_eager_forward_replacing_nothing_runs_the_plain_models_ops(variant):
    """Eagerly, a forward whose host masks replace no row costs each target a plain call: after
    the first forward (which checks every point) and once its masks are known, the instrumented
    model dispatches exactly the plain model's ops and returns its bits; one row on brings the
    replacement back."""
    plain, model = _model(3, max_tokens=TOKENS)
    x = torch.randn(TOKENS, HIDDEN)
    values, ctx = _context(model.targets, 0, every=TOKENS + 1)  # row 0 on
    off = ReplacementContext(values, torch.zeros(TOKENS, dtype=torch.bool))
    kwargs = {"replacements": off} if variant == "context" else {}
    if variant == "fed":
        model.feed(ctx)
        model.clear()
    first, _ = _ops(lambda: model(x, **kwargs))
    _ops(lambda: model(x, **kwargs))  # (reads the masks' bytes through views it keeps)
    plain_ops, want = _ops(lambda: plain(x))
    later, got = _ops(lambda: model(x, **kwargs))
    assert later == plain_ops and torch.equal(got, want)
    assert (first == plain_ops) == (variant == "never fed")  # the first forward checks every point
    if variant == "fed":
        model.feed(ctx)
    on = {"replacements": ctx} if variant != "fed" else {}
    if variant != "never fed":
        with torch.no_grad():
            torch.testing.assert_close(model(x, **on), reference(plain, x, values, ctx.mask))


def _given_in_place(model) -> bool:
    """Whether every target's ``__dict__`` holds its given forward (see fxreplace.slots.GivenForwards)."""
    return all("forward" in model.get_submodule(name).__dict__ for name in model.targets)


def test_a_forward_replacing_nothing_runs_the_given_forwards_and_one_that_may_replace_checks_the_hits():
    """After the first forward (which checks every point), a forward that replaces nothing runs the forwards the
    targets were given, put in their place (on a torch whose traces see through them): a target reached twice
    there computes what the given model computes, and the first forward that may replace a row names it. On an
    older torch each target runs its instrumented forward, which counts the hit."""
    plain, model = _model(2)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        model(x)
        assert not _given_in_place(model)  # the first forward checks every point
        for m in (plain, model):
            m[0].forward = (lambda b: lambda h: h + b.down(b.gate(h).softmax(-1)) + 0 * b.gate(h)[:, :1])(m[0])
        if SUBSTITUTES_MODULE_METHODS:
            assert torch.equal(model(x), plain(x))
            assert _given_in_place(model)
        else:
            with pytest.raises(TargetNotHitError, match="hit twice"):
                model(x)
            assert not _given_in_place(model)
        with pytest.raises(TargetNotHitError, match="hit twice"):
            model(x, replacements=_context(model.targets, 0)[1])
        assert not _given_in_place(model)


def test_a_forward_replacing_nothing_on_inputs_of_a_new_shape_checks_the_hits():
    """The given forwards are put in place only for inputs of a signature (shapes, flags) that a forward checking
    every hit has run: a path first taken, as a decode step whose fused kernel skips a target, is named with
    nothing replaced."""
    _, model = _model(2)

    class FusedDecode(Stack):
        def forward(self, x):
            return self[1](x) if x.shape[0] == 1 else super().forward(x)

    model.__class__ = type("FusedDecode", (type(model), FusedDecode), {})
    prefill, decode = torch.randn(TOKENS, HIDDEN), torch.randn(1, HIDDEN)
    with torch.no_grad():
        model(prefill)
        model(prefill)
        assert _given_in_place(model) == SUBSTITUTES_MODULE_METHODS
        with pytest.raises(TargetNotHitError, match=r"not reached.*\['0\.gate'\]"):
            model(decode)
        model(prefill)
        assert _given_in_place(model) == SUBSTITUTES_MODULE_METHODS


def test_a_forward_of_checked_targets_applies_the_checked_calls_and_checks_what_is_new(monkeypatch):
    """Once a forward checked every target, a forward replacing rows applies each target's checked call
    (the Injection's full check runs no more): values and mask written into the context in place are
    read, a new context is checked once, and a shape nobody checked is refused naming the target."""
    from fxreplace.injection import Injection

    plain, model = _model(2)
    full_checks = []
    inject = Injection._inject
    monkeypatch.setattr(Injection, "_inject", lambda self, computed, *a: full_checks.append(self.module_name)
                        or inject(self, computed, *a))
    ctx = _context(model.targets, 0)[1]
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        for step in range(3):
            expected = reference(plain, x, {name: ctx[name] for name in model.targets}, ctx.mask)
            torch.testing.assert_close(model(x, replacements=ctx), expected)
            ctx["1.gate"].add_(1.0)  # the engine writes the next step's rows in place
            ctx.mask.copy_(torch.arange(TOKENS) % 3 == step)
        assert full_checks == ["0.gate", "1.gate"]
        other_values, other = _context(model.targets, 1)
        for _ in range(2):
            torch.testing.assert_close(model(x, replacements=other), reference(plain, x, other_values, other.mask))
        assert full_checks == ["0.gate", "1.gate"] * 2
        with pytest.raises(ShapeError, match=r"0\.gate has shape \(6, 4\), but the module computes \(5, 4\)"):
            model(x[:TOKENS - 1], replacements=other)


def test_a_forward_on_the_inputs_of_the_last_replays_its_calls_only_where_they_fit():
    """A forward on the inputs of the forward before (here the fed buffers) replays each target's checked
    call: a computed dtype that changed (autocast) goes through the full check, and a forward on a context
    checked before that failed half way leaves no call of its own to be replayed on the fed buffers."""
    plain, model = _model(2, max_tokens=TOKENS)
    fed, other = _context(model.targets, 0)[1], _context(model.targets, 1)[1]
    model.feed(fed)
    x = torch.randn(TOKENS, HIDDEN)

    def expected(context):
        return reference(plain, x, {name: context[name] for name in model.targets}, context.mask)

    def fails_in_block_1(h):
        raise ValueError("a port's bug in block 1")

    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), expected(fed))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(x), expected(fed))
        for _ in range(2):
            torch.testing.assert_close(model(x), expected(fed))
        torch.testing.assert_close(model(x, replacements=other), expected(other))
        for _ in range(2):
            torch.testing.assert_close(model(x), expected(fed))
        model[1].forward = fails_in_block_1
        with pytest.raises(ValueError, match="block 1"):  # block 0's gate applies the context's checked call
            model(x, replacements=other)
        del model[1].forward
        torch.testing.assert_close(model(x), expected(fed))


def test_a_replayed_forward_checks_every_hit(monkeypatch):
    """A forward on the context of the forward before replays each target's checked call (an engine's steady
    step: no full check) and still refuses a target its model skipped or reached twice, naming it; a forward
    after such a failure is right."""
    from fxreplace.injection import Injection

    plain, model = _model(2)
    full_checks = []
    inject = Injection._inject
    monkeypatch.setattr(Injection, "_inject", lambda self, computed, *a: full_checks.append(self.module_name)
                        or inject(self, computed, *a))
    values, ctx = _context(model.targets, 0)
    x = torch.randn(TOKENS, HIDDEN)
    gate = plain[1].gate
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x, replacements=ctx), reference(plain, x, values, ctx.mask))
        assert full_checks == ["0.gate", "1.gate"]  # the first forward checked; the others replayed
        model[1].forward = lambda h: h + model[1].down(gate(h).softmax(-1))  # a port's block 1 skips its gate
        with pytest.raises(TargetNotHitError, match=r"not reached.*\['1\.gate'\]"):
            model(x, replacements=ctx)
        model[1].forward = lambda h: h + model[1].down((model[1].gate(h) + model[1].gate(h)).softmax(-1))
        with pytest.raises(TargetNotHitError, match=r"'1\.gate' was hit twice in one forward"):
            model(x, replacements=ctx)
        del model[1].forward
        assert full_checks == ["0.gate", "1.gate"]  # both failed forwards were replays
        for _ in range(2):
            torch.testing.assert_close(model(x, replacements=ctx), reference(plain, x, values, ctx.mask))


def test_a_replayed_step_that_fails_leaves_the_next_step_on_the_context_right():
    """An engine's steady step (a replay) given a batch its context does not fit is refused naming the
    target, and the next step on the same context is right: the failed step dropped the call its target
    replayed, so the next is checked anew and then replayed again."""
    plain, model = _model(2)
    values, ctx = _context(model.targets, 0)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        for _ in range(3):
            model(x, replacements=ctx)
        assert model._fxreplace.replay_inputs is not None
        with pytest.raises(ShapeError, match=r"0\.gate has shape \(6, 4\), but the module computes \(5, 4\)"):
            model(x[:TOKENS - 1], replacements=ctx)
        for _ in range(3):
            torch.testing.assert_close(model(x, replacements=ctx), reference(plain, x, values, ctx.mask))
        assert model._fxreplace.replay_inputs is not None


class PairGate(nn.Linear):
    """A gate returning ``(logits, probabilities)``: its target's point is ``output[0]``."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.softmax(-1)


class PairBlock(Block):
    def __init__(self):
        super().__init__()
        self.gate = PairGate(HIDDEN, EXPERTS, bias=False)

    def forward(self, x):
        logits, probabilities = self.gate(x)
        return x + self.down(logits.softmax(-1) + probabilities)


def test_a_replayed_forward_applies_output_i_points_and_leaves_a_target_without_rows_as_computed(monkeypatch):
    """Replayed forwards (the context of the forward before) apply an ``output[0]`` point's checked call to
    that element of the module's tuple, and leave a target the context holds no rows for as computed: each
    step equals the replacement applied by hand, with one full check per target that has rows."""
    from fxreplace.injection import Injection

    torch.manual_seed(0)
    plain = nn.Sequential(PairBlock(), PairBlock()).eval()
    model = fxreplace.instrument(nn.Sequential(PairBlock(), PairBlock()).eval(),
                                 [fxreplace.Target("*.gate", point="output[0]")])
    model.load_state_dict(plain.state_dict())
    full_checks = []
    inject = Injection._inject
    monkeypatch.setattr(Injection, "_inject", lambda self, computed, *a: full_checks.append(self.module_name)
                        or inject(self, computed, *a))
    ctx = _context(["0.gate"], 0)[1]  # no rows for 1.gate

    def expected(x):
        for i, block in enumerate(plain):
            logits, probabilities = block.gate(x)
            if i == 0:
                logits = torch.where(ctx.mask.unsqueeze(-1), ctx["0.gate"], logits)
            x = x + block.down(logits.softmax(-1) + probabilities)
        return x

    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        for step in range(4):
            assert torch.equal(model(x, replacements=ctx), expected(x)), step
            ctx["0.gate"].add_(1.0)  # the engine writes the next step's rows in place
            ctx.mask.copy_(torch.arange(TOKENS) % 3 == step)
        assert model._fxreplace.replay_inputs is not None  # the last forwards were replays
    assert full_checks == ["0.gate"]


def test_a_forward_set_on_a_target_after_instrument_is_never_overwritten():
    """A forward set on a target after instrument() (a port swapping code in) stays, whether the given forwards were
    in place when it was set (a forward that may replace leaves it) or not (they are placed no more)."""
    plain, model = _model(2)
    x = torch.randn(TOKENS, HIDDEN)
    ctx = _context(model.targets, 0)[1]
    with torch.no_grad():
        model(x)
        model(x)
        assert _given_in_place(model) == SUBSTITUTES_MODULE_METHODS
        own = model[0].gate.forward = lambda h: plain[0].gate(h)  # set while in place
        with pytest.raises(TargetNotHitError, match=r"not reached.*'0\.gate'"):
            model(x, replacements=ctx)
        assert model[0].gate.__dict__["forward"] is own and "forward" not in model[1].gate.__dict__
        del model[0].gate.forward
        model(x, replacements=ctx)
        own = model[1].gate.forward = lambda h: plain[1].gate(h)  # set while not in place
        with pytest.raises(TargetNotHitError, match=r"not reached.*'1\.gate'"):
            model(x)
        assert model[1].gate.__dict__["forward"] is own and "forward" not in model[0].gate.__dict__
        del model[1].gate.forward
        model(x)
        assert not _given_in_place(model)  # placed no more


NO_GUARDS = {"guard_filter_fn": lambda entries: [False] * len(entries)}  # as vLLM compiles


def test_a_trace_begun_while_the_given_forwards_are_in_place_injects():
    """A compiled region inside the model traced during a forward that replaces nothing (the given forwards in
    place) still traces the instrumented forwards: the graph, run with no guard checked (as vLLM runs its inner
    model; its compiled engine's AOT capture, which runs no compile callback, in test_vllm), replaces rows in
    later forwards. Once traced, the model places the given forwards no more."""
    torch.manual_seed(0)
    plain = Stack(3).eval()
    model = fxreplace.instrument(Outer(3).eval(), ["inner.*.gate"], max_tokens=TOKENS)
    model.inner.load_state_dict(plain.state_dict())
    x = torch.randn(TOKENS, HIDDEN)
    values, ctx = _context(model.targets, 1)
    with torch.no_grad():
        model.feed(ctx)
        model.clear()
        model(x)  # the first forward checks every point
        model.run[0] = torch.compile(model.inner, fullgraph=True, backend="eager", options=NO_GUARDS)
        placed = []
        model.inner[0].register_forward_pre_hook(lambda *_: placed.append(_given_in_place(model)))
        assert torch.equal(model(x), plain(x))  # traced now
        assert placed == [SUBSTITUTES_MODULE_METHODS]
        model.feed(ctx)
        values = {name.removeprefix("inner."): value for name, value in values.items()}
        torch.testing.assert_close(model(x), reference(plain, x, values, ctx.mask))
        model.clear()
        model(x)
        assert not _given_in_place(model)


def test_a_compiled_model_called_between_eager_forwards_replacing_nothing_compiles_once():
    """Eager forwards that replace nothing before and between the calls of the compiled model: one graph (its
    trace takes the given forwards out for good, which its guards would otherwise see come and go)."""
    plain, model = _model(2, max_tokens=TOKENS)
    x = torch.randn(TOKENS, HIDDEN)
    graphs = Graphs()
    compiled = torch.compile(model, backend=graphs)
    with torch.no_grad():
        model.feed(_context(model.targets, 0)[1])
        model.clear()
        model(x)
        model(x)
        assert _given_in_place(model) == SUBSTITUTES_MODULE_METHODS
        for _ in range(2):
            assert torch.equal(compiled(x), plain(x))
            assert torch.equal(model(x), plain(x))
            assert not _given_in_place(model)
    assert graphs.count == 1


@pytest.mark.parametrize("context", [True, False], ids=["context", "fed"])
def test_each_target_adds_one_guard_its_key_never_its_slot(context):
    """Per target, a compiled model's trace reads one string in the target module's own ``__dict__``
    (which the plain model's guards reach anyway), never the target's slot: a guard on a slot reads
    an object the compiled call never touches, cold in the caches after each step. Counted as
    compiled with :func:`fxreplace.guard_filter` (older torch adds aliasing guards on fxreplace's
    modules per target, which it drops)."""
    counts = {}
    for n in (2, 6):
        plain, model = _model(n, max_tokens=None if context else TOKENS)
        x = torch.randn(TOKENS, HIDDEN)
        ctx = _context(model.targets, 0)[1]
        if not context:
            model.feed(ctx)
        for name, m, kwargs in (("plain", plain, {}), ("model", model, {"replacements": ctx} if context else {})):
            kept = []

            def keep(entries):
                keeps = fxreplace.guard_filter(entries)
                kept.extend(e.name for e, k in zip(entries, keeps) if k)
                return keeps

            torch._dynamo.reset()
            with torch.no_grad():
                torch.compile(m, backend="eager", options={"guard_filter_fn": keep})(x, **kwargs)
            counts[name, n] = kept
    per_target = (len(counts["model", 6]) - len(counts["plain", 6]) - len(counts["model", 2])
                  + len(counts["plain", 2])) / 4
    assert per_target == 1
    assert sorted(name for name in counts["model", 6] if "_fxreplace_key" in name) == [
        f"self._modules['{i}']._modules['gate']._fxreplace_key" for i in range(6)]
    assert not [name for name in counts["model", 6] if "_fxreplace_slot" in name]


def test_the_proof_of_an_unchanged_model_runs_the_instrumented_forwards_replacing_nothing(monkeypatch):
    """prove_unchanged() proves the instrumented forwards, also through an engine's forward that
    replaces nothing (fed buffers cleared) after the model was checked, whose targets would otherwise
    take the plain calls: an injection planted to return more than it was given is found."""
    _, model = _model(2, max_tokens=TOKENS)
    x = torch.randn(TOKENS, HIDDEN)
    model.feed(_context(model.targets, 0)[1])
    model.clear()
    with torch.no_grad():
        model(x)
        slots = importlib.import_module("fxreplace.slots")
        given = slots.Slot.with_injected
        monkeypatch.setattr(slots.Slot, "with_injected",
                            lambda slot, output, index, value, injected: given(slot, output, index, value, injected + 1))
        with pytest.raises(fxreplace.InstrumentationChangedError, match=r"instrumenting '0\.gate' changed"):
            fxreplace.prove_unchanged(model, lambda: model(x))


class EngineSteps(RuleBasedStateMachine):
    """An engine's eager steps in any order, on one instrumented model that keeps its fast paths (checked
    calls, replays, the forwards given to targets) between them: contexts given again and written in place,
    fed buffers fed, cleared and read by a shorter batch, autocast, and batches a context does not fit.
    Every step that runs equals the replacement applied by hand; a step given a batch its context does not
    fit is refused naming the target, unless its mask replaces no row (then it is the plain model's step),
    and the next step on that context is right."""

    def __init__(self):
        super().__init__()
        self.plain, self.model = _model(2, max_tokens=TOKENS)
        self.contexts = [_context(self.model.targets, seed)[1] for seed in range(2)] + [_context(["0.gate"], 2)[1]]
        self.fed = _context(self.model.targets, 3)[1]
        self.model.feed(self.fed)
        self.fed_on = True
        self.x = torch.randn(TOKENS, HIDDEN)

    def expected(self, x, context):
        if context is None:
            return self.plain(x)
        rows = x.shape[0]
        return reference(self.plain, x, {name: context[name][:rows] for name in self.model.targets if name in context},
                         context.mask[:rows])

    @rule(which=st.integers(0, 2), autocast=st.booleans())
    def step_on_a_context(self, which, autocast):
        ctx = self.contexts[which]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got, expected = self.model(self.x, replacements=ctx), self.expected(self.x, ctx)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)

    @rule(rows=st.sampled_from([TOKENS, 3]))
    def step_on_the_fed_buffers(self, rows):
        x = self.x[:rows]
        with torch.no_grad():
            expected = self.expected(x, self.fed if self.fed_on else None)
            torch.testing.assert_close(self.model(x), expected, rtol=0, atol=0)

    @rule(which=st.integers(0, 2))
    def step_on_a_batch_the_context_does_not_fit(self, which):
        ctx, x = self.contexts[which], self.x[:TOKENS - 1]
        with torch.no_grad():
            try:
                got = self.model(x, replacements=ctx)
            except ShapeError as error:
                assert "0.gate has shape (6, 4), but the module computes (5, 4)" in str(error)
            else:
                assert not ctx.mask.any() and torch.equal(got, self.plain(x))
        self.step_on_a_context(which, autocast=False)  # the engine's next step, on the same context

    @rule(which=st.integers(0, 2), seed=st.integers(0, 2**16), step=st.integers(0, 9))
    def write_a_context_in_place(self, which, seed, step):
        ctx = self.contexts[which]
        for name in self.model.targets:
            if name in ctx:
                ctx[name].add_(float(step))
        ctx.mask.copy_(torch.rand(TOKENS, generator=torch.Generator().manual_seed(seed)) > step / 10)

    @rule()
    def clear_the_fed_buffers(self):
        self.model.clear()
        self.fed_on = False

    @rule()
    def feed_again(self):
        self.model.feed(self.fed)
        self.fed_on = True


TestEngineSteps = EngineSteps.TestCase
TestEngineSteps.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
