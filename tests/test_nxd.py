"""NxD Inference's layout (fxreplace.models.nxd): the stand-in keeps NxD's contracts and HF's
arithmetic, the one-call mapping instruments its inner model with HF capture names, and
replacement fed per step in NxDI's bucketed layouts (context encoding padded to a bucket,
token generation one row per sequence, speculation 1 + k rows) gives back HF's logits from a
model whose routers are off. Runs in both environments (the compat one is what NxDI pins)."""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fxreplace import ReplacementContext, Target, TargetNotHitError, instrument, uninstrument
from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model
from fxreplace.liveness import check_live
from fxreplace.models.nxd import NXD_ROUTER, BucketedApplication, NeuronConfig, NxDQwen3MoeModel, nxd_targets
from fxreplace.points import TargetNotLiveError
from fxreplace.replacer import TensorReplacer
from graph_helpers import random_context

pytestmark = pytest.mark.compat

HF_ARCH = "Qwen3MoeForCausalLM"
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def hf():
    return tiny_model(HF_ARCH)


@pytest.fixture(scope="module")
def reference(hf):
    return capture_reference(hf, PROMPTS, get_family(HF_ARCH).targets, max_new_tokens=NEW_TOKENS, progress=False)


def stand_in(hf, speculation_length=0, router_fault=0.0, **config):
    """The NxDI-shaped model converted from ``hf``; ``router_fault`` perturbs every router's weight."""
    model = NxDQwen3MoeModel.from_hf(hf, NeuronConfig(speculation_length=speculation_length, **config))
    generator = torch.Generator().manual_seed(1)
    for layer in model.layers:
        weight = layer.mlp.router.linear_router.weight
        weight.data += router_fault * torch.randn(weight.shape, generator=generator)
    return BucketedApplication(model)


def run_steps(app, reference, feed=None):
    """Teacher-forced steps over the reference's generation: one context encoding, then token
    generation steps of 1 + speculation tokens per sequence. ``feed(kind, positions)`` is
    called before each step. Returns the largest |logits - reference logits|."""
    batch, length = len(PROMPTS), len(PROMPTS[0])
    worst = 0.0
    if feed:
        feed("context", torch.arange(length).expand(batch, length))
    out = app.forward(torch.tensor(PROMPTS), torch.arange(length).expand(batch, length))
    worst = max((out[b, -1] - reference.logits(b)[0]).abs().max().item() for b in range(batch))
    k = app.token_generation_length
    for step in range(1, NEW_TOKENS - k + 1, k):
        tokens = torch.tensor([reference.tokens(b)[step - 1:step - 1 + k] for b in range(batch)])
        positions = torch.arange(length + step - 1, length + step - 1 + k).expand(batch, k)
        if feed:
            feed("token", positions)
        out = app.forward(tokens, positions)
        worst = max([worst] + [(out[b] - reference.logits(b)[step:step + k]).abs().max().item() for b in range(batch)])
    return worst


def feeder(app, model, reference):
    """feed() before each step, from one TensorReplacer, in the layout the step's router rows have."""
    replacer = TensorReplacer(reference.store)
    requests = [f"seq{b}" for b in range(len(PROMPTS))]
    for request, prompt in zip(requests, PROMPTS):
        replacer.register_request(request, prompt)

    def feed(kind, positions):
        if kind == "context":  # each sequence padded to the bucket: its padded rows are no request's
            bucket, length = app.bucket(positions.shape[1]), positions.shape[1]
            rows = [p if p < length else -1 for _ in requests for p in range(bucket)]
            ctx = replacer.build_context_for_batch(requests, [bucket] * len(requests), rows)
            assert ctx.num_tokens == app.rows(length) and int(ctx.mask.sum()) == len(requests) * length
        else:
            ctx = replacer.build_context(requests, positions.reshape(-1).tolist(), is_prefill=False,
                                         tokens_per_req=positions.shape[1])
        model.feed(ctx)

    return feed


def test_nxd_targets_map_the_inner_router_to_hf_capture_names(hf):
    targets = nxd_targets(HF_ARCH)
    app = stand_in(hf)
    model = instrument(app.model, targets, max_tokens=app.max_tokens)
    assert model.targets == ["layers.0.mlp.router", "layers.1.mlp.router"]
    assert [t.capture_name for t in model._fxreplace.targets] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


@pytest.mark.parametrize("speculation_length", [0, 2])
def test_stand_in_reproduces_hf_in_every_bucketed_layout(hf, reference, speculation_length):
    assert run_steps(stand_in(hf, speculation_length), reference) < 1e-4


@pytest.mark.parametrize("speculation_length", [0, 2])
def test_fed_hf_router_logits_give_back_hf_logits(hf, reference, speculation_length):
    app = stand_in(hf, speculation_length, router_fault=0.1)
    assert run_steps(app, reference) > 0.1  # the planted fault shows
    model = instrument(app.model, nxd_targets(HF_ARCH), max_tokens=app.max_tokens)
    assert run_steps(app, reference, feeder(app, model, reference)) < 1e-4
    model.clear()
    assert run_steps(app, reference) > 0.1  # cleared: the faulty routers again


def context_step(app):
    return torch.tensor(PROMPTS), torch.arange(len(PROMPTS[0])).expand(len(PROMPTS), len(PROMPTS[0]))


def test_router_output0_is_refused_at_instrument_time_and_auto_passes(hf):
    app = stand_in(hf)
    with pytest.raises(TargetNotLiveError, match=r"'layers\.0\.mlp\.router', point 'output\[0\]'.*caller 'layers\.0\.mlp' "
                                                 r"never reads output\[0\].*point='auto'.*linear_router"):
        instrument(app.model, [Target(NXD_ROUTER, point="output[0]")])
    model = instrument(app.model, nxd_targets(HF_ARCH), max_tokens=app.max_tokens)
    moved = check_live(model, lambda: app.forward(*context_step(app)))
    assert set(moved) == set(model.targets) and min(moved.values()) > 0


def test_liveness_check_flags_output0_where_no_graph_decides(hf):
    """With the fused kernel configured, NxD's MoE branches on the step's length, so it cannot be
    traced alone and instrument() cannot see that output[0] is dropped: the first fed forward
    (through NxDI's application, no explicit call) and check_live() both say so."""
    app = stand_in(hf, moe_fused_nki_kernel_enabled=True)
    model = instrument(app.model, [Target(NXD_ROUTER, point="output[0]")], max_tokens=app.max_tokens)
    run = lambda: app.forward(*context_step(app))  # noqa: E731
    before = run()  # nothing fed: nothing to prove
    model.feed(ReplacementContext({n: torch.ones(app.max_tokens, 8) for n in ("layers.0.mlp.router", "layers.1.mlp.router")},
                                  torch.ones(app.max_tokens, dtype=torch.bool)))
    fed = [values.clone() for values, _ in model._fxreplace.fed]
    dead = r"'layers\.0\.mlp\.router' \(point 'output\[0\]'\), 'layers\.1\.mlp\.router' \(point 'output\[0\]'\).*point='auto'"
    with pytest.raises(TargetNotLiveError, match=r"replacing " + dead):
        run()
    with pytest.raises(TargetNotLiveError, match=dead):
        check_live(model, run)
    assert all(torch.equal(a, b) for a, (b, _) in zip(fed, model._fxreplace.fed))  # the feed is left as it was
    model.clear()
    with pytest.raises(TargetNotLiveError, match=dead):  # still dead, whatever the mask
        run()
    uninstrument(model)
    assert torch.equal(run(), before)
    assert min(check_live(instrument(app.model, nxd_targets(HF_ARCH)), run).values()) > 0


def test_fused_token_generation_kernel_raises_target_not_hit_naming_the_switch(hf, reference):
    app = stand_in(hf, moe_fused_nki_kernel_enabled=True)
    model = instrument(app.model, nxd_targets(HF_ARCH), max_tokens=app.max_tokens)
    app.forward(*context_step(app))  # context encoding runs the router
    with pytest.raises(TargetNotHitError, match=r"layers\.0\.mlp\.router.*layers\.0\.mlp\.moe_fused_tkg.*"
                                                r"moe_fused_nki_kernel_enabled=False"):
        app.forward(torch.tensor([[1], [2]]), torch.full((2, 1), 5))
    assert model.targets  # the model stays usable: context encoding still replaces
    app.forward(*context_step(app))


def test_graph_break_in_every_layer_compiles_as_many_graphs_for_any_number_of_layers():
    """NxDI's module markers break Dynamo graphs inside every decoder layer; the frames resumed
    after a break must not recompile per layer because each layer's router is instrumented (there
    a target reads its replacement out of graph: a few frames more than plain, the same for 2 layers
    as for 4)."""
    graphs = {}
    for layers in (2, 4):
        hf = tiny_model(HF_ARCH, num_hidden_layers=layers)
        plain = NxDQwen3MoeModel.from_hf(hf, NeuronConfig(batch_size=1, buckets=(8,)))
        instrumented = instrument(copy.deepcopy(plain), nxd_targets(HF_ARCH), max_tokens=8)
        names = [t.capture_name for t in instrumented._fxreplace.targets]
        ids, positions = torch.arange(8)[None], torch.arange(8)[None]
        for label, model, contexts in (("plain", plain, [None] * 3),
                                       ("instrumented", instrumented, [random_context(names, 8, 8, seed=1), None,
                                                                       random_context(names, 8, 8, seed=2)])):
            torch._dynamo.reset()
            counter = CompileCounter()
            compiled = torch.compile(model, backend=counter)
            with torch.no_grad():
                for ctx in contexts:
                    if label == "instrumented":
                        model.feed(ctx) if ctx is not None else model.clear()
                    compiled(ids, positions)
            graphs[label, layers] = counter.frame_count
        breaks = torch._dynamo.utils.counters["graph_break"]
        assert sum(breaks.values()) > 0, "the stand-in's markers no longer break graphs"
    assert graphs["plain", 2] == graphs["plain", 4], graphs
    assert graphs["instrumented", 2] == graphs["instrumented", 4], graphs


def test_cli_inspect_check_live(capsys):
    """`fxreplace inspect MODEL --check-live`: the family's targets pass, a dead point is one error line."""
    from fxreplace.cli import main

    assert main(["inspect", "builtin:NeuronMoeForCausalLM", "--check-live"]) == 0
    out = capsys.readouterr().out
    assert "every target reaches the logits" in out and "model.layers.1.mlp.router" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "builtin:NeuronMoeForCausalLM", "--check-live", "model.layers.*.mlp.router@output[0]"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: ") and "'model.layers.0.mlp.router', point 'output[0]'" in error[0]
    assert "point='auto'" in error[0]


def test_a_bound_feed_refuses_to_run_after_the_model_moves(hf):
    """feed(bind=True) makes the buffers the context's own tensors; a move (here a conversion, the
    same _apply) makes copies the caller no longer writes into: the next forward says to feed again."""
    app = stand_in(hf)
    model = instrument(app.model, nxd_targets(HF_ARCH), max_tokens=app.max_tokens)
    names = [t.capture_name for t in model._fxreplace.targets]
    ctx = random_context(names, 8, app.max_tokens, seed=3)
    model.feed(ctx, bind=True)
    model.double()
    with pytest.raises(ValueError, match=r"moved or converted after feed\(bind=True\).*torch\.float64 on cpu.*feed"):
        app.forward(*context_step(app))
    model.feed(ReplacementContext({n: ctx[n].double() for n in names}, ctx.mask), bind=True)
    assert app.forward(*context_step(app)).dtype == torch.float64
