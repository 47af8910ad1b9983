"""benchmarks/bench_blame_suite.py in a reduced form: its scoring (a planted fault found scores 1,
a wrong origin lowers precision, a miss lowers recall, a target that does not diverge names
nothing), its oracle (it confirms a planted fault and refuses a module that holds none), one
fixture end to end through blame, and a subset of its code faults (``--code-faults``) end to end."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fxreplace.blame import LayerShare, Origin, Pass
from fxreplace.models import tiny_model

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_blame_suite.py"
spec = importlib.util.spec_from_file_location("bench_blame_suite", PATH)
suite = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
spec.loader.exec_module(suite)

LAYERS = 4


def result(origins, *, diverged=True, after_layers=1.0):
    """A blame result as the scoring reads it: the origins, the streams' shares, the first pass."""
    off = Pass((), 0.3, 1.0, 0.5, 1, 5 if diverged else 0, 0, False, 1, 0.1)
    shares = [LayerShare(k, f"model.layers.{k}", after_layers if k == LAYERS - 1 else 0.0, 0.0) for k in range(LAYERS)]
    return SimpleNamespace(origins=origins, layer_shares=shares, passes=[off], layers=list(range(LAYERS)),
                           diffuse=False, floor=None)


def origin(kind, layer):
    return Origin(layer, 0.5, None if kind == "layer" else f"model.layers.{layer}.{kind}", None if kind == "layer" else kind)


def test_a_planted_fault_found_scores_one_and_a_wrong_origin_lowers_precision():
    planted = [("router", 2)]
    assert suite.score(planted, result([origin("router", 2)])) == {
        "top1": 1.0, "recall": 1.0, "precision": 1.0, "named": [("router", 2)]}
    wrong_first = suite.score(planted, result([origin("attention", 1), origin("router", 2)]))
    assert (wrong_first["top1"], wrong_first["recall"], wrong_first["precision"]) == (0.0, 1.0, 0.5)
    missed = suite.score([("router", 2), ("attention", 0)], result([origin("router", 2)]))
    assert (missed["top1"], missed["recall"], missed["precision"]) == (1.0, 0.5, 1.0)
    layer_itself = suite.score([("layer", 0)], result([origin("layer", 0)]))  # no kind explains it
    assert layer_itself["recall"] == 1.0 and layer_itself["precision"] == 1.0
    # the rest arising after the last layer is the final norm's finding; a target not diverging names nothing
    assert suite.named(result([], after_layers=0.2)) == [suite.FINAL]
    assert suite.named(result([], diverged=False, after_layers=0.0)) == []
    assert suite.drift_right("clean fp32", result([], diverged=False, after_layers=0.0))
    assert not suite.drift_right("pure bf16", result([origin("attention", 0)]))
    assert suite.drift_right("pure bf16", SimpleNamespace(**{**vars(result([])), "floor": {"within": True}}))


@pytest.fixture(scope="module")
def family():
    fam = suite.FAMILIES[0]  # Qwen3-MoE
    clean, components = suite.build(fam, 0, LAYERS)
    reference = suite.draw_reference(clean, components, fam, torch.Generator().manual_seed(0), 2, 6)
    return fam, clean, components, reference


def test_the_oracle_confirms_a_planted_fault_and_refuses_a_module_holding_none(family):
    fam, clean, components, reference = family
    target = copy.deepcopy(clean)
    fault = suite.plant(target, "router_rows", 2, random.Random(0), "experts", [5])
    assert fault.module == "model.layers.2.mlp.gate" and fault.expected == ("router", 2)
    assert suite.decide(clean, target, reference, [fault]) is None
    elsewhere = suite.Fault("attention_proj", 1, "model.layers.1.self_attn.o_proj", ("attention", 1))
    why = suite.decide(clean, target, reference, [elsewhere])
    assert why is not None and "explain 0%" in why
    assert suite.decide(clean, copy.deepcopy(clean), reference, [elsewhere]) == "the target does not diverge"


@pytest.mark.parametrize("kind", ["attention_proj", "embedding"])
def test_one_fixture_end_to_end(family, kind):
    fam, clean, components, reference = family
    (case, target), refused = suite.draw(fam, clean, reference, kind, [kind], False, random.Random(1), 3, LAYERS)
    row = suite.run_case(case, target, reference, components)
    assert (row["top1"], row["recall"], row["precision"]) == (1.0, 1.0, 1.0), row["verdict"]
    assert row["named"] == [case.faults[0].expected] and row["passes"] < row["one_by_one"]
    total = suite.aggregate([row, {**row, "precision": 0.5, "top1": 0.0}])
    assert total["precision"] == 0.75 and total["top1"] == 0.5 and total["recall"] == 1.0


CODE_SUBSET = ["renorm skipped@Qwen3MoeForCausalLM", "renorm skipped, instance attribute",
               "kv heads tiled@LlamaForCausalLM", "scaling twice", "rmsnorm offset (interaction)", "decode: rope again"]


def test_code_faults_end_to_end(capsys):
    """A subset of ``--code-faults`` through the suite: routing bugs (in the class and on an instance), the key/value
    heads tiled, DeepSeek's scaling applied twice (every MoE layer), the interacting norm offset and a decode-only
    fault, each confirmed by the oracle, blamed, scored; the final JSON line holds the figures."""
    args = SimpleNamespace(seed=0, layers=None, prompts=2, new_tokens=8, redraws=3, faults=CODE_SUBSET)
    suite.code_fault_suite(args)
    printed = capsys.readouterr().out
    out = json.loads(printed.strip().splitlines()[-1])
    assert out["suite"] == "code faults" and out["cases"] == 9 and out["not_run"] == 0, printed
    assert (out["top1"], out["recall"], out["precision"]) == (1.0, 1.0, 1.0), out["wrong"]
    assert out["systematic_ok"] == "9/9" and out["decode_ok"] == "1/1" and out["goal_met"], out["wrong"]
    assert out["by_kind"]["routing, every layer"]["cases"] == 2 and out["by_kind"]["routing, one layer"]["top1"] == 1.0
    (interaction,) = out["interaction"]
    assert interaction["worse_alone"] and min(interaction["oracle_alone"]) < 0, interaction  # the fixture's premise
    assert "fault, placement @ family" in printed and "scaling twice, every layer @ DeepseekV3" in printed


def test_a_code_fault_in_every_layer_is_confirmed_by_the_oracle_and_one_layer_alone_is_not_enough():
    cf = suite.code_faults_module()
    fault = next(f for f in cf.FAULTS if f.name == "attention scale" and f.family == "LlamaForCausalLM")
    clean = tiny_model(fault.family, num_hidden_layers=LAYERS, **cf.config_for(fault, LAYERS))
    reference = suite.draw_reference(clean, None, suite.FAMILIES[2], torch.Generator().manual_seed(0), 2, 6)
    target = fault.plant(clean, list(range(LAYERS)))
    modules = [f"model.layers.{k}.self_attn" for k in range(LAYERS)]
    assert suite.decide_code(clean, target, reference, modules, False)[0] is None
    why, figures = suite.decide_code(clean, target, reference, modules[:1], False)  # layer 0 alone: the rest remain
    assert why is not None and "explain" in why and figures["together"] < suite.EXPLAINS
    # the planted class is the port's, the weights are the clean model's
    assert type(target.model.layers[0].self_attn).__name__ == "PortedLlamaAttention"
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), clean.state_dict().values()))
