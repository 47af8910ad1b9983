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


def test_feed_and_move_in_any_order(xla):
    """Engines feed and move in their own order: instrument, move, feed a context built on the host
    (the first feed creates the buffers where the targets compute); feed, move, feed again; move
    back and forth. Every forward gives the oracle's logits for the context fed last."""
    device, tokens = xla.device(), 8
    model = instrument(families.tiny_model(ARCH), TARGETS, max_tokens=16)
    states = contexts(model.targets, tokens)

    def logits(on):
        return step(xla, lambda: model(input_ids(tokens).to(on))) if on != "cpu" else model(input_ids(tokens)).detach()

    model.to(device)
    model.feed(states["on"])  # built on the host, fed after the move
    torch.testing.assert_close(logits(device), oracle(states["on"], tokens), rtol=1e-5, atol=1e-5)
    model.feed(states["new"])
    model.to("cpu")  # the buffers follow the model
    torch.testing.assert_close(logits("cpu"), oracle(states["new"], tokens), rtol=1e-5, atol=1e-5)
    model.to(device)
    torch.testing.assert_close(logits(device), oracle(states["new"], tokens), rtol=1e-5, atol=1e-5)
    model.feed(states["off"].to(device))
    torch.testing.assert_close(logits(device), oracle(states["off"], tokens), rtol=1e-5, atol=1e-5)


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


def _engine_builds(model, device, tokens):
    """The contexts an engine alternates, built by a TensorReplacer on the XLA device: an
    all-off warm-up, fresh builds, builds into out= (a partial mask, new values) and into a
    leading() view of a max-size feed."""
    from fxreplace import TensorReplacer

    gen = torch.Generator().manual_seed(4)
    flat = {p: {n: torch.randn(rows, EXPERTS, generator=gen) * 3 for n in model.targets} for p, rows in ((0, 12), (1, 6))}
    replacer = TensorReplacer(flat, device=device)
    replacer.register_request("a", None, prompt_idx=0)
    replacer.register_request("b", None, prompt_idx=1)
    out, feed = replacer.warmup_context(tokens), replacer.warmup_context(2 * tokens)
    return {
        "warm-up": lambda: replacer.warmup_context(tokens),
        "fresh": lambda: replacer.build_context(["a"], list(range(tokens)), is_prefill=True),
        "warm-up again": lambda: replacer.warmup_context(tokens),
        "out= partial": lambda: replacer.build_context(["b"], list(range(tokens)), is_prefill=True, out=out),
        "out= new values": lambda: replacer.build_context(["a"], list(range(4, 4 + tokens)), is_prefill=True, out=out),
        "leading()": lambda: replacer.build_context_for_batch(["a", "b"], [4, 4], [0, 1, 2, 3, 2, 3, 4, 5],
                                                              out=feed.leading(tokens)),
        "all off": lambda: replacer.warmup_context(tokens),
    }


def _engine_pass(xla, forward, builds, tokens):
    """One pass over the engine's contexts, each step checked against the eager oracle (XLA
    compiles per call pattern: the warm-up pass makes exactly the calls the measured one does)."""
    device = xla.device()
    for state, build in builds.items():
        ctx = build()
        out = step(xla, lambda: forward(input_ids(tokens).to(device), ctx))
        torch.testing.assert_close(out, oracle(ctx.to("cpu"), tokens), rtol=1e-5, atol=1e-5, msg=state)


def test_lazy_tracing_compiles_nothing_new_for_alternating_engine_contexts(xla, model):
    """torch-neuronx's path (lazy tensors traced to HLO at each sync): after one pass over
    every kind of context an engine alternates, a second pass compiles nothing."""
    device, tokens = xla.device(), 8
    builds = _engine_builds(model, device, tokens)
    # warm-up, the same calls twice: a second fresh build reuses the first one's buffers (the
    # replacer recycles them), which XLA traces as another graph of pending ops, once
    for _ in range(2):
        _engine_pass(xla, lambda ids, ctx: model(ids, replacements=ctx), builds, tokens)
    before = compilations(xla)
    _engine_pass(xla, lambda ids, ctx: model(ids, replacements=ctx), builds, tokens)
    added = compilations(xla) - before
    print(f"lazy XLA, alternating engine contexts: compilations after one pass {added}")
    assert added == 0


def test_openxla_one_graph_for_alternating_engine_contexts(xla, model):
    """The same under torch.compile(backend="openxla"): one Dynamo graph, no XLA compilation
    after warm-up. Without leading() views: torch-xla 2.9's openxla bridge fails on a view of
    a device buffer given as a graph input ("buffer ... is deleted"), with or without fxreplace's
    changes; engines on XLA hand per-step contexts (see docs/neuron.md)."""
    device, tokens = xla.device(), 8
    builds = {k: b for k, b in _engine_builds(model, device, tokens).items() if k != "leading()"}
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("openxla")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(2):  # warm-up, as above
        _engine_pass(xla, lambda ids, ctx: compiled(ids, replacements=ctx), builds, tokens)
    before = compilations(xla)
    _engine_pass(xla, lambda ids, ctx: compiled(ids, replacements=ctx), builds, tokens)
    added = compilations(xla) - before
    print(f"openxla, alternating engine contexts: Dynamo graphs {counter.frame_count}, XLA compilations {added}")
    assert counter.frame_count == 1 and added == 0


def test_nxd_feed_then_move_to_xla_no_recompiles_per_bucket(xla):
    """NxDI's order: instrument and feed on the host, then the trace moves the model to the
    device. The fed buffers follow the model; per bucket (context encoding padded to 8, token
    generation one row per sequence) a warm-up step compiles and replacement on/off/new values
    compile nothing more; every step equals the same model run eagerly on the host."""
    import copy

    from fxreplace.models.nxd import BucketedApplication, NeuronConfig, NxDQwen3MoeModel, nxd_targets

    device = xla.device()
    hf = families.tiny_model("Qwen3MoeForCausalLM")
    host = BucketedApplication(NxDQwen3MoeModel.from_hf(hf, NeuronConfig(batch_size=2, buckets=(8,))))
    instrument(host.model, nxd_targets("Qwen3MoeForCausalLM"), max_tokens=host.max_tokens)
    names = [t.capture_name for t in host.model._fxreplace.targets]
    host.model.feed(off_context(names, 8, host.max_tokens))  # fed before the move
    on_device = BucketedApplication(copy.deepcopy(host.model).to(device))

    def context(rows, state):
        return {"on": random_context(names, 8, rows, seed=1), "off": off_context(names, 8, rows),
                "new": random_context(names, 8, rows, seed=2)}[state]

    prompts = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    buckets = {"context": (prompts, torch.arange(5).expand(2, 5)),
               "token": (prompts[:, -1:], torch.full((2, 1), 5))}
    # the trace's example forward: on the device, reading what was fed on the host
    ids, positions = buckets["context"]
    torch.testing.assert_close(step(xla, lambda: on_device.forward(ids, positions)), host.forward(ids, positions),
                               rtol=1e-5, atol=1e-5)
    for bucket, (ids, positions) in buckets.items():
        rows = host.rows(ids.shape[1])
        counts = []
        for state in ("on", "on", "on", "off", "new"):  # two warm-up steps, then what must reuse their graph
            ctx = context(rows, state)
            host.model.feed(ctx)
            on_device.model.feed(ctx.to(device))
            expected = host.forward(ids, positions)
            out = step(xla, lambda: on_device.forward(ids, positions))
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"{bucket} {state}")
            counts.append(compilations(xla))
        added = counts[-1] - counts[1]
        print(f"NxD stand-in on XLA, {bucket}: compilations per step {counts}; after warm-up, on/off/new: {added}")
        assert added == 0, (bucket, counts)
