"""fxreplace.export: the pass applied to a torch.export graph; the program (and
its AOTInductor build) equals the eager instrumented model, on and off."""

import copy

import pytest
import torch

import fxreplace.models as families
from fxreplace.instrument import export, export_input_name, instrument
from graph_helpers import input_ids, off_context, random_context

GATES = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


@pytest.fixture(scope="module")
def exported():
    plain = families.tiny_model("Qwen3MoeForCausalLM")
    program = export(plain, {"input_ids": input_ids(), "use_cache": False}, ["model.layers.*.mlp.gate"])
    eager = instrument(copy.deepcopy(plain), ["model.layers.*.mlp.gate"])
    return program, eager


def program_inputs(ctx):
    return {"input_ids": input_ids(), "use_cache": False,
            **{export_input_name(n): ctx[n] for n in GATES}, "fxreplace_mask": ctx.mask}


def eager_logits(model, ctx):
    with torch.no_grad():
        return model(input_ids=input_ids(), use_cache=False, replacements=ctx).logits


def test_exported_program_takes_replacement_inputs(exported):
    program, eager = exported
    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert [export_input_name(n) for n in GATES] + ["fxreplace_mask"] == names[-3:]
    module = program.module()
    for ctx in (random_context(GATES, 8, seed=1), off_context(GATES, 8), random_context(GATES, 8, seed=2)):
        with torch.no_grad():
            out = module(**program_inputs(ctx)).logits
        torch.testing.assert_close(out, eager_logits(eager, ctx), rtol=1e-5, atol=1e-5)


def test_aot_inductor_equals_eager(exported, tmp_path):
    program, eager = exported
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "qwen.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for ctx in (random_context(GATES, 8, seed=3), off_context(GATES, 8)):
        out = runner(**program_inputs(ctx)).logits
        torch.testing.assert_close(out, eager_logits(eager, ctx), rtol=1e-4, atol=1e-4)
