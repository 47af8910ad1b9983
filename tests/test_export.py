"""fxreplace.export: the pass applied to a torch.export graph; the program (and
its AOTInductor build) equals the eager instrumented model, on and off, at every
sequence length a dynamic export allows."""

import copy

import pytest
import torch
from torch.export import Dim

import fxreplace.models as families
from fxreplace import TensorReplacer
from fxreplace import ReplacementContext
from fxreplace.export import export, export_input_name, export_inputs
from fxreplace.sharding import ShapeError
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


def program_inputs(program, ctx, tokens=8):
    return {"input_ids": input_ids(tokens), "use_cache": False, **export_inputs(program, ctx)}


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
            out = module(**program_inputs(program, ctx)).logits
        torch.testing.assert_close(out, eager_logits(eager, ctx), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="input_ids"):  # the static program holds 8 tokens only
        module(**program_inputs(program, random_context(GATES, 8, 12), tokens=12))


def test_a_0_1_integer_mask_works_as_the_bool_one(dynamic_program):
    """A hand-made mask of 0/1 integers (int64, as torch.tensor([1, 0, ...]) makes it) gives the program's
    bool result instead of failing inside a where that names no input."""
    module = dynamic_program.module()
    inputs = program_inputs(dynamic_program, random_context(GATES, 8, 8, seed=3))
    inputs["fxreplace_mask"][1::2] = False  # some rows replaced, some computed
    with torch.no_grad():
        expected = module(**inputs).logits
        got = module(**{**inputs, "fxreplace_mask": inputs["fxreplace_mask"].long()}).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_dynamic_export_follows_the_sequence_length(dynamic_program, eager):
    module = dynamic_program.module()
    for tokens in (3, 8, 21):
        for ctx in contexts(tokens, seed=tokens):
            with torch.no_grad():
                out = module(**program_inputs(dynamic_program, ctx, tokens)).logits
            torch.testing.assert_close(out, eager_logits(eager, ctx, tokens), rtol=1e-5, atol=1e-5)
    wrong = program_inputs(dynamic_program, random_context(GATES, 8, 5), tokens=6)  # replacement rows != tokens
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
            out = runner(**program_inputs(dynamic_program, ctx, tokens)).logits
            torch.testing.assert_close(out, eager_logits(eager, ctx, tokens), rtol=1e-4, atol=1e-4)
        for step, ctx in enumerate(engine_contexts(tokens)):  # the one compiled program serves them all
            out = runner(**program_inputs(dynamic_program, ctx, tokens)).logits
            torch.testing.assert_close(out, eager_logits(eager, ctx, tokens), rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_export_inputs_check_a_context_against_the_program(dynamic_program, eager):
    """The program's inputs from a context: float values cast as the eager model casts them;
    a wrong dtype, width or a missing target named before the graph fails deep without a name."""
    ctx = random_context(GATES, 8, 5, seed=4)
    doubled = ReplacementContext({n: ctx[n].double() for n in GATES}, ctx.mask)
    with torch.no_grad():
        out = dynamic_program.module()(**program_inputs(dynamic_program, doubled, 5)).logits
    torch.testing.assert_close(out, eager_logits(eager, ctx, 5), rtol=1e-5, atol=1e-5)

    as_ints = ReplacementContext({n: ctx[n].long() for n in GATES}, ctx.mask)
    with pytest.raises(TypeError, match=f"{GATES[0]}.*torch.int64.*torch.float32"):
        export_inputs(dynamic_program, as_ints)
    narrow = ReplacementContext({n: ctx[n][:, :4] for n in GATES}, ctx.mask)
    with pytest.raises(ShapeError, match=f"{GATES[0]}.*\\(5, 4\\).*\\[tokens, 8\\]"):
        export_inputs(dynamic_program, narrow)
    with pytest.raises(KeyError, match=export_input_name(GATES[1])):
        export_inputs(dynamic_program, ReplacementContext({GATES[0]: ctx[GATES[0]]}, ctx.mask))
    with pytest.raises(ValueError, match="mask must be a 1-D bool tensor, got torch.int64"):
        ReplacementContext(dict(ctx.items()), ctx.mask.long())
