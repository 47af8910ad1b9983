"""The embedded runner: engine-style layouts, exact greedy generation, contexts built from its own metadata."""

import pytest
import torch

from fxreplace import TensorReplacer
from fxreplace.models import tiny_model
from fxreplace.context import PerRequest
from fxreplace.engines.embedded.runner import Runner, RunnerConfig, propose_ngram
from fxreplace.testing import build_context_loop, slot_owners

PROMPTS = [[1, 5, 9, 3, 7], [2, 8, 8, 4, 1, 6, 3, 9, 12], [3, 3, 3]]
STEPS = 10


@pytest.fixture(scope="module")
def hf():
    return tiny_model("Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def hf_greedy(hf):
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            g = hf.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True)
            out.append((g.sequences[0, len(p):].tolist(), torch.cat(g.logits)))
    return out


class Spy:
    """Calls the HF model and records every context it was given."""

    def __init__(self, model):
        self.model, self.contexts = model, []

    def __call__(self, replacements=None, **kwargs):
        self.contexts.append(replacements)
        return self.model(**kwargs)


def fake_reference(num_modules=2, width=4):
    """Captures whose rows encode (prompt, position) so a context reveals what was gathered."""
    caps = []
    for p, prompt in enumerate(PROMPTS):
        rows = len(prompt) + STEPS
        value = torch.tensor([[p * 1000 + pos] * width for pos in range(rows)], dtype=torch.float32)
        caps.append({f"m{i}": value + i for i in range(num_modules)})
    return dict(enumerate(caps)), caps


@pytest.mark.parametrize("k", [0, 2])
def test_runner_reproduces_hf_greedy_generation(hf, hf_greedy, k):
    runner = Runner(hf, hf.config, runner_config=RunnerConfig(speculative_tokens=k, max_len=128, batch_buckets=(1, 4)))
    gens = runner.generate(PROMPTS, STEPS, replace=False)
    for g, (tokens, logits) in zip(gens, hf_greedy):
        assert g.tokens == tokens
        torch.testing.assert_close(g.logits_tensor, logits, atol=1e-4, rtol=0)
    if k:
        assert runner.forwards < len(PROMPTS) + STEPS - 1, "speculation must accept some drafts"


@pytest.mark.parametrize("k, batched", [(0, False), (2, False), (0, True)])
def test_sliding_window_layers_reproduce_hf_past_the_window(k, batched):
    """GPT-OSS alternates sliding-window (16 positions here) and full layers: prompts and
    continuations longer than the window, speculation and a batched prefill give HF's own tokens
    and logits (its cache keeps a window-sized ring buffer, the runner a mask over its slots)."""
    model = tiny_model("GptOssForCausalLM", init_std=0.3, seed=2)
    assert model.config.sliding_window == 16 and "sliding_attention" in model.config.layer_types
    prompts = [list(range(3, 23)), [7, 1, 9, 4, 2, 8, 5, 5, 6, 1, 3]]
    runner = Runner(model, model.config, runner_config=RunnerConfig(
        speculative_tokens=k, max_len=128, prefill_buckets=(32,), batch_buckets=(2,), batched_prefill=batched))
    gens = runner.generate(prompts, 12, replace=False)
    with torch.no_grad():
        for g, p in zip(gens, prompts):
            want = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
            assert g.tokens == want.sequences[0, len(p):].tolist()
            torch.testing.assert_close(g.logits_tensor, torch.cat(want.logits), atol=1e-4, rtol=0)


@pytest.mark.parametrize("batched", [False, True])
def test_prefill_computes_the_vocabulary_only_at_each_rows_last_position(hf, hf_greedy, batched):
    """A prefill reads one position per row: the lm head sees that one (of a [rows]-long keep list when
    batched), not the whole bucket, and the generation is HF's."""
    runner = Runner(hf, hf.config, runner_config=RunnerConfig(max_len=128, batch_buckets=(4,), batched_prefill=batched))
    widths = []
    hook = hf.lm_head.register_forward_hook(lambda mod, args, out: widths.append(out.shape[1]))
    try:
        gens = runner.generate(PROMPTS, STEPS, replace=False)
    finally:
        hook.remove()
    assert widths[0] == (4 if batched else 1) and widths[1 if batched else len(PROMPTS):] == [1] * (STEPS - 1)
    for g, (tokens, logits) in zip(gens, hf_greedy):
        assert g.tokens == tokens
        torch.testing.assert_close(g.logits_tensor, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("k, batched", [(0, False), (2, False), (0, True)])
def test_forced_steps_read_the_forced_tokens(hf, k, batched):
    """Teacher forcing inside a wave: step j's logits are the model's after the prompt and the first j
    forced tokens, whatever the request picked; its tokens are its own picks."""
    g = torch.Generator().manual_seed(3)
    forced = [torch.randint(0, hf.config.vocab_size, (STEPS,), generator=g).tolist() for _ in PROMPTS]
    runner = Runner(hf, hf.config, runner_config=RunnerConfig(speculative_tokens=k, max_len=128, batch_buckets=(4,),
                                                              batched_prefill=batched))
    gens = runner.generate(PROMPTS, STEPS, replace=False, forced=forced)
    assert runner.forwards == (1 if batched else len(PROMPTS)) + -(-(STEPS - 1) // (k + 1)), "no re-run, k + 1 per step"
    with torch.no_grad():
        for prompt, f, gen in zip(PROMPTS, forced, gens):
            full = hf(torch.tensor([prompt + f[: STEPS - 1]])).logits[0, len(prompt) - 1 :]
            torch.testing.assert_close(gen.logits_tensor, full, atol=1e-4, rtol=0)
            assert gen.tokens == full.argmax(-1).tolist() != f
    with pytest.raises(ValueError, match="forced holds 1 continuations for 3 prompts"):
        runner.generate(PROMPTS, STEPS, replace=False, forced=forced[:1])


@pytest.mark.parametrize("k", [0, 3])
def test_every_context_matches_the_per_slot_oracle(hf, k):
    flat, _ = fake_reference()
    replacer = TensorReplacer(flat, prompt_token_ids=PROMPTS)
    spy = Spy(hf)
    cfg = RunnerConfig(speculative_tokens=k, max_len=160, prefill_buckets=(8, 16), batch_buckets=(1, 2, 4))
    runner = Runner(spy, hf.config, replacer=replacer, runner_config=cfg)
    recorded = []
    original = replacer.build_context

    def build(req_ids, positions, is_prefill, device=None, tokens_per_req=1, names=None):
        assert names is None, "replace=True: every name's rows"
        ctx = original(req_ids, positions, is_prefill, device=device, tokens_per_req=tokens_per_req)
        recorded.append((list(req_ids), positions.tolist(), is_prefill, tokens_per_req, ctx))
        return ctx

    replacer.build_context = build
    gens = runner.generate(PROMPTS, STEPS, replace=True)
    assert replacer.requests == {}, "requests are released after the wave"
    prompt_of = {g.req_id: i for i, g in enumerate(gens)}
    assert len(recorded) == runner.forwards == len(spy.contexts)
    prefill_shapes = set()
    for req_ids, positions, is_prefill, width, ctx in recorded:
        owners = slot_owners(len(positions), len(req_ids), positions=positions, is_prefill=is_prefill, tokens_per_req=width)
        expected, mask = build_context_loop(flat, [prompt_of[r] for r in req_ids], positions, owners)
        assert ctx.mask.tolist() == mask.tolist()
        for m in expected:
            assert torch.equal(ctx[m], expected[m])
        if is_prefill:
            prefill_shapes.add(len(positions))
            n = int(ctx.mask.sum())
            assert positions[:n] == list(range(n)) and n == len(PROMPTS[prompt_of[req_ids[0]]]), "padding masked off"
        else:
            assert width == 1 + k
            assert len(positions) == 4 * width, "3 requests padded to the batch bucket of 4"
            assert not ctx.mask[3 * width :].any()
    assert prefill_shapes == {8, 16}


def test_an_eager_runner_gathers_the_rows_of_the_names_it_replaces_only(hf):
    """A blame pass replaces a few of many components: an eager runner's contexts hold their rows alone
    (nothing for replace=False, a selection's names, the union of a PerRequest's), each name's own rows
    (a compiled runner's keep every name: one graph for every selection, tested by the CLI's graph counts)."""
    flat, _ = fake_reference(num_modules=3)
    spy = Spy(hf)
    runner = Runner(spy, hf.config, replacer=TensorReplacer(flat, prompt_token_ids=PROMPTS),
                    runner_config=RunnerConfig(max_len=64, prefill_buckets=(16,), batch_buckets=(4,)))
    cases = [(False, set()), (["m0", "m2"], {"m0", "m2"}), (PerRequest([{"m1"}, {"m2"}, {"m1"}]), {"m1", "m2"}),
             (True, {"m0", "m1", "m2"})]
    for replace, names in cases:
        spy.contexts.clear()
        runner.generate(PROMPTS, 2, replace=replace)
        # a prompt's own prefill holds its own selection, a decode step the batch's
        each = [set(r) for r in replace] if isinstance(replace, PerRequest) else [names] * len(PROMPTS)
        assert [set(c) for c in spy.contexts] == each + [names], replace
        for c in spy.contexts:
            assert sum(block.shape[1] for block in c.storage) == len(c), "no other name's rows gathered"
            assert c.mask.any() == (replace is not False)
            first, *others = sorted(c) or [None]
            for name in others:  # name i's rows are the (prompt, position) code + i
                assert (c[name][c.mask] - c[first][c.mask] == int(name[1]) - int(first[1])).all()


@pytest.mark.parametrize("replace", [True, ["m1"], PerRequest([{"m0"}, {"m1"}, {"m0"}])])
def test_each_built_context_goes_back_after_its_forward(hf, replace):
    """The runner releases every context it built once its forward is done with it (a select() of it
    the forward read included), so later forwards of that shape reuse its buffers."""
    flat, _ = fake_reference()
    replacer = TensorReplacer(flat, prompt_token_ids=PROMPTS)
    runner = Runner(hf, hf.config, replacer=replacer,
                    runner_config=RunnerConfig(max_len=64, prefill_buckets=(16,), batch_buckets=(4,)))
    built, released, reused = [], [], []  # ids only: holding a context would keep its buffers from reuse
    build, release, take = replacer.build_context, replacer.release, replacer._pool._take

    def building(*args, **kwargs):
        ctx = build(*args, **kwargs)
        built.append(id(ctx))
        return ctx

    def releasing(ctx):
        released.append((id(ctx), release(ctx)))
        return released[-1][1]

    def taking(shapes):
        buffers = take(shapes)
        reused.append(buffers is not None)
        return buffers

    replacer.build_context, replacer.release, replacer._pool._take = building, releasing, taking
    runner.generate(PROMPTS, STEPS, replace=replace)
    assert released == [(i, True) for i in built] and len(built) == runner.forwards
    # new buffers for the first prefill and the first two decode steps (the runner still holds the
    # step before while it builds the next), reused by every other forward
    assert reused.count(False) == 3 and len(reused) == runner.forwards, reused


def test_bad_sizes_are_clear_errors(hf):
    runner = Runner(hf, hf.config, runner_config=RunnerConfig(max_len=16, prefill_buckets=(8,)))
    with pytest.raises(ValueError, match=r"a prompt of 9 exceeds the largest bucket 8"):
        runner.generate([list(range(9))], 1, replace=False)
    with pytest.raises(ValueError, match=r"max_len 16 is too small"):
        runner.generate([[1, 2]], 20, replace=False)
    with pytest.raises(ValueError, match="replace=True needs a Runner built with a replacer"):
        runner.generate([[1, 2]], 1)


def test_ngram_proposer():
    assert propose_ngram([1, 2, 3, 1, 2], n=2, k=2) == [3, 1]
    assert propose_ngram([4, 5, 6], n=2, k=3) == [6, 6, 6]
    assert propose_ngram([7, 8, 7, 8], n=2, k=3) == [7, 8, 8]
