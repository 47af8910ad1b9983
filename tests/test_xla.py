"""The Neuron compile path, on torch-xla's CPU device (PJRT_DEVICE=CPU): XLA
lazy tensors trace each step to HLO and compile it once per graph, as
torch-neuronx does. The instrumented static-shape MoE model must give the
eager oracle's outputs with replacement on, off and new values, and after a
bucket's warm-up none of those may compile anything new. Runs in the compat
environment (torch-xla); the main environment deselects ``-m xla``."""

import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fxreplace.models as families
from fxreplace import ShardSpec, Target
from fxreplace.instrument import instrument
from graph_helpers import OverrideLinear, input_ids, off_context, random_context

pytestmark = pytest.mark.xla

ARCH = "NeuronMoeForCausalLM"
TARGETS = families.get_family(ARCH).targets
EXPERTS = families.neuron_moe.NeuronMoeConfig().num_experts


@pytest.fixture(scope="module")
def xla():
    """torch_xla, imported only where the tests run (the main environment has none)."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla
    import torch_xla.debug.metrics

    return torch_xla


def compilations(xla) -> int:
    """XLA graph compilations so far in this process (cache hits do not count)."""
    data = xla.debug.metrics.metric_data("CompileTime")
    return data[0] if data else 0


def oracle(ctx, tokens, rows=slice(None)):
    """Eager CPU model, router logits overridden without fxreplace; ``rows``: this rank's share."""
    plain = families.tiny_model(ARCH)
    weights = {plain.get_submodule(f"{n}.linear_router").weight: ctx[n][rows] for n in ctx}
    with torch.no_grad(), OverrideLinear(weights, ctx.mask[rows]):
        return plain(input_ids(tokens)[:, rows])


def contexts(names, tokens):
    """Replacement on, off, and on with new values: the three states one graph must serve."""
    return {"on": random_context(names, EXPERTS, tokens, seed=1), "off": off_context(names, EXPERTS, tokens),
            "new": random_context(names, EXPERTS, tokens, seed=2)}


def step(xla, forward):
    """One engine step: trace, cut the graph (compile or reuse), read the result."""
    with torch.no_grad():
        out = forward()
    xla.sync()
    return out.cpu()


@pytest.fixture(scope="module")
def model(xla):
    return instrument(families.tiny_model(ARCH), TARGETS).to(xla.device())


def test_equals_eager_oracle_on_off_new(xla, model):
    device = xla.device()
    for state, ctx in contexts(model.targets, 8).items():
        out = step(xla, lambda: model(input_ids(8).to(device), replacements=ctx.to(device)))
        torch.testing.assert_close(out, oracle(ctx, 8), rtol=1e-5, atol=1e-5, msg=state)


def test_no_compilation_after_bucket_warm_up(xla, model):
    device, tokens = xla.device(), 16  # a bucket no other test has compiled
    states = contexts(model.targets, tokens)
    before = compilations(xla)
    step(xla, lambda: model(input_ids(tokens).to(device), replacements=states["on"].to(device)))
    warm_up = compilations(xla) - before
    for state, ctx in states.items():
        out = step(xla, lambda: model(input_ids(tokens).to(device), replacements=ctx.to(device)))
        torch.testing.assert_close(out, oracle(ctx, tokens), rtol=1e-5, atol=1e-5, msg=state)
    added = compilations(xla) - before - warm_up
    print(f"XLA compilations: bucket warm-up {warm_up}, then replacement on/off/new {added}")
    assert warm_up >= 1 and added == 0, (warm_up, added)


def test_static_feed_buffers_no_compilation_after_warm_up(xla):
    device, tokens = xla.device(), 8
    fed = instrument(families.tiny_model(ARCH), TARGETS, max_tokens=16).to(device)
    states = contexts(fed.targets, tokens)

    def forward(ctx):
        if ctx is None:
            fed.clear()
        else:
            fed.feed(ctx.to(device))
        return fed(input_ids(tokens).to(device))

    plain = step(xla, lambda: forward(None))  # buffers not yet created: the plain model
    torch.testing.assert_close(plain, oracle(states["off"], tokens), rtol=1e-5, atol=1e-5)
    # Warm-up: the first feed creates the buffers, later feeds overwrite them, clear() only resets the mask.
    for ctx in (states["on"], states["on"], None):
        step(xla, lambda: forward(ctx))
    before = compilations(xla)
    for state, ctx in [*states.items(), ("cleared", None)]:
        out = step(xla, lambda: forward(ctx))
        torch.testing.assert_close(out, oracle(states["off"] if ctx is None else ctx, tokens),
                                   rtol=1e-5, atol=1e-5, msg=state)
    added = compilations(xla) - before
    print(f"XLA compilations after feed() warm-up, on/off/new/clear: {added}")
    assert added == 0


def test_rank_tensor_one_graph_for_both_ranks(xla):
    """Sequence parallel over 2 ranks: each rank's model sees its half of the
    tokens and slices its rows of the full context by a rank tensor, so the
    traced graph is the same for rank 0 and rank 1."""
    device, tokens, world = xla.device(), 8, 2
    rank = torch.tensor(0, device=device)
    spec = ShardSpec("sequence", world, rank)
    sharded = instrument(families.tiny_model(ARCH), [Target(TARGETS[0].pattern, shard=spec)]).to(device)
    ctx = random_context(sharded.targets, EXPERTS, tokens, seed=3)
    local = tokens // world

    def run_as(value):
        rank.copy_(torch.tensor(value))
        xla.sync()  # the rank is now device data, like an input the runtime hands each rank
        before = compilations(xla)
        rows = slice(value * local, (value + 1) * local)
        out = step(xla, lambda: sharded(input_ids(tokens)[:, rows].to(device), replacements=ctx.to(device)))
        torch.testing.assert_close(out, oracle(ctx, tokens, rows), rtol=1e-5, atol=1e-5, msg=f"rank {value}")
        return compilations(xla) - before

    first, second = run_as(0), run_as(1)
    print(f"XLA compilations of the forward: rank 0 {first}, then rank 1 {second}")
    assert first >= 1 and second == 0, (first, second)


def test_torch_compile_openxla_one_graph(xla, model):
    device, tokens = xla.device(), 8
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("openxla")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    states = contexts(model.targets, tokens)
    step(xla, lambda: compiled(input_ids(tokens).to(device), replacements=states["on"].to(device)))
    before = compilations(xla)
    for state, ctx in states.items():
        out = step(xla, lambda: compiled(input_ids(tokens).to(device), replacements=ctx.to(device)))
        torch.testing.assert_close(out, oracle(ctx, tokens), rtol=1e-5, atol=1e-5, msg=state)
    added = compilations(xla) - before
    print(f"openxla: Dynamo graphs {counter.frame_count}, XLA compilations after warm-up {added}")
    assert counter.frame_count == 1 and added == 0
