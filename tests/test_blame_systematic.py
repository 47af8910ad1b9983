"""A port's bug is code in a class every layer runs, so it shows in every layer (vLLM PR #24119: DeepSeek's
routed scaling factor applied twice in every MoE layer). Planted here as code, not weights: the target's
modules run a subclass of their class (one class for every layer it is planted in) that reads the config
wrong, drops a step or uses another activation, in float32 tiny models of three families, so precision noise
is not the explanation. Blame must tell such a fault as one systematic fault of the right kind naming every
faulty layer (not "diffuse drift", not "independent sources"), name each layer of a fault in some layers
only, find a layer the search passed over, and keep "independent" for sources of different kinds."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxreplace.blame import MEMBER, SIGNIFICANT, LayerCode, Search, SharedClass, blame, resolve_components
from fxreplace.blame.result import Systematic
from fxreplace.blame.systematic import LEAVE_OUT
from fxreplace.components import layer_of
from fxreplace.covers import (AFTER_LAYERS, component_covers, components_from_data, components_to_data,
                              covers_from_data, covers_to_data, own_code)
from fxreplace.capture import capture_reference
from fxreplace.engines.protocol import Engine
from fxreplace.metrics import BELOW_ZERO, EXPLAINS, Tolerances
from fxreplace.words import pct
from fxreplace.models import get_family, tiny_model
from fxreplace.repro import blamed_component

# benchmarks/code_faults.py: the norm class's and the layer's own bugs the code-fault suite plants (one module)
if "code_faults" not in sys.modules:
    spec = importlib.util.spec_from_file_location("code_faults", Path(__file__).resolve().parent.parent / "benchmarks"
                                                  / "code_faults.py")
    sys.modules["code_faults"] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules["code_faults"])
code_faults = sys.modules["code_faults"]

QWEN, MIXTRAL, LLAMA = "Qwen3MoeForCausalLM", "MixtralForCausalLM", "LlamaForCausalLM"
LAYERS = 4
NEW = 6


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (length,), generator=g).tolist() for length in (6, 9)]


def suite_prompts():
    """The code-fault suite's prompts for seed 0 (benchmarks/bench_blame_suite.py, 2 prompts), on which the search
    at 64 layers takes the paths the deep-model tests reenact."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (int(n),), generator=g).tolist() for n in torch.randint(6, 14, (2,), generator=g)]


def ported(model: nn.Module, path: str, layers=None, **code) -> nn.Module:
    """A copy of ``model`` whose module at ``path`` in each of ``layers`` (default: every layer) runs one subclass
    of its class with ``code`` (methods, properties) instead: the port's bug, the weights untouched."""
    model = copy.deepcopy(model)
    layers = range(model.config.num_hidden_layers) if layers is None else layers
    modules = [model.model.layers[k].get_submodule(path) for k in layers]
    faulty = type(f"Ported{type(modules[0]).__name__}", (type(modules[0]),), code)
    for module in modules:
        module.__class__ = faulty
    return model


def scale_from_hidden_size(model, layers=None):
    """Attention scaled by (hidden_size // num_heads) ** -0.5 instead of head_dim ** -0.5."""
    return ported(model, "self_attn", layers,
                  scaling=property(lambda self: (self.config.hidden_size // self.config.num_attention_heads) ** -0.5))


def no_qk_norm(model, layers=None):
    """Qwen3's q/k RMSNorms left out of the attention."""
    return ported(model, "self_attn", layers, q_norm=property(lambda self: nn.Identity()),
                  k_norm=property(lambda self: nn.Identity()))


def gelu_mlp(model, layers=None):
    """The MLP's activation is GELU where the config says SiLU."""
    return ported(model, "mlp", layers,
                  forward=lambda self, x: self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x)))


def norm_weight_offset(model, layers=None):
    """The input RMSNorm scales by (1 + weight), Gemma's convention, on weights stored for ``weight``."""

    def forward(self, x):
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    return ported(model, "input_layernorm", layers, forward=forward)


def no_topk_renorm(model, layers=None):
    """Mixtral's router skips renormalising its top-k weights (the logits are right: the MoE block's output is not)."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, indices = torch.topk(F.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return logits, weights, indices

    return ported(model, "mlp.gate", layers, forward=forward)


def norm_topk_prob_ignored(model, layers=None):
    """Qwen3-MoE's router reads norm_topk_prob as False."""
    return ported(model, "mlp.gate", layers, norm_topk_prob=property(lambda self: False))


# name -> (family, config overrides, fault, the kind blame must name)
EVERY_LAYER = {
    "attention scale": (QWEN, {"num_attention_heads": 4}, scale_from_hidden_size, "attention"),
    "q/k norm missing": (QWEN, {}, no_qk_norm, "attention"),
    "mlp activation": (LLAMA, {}, gelu_mlp, "mlp"),
    "rmsnorm offset": (LLAMA, {}, norm_weight_offset, "attention"),
    "top-k renorm skipped": (MIXTRAL, {}, no_topk_renorm, "routing"),
}


def drawn_prompts(seed: int, n: int = 2) -> list[list[int]]:
    """The prompts bench_blame_suite.py --code-faults draws for ``seed`` (its 2 prompts of 6-13 tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 14, (n,), generator=g)
    return [torch.randint(4, 128, (int(length),), generator=g).tolist() for length in lengths]


@pytest.fixture(scope="module")
def setups():
    """(clean model, reference) per (family, config overrides, layers, weights' seed, prompts, new tokens), built
    once; by default the weights of seed 0 and this file's prompts."""
    cache = {}

    def get(arch, overrides, layers=LAYERS, seed=0, ids=None, new=NEW):
        ids = ids or prompts()
        key = (arch, repr(sorted(overrides.items())), layers, seed, repr(ids), new)
        if key not in cache:
            clean = tiny_model(arch, seed=seed, num_hidden_layers=layers, **overrides)
            cache[key] = clean, capture_reference(clean, ids, [], new, components=get_family(arch).components,
                                                  progress=False)
        return cache[key]

    return get


def named(result):
    return [(o.kind, o.layer) for o in result.origins]


@pytest.mark.parametrize("name", EVERY_LAYER)
def test_a_code_fault_in_every_layer_is_one_systematic_fault(setups, name, tmp_path):
    arch, overrides, fault, kind = EVERY_LAYER[name]
    clean, reference = setups(arch, overrides)
    result = blame(fault(clean), reference, progress=False)
    found = result.systematic
    assert found is not None and (found.kind, found.layers, found.where, found.every) == (
        kind, list(range(LAYERS)), "every layer", True), result.verdict
    assert named(result) == [(kind, k) for k in range(LAYERS)], result.verdict  # in layer order: the first is the repro's
    assert result.confident and not result.diffuse and found.explained >= EXPLAINS and result.explained >= EXPLAINS
    assert result.verdict.startswith(f"1 systematic fault: {kind} (") and " in every layer: " in result.verdict
    assert "diffuse" not in result.verdict and "independent" not in result.verdict, result.verdict
    assert "points at code they share" in result.verdict
    # no layer alone explains it (what the search used to call drift or independent sources); each one left out of
    # the kind's replacement leaves its own part
    assert all(share < EXPLAINS for share in found.alone) and all(part >= MEMBER for part in found.left_out), found
    # the verdict's per-layer figures are the origins' (each layer's replacement alone) and the table's
    assert [o.share for o in result.origins] == found.alone
    assert all(f"layer {o.layer} {pct(o.share)}" in result.verdict for o in result.origins), result.verdict
    rows = {b.component: b for b in result.ranking}
    assert all(rows[o.component].origin and rows[o.component].explained == o.share for o in result.origins)
    # the result carries it as data; `repro write` takes the first faulty layer's component
    data = json.loads(result.write_json(tmp_path / "blame.json").read_text())["systematic"]
    assert (data["kind"], data["layers"], data["alone"]) == (kind, found.layers, found.alone)
    assert blamed_component(tmp_path / "blame.json") == blamed_component(result) == found.components[0] == \
        result.origins[0].component and result.origins[0].layer == 0


def test_a_code_fault_in_some_layers_names_each_of_them(setups):
    """The same ported router in two of the four layers: one kind at fault in those two, never called independent."""
    clean, reference = setups(MIXTRAL, {})
    result = blame(no_topk_renorm(clean, [1, 3]), reference, progress=False)
    found = result.systematic
    assert found is not None and (found.kind, found.layers, found.every) == ("routing", [1, 3], False), result.verdict
    assert found.where == "layers 1 and 3 (2 of 4)" and named(result) == [("routing", 1), ("routing", 3)]
    assert result.verdict.startswith(
        "1 kind at fault in 2 layers: routing (model.layers.N.mlp.experts) in layers 1 and 3 ")
    assert "independent" not in result.verdict and "diffuse" not in result.verdict and result.confident
    assert "what these layers share and the others do not" in result.verdict


def test_a_faulty_layer_the_search_passed_over_is_named(setups):
    """Eight layers, the router ported wrong in layers 0, 4 and 7: past layer 0's experts, layers 4 and 7 each add
    less than SIGNIFICANT. The search passes over layer 4; it finds layer 7 (its stream explains all that layer 0's
    origin leaves) but none of its kinds explains that part, layer 4's error being upstream (it used to name "layer
    7: none of attention/router/experts explains it" beside layer 0's experts, as two independent sources).
    Replacing the MoE block in every layer explains it all; leaving layer 4 or 7 out of that replacement leaves a
    part, leaving any other out leaves none: all three are named, no other."""
    clean, reference = setups(MIXTRAL, {}, 8)
    result = blame(no_topk_renorm(clean, [0, 4, 7]), reference, progress=False)
    shares = {s.layer: s.share for s in result.layer_shares}
    assert shares[4] < SIGNIFICANT and shares[7] < SIGNIFICANT, shares
    assert result.systematic is not None and result.systematic.layers == [0, 4, 7], result.verdict
    assert named(result) == [("routing", 0), ("routing", 4), ("routing", 7)] and result.explained >= EXPLAINS
    assert result.verdict.startswith(
        "1 kind at fault in 3 layers: routing (model.layers.N.mlp.experts) in layers 0, 4 and 7 ")
    assert "look at the norms" not in result.verdict and "independent" not in result.verdict and result.confident


def test_a_faulty_layer_left_over_by_one_origin_is_named(setups):
    """The attention scale ported wrong in layers 0 and 7 of 8: layer 0's attention alone removes >= 90% of the
    divergence, where the search stops ("1 source ... 95%", layer 7 left over). What it leaves is more than
    MEMBER, so its kind is replaced in every layer too: that removes the rest, and leaving layer 7 out leaves it."""
    clean, reference = setups(QWEN, {"num_attention_heads": 4}, 8)
    result = blame(scale_from_hidden_size(clean, [0, 7]), reference, progress=False)
    off = next(p for p in result.passes if not p.replaced)
    first = next(p for p in result.passes if p.replaced == ("model.layers.0.self_attn",))
    removed = min(1 - first.mean_kl / off.mean_kl, 1 - first.mean_top5_error / off.mean_top5_error)
    assert EXPLAINS <= removed < 1 - MEMBER, removed
    assert result.systematic is not None and result.systematic.layers == [0, 7], result.verdict
    assert named(result) == [("attention", 0), ("attention", 7)] and result.explained >= 1 - MEMBER
    assert result.verdict.startswith("1 kind at fault in 2 layers: attention (model.layers.N.self_attn) in layers 0 "
                                     "and 7 (2 of 8): ")


def test_a_fault_in_every_moe_layer_is_named_by_the_models_layers(setups):
    """Layer 0 of this Qwen3-MoE is dense: a router reading norm_topk_prob wrong is in every MoE layer, not every layer."""
    clean, reference = setups(QWEN, {"mlp_only_layers": [0]})
    result = blame(norm_topk_prob_ignored(clean, [1, 2, 3]), reference, progress=False)
    found = result.systematic
    assert found is not None and (found.kind, found.layers, found.where, found.every) == (
        "routing", [1, 2, 3], "every MoE layer", True), result.verdict
    assert result.verdict.startswith("1 systematic fault: routing (model.layers.N.mlp.experts) in every MoE layer: ")


def test_layers_are_named_by_their_type():
    """GPT-OSS alternates sliding and full attention (config.layer_types): a fault in the sliding ones only is
    "every sliding attention layer"; layers forming no group are listed."""
    model = tiny_model("GptOssForCausalLM", num_hidden_layers=4,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    components = resolve_components(model, get_family("GptOssForCausalLM").components)

    class Idle(Engine):
        def generate(self, prompts, max_new_tokens, replace):
            raise AssertionError("naming layers runs no pass")

    search = Search(Idle(), None, components, tolerances=Tolerances(), prompts=[0], budget=None, probes=8,
                    progress=False, supply=None, observe=None, layer_types=model.config.layer_types)
    assert search._where("attention", [0, 2]) == ("every sliding attention layer", True)
    assert search._where("attention", [1, 3]) == ("every full attention layer", True)
    assert search._where("router", [0, 1, 2, 3]) == ("every layer", True)
    assert search._where("attention", [0, 1]) == ("layers 0 and 1 (2 of 4)", False)


def test_a_systematic_fault_beside_a_fault_of_another_kind_are_independent_sources(setups):
    """The attention scale ported wrong in every layer and one layer's router weights flipped: two sources of
    different kinds, independent; the router is named beside the systematic fault, not hidden in it."""
    clean, reference = setups(QWEN, {"num_attention_heads": 4})
    target = scale_from_hidden_size(clean)
    with torch.no_grad():
        target.model.layers[2].mlp.gate.weight.mul_(-1.0)
    result = blame(target, reference, progress=False)
    assert result.systematic is not None and result.systematic.layers == list(range(LAYERS)), result.verdict
    assert sorted(named(result)) == sorted([("attention", k) for k in range(LAYERS)] + [("router", 2)])
    assert result.verdict.startswith("2 independent sources: attention (model.layers.N.self_attn) in every layer: ")
    assert "layer 2 router model.layers.2.mlp.gate (" in result.verdict and result.confident


def test_a_router_fault_in_a_layer_the_search_passed_over_is_the_routers(setups):
    """The router ported wrong in layers 0 and 2 and layer 3's router weights flipped (two rows): the routing
    replaced in every layer hides the flipped rows too (it is computed from them), and the search stops there.
    Leaving layer 3's routing out of that replacement leaves a part, which replacing its router instead removes:
    layer 3's fault is its router's, named beside the two-layer fault as an independent source, not as a third
    layer of it."""
    clean, reference = setups(MIXTRAL, {})
    target = no_topk_renorm(clean, [0, 2])
    with torch.no_grad():
        gate = target.model.layers[3].mlp.gate.weight
        gate[[1, 5]] = -1.5 * gate[[1, 5]]
    result = blame(target, reference, progress=False)
    assert result.systematic is not None and result.systematic.layers == [0, 2], result.verdict
    assert named(result) == [("routing", 0), ("routing", 2), ("router", 3)] and result.confident
    assert result.verdict.startswith(
        "2 independent sources: routing (model.layers.N.mlp.experts) in layers 0 and 2 (2 of 4): ")
    router = result.origins[2]
    assert f"layer 3 router model.layers.3.mlp.gate ({pct(router.share)})" in result.verdict and router.share >= SIGNIFICANT


def test_a_layer_that_alone_makes_it_worse_reads_below_zero(setups):
    """An RMSNorm offset in every layer of Qwen3-MoE interacts: one layer's input norm replaced alone makes the
    target worse (the next layers were tuned, by the bug, to its wrong scale). Its part reads below 0, marked, in
    the verdict and in its row alike, not as 0% (the search still decides on what each replacement removes)."""
    clean, reference = setups(QWEN, {})
    result = blame(norm_weight_offset(clean), reference, progress=False)
    found = result.systematic
    assert found is not None and found.kind == "attention" and found.every, result.verdict
    worse = [(layer, share) for layer, share in zip(found.layers, found.alone) if share < 0]
    assert worse, found  # the interaction this test is about
    layer, share = worse[0]
    assert f"layer {layer} {pct(share)}{BELOW_ZERO}" in result.verdict, result.verdict
    assert "fixed alone, that layer makes the target worse: the layers' faults interact" in result.verdict
    rows = {b.component: b for b in result.ranking}
    assert all(rows[o.component].explained == o.share for o in result.origins)


def router_rows(model: nn.Module, layer: int) -> nn.Module:
    """A weight fault: two of layer ``layer``'s router rows negated and scaled 1.5x, in place."""
    with torch.no_grad():
        gate = model.model.layers[layer].mlp.gate.weight
        gate[[1, 5]] = -1.5 * gate[[1, 5]]
    return model


# name -> (family, config overrides, weights' seed, the benchmark's prompts (else this file's), code fault, its layers,
# its kind, the layer of the flipped router rows)
BESIDE = {
    # bench_blame_suite.py --code-faults --seed 0: the router was named as layer 3's MoE block (its router explained
    # 89% of the layer's part: the rest was layer 2's routing fault, not yet found), then dropped as the routing
    # replaced in every layer hides it: "diffuse drift" with the systematic fault set
    "renorm skipped in layers 0 and 2, router rows in layer 3": (MIXTRAL, {}, 0, True, no_topk_renorm, [0, 2],
                                                                  "routing", 3),
    # --seed 2: layer 2's part held its attention fault too, which its MoE block's replacement carries and its
    # router's does not: the MoE block was named, and stayed so beside the systematic attention fault
    "attention scale in every layer, router rows in layer 2": (QWEN, {"num_attention_heads": 4}, 2, True,
                                                              scale_from_hidden_size, [0, 1, 2, 3], "attention", 2),
    # only layer 0's attention adds SIGNIFICANT: the router, the largest origin, was the only kind tried in every
    # layer, which does not explain it: "diffuse drift"
    "attention scale in every layer (one layer standing out), router rows in layer 2": (
        QWEN, {"num_attention_heads": 4}, 1, False, scale_from_hidden_size, [0, 1, 2, 3], "attention", 2),
}


@pytest.mark.parametrize("name", BESIDE)
def test_a_systematic_fault_beside_a_weight_fault_of_another_kind_names_both(setups, name):
    """A code fault in several layers and a router's weights flipped in one layer: the systematic fault of its kind
    in exactly its layers, and the router at its layer beside it (not the MoE block carrying it, not swallowed by
    the kind's replacement), two sources of different kinds; no drift talk."""
    arch, overrides, seed, drawn, fault, layers, kind, router = BESIDE[name]
    clean, reference = setups(arch, overrides, seed=seed, **({"ids": drawn_prompts(seed), "new": 8} if drawn else {}))
    result = blame(router_rows(fault(clean, layers), router), reference, progress=False)
    found = result.systematic
    assert found is not None and (found.kind, found.layers) == (kind, layers), result.verdict
    assert named(result) == [(kind, k) for k in layers] + [("router", router)], result.verdict
    assert result.verdict.startswith(f"2 independent sources: {kind} (model.layers.N."), result.verdict
    assert f"; layer {router} router model.layers.{router}.mlp.gate (" in result.verdict, result.verdict
    assert "diffuse" not in result.verdict and not result.diffuse and "independent" not in found.describe()
    assert result.confident and result.explained >= EXPLAINS


@pytest.mark.parametrize("arch, kinds, instances", [
    (LLAMA, "the attention and the mlp", "input_layernorm, post_attention_layernorm"),
    (QWEN, "the attention and the experts", "input_layernorm, self_attn.q_norm, self_attn.k_norm, post_attention_layernorm"),
])
def test_a_bug_in_the_norm_class_every_layer_runs_is_one_fault_naming_the_class(setups, arch, kinds, instances):
    """One class every layer's attention and MLP run (through their norms), and the final norm too: origins of two
    kinds in every layer and a part after the layers, which read as "diffuse drift". It is one fault, named by its
    class, with the norms running it; leaving any of the replaced components out leaves its own part."""
    clean, reference = setups(arch, {})
    target = code_faults.norm_class_offset(clean, None)
    result = blame(target, reference, progress=False)
    found = result.systematic
    norm = type(target.model.norm).__name__
    assert isinstance(found, SharedClass) and found.classes[0] == norm and found.every, result.verdict
    assert result.verdict.startswith(
        f"1 systematic fault: {norm}, the class that {kinds} of every layer run ({instances}) and, after the last "
        "layer, model.norm: "), result.verdict
    assert f"fix {norm} (its forward" in result.verdict and f"input_layernorm ({norm}), self_attn (" in result.verdict
    assert f"`fxreplace repro write --component model.layers.0.input_layernorm` runs {norm} alone" in result.verdict
    assert found.modules[0] == "model.layers.0.input_layernorm"
    assert "diffuse" not in result.verdict and "independent" not in result.verdict and not result.diffuse
    assert found.layers == list(range(LAYERS)) and len(found.components) == 2 * LAYERS
    assert all(part >= MEMBER for part in found.left_out) and result.confident, found
    # what arises in the layers is what it removes; the rest arises after them, where the final norm runs it
    assert found.explained >= EXPLAINS * found.whole and found.whole < 1 - SIGNIFICANT
    assert sorted(o.component for o in result.origins) == sorted(found.components)


def test_a_bug_in_the_norm_class_of_a_deep_model_is_one_fault_told_by_groups_of_layers(setups):
    """In a deep model a class's fault is spread over as many places: one norm left out leaves too small a part to
    tell, and leaving each out alone would not fit the budget beside the heat map (64 layers: 128 passes), so each
    kind's components are left out in LEAVE_OUT groups of neighbouring layers (before: the layers' own code in 36 of
    64 layers, or diffuse drift)."""
    layers = 64
    clean, reference = setups(LLAMA, {}, layers=layers)
    target = code_faults.norm_class_offset(clean, None)
    result = blame(target, reference, progress=False)
    found = result.systematic
    norm = type(target.model.norm).__name__
    assert isinstance(found, SharedClass) and found.classes[0] == norm and found.every, result.verdict
    assert result.verdict.startswith(f"1 systematic fault: {norm}, the class that the attention and the mlp of every "
                                     "layer run (input_layernorm, post_attention_layernorm) and, after the last layer, "
                                     "model.norm: "), result.verdict
    assert f"any one of the {2 * LEAVE_OUT} groups of neighbouring layers' components leaves" in result.verdict
    attention = found.tried[:LEAVE_OUT]  # the attention's groups, then the mlp's, each of 8 neighbouring layers
    assert len(found.tried) == 2 * LEAVE_OUT and [layer_of(n) for group in attention for n in group] == list(range(layers))
    assert all(len(group) == layers // LEAVE_OUT for group in found.tried) and len(found.left_out) == 2 * LEAVE_OUT
    assert all(part >= MEMBER for part in found.left_out) and result.confident, found
    assert len(result.passes) < 2 * layers  # fewer than leaving each of the 128 out alone would take
    # one fault in 128 places, none measured alone
    assert sorted(o.component for o in result.origins) == sorted(found.components)
    assert all(o.share is None for o in result.origins) and "diffuse" not in result.verdict


def test_a_routing_bug_in_every_layer_of_a_deep_model_the_search_named_a_block_for_is_one_fault(setups):
    """A router that does not renormalise, in all 64 layers: the search reaches one layer's MoE block before its
    routing, and with the block replaced there the routing left out leaves nothing, so that layer stood apart (before:
    "2 independent sources: routing ... in 63 of 64 layers; layer 2 routing (23%)"). The routing is left out with the
    block holding it: one fault in every layer."""
    layers = 64
    clean, reference = setups(QWEN, {}, layers=layers, ids=suite_prompts(), new=8)
    result = blame(code_faults.renorm_skipped(clean, list(range(layers))), reference, progress=False)
    found = result.systematic
    assert found is not None and (found.kind, found.layers, found.every) == ("routing", list(range(layers)), True), \
        result.verdict
    assert result.verdict.startswith("1 systematic fault: routing (model.layers.N.mlp.experts) in every layer: ")
    assert named(result) == [("routing", k) for k in range(layers)] and all(p >= MEMBER for p in found.left_out)
    assert "independent" not in result.verdict and "diffuse" not in result.verdict and result.confident


def test_an_attention_bug_in_every_layer_of_a_deep_model_no_kind_explained_alone_is_the_attention(setups):
    """Grouped-query attention reading its key/value heads tiled, in all 64 layers: each layer's part holds the error
    of the faulty layers upstream, which its own attention replaced alone does not remove, so the search named layers
    no kind explains (before: "the layers' own code ... in 33 of 64 layers", explaining 48%). The attention replaced
    in every layer explains it all: one fault of that kind."""
    layers = 64
    clean, reference = setups(LLAMA, {"num_attention_heads": 4, "num_key_value_heads": 2}, layers=layers,
                              ids=suite_prompts(), new=8)
    result = blame(code_faults.kv_heads_tiled(clean, list(range(layers))), reference, progress=False)
    found = result.systematic
    assert type(found) is Systematic and (found.kind, found.every) == ("attention", True), result.verdict
    assert result.verdict.startswith("1 systematic fault: attention (model.layers.N.self_attn) in every layer: ")
    assert "own code" not in result.verdict and "independent" not in result.verdict and result.explained >= EXPLAINS


def test_faults_of_two_kinds_and_after_the_layers_are_not_a_class(setups):
    """Weights flipped in layer 0's attention, layer 2's MLP and the final norm: origins of two kinds and a part
    after the layers, as a norm class's bug gives. The class is tried (every attention and MLP replaced, each left
    out in turn), but a sound attention or MLP left out leaves nothing: not one class at fault wherever it runs."""
    clean, reference = setups(LLAMA, {})
    target = copy.deepcopy(clean)
    with torch.no_grad():
        target.model.layers[0].self_attn.o_proj.weight[:4] *= -3.0
        target.model.layers[2].mlp.down_proj.weight[:4] *= -3.0
        target.model.norm.weight[:8] *= 3.0
    result = blame(target, reference, progress=False)
    tried = [p.replaced for p in result.passes if len(p.replaced) == 2 * LAYERS]  # every attention and mlp replaced
    assert tried, "the class was not tried: this test no longer exercises its refusal"
    assert result.systematic is None and "the class that" not in result.verdict, result.verdict
    # float32 does not drift: the part after the layers is a place of its own, not "diffuse drift"
    assert result.verdict.startswith("3 independent sources: layer 0 attention model.layers.0.self_attn ("), \
        result.verdict
    assert "; layer 2 mlp model.layers.2.mlp (" in result.verdict and not result.diffuse
    assert "; after the last layer, model.norm (LlamaRMSNorm), lm_head (Linear) (" in result.verdict


def test_a_fault_after_the_layers_beside_one_in_them_is_two_sources_not_drift(setups):
    """A float32 target with an attention fault in layer 0 and the final norm's weights scaled: the layers after 0
    add nothing and the rest arises after them. That is two places, not a drift building up across the layers."""
    clean, reference = setups(LLAMA, {})
    target = copy.deepcopy(clean)
    with torch.no_grad():
        target.model.layers[0].self_attn.o_proj.weight[:4] *= -3.0
        target.model.norm.weight[:8] *= 3.0
    result = blame(target, reference, progress=False)
    assert not result.diffuse and [(o.kind, o.layer) for o in result.origins] == [("attention", 0)], result.verdict
    assert result.verdict.startswith("2 independent sources: layer 0 attention model.layers.0.self_attn ("), \
        result.verdict
    assert "; after the last layer, model.norm (LlamaRMSNorm), lm_head (Linear) (" in result.verdict
    assert "; replacing the one in the layers removes " in result.verdict and "diffuse" not in result.verdict


def test_the_verdict_names_what_a_kinds_replacement_spans(setups):
    """Replacing the MLP's output also undoes its post-attention norm: a norm bug in every layer is blamed on the
    mlp kind, and the advice names both modules and their classes (the MLP's own repro then agrees: the verdict
    says that points before it)."""
    clean, reference = setups(LLAMA, {})
    target = ported(clean, "post_attention_layernorm", forward=lambda self, x: (1 + self.weight) * (
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)))
    result = blame(target, reference, progress=False)
    assert result.systematic is not None and result.systematic.kind == "mlp", result.verdict
    assert ("what replacing the mlp spans in each layer, post_attention_layernorm (PortedLlamaRMSNorm), "
            "mlp (LlamaMLP): their classes") in result.verdict, result.verdict
    assert "where its module agrees with the reference on the reference's inputs, the fault is in what runs before it" \
        in result.verdict


def test_covers_name_the_modules_between_points_in_the_order_they_run():
    """A component's cover: what runs in its layer since the point before it, in the order modules finish,
    and what outside the layers it is called with."""
    model = tiny_model(QWEN, seed=0, num_hidden_layers=2)
    covers = component_covers(model, resolve_components(model, get_family(QWEN).components))
    words = {name: cover.words() for name, cover in covers.items()}
    assert words["model.embed_tokens"] == "model.embed_tokens (Embedding)"
    # the rotary embedding runs once, outside the layers, and hands every attention its cos/sin
    assert words["model.layers.1.self_attn"] == ("model.rotary_emb (Qwen3MoeRotaryEmbedding), input_layernorm "
                                                 "(Qwen3MoeRMSNorm), self_attn (Qwen3MoeAttention)")
    assert words["model.layers.1.mlp.gate"] == "post_attention_layernorm (Qwen3MoeRMSNorm), mlp.gate (Qwen3MoeTopKRouter)"
    # the routing the experts are called with: the router's code after its logits and the block handing it on
    assert words["model.layers.1.mlp.experts"] == ("post_attention_layernorm (Qwen3MoeRMSNorm), mlp.gate "
                                                   "(Qwen3MoeTopKRouter), mlp (Qwen3MoeSparseMoeBlock)")
    assert words["model.layers.1.mlp"] == "post_attention_layernorm (Qwen3MoeRMSNorm), mlp (Qwen3MoeSparseMoeBlock)"
    assert words[AFTER_LAYERS] == "model.norm (Qwen3MoeRMSNorm), lm_head (Linear)"
    assert "Qwen3MoeExperts" in covers["model.layers.1.mlp"].classes
    assert covers["model.layers.1.self_attn"].holding("Qwen3MoeRMSNorm") == [
        "input_layernorm", "self_attn.q_norm", "self_attn.k_norm"]
    # components given without the layers' streams (`blame(components=...)`): the layers come from their names
    declared = {kind: target for kind, target in get_family(QWEN).components.items() if kind != "layer"}
    assert {name: cover.words() for name, cover in component_covers(
        model, resolve_components(model, declared)).items()} == words
    # what crosses an engine's worker boundary (vLLM's serializer: plain values) comes back the same
    components = resolve_components(model, get_family(QWEN).components)
    sent = json.loads(json.dumps(components_to_data(components)))
    assert covers_from_data(json.loads(json.dumps(covers_to_data(component_covers(
        model, components_from_data(sent)))))) == covers


def test_a_bug_in_the_layers_own_code_in_every_layer_is_one_fault(setups):
    """No kind explains what arises in each layer (the residual path is the layer class's own forward): the layers
    were named as independent sources, one each. They are one fault, the layer class's forward, with a repro of
    one whole layer; in one layer only it stays that layer's."""
    clean, reference = setups(LLAMA, {})
    result = blame(code_faults.residual_after_norm(clean, list(range(LAYERS))), reference, progress=False)
    found = result.systematic
    assert isinstance(found, LayerCode) and found.layers == list(range(LAYERS)) and found.every, result.verdict
    assert result.verdict.startswith("1 systematic fault: the layers' own code (PortedLlamaDecoderLayer.forward) in "
                                     "every layer: no kind (attention/mlp) explains"), result.verdict
    assert "independent" not in result.verdict and "diffuse" not in result.verdict and not result.diffuse
    assert "`fxreplace repro write --component model.layers.0` runs one layer alone" in result.verdict
    assert [(o.component, o.layer) for o in result.origins] == [(None, k) for k in range(LAYERS)]
    assert all(part >= MEMBER for part in found.alone) and found.running == list(range(LAYERS))

    one = blame(code_faults.residual_after_norm(clean, [2]), reference, progress=False)
    assert one.systematic is None and one.verdict.startswith("1 source: layer 2 ("), one.verdict
    assert "look at what no kind spans there: model.layers.2 (PortedLlamaDecoderLayer)'s own forward" in one.verdict


def test_layers_whose_part_a_module_outside_the_kinds_may_hold_are_not_their_own_code(setups):
    """A norm after the MLP, before the residual add (Gemma's post-feedforward norm), lies in no kind's span: its
    weights scaled in two layers leave two layers no kind explains, which are two places, not the layers' code."""

    class PostNormLayer(type(setups(LLAMA, {})[0].model.layers[0])):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states, _ = self.self_attn(
                hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                position_embeddings=position_embeddings, **kwargs)
            hidden_states = residual + hidden_states
            return hidden_states + self.post_feedforward_layernorm(self.mlp(self.post_attention_layernorm(hidden_states)))

    clean = copy.deepcopy(setups(LLAMA, {})[0])
    for layer in clean.model.layers:
        layer.__class__ = PostNormLayer
        layer.post_feedforward_layernorm = copy.deepcopy(layer.post_attention_layernorm)
    reference = capture_reference(clean, prompts(), [], NEW, components=get_family(LLAMA).components, progress=False)
    target = copy.deepcopy(clean)
    with torch.no_grad():
        for k in (1, 3):
            target.model.layers[k].post_feedforward_layernorm.weight.mul_(-4.0)
    result = blame(target, reference, progress=False)
    assert result.systematic is None and sorted(o.layer for o in result.origins) == [1, 3], result.verdict
    assert all(o.component is None for o in result.origins), result.verdict
    assert result.verdict.startswith("2 independent sources: layer "), result.verdict
    assert ("look at what no kind spans there: model.layers.1 (PostNormLayer)'s own forward, post_feedforward_layernorm "
            "(LlamaRMSNorm)") in result.verdict
    # what no kind spans in a layer: the layer's own forward and its post-feedforward norm
    covers = component_covers(clean, resolve_components(clean, get_family(LLAMA).components))
    assert covers[own_code("model.layers.1")].spanned == (("model.layers.1", "PostNormLayer"),
                                                          ("model.layers.1.post_feedforward_layernorm", "LlamaRMSNorm"))
