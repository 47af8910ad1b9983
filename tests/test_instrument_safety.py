"""Instrumented models under careless use: a refused feed leaves the previous one in force,
no targets is an error, a deep copy has its own slots, and two threads never mix their
replacements (the second concurrent forward is refused)."""

import copy
import threading

import pytest
import torch

import fxreplace.models as families
from fxreplace.context import ReplacementContext
from fxreplace.instrument import ConcurrentForwardError, instrument
from fxreplace.sharding import ShapeError
from graph_helpers import input_ids, random_context

ARCH = "Qwen3MoeForCausalLM"
GATES = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
E = 8
MAX = 16


@pytest.fixture(scope="module")
def plain():
    return families.tiny_model(ARCH)


@pytest.fixture
def model(plain):
    return instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=MAX)


def run(model, **kwargs):
    with torch.no_grad():
        return model(input_ids=input_ids(), **kwargs).logits


def test_a_refused_feed_leaves_the_previous_one_in_force(model):
    good = random_context(GATES, E, seed=1)
    model.feed(good)
    expected = run(model, replacements=good)
    assert torch.equal(run(model), expected)
    other = random_context(GATES, E, seed=2)
    with pytest.raises(ShapeError, match="feed for model.layers.1.mlp.gate: shape \\(17, 8\\) does not fit"):
        model.feed({GATES[0]: other[GATES[0]], GATES[1]: torch.randn(MAX + 1, E)})  # rejected at its second target
    assert torch.equal(run(model), expected), "a rejected feed half-applied"
    with pytest.raises(KeyError, match=r"feed\(\): replacement name\(s\) \['model.layers.9.mlp.gate'\] match no target"):
        model.feed({GATES[0]: other[GATES[0]], "model.layers.9.mlp.gate": other[GATES[1]]})
    full = random_context(GATES, E, tokens=MAX, seed=3)
    half = ReplacementContext({GATES[0]: full[GATES[0]]}, full.mask)  # the second target missing
    with pytest.raises(ShapeError, match="feed\\(bind=True\\): 'model.layers.1.mlp.gate' is missing"):
        model.feed(half, bind=True)
    assert torch.equal(run(model), expected), "a rejected bind half-applied"
    with pytest.raises(TypeError, match="feed\\(\\) needs a ReplacementContext or a dict of tensors, got list"):
        model.feed([full])


def test_no_targets_is_an_error(plain):
    with pytest.raises(ValueError, match="instrument\\(\\) needs at least one target"):
        instrument(copy.deepcopy(plain), [])
    with pytest.raises(ValueError, match="max_tokens must be a positive int.*-4"):
        instrument(copy.deepcopy(plain), GATES, max_tokens=-4)


def test_a_deep_copy_has_its_own_slots(model, plain):
    ctx = random_context(GATES, E, seed=4)
    expected = run(model, replacements=ctx)
    twin = copy.deepcopy(model)
    # instrumented alike, as a model of its own (its forward's code its own: Dynamo compiles for it apart)
    assert twin.targets == model.targets and type(twin).__bases__ == type(model).__bases__
    assert type(twin).__name__ == type(model).__name__ and type(twin).forward.__code__ is not type(model).forward.__code__
    assert torch.equal(run(twin, replacements=ctx), expected)  # the copy's targets are hit, not the original's
    assert torch.equal(run(twin), run(plain)) and torch.equal(run(model), run(plain))
    model.feed(ctx)
    fed_twin = copy.deepcopy(model)
    assert torch.equal(run(fed_twin), expected)  # the feed is copied
    model.clear()
    assert torch.equal(run(fed_twin), expected) and torch.equal(run(model), run(plain))  # and independent
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), fed_twin.parameters()))


def test_a_second_concurrent_forward_is_refused_never_mixed(model):
    first, second = random_context(GATES, E, seed=5), random_context(GATES, E, seed=6)
    # the expected logits come from a thread too: after an in-process vLLM engine ran earlier in this
    # process, the main thread's logits differ in the last bits from any other thread's
    want = {}
    expected = threading.Thread(target=lambda: want.update({1: run(model, replacements=first), 2: run(model, replacements=second)}))
    expected.start()
    expected.join(60)
    inside, release = threading.Event(), threading.Event()

    def hold(module, args):  # keeps thread 1 inside its forward
        if threading.current_thread().name == "one":
            inside.set()
            release.wait(30)

    handle = model.model.layers[1].register_forward_pre_hook(hold)
    results = {}
    one = threading.Thread(target=lambda: results.update(one=run(model, replacements=first)), name="one")
    one.start()
    assert inside.wait(30)
    with pytest.raises(ConcurrentForwardError, match="already running a forward"):
        run(model, replacements=second)
    release.set()
    one.join(30)
    handle.remove()
    assert torch.equal(results["one"], want[1])

    outcomes = {"right": 0, "refused": 0, "wrong": 0, "other": []}
    barrier = threading.Barrier(2)

    def worker(k, ctx):
        barrier.wait()
        for _ in range(30):
            try:
                out = run(model, replacements=ctx)
            except ConcurrentForwardError:
                outcomes["refused"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - any other failure is what this test looks for
                outcomes["other"].append(repr(e))
                continue
            outcomes["right" if torch.equal(out, want[k]) else "wrong"] += 1

    threads = [threading.Thread(target=worker, args=(k, ctx)) for k, ctx in ((1, first), (2, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert outcomes["wrong"] == 0 and outcomes["other"] == [], outcomes
    assert outcomes["right"] + outcomes["refused"] == 60 and outcomes["right"] > 0
    # one copy per thread: every forward served, every result its own
    copies = {1: copy.deepcopy(model), 2: copy.deepcopy(model)}
    got = {}
    threads = [threading.Thread(target=lambda k=k, ctx=ctx: got.update({k: [run(copies[k], replacements=ctx) for _ in range(10)]}))
               for k, ctx in ((1, first), (2, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(torch.equal(out, want[k]) for k in (1, 2) for out in got[k])


def test_a_feed_under_inference_mode_is_cleared_and_fed_outside_it(plain):
    """Buffers the first feed makes under torch.inference_mode() are plain tensors: clear() and the
    next feed work outside it. A context bound while built inside it says where clear() must run."""
    model = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"], max_tokens=16)
    names = [t.capture_name for t in model._fxreplace.targets]
    with torch.inference_mode():
        model.feed(random_context(names, 8, tokens=16, seed=1))
        on = model(input_ids()).logits
    model.clear()
    with torch.no_grad():
        assert torch.equal(model(input_ids()).logits, plain(input_ids()).logits)
        model.feed(random_context(names, 8, tokens=16, seed=1))
        assert torch.equal(model(input_ids()).logits, on)
    with torch.inference_mode():
        bound = random_context(names, 8, tokens=16, seed=2)
    model.feed(bound, bind=True)
    with pytest.raises(ValueError, match=r"clear\(\): .*inference_mode\(\).*call clear\(\) inside inference_mode"):
        model.clear()
    with torch.inference_mode():
        model.clear()
