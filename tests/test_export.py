"""fxreplace.export: the pass applied to a torch.export graph; the program (and
its AOTInductor build) equals the eager instrumented model, on and off, at every
sequence length a dynamic export allows."""

import copy

import pytest
import torch
from torch.export import Dim

import fxreplace.models as families
from fxreplace import TensorReplacer
from fxreplace.export import export, export_input_name
from fxreplace.instrument import instrument
from graph_helpers import input_ids, off_context, random_context

GATES = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
TARGETS = ["model.layers.*.mlp.gate"]


@pytest.fixture(scope="module")
def plain():
    return families.tiny_model("Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def eager(plain):
    return instrument(copy.deepcopy(plain), TARGETS)


@pytest.fixture(scope="module")
def dynamic_program(plain):
    """Exported at 8 tokens with the sequence length dynamic."""
    return export(plain, {"input_ids": input_ids(), "use_cache": False}, TARGETS,
                  dynamic_shapes={"input_ids": {1: Dim("seq", min=2, max=64)}, "use_cache": None})


def program_inputs(ctx, tokens=8):
    return {"input_ids": input_ids(tokens), "use_cache": False,
            **{export_input_name(n): ctx[n] for n in GATES}, "fxreplace_mask": ctx.mask}


def eager_logits(model, ctx, tokens=8):
    with torch.no_grad():
        return model(input_ids=input_ids(tokens), use_cache=False, replacements=ctx).logits


def contexts(tokens, seed):
    return (random_context(GATES, 8, tokens, seed=seed), off_context(GATES, 8, tokens),
            random_context(GATES, 8, tokens, seed=seed + 1))


def test_static_export_takes_replacement_inputs(plain, eager):
    program = export(plain, {"input_ids": input_ids(), "use_cache": False}, TARGETS)
    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert [export_input_name(n) for n in GATES] + ["fxreplace_mask"] == names[-3:]
    module = program.module()
    for ctx in contexts(8, seed=1):
        with torch.no_grad():
            out = module(**program_inputs(ctx)).logits
        torch.testing.assert_close(out, eager_logits(eager, ctx), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="input_ids"):  # the static program holds 8 tokens only
        module(**program_inputs(random_context(GATES, 8, 12), tokens=12))


def test_dynamic_export_follows_the_sequence_length(dynamic_program, eager):
    module = dynamic_program.module()
    for tokens in (3, 8, 21):
        for ctx in contexts(tokens, seed=tokens):
            with torch.no_grad():
                out = module(**program_inputs(ctx, tokens)).logits
            torch.testing.assert_close(out, eager_logits(eager, ctx, tokens), rtol=1e-5, atol=1e-5)
    wrong = program_inputs(random_context(GATES, 8, 5), tokens=6)  # replacement rows != tokens
    with pytest.raises(Exception, match=export_input_name(GATES[0])):
        module(**wrong)


def engine_contexts(tokens):
    """What an engine alternates, built by a TensorReplacer: an all-off warm-up, a fresh
    build, builds into out= (a partial mask, new values) and into a leading() view of a
    max-size feed, all-off again."""
    gen = torch.Generator().manual_seed(5)
    flat = {p: {n: torch.randn(rows, 8, generator=gen) * 3 for n in GATES} for p, rows in ((0, 20), (1, tokens - 2))}
    replacer = TensorReplacer(flat)
    replacer.register_request("a", None, prompt_idx=0)
    replacer.register_request("b", None, prompt_idx=1)
    out, feed = replacer.warmup_context(tokens), replacer.warmup_context(2 * tokens)
    yield replacer.warmup_context(tokens)
    yield replacer.build_context(["a"], list(range(tokens)), is_prefill=True)
    yield replacer.build_context(["b"], list(range(tokens)), is_prefill=True, out=out)
    yield replacer.build_context(["a"], list(range(3, 3 + tokens)), is_prefill=True, out=out)
    yield replacer.build_context(["a"], list(range(tokens)), is_prefill=True, out=feed.leading(tokens))
    yield replacer.warmup_context(tokens)


def test_aot_inductor_equals_eager(dynamic_program, eager, tmp_path):
    path = torch._inductor.aoti_compile_and_package(dynamic_program, package_path=str(tmp_path / "qwen.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for tokens in (8, 13):
        for ctx in contexts(tokens, seed=3)[:2]:
            out = runner(**program_inputs(ctx, tokens)).logits
            torch.testing.assert_close(out, eager_logits(eager, ctx, tokens), rtol=1e-4, atol=1e-4)
        for step, ctx in enumerate(engine_contexts(tokens)):  # the one compiled program serves them all
            out = runner(**program_inputs(ctx, tokens)).logits
            torch.testing.assert_close(out, eager_logits(eager, ctx, tokens), rtol=1e-4, atol=1e-4, msg=f"step {step}")
