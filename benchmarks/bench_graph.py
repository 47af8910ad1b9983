"""Cost of instrument() under torch.compile (inductor), Qwen3-MoE mid-size, fp32.

Variants, timed interleaved (medians): plain compiled model; instrumented with
replacement off (an all-off warm-up context of a TensorReplacer); on with the model's own
router logits (same routing, so only the inserted ops cost), built by the replacer into an
``out=`` context; on with different logits, built fresh. The variants alternate the way an
engine alternates contexts, so "graphs compiled" (over every call) holds the promise that one
graph serves them all. Also the compile-time ratio. Prints a table and a final JSON line.

Every compiled variant shares the *same* weight tensors (as instrument() does
for users: it rewrites the model in place). Separate copies are not a fair
baseline: where the allocator put a copy's weights moves the step time by up
to ~20% on its own. A second plain model ("plain_twin") measures the noise
floor of the comparison.

    python benchmarks/bench_graph.py [--quick] [--threads N]
"""

import argparse
import copy
import json
import statistics
import time

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fxreplace import TensorReplacer, instrument

TARGETS = ["model.layers.*.mlp.gate"]


def build(tokens):
    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=tokens,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def own_router_logits(model, ids):
    """The router logits the plain model computes (the gate's output[0])."""
    captured, handles = {}, []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            handles.append(module.register_forward_hook(
                lambda m, a, out, name=name: captured.__setitem__(name, out[0].detach().clone())))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return captured


def sharing_weights(model):
    """A new module tree over the same parameter and buffer tensors."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer timed repetitions")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 is steadier on a machine shared with other jobs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens, reps = 256, (10 if args.quick else 40)
    torch._inductor.config.fx_graph_cache = False  # time real compiles

    plain = build(tokens)
    model = instrument(sharing_weights(plain), TARGETS)
    ids = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(0))
    same = own_router_logits(plain, ids)
    gen = torch.Generator().manual_seed(1)
    # prompt 0: the model's own router logits; prompt 1: other logits
    replacer = TensorReplacer({0: {n: t.reshape(tokens, -1) for n, t in same.items()},
                               1: {n: torch.randn(tokens, 16, generator=gen) for n in same}})
    replacer.register_request("same", None, prompt_idx=0)
    replacer.register_request("other", None, prompt_idx=1)
    positions = list(range(tokens))
    on_same = replacer.build_context(["same"], positions, is_prefill=True, out=replacer.warmup_context(tokens))
    off = replacer.warmup_context(tokens)

    compiled_plain = torch.compile(sharing_weights(plain))
    compiled_twin = torch.compile(sharing_weights(plain))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    variants = {
        "plain": lambda: compiled_plain(input_ids=ids, use_cache=False),
        "plain_twin": lambda: compiled_twin(input_ids=ids, use_cache=False),
        "off": lambda: compiled(input_ids=ids, use_cache=False, replacements=off),
        "on_same_routing": lambda: compiled(input_ids=ids, use_cache=False, replacements=on_same),
        "on_other_logits": lambda: compiled(input_ids=ids, use_cache=False,
                                            replacements=replacer.build_context(["other"], positions, is_prefill=True)),
    }
    with torch.no_grad():
        # Warm inductor's process-wide state and kernel cache once, so neither
        # timed compile pays the first-compile cost alone.
        torch.compile(sharing_weights(plain))(input_ids=ids, use_cache=False)
        torch._dynamo.reset()
        compile_plain = timed(variants["plain"])
        compile_instrumented = timed(variants["on_same_routing"])
        for fn in variants.values():  # warm up (no compile expected for the instrumented ones)
            fn()
        graphs = counter.frame_count
        torch.testing.assert_close(variants["on_same_routing"]().logits, variants["plain"]().logits,
                                   rtol=1e-3, atol=1e-3)
        times = {name: [] for name in variants}
        order = list(variants)
        for rep in range(reps):
            for name in order[rep % len(order):] + order[:rep % len(order)]:  # rotate: no position bias
                times[name].append(timed(variants[name]))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'variant':<18}{'median ms':>12}{'vs plain':>10}")
    for name, value in median.items():
        print(f"{name:<18}{value * 1e3:>12.2f}{value / median['plain']:>10.3f}")
    print(f"compile: plain {compile_plain:.1f}s, instrumented {compile_instrumented:.1f}s; graphs compiled: {graphs}")
    print(json.dumps({
        "overhead_off": round(median["off"] / median["plain"], 4),
        "overhead_on_same_routing": round(median["on_same_routing"] / median["plain"], 4),
        "overhead_on_other_logits": round(median["on_other_logits"] / median["plain"], 4),
        "noise_floor": round(median["plain_twin"] / median["plain"], 4),
        "compile_time_ratio": round(compile_instrumented / compile_plain, 4),
        "graphs_compiled": graphs,
        "tokens": tokens, "repetitions": reps,
    }))


if __name__ == "__main__":
    main()
