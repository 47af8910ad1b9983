"""instrument() on Qwen3-MoE: replacement semantics, model identity, errors,
one compiled graph for on/off/new values, static feed buffers."""

import copy
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fxreplace.models as families
from fxreplace.context import ReplacementContext
from fxreplace.instrument import TargetNotHitError, instrument
from fxreplace.sharding import ShapeError
from fxreplace.targets import Target, TargetError
from graph_helpers import TOKENS, OverrideLinear, contiguous_context, input_ids, off_context, random_context

ARCH = "Qwen3MoeForCausalLM"
GATES = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
E = 8


@pytest.fixture(scope="module")
def plain():
    return families.tiny_model(ARCH)


@pytest.fixture(scope="module")
def model(plain):
    return instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)


def reference(plain, ctx):
    weights = {plain.get_submodule(n).weight: ctx[n] for n in ctx}
    with torch.no_grad(), OverrideLinear(weights, ctx.mask):
        return plain(input_ids=input_ids()).logits


def logits(model, **kwargs):
    with torch.no_grad():
        return model(input_ids=input_ids(), **kwargs).logits


def test_targets_and_model_identity(plain):
    fresh = copy.deepcopy(plain)
    params = dict(fresh.named_parameters())
    keys = list(fresh.state_dict())
    out = instrument(fresh, ["model.layers.*.mlp.gate"])
    assert out is fresh and out.targets == GATES
    assert list(out.state_dict()) == keys
    assert all(p is params[n] for n, p in out.named_parameters())
    assert type(out).__name__ == type(plain).__name__ and isinstance(out, type(plain))
    with pytest.raises(ValueError, match="already instrumented"):
        instrument(out, ["model.layers.*.mlp.gate"])


def test_replacement_equals_independent_override(model, plain):
    ctx = random_context(GATES, E)
    expected = reference(plain, ctx)
    assert not torch.allclose(expected, logits(plain))  # the replacement matters
    torch.testing.assert_close(logits(model, replacements=ctx), expected, rtol=1e-5, atol=1e-5)


def test_off_and_plain_equal_the_plain_model(model, plain):
    assert torch.equal(logits(model), logits(plain))
    assert torch.equal(logits(model, replacements=off_context(GATES, E)), logits(plain))


def test_dict_replaces_all_rows_and_missing_names_stay_off(model, plain):
    ctx = random_context(GATES, E, mask=torch.ones(TOKENS, dtype=torch.bool))
    expected = reference(plain, ctx)
    torch.testing.assert_close(logits(model, replacements=dict(ctx.items())), expected, rtol=1e-5, atol=1e-5)
    only_first = ReplacementContext({GATES[0]: ctx[GATES[0]]}, ctx.mask)
    torch.testing.assert_close(logits(model, replacements=only_first), reference(plain, only_first),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError, match="no replacement name"):
        logits(model, replacements={"model.layers.0.mlp.router": ctx[GATES[0]]})


def test_load_state_dict_updates_what_forward_uses(plain):
    fresh = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"])
    state = {k: v.clone() for k, v in fresh.state_dict().items()}
    state[f"{GATES[0]}.weight"] = torch.randn(E, 64)
    for assign in (False, True):
        other = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"])
        other.load_state_dict(state, assign=assign)
        twin = copy.deepcopy(plain)
        twin.load_state_dict(state)
        assert torch.equal(logits(other), logits(twin))
        assert not torch.equal(logits(other), logits(plain))


def test_shape_mismatch_names_module_and_shapes(model):
    bad = random_context(GATES, E, tokens=TOKENS + 1)
    with pytest.raises(ShapeError, match=r"model\.layers\.0\.mlp\.gate.*\(9, 8\).*\[8, E\]"):
        logits(model, replacements=bad)
    wrong_experts = ReplacementContext({n: torch.zeros(TOKENS, E + 1) for n in GATES}, torch.ones(TOKENS, dtype=torch.bool))
    with pytest.raises(ShapeError, match=r"model\.layers\.0\.mlp\.gate.*\(8, 9\).*\(8, 8\)"):
        logits(model, replacements=wrong_experts)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    with pytest.raises(ShapeError, match=r"model\.layers\.0\.mlp\.gate"):
        with torch.no_grad():
            torch.compile(model, backend=cnt)(input_ids=input_ids(), replacements=bad)


def test_a_forward_that_skips_the_router_is_an_error(plain):
    fresh = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"])
    moe = fresh.model.layers[1].mlp
    moe.forward = lambda hidden_states: hidden_states  # a "kernel" that never calls the gate
    with pytest.raises(TargetNotHitError, match=r"model\.layers\.1\.mlp\.gate"):
        logits(fresh, replacements=random_context(GATES, E))
    with pytest.raises(TargetNotHitError, match=r"model\.layers\.1\.mlp\.gate"):
        logits(fresh)
    gate = fresh.model.layers[0].mlp.gate
    twice = fresh.model.layers[0].mlp
    twice.forward = lambda h: (gate(h.view(-1, 64)), gate(h.view(-1, 64)), h)[-1]
    with pytest.raises(TargetNotHitError, match="hit twice"):
        logits(fresh)


def test_one_compiled_graph_for_on_off_and_new_values(model, plain):
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    contexts = [random_context(GATES, E, seed=1), off_context(GATES, E), random_context(GATES, E, seed=2)]
    for ctx in contexts:
        with torch.no_grad():
            out = compiled(input_ids=input_ids(), replacements=ctx).logits
        torch.testing.assert_close(out, reference(plain, ctx), rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1


def test_inductor_matches_eager_and_compiles_once(model, plain):
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=cnt)
    for seed in (3, 4):
        ctx = random_context(GATES, E, seed=seed)
        with torch.no_grad():
            out = compiled(input_ids=input_ids(), replacements=ctx).logits
        torch.testing.assert_close(out, reference(plain, ctx), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        out = compiled(input_ids=input_ids(), replacements=off_context(GATES, E)).logits
    torch.testing.assert_close(out, logits(plain), rtol=1e-4, atol=1e-4)
    assert cnt.frame_count == 1


def test_feed_buffers_serve_one_graph(plain):
    torch._dynamo.reset()
    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    keys = list(fed.state_dict())
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(fed, backend=cnt, fullgraph=True)
    fed.feed(off_context(GATES, E, tokens=16))  # warmup: sizes the buffers
    assert list(fed.state_dict()) == keys  # buffers are not persistent
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=input_ids()).logits, logits(plain))
    for seed in (5, 6):
        ctx = random_context(GATES, E, seed=seed)
        fed.feed(ctx)
        with torch.no_grad():
            out = compiled(input_ids=input_ids()).logits
        torch.testing.assert_close(out, reference(plain, ctx), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, logits(fed, replacements=ctx), rtol=1e-5, atol=1e-5)
    fed.clear()
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=input_ids()).logits, logits(plain))
    assert cnt.frame_count == 1
    with pytest.raises(ShapeError, match="does not fit"):
        fed.feed(random_context(GATES, E, tokens=17))


def test_feed_needs_max_tokens(plain):
    fresh = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"])
    with pytest.raises(ValueError, match="max_tokens"):
        fresh.feed(off_context(GATES, E))


def test_a_fed_forward_longer_than_max_tokens_names_max_tokens(plain):
    """A forward computing more rows than the feed buffers hold is refused in the words of the fix
    (max_tokens), not as a replacement of a shape the user never gave."""
    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=TOKENS // 2)
    fed.feed(random_context(GATES, E, tokens=TOKENS // 2))
    with torch.no_grad(), pytest.raises(ShapeError, match=(
            rf"model\.layers\.0\.mlp\.gate computes \({TOKENS}, {E}\) here, more rows than the {TOKENS // 2} of the "
            r"feed buffers: instrument\(\.\.\., max_tokens=N\) sizes them")):
        fed(input_ids=input_ids())


# --------------------------------------------------------------------------- layouts and adapters


class RankRouter(torch.nn.Module):
    """One rank's router of a model split over 2 ranks: the logits of its 4 of 8
    experts for all 16 tokens (``experts``), or of all 8 experts for its 8 of 16
    tokens (``tokens``), as an engine that shards the router computes them."""

    def __init__(self, split: str):
        super().__init__()
        self.split = split
        self.gate = torch.nn.Linear(16, 4 if split == "experts" else 8, bias=False)

    def forward(self, x):
        return self.gate(x[8:] if self.split == "tokens" else x)


@pytest.mark.parametrize("split, spec", [("experts", 'ShardSpec("expert", 2, rank)'),
                                         ("tokens", 'ShardSpec("sequence", 2, rank)')])
def test_forgotten_shard_spec_names_the_spec_that_fits(split, spec):
    from fxreplace import ShardSpec, Target

    x, full = torch.randn(16, 16), torch.randn(16, 8)
    model = instrument(RankRouter(split), ["gate"])
    with pytest.raises(ShapeError, match=r"gate.*give the target shard=" + re.escape(spec)):
        model(x, replacements={"gate": full})
    mode = "expert" if split == "experts" else "sequence"
    fixed = instrument(RankRouter(split), [Target("gate", shard=ShardSpec(mode, 2, 1))])
    with torch.no_grad():
        out = fixed(x, replacements={"gate": full})
    torch.testing.assert_close(out, full[:, 4:] if split == "experts" else full[8:])


class FusedRouter(torch.nn.Module):
    """A router whose output is dense routing weights (softmax -> top-2 -> renorm, scattered)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 8, bias=False)
        self.top_k, self.norm_topk_prob = 2, True

    def forward(self, x):
        values, indices = torch.topk(torch.softmax(self.proj(x), dim=-1), self.top_k, dim=-1)
        return torch.zeros(x.shape[0], 8).scatter(1, indices, values / values.sum(-1, keepdim=True))


def test_routing_adapter_at_a_logits_point_is_refused(plain):
    """A routing adapter converts logits to routing weights of the same [T, E] shape: at a
    point that computes the logits it would silently feed weights to the model."""
    from fxreplace import Target
    from fxreplace.adapters import get_adapter

    for target in (Target("model.layers.*.mlp.gate", adapter="softmax_topk_renorm"),  # auto: the gate's linear
                   Target("model.layers.*.mlp.gate", point="output[0]", adapter="softmax_topk_renorm")):
        with pytest.raises(TargetError, match=r"model\.layers\.0\.mlp\.gate.*'softmax_topk_renorm' turns router "
                                              r"logits into routing weights.*computed by a linear layer"):
            instrument(copy.deepcopy(plain), [target])
    with pytest.raises(TargetError, match="'topk_softmax_scatter' turns router logits"):
        instrument(RankRouter("tokens"), [Target("gate", adapter=get_adapter("topk_softmax_scatter"))])
    from fxreplace.export import export

    with pytest.raises(TargetError, match=r"model\.layers\.0\.mlp\.gate.*'softmax_topk_renorm' turns router logits"):
        export(copy.deepcopy(plain), {"input_ids": input_ids(), "use_cache": False},
               [Target("model.layers.*.mlp.gate", adapter="softmax_topk_renorm")])
    # at a point that computes routing weights, the adapter is what makes the replacement fit
    model = torch.nn.Sequential(FusedRouter())
    instrument(model, [Target("0", point="output", adapter="softmax_topk_renorm")])
    logits = torch.randn(16, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.randn(16, 16), replacements={"0": logits}),
                                   get_adapter("softmax_topk_renorm")(logits, model[0]))


# --------------------------------------------------------------------------- bad input


def test_a_failed_forward_leaves_no_replacement_armed(plain):
    fresh = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"])
    ctx = random_context(GATES, E, mask=torch.ones(TOKENS, dtype=torch.bool))
    bad = {GATES[0]: ctx[GATES[0]], GATES[1]: torch.zeros(TOKENS + 1, E)}  # layer 0 replaced, then layer 1 fails
    with pytest.raises(ShapeError, match=r"model\.layers\.1\.mlp\.gate"):
        logits(fresh, replacements=bad)
    gate, hidden = fresh.get_submodule(GATES[1]), torch.randn(TOKENS, 64)
    with torch.no_grad():  # a direct call of a target is the plain module again
        assert torch.equal(gate(hidden)[0], torch.nn.functional.linear(hidden, gate.weight))
    assert torch.equal(logits(fresh), logits(plain))  # no stale "hit twice", no stale replacement
    with pytest.raises(KeyError):
        logits(fresh, replacements={"nope": ctx[GATES[0]]})
    assert torch.equal(logits(fresh), logits(plain))


def test_output_index_on_a_tensor_output_is_an_error():
    """HF's attention returns (output, weights), vLLM's the tensor: output[0] there is a row."""
    from fxreplace import Target

    llama = instrument(families.tiny_model("LlamaForCausalLM"), [Target("model.layers.*.mlp", point="output[0]")])
    with pytest.raises(TargetError, match=r"'model\.layers\.0\.mlp': point 'output\[0\]' indexes the output, but "
                                          r"the module returns a Tensor"):
        logits(llama)


def test_misspelled_replacement_name_is_an_error(model):
    ctx = random_context(GATES, E)
    with pytest.raises(KeyError, match=r"\['model\.layers\.1\.mlp\.gat'\] match no target; close capture names: "
                                       r"\{'model\.layers\.1\.mlp\.gat': \['model\.layers\.1\.mlp\.gate'"):
        logits(model, replacements={GATES[0]: ctx[GATES[0]], "model.layers.1.mlp.gat": ctx[GATES[1]]})


def test_targets_as_one_string_are_one_pattern(plain):
    assert instrument(copy.deepcopy(plain), "model.layers.*.mlp.gate").targets == GATES
    with pytest.raises(TargetError, match=r"target 'model.layers.9.mlp.gate' matches no module"):
        instrument(copy.deepcopy(plain), "model.layers.9.mlp.gate")


def test_replacement_dtype_and_device_are_checked(model):
    ints = {n: torch.ones(TOKENS, E, dtype=torch.int64) for n in GATES}
    with pytest.raises(TypeError, match=r"replacement for model\.layers\.0\.mlp\.gate is torch\.int64, but the "
                                        r"module computes torch\.float32"):
        logits(model, replacements=ints)
    meta = {n: torch.zeros(TOKENS, E, device="meta") for n in GATES}
    with pytest.raises(ValueError, match=r"replacement for model\.layers\.0\.mlp\.gate is on meta, but the module "
                                         r"computes on cpu"):
        logits(model, replacements=meta)
    halves = {n: t.to(torch.bfloat16) for n, t in random_context(GATES, E).items()}
    logits(model, replacements=halves)  # another float dtype is cast, as before


def test_uninstrumented_model_refuses_replacements(plain):
    from fxreplace.instrument import uninstrument

    fresh = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"])
    uninstrument(fresh)
    with pytest.raises(TypeError, match=r"Qwen3MoeForCausalLM is no longer instrumented .*replacements="):
        logits(fresh, replacements=random_context(GATES, E))
    assert torch.equal(logits(fresh), logits(plain))
    again = instrument(fresh, ["model.layers.*.mlp.gate"])  # and instrumenting again works
    ctx = random_context(GATES, E)
    torch.testing.assert_close(logits(again, replacements=ctx), reference(plain, ctx), rtol=1e-5, atol=1e-5)


def test_eager_bound_feed_reads_rows_without_a_kernel(plain):
    """Eagerly, with host buffers bound by feed(bind=True): a call whose rows are all
    replaced returns the buffer's rows themselves, one with none returns the computed
    value, a mixed one selects per row; each forward reads the buffers' current contents.
    A copying feed() never hands its buffers out."""
    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    bound = contiguous_context(GATES, E, tokens=16, seed=3)
    assert all(bound[n].is_contiguous() for n in GATES)
    fed.feed(bound, bind=True)
    seen = {}
    hooks = [fed.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out))
             for n in GATES]

    def router_output(name):
        out = seen[name]
        return out[0] if isinstance(out, tuple) else out

    try:
        logits(fed)  # the first call checks the buffers; later calls reuse that check
        for seed, mask in ((4, "all"), (5, "none"), (6, "mixed"), (7, "all")):
            values = random_context(GATES, E, tokens=16, seed=seed)
            for name in GATES:
                bound[name].copy_(values[name])
            rows = {"all": torch.ones(TOKENS, dtype=torch.bool), "none": torch.zeros(TOKENS, dtype=torch.bool),
                    "mixed": values.mask[:TOKENS]}[mask]
            bound.mask.fill_(False)
            bound.mask[:TOKENS] = rows
            ctx = ReplacementContext({n: bound[n][:TOKENS].clone() for n in GATES}, rows.clone())
            torch.testing.assert_close(logits(fed), reference(plain, ctx), rtol=1e-5, atol=1e-5)
            if mask == "all":
                assert all(router_output(n).data_ptr() == bound[n].data_ptr() for n in GATES)
            if mask == "none":
                assert torch.equal(logits(fed), logits(plain))
        fed.feed(random_context(GATES, E, tokens=TOKENS, seed=8, mask=torch.ones(TOKENS, dtype=torch.bool)))
        logits(fed)
        buffers = [values for values, _ in fed._fxreplace.fed]
        assert all(router_output(n).data_ptr() != b.data_ptr() for n, b in zip(GATES, buffers))
    finally:
        for hook in hooks:
            hook.remove()


def test_make_fx_of_a_bound_feed_keeps_the_mask_in_the_graph(plain):
    """The eager shortcut (all rows replaced: the rows themselves) is not taken while a
    dispatch mode records kernels: make_fx's graph selects by the mask it reads at run time."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    bound = random_context(GATES, E, tokens=16, seed=3, mask=torch.ones(16, dtype=torch.bool))
    fed.feed(bound, bind=True)
    replaced = logits(fed)
    assert torch.equal(logits(fed), replaced)  # the shortcut's path, eagerly
    with torch.no_grad():
        graph = make_fx(lambda ids: fed(input_ids=ids).logits)(input_ids())
    with torch.no_grad():
        torch.testing.assert_close(graph(input_ids()), replaced, rtol=1e-5, atol=1e-5)
        bound.mask.fill_(False)
        torch.testing.assert_close(graph(input_ids()), logits(plain), rtol=1e-5, atol=1e-5)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def test_jit_trace_of_a_fed_model_keeps_the_mask_in_the_graph(plain):
    """torch.jit.trace (what torch_neuronx.trace runs) of a model fed with feed() after
    eager forwards: the eager shortcut (no row replaced: the computed value) is not
    recorded; the trace reads the buffers and selects by their masks at run time."""
    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    fed.feed(random_context(GATES, E, tokens=16, seed=3, mask=torch.zeros(16, dtype=torch.bool)))
    assert torch.equal(logits(fed), logits(plain)) and torch.equal(logits(fed), logits(plain))
    with torch.no_grad():
        traced = torch.jit.trace(_Logits(fed), (input_ids(),), check_trace=False, strict=False)
        torch.testing.assert_close(traced(input_ids()), logits(plain), rtol=1e-5, atol=1e-5)
        ctx = random_context(GATES, E, seed=4)
        fed.feed(ctx)
        torch.testing.assert_close(traced(input_ids()), reference(plain, ctx), rtol=1e-5, atol=1e-5)


def test_a_forward_with_its_own_replacements_leaves_the_fed_buffers_in_place(plain):
    """Between forwards the targets hold the fed buffers: a forward given replacements= (one
    that succeeds, one that fails) reads its own tensors, and the next plain forward the
    fed ones again, not the tensors of the call before."""
    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    bound = random_context(GATES, E, tokens=16, seed=3, mask=torch.ones(16, dtype=torch.bool))
    fed.feed(bound, bind=True)
    from_feed = ReplacementContext({n: bound[n][:TOKENS] for n in GATES}, bound.mask[:TOKENS])
    own = random_context(GATES, E, seed=9)
    expected_fed, expected_own = reference(plain, from_feed), reference(plain, own)
    assert not torch.allclose(expected_fed, expected_own)
    torch.testing.assert_close(logits(fed), expected_fed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(fed, replacements=own), expected_own, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(fed), expected_fed, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match=r"model\.layers\.1\.mlp\.gate"):
        logits(fed, replacements={GATES[0]: own[GATES[0]], GATES[1]: torch.zeros(TOKENS + 1, E)})
    torch.testing.assert_close(logits(fed), expected_fed, rtol=1e-5, atol=1e-5)
    fed.clear()
    assert torch.equal(logits(fed), logits(plain))


def test_eager_bound_feed_checks_each_batch_size_once(plain, monkeypatch):
    """An engine's batch size changes from step to step: each size's first call is checked
    in full, later calls of any size seen before reuse that check (and stay exact)."""
    from fxreplace.injection import Injection

    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    bound = random_context(GATES, E, tokens=16, seed=3, mask=torch.ones(16, dtype=torch.bool))
    fed.feed(bound, bind=True)
    full_checks = []
    inject = Injection._inject
    monkeypatch.setattr(Injection, "_inject", lambda self, computed, *a: full_checks.append(computed.shape[0])
                        or inject(self, computed, *a))
    for tokens in (4, TOKENS, 4, 12, TOKENS, 4, 12):
        ids = input_ids(tokens)
        ctx = ReplacementContext({n: bound[n][:tokens] for n in GATES}, bound.mask[:tokens])
        weights = {plain.get_submodule(n).weight: ctx[n] for n in ctx}
        with torch.no_grad(), OverrideLinear(weights, ctx.mask):
            expected = plain(input_ids=ids).logits
        with torch.no_grad():
            torch.testing.assert_close(fed(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert full_checks == [4, 4, TOKENS, TOKENS, 12, 12]  # two targets, three sizes, once each


class _PairRouter(torch.nn.Module):
    """Returns ``(logits, None)`` like vLLM's linear layers (output and bias)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, E, bias=False)

    def forward(self, x):
        return self.linear(x), None


class _Routed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = _PairRouter()
        self.plain = torch.nn.Linear(6, E, bias=False)
        self.proj = torch.nn.Linear(E, 3)

    def forward(self, x):
        logits, _ = self.pair(x)
        return self.proj(logits.softmax(-1) + self.plain(x).softmax(-1))


def test_a_bound_built_feed_hands_the_model_contiguous_rows(plain):
    """A replacer's feed bound eagerly (as the vLLM plugin binds it): its capture tensors are
    columns of position-major storage, so a call whose rows are all replaced computes them
    (where()) instead of handing the strided rows on; a kernel after the target (a fused
    top-k) may take rows to be E apart."""
    from fxreplace import TensorReplacer

    fed = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    values = random_context(GATES, E, tokens=TOKENS + 4, seed=3)
    replacer = TensorReplacer({0: {n: values[n] for n in GATES}})
    replacer.register_request("a", None, prompt_idx=0)
    feed = replacer.warmup_context(16)
    assert not feed[GATES[0]].is_contiguous(), "two capture names of one width share a group"
    fed.feed(feed, bind=True)
    seen = {}
    hooks = [fed.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out))
             for n in GATES]
    try:
        for start in (0, 2, 4, 1):  # the first call of a size is checked in full, later ones take the cache
            ctx = replacer.build_context(["a"], list(range(start, start + TOKENS)), True, out=feed.leading(TOKENS))
            torch.testing.assert_close(logits(fed), reference(plain, ctx), rtol=1e-5, atol=1e-5)
            outputs = [seen[n][0] if isinstance(seen[n], tuple) else seen[n] for n in GATES]
            assert all(out.is_contiguous() for out in outputs)
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("mask", ["all", "none", "mixed"])
def test_output_points_of_a_bound_feed_read_the_fed_rows(mask):
    """Output points (a tensor, and output[0] of a tuple), eagerly, with host buffers bound
    by feed(bind=True), at batch sizes that change between forwards: every forward equals
    the module with the replacement applied by hand; a forward whose rows are all replaced
    hands the buffer's rows on (no copy), and observers still see every computed value."""
    from fxreplace.instrument import observe

    torch.manual_seed(0)
    model = _Routed().eval()
    names = ["pair", "plain"]
    fed = instrument(copy.deepcopy(model), [Target("pair", point="output[0]"), Target("plain", point="output")],
                     max_tokens=16)
    bound = contiguous_context(names, E, tokens=16, seed=3)
    fed.feed(bound, bind=True)
    seen = {}
    for name in names:
        fed.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out))

    def expected(x, rows):
        with torch.no_grad():
            pair = torch.where(rows[:, None], bound["pair"][:len(x)], model.pair(x)[0])
            plain = torch.where(rows[:, None], bound["plain"][:len(x)], model.plain(x))
            return model.proj(pair.softmax(-1) + plain.softmax(-1))

    observed = []
    for step, tokens in enumerate((5, 9, 5, 9, 5)):
        x = torch.randn(tokens, 6, generator=torch.Generator().manual_seed(step))
        rows = {"all": torch.ones(tokens, dtype=torch.bool), "none": torch.zeros(tokens, dtype=torch.bool),
                "mixed": torch.arange(tokens) % 2 == 0}[mask]
        for name in names:
            bound[name].normal_(generator=torch.Generator().manual_seed(10 + step))
        bound.mask.fill_(True)  # rows past this forward's do not count
        bound.mask[:tokens] = rows
        if step == 3:
            with observe(fed, lambda name, computed: observed.append((name, computed.shape[0]))), torch.no_grad():
                got = fed(x)
        else:
            with torch.no_grad():
                got = fed(x)
        torch.testing.assert_close(got, expected(x, rows), rtol=1e-5, atol=1e-6)
        handed_on = [seen["pair"][0].data_ptr() == bound["pair"].data_ptr(),
                     seen["plain"].data_ptr() == bound["plain"].data_ptr()]
        assert handed_on == [mask == "all" and step >= 2] * 2  # the first call of each size is checked in full
    assert observed == [("pair", 9), ("plain", 9)]


class _Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, E)

    def forward(self, x):
        logits = self.linear(x)
        return logits, logits.softmax(-1)


class _Untraceable(torch.nn.Module):
    """A parent whose forward branches on a value (fx cannot trace it alone), reading its gate's
    ``output[0]`` or, with ``reads_logits=False``, only ``output[1]``."""

    def __init__(self, reads_logits: bool):
        super().__init__()
        self.gate = _Gate()
        self.reads_logits = reads_logits

    def forward(self, x):
        logits, probs = self.gate(x)
        if x.sum() > -1e9:  # data-dependent control flow
            return logits * 2 if self.reads_logits else probs
        return probs


@pytest.mark.parametrize("reads_logits", [True, False])
def test_first_replaced_forward_proves_a_point_no_graph_decides(reads_logits):
    """instrument() cannot trace the caller, so output[0] is watched on the first forward that has a
    replacement: read, it is proven (and never watched again); dropped, the forward says so and
    names the point that works. A forward with nothing fed proves nothing."""
    from fxreplace import TargetNotLiveError

    torch.manual_seed(0)
    model = instrument(_Untraceable(reads_logits), [Target("gate", point="output[0]")], max_tokens=8)
    slot = model._fxreplace.slots[0]
    x = torch.randn(4, 6)
    with torch.no_grad():
        plain = model(x)
        assert slot.unproven
        values = torch.randn(8, E)
        model.feed(ReplacementContext({"gate": values}, torch.ones(8, dtype=torch.bool)))
        if not reads_logits:
            with pytest.raises(TargetNotLiveError, match=r"replacing 'gate' \(point 'output\[0\]'\) changes nothing.*"
                                                         r"point='auto'"):
                model(x)
            assert slot.unproven and model._fxreplace.slots[0].state == "idle"
            return
        out = model(x)
        assert type(out) is torch.Tensor and torch.equal(out, values[:4] * 2) and not torch.equal(out, plain)
        assert not slot.unproven and not model._fxreplace.unproven
        assert torch.equal(model(x), values[:4] * 2)
