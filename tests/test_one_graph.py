"""instrument()'s core promise, the way engines exercise it: one compiled graph for every
context an engine produces, in any order, and for contexts made by hand. An engine compiles with an all-off warm-up
context, then alternates built contexts (fresh, into ``out=``, into ``leading()`` views of
a bound max-size feed, with partial masks and new values) with more all-off ones (padding
batches, dummy runs); a context that changed when read, or two kinds of context that look
different to Dynamo, would recompile. Families built from configs, two of them not
registered by fxreplace (their targets given by the user)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import AutoModelForCausalLM, PhimoeConfig, Qwen2MoeConfig

import fxreplace
from fxreplace.models import tiny_model

TOKENS, MAX_TOKENS = 8, 16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own model's graphs: Dynamo keeps per-code-object state (cache
    entries, sizes seen) across models, and every instrumented model shares one forward."""
    torch._dynamo.reset()


def _qwen3():
    return tiny_model("Qwen3MoeForCausalLM"), "model.layers.*.mlp.gate"


def _qwen2():  # not registered
    config = Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                            initializer_range=0.2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval(), "model.layers.*.mlp.gate"


def _phimoe():  # not registered
    config = PhimoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64, initializer_range=0.2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval(), "model.layers.*.mlp.router"


FAMILIES = {"qwen3-moe": _qwen3, "qwen2-moe": _qwen2, "phimoe": _phimoe}


def _setup(family, max_tokens=None):
    model, pattern = FAMILIES[family]()
    model = fxreplace.instrument(model, [pattern], max_tokens=max_tokens)
    widths = {}
    with fxreplace.observe(model, lambda name, value: widths.setdefault(name, value.shape[-1])), torch.no_grad():
        model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=False)
    gen = torch.Generator().manual_seed(0)
    # prompt 0 holds 12 rows, prompt 1 only 6 (a batch of 8 past them is partly unreplaced)
    flat = {p: {name: torch.randn(rows, width, generator=gen) * 3 for name, width in widths.items()}
            for p, rows in ((0, 12), (1, 6))}
    replacer = fxreplace.TensorReplacer(flat, on_unknown="passthrough")
    replacer.register_request("a", None, prompt_idx=0)
    replacer.register_request("b", None, prompt_idx=1)
    return model, replacer


def _ids(seed):
    return torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(seed))


def _hand_made(replacer):
    """A context made with the public constructor, its names in another order than the store's."""
    built = replacer.build_context(["a"], list(range(2, 2 + TOKENS)), is_prefill=True)
    names = list(reversed(replacer.capture_names))
    return fxreplace.ReplacementContext({n: built[n].clone() for n in names}, torch.arange(TOKENS) % 3 != 1)


def _engine_contexts(replacer):
    """What an engine hands the model, in an engine's order: warm-up (all off), fresh
    builds, builds into out= and into leading() views of a max-size feed, a partial mask,
    new values, all-off again between them."""
    out = replacer.warmup_context(TOKENS)
    feed = replacer.warmup_context(MAX_TOKENS)
    yield replacer.warmup_context(TOKENS)
    yield replacer.build_context(["a"], list(range(TOKENS)), is_prefill=True)
    yield replacer.warmup_context(TOKENS)
    yield replacer.build_context(["b"], list(range(TOKENS)), is_prefill=True, out=out)  # 6 of 8 rows: partial mask
    yield replacer.build_context(["a"], list(range(4, 4 + TOKENS)), is_prefill=True, out=out)  # new values
    yield replacer.build_context_for_batch(["a", "b"], [4, 4], [0, 1, 2, 3, 2, 3, 4, 5], out=feed.leading(TOKENS))
    yield replacer.warmup_context(TOKENS)
    yield _hand_made(replacer)
    yield out
    yield replacer.build_context_for_batch(["b", "a"], [3, 3], [3, 4, 5, 9, 10, 11, 0, 0], out=feed.leading(TOKENS))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_graph_for_every_context_an_engine_alternates(family):
    model, replacer = _setup(family)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        for step, ctx in enumerate(_engine_contexts(replacer)):
            ids = _ids(step)
            got = compiled(input_ids=ids, use_cache=False, replacements=ctx).logits
            want = model(input_ids=ids, use_cache=False, replacements=ctx).logits
            torch.testing.assert_close(got, want, msg=f"step {step}")
    assert counter.frame_count == 1, f"{family}: {counter.frame_count} graphs for one batch shape"


@pytest.mark.parametrize("family", ["qwen2-moe"])
def test_one_graph_for_a_bound_feed_turned_off_and_on(family):
    """An engine that owns the forward: the feed is bound once, each step builds into its
    leading rows (or clears it), and the compiled model is called without replacements=."""
    model, replacer = _setup(family, max_tokens=MAX_TOKENS)
    feed = replacer.warmup_context(MAX_TOKENS)
    model.feed(feed, bind=True)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    steps = [None, (["a"], [0] * 0 + list(range(TOKENS))), None, (["b"], list(range(TOKENS))),
             (["a"], list(range(3, 3 + TOKENS)))]
    with torch.no_grad():
        for step, batch in enumerate(steps):
            if batch is None:
                model.clear()
                ctx = replacer.warmup_context(TOKENS)
            else:
                ctx = replacer.build_context(batch[0], batch[1], is_prefill=True, out=feed.leading(TOKENS))
            ids = _ids(step)
            got = compiled(input_ids=ids, use_cache=False).logits
            want = model(input_ids=ids, use_cache=False, replacements=ctx).logits
            torch.testing.assert_close(got, want, msg=f"step {step}")
    assert counter.frame_count == 1


def test_inductor_compiles_once_for_alternating_contexts():
    model, replacer = _setup("phimoe")
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        for step, ctx in enumerate(_engine_contexts(replacer)):
            ids = _ids(step)
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False, replacements=ctx).logits,
                                       model(input_ids=ids, use_cache=False, replacements=ctx).logits,
                                       rtol=1e-4, atol=1e-4, msg=f"step {step}")
    assert counter.frame_count == 1
