"""``fxreplace blame`` on planted faults: a tiny 4-layer Qwen3-MoE in float32 is the
reference; the target is the same checkpoint with one fault planted (or the whole
model in bf16: diffuse drift). The search must rank the planted component first, with
its kind and layer, in fewer passes than replacing every component one by one."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from fxreplace import Target
from fxreplace.blame import LAYER, blame, resolve_components
from fxreplace.capture import capture_reference
from fxreplace.cli import main as cli
from fxreplace.context import ReplacementContext
from fxreplace.models import get_family, tiny_model
from fxreplace.validation import EXPLAINS, explained, verdict

ARCH = "Qwen3MoeForCausalLM"
LAYERS = 4
NEW = 6
KINDS = ["attention", "router", "experts", "layer"]


def prompts(n=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (length,), generator=g).tolist() for length in (6, 9, 12)[:n]]


def plant(model, fault: str):
    """A copy of ``model`` with one planted fault (the acceptance scenarios of issue 12)."""
    model = copy.deepcopy(model)
    layers = model.model.layers
    with torch.no_grad():
        if fault == "attention":
            layers[1].self_attn.o_proj.weight.mul_(1.5)
        elif fault == "router":
            layers[2].mlp.gate.weight.mul_(-1.0)
        elif fault == "experts":
            layers[3].mlp.experts.gate_up_proj[0].mul_(3.0)  # expert 0 only
    return model


PLANTED = {"attention": ("model.layers.1.self_attn", 1), "router": ("model.layers.2.mlp.gate", 2),
           "experts": ("model.layers.3.mlp", 3)}


@pytest.fixture(scope="module")
def clean():
    return tiny_model(ARCH, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(clean):
    return capture_reference(clean, prompts(), [], NEW, components=get_family(ARCH).components, progress=False)


@pytest.fixture(scope="module")
def blamed(clean, reference):
    cache = {}

    def get(fault):
        if fault not in cache:
            if fault == "bf16":
                cache[fault] = blame(clean, reference, dtype=torch.bfloat16, progress=False)
            else:
                cache[fault] = blame(plant(clean, fault), reference, progress=False)
        return cache[fault]

    return get


def test_store_holds_every_kind_as_rows_per_layer(clean, reference):
    components = reference.metadata["components"]
    assert len(components) == LAYERS * len(KINDS)
    hidden, experts = clean.config.hidden_size, clean.config.num_experts
    for name, info in components.items():
        assert info["kind"] in KINDS and 0 <= info["layer"] < LAYERS
        rows = reference.store.rows(0, name)
        assert rows.shape == (len(prompts()[0]) + NEW - 1, experts if info["kind"] == "router" else hidden), name
    # the stream after the last layer, normed and projected, gives the reference's logits
    stream = reference.store.rows(0, f"model.layers.{LAYERS - 1}")
    with torch.no_grad():
        logits = clean.lm_head(clean.model.norm(stream))
    torch.testing.assert_close(logits[len(prompts()[0]) - 1:], reference.logits(0), atol=1e-4, rtol=0)


DECLARED = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM",
            "GptOssForCausalLM+fused_router", "GptOssForCausalLM+fused_topk", "LlamaForCausalLM"]


def test_families_declare_components_that_resolve():
    for arch in DECLARED:
        family = get_family(arch)
        assert list(family.components)[-1] == LAYER and "attention" in family.components, arch
        model = tiny_model(arch)
        found = resolve_components(model, family.components)
        assert {c.layer for c in found} == set(range(model.config.num_hidden_layers)), arch
    assert get_family(ARCH).vllm_components["layer"].adapter == "residual_stream_pair"


@pytest.mark.parametrize("fault", ["attention", "router", "experts"])
def test_planted_fault_is_ranked_first(blamed, fault):
    result = blamed(fault)
    component, layer = PLANTED[fault]
    top = result.ranking[0]
    assert (top.component, top.kind, top.layer) == (component, fault, layer), result.table()
    assert result.confident and not result.diffuse and result.origin_layer == layer
    assert top.explained >= EXPLAINS and top.kl_on < 1e-3 * top.kl_off and top.kl_off > 1e-3
    assert result.guilty is top and component in result.verdict
    # fewer passes than one by one (off + every component), and logarithmic in the layers
    assert len(result.passes) < 1 + LAYERS * len(KINDS)
    assert len(result.passes) <= 1 + math.ceil(math.log2(LAYERS)) + 1 + (len(KINDS) - 1)
    # components of the layers before the fault explain nothing
    for b in result.ranking:
        if b.layer < layer:
            assert b.explained < 0.1, b


def test_bf16_drift_is_reported_as_diffuse(blamed):
    result = blamed("bf16")
    assert result.diffuse and not result.confident and result.guilty is None
    assert result.verdict.startswith("diffuse drift")
    assert all((b.share or 0) < EXPLAINS for b in result.ranking)
    assert {(b.kind, b.layer) for b in result.ranking} == {(k, n) for k in KINDS for n in range(LAYERS)}


def test_blame_json_and_heat_map(blamed, tmp_path):
    result = blamed("router")
    html = result.write_report(tmp_path)
    data = json.loads((tmp_path / "blame.json").read_text())
    assert data["passes"] == len(result.passes) and data["ranking"][0]["component"] == "model.layers.2.mlp.gate"
    assert {"component", "kind", "layer", "kl_off", "kl_on", "explained"} <= set(data["ranking"][0])
    assert (tmp_path / "blame_heatmap.png").stat().st_size > 1000
    assert "blame_heatmap.png" in html.read_text() and "model.layers.2.mlp.gate" in html.read_text()


def test_cli_blame_with_explicit_components(clean, tmp_path, capsys):
    """A family-less workflow: components given as KIND=PATTERN[@POINT]."""
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean.save_pretrained(clean_dir)
    plant(clean, "attention").save_pretrained(faulty_dir)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()))
    components = ["--component", "attention=model.layers.*.self_attn@output[0]", "--component", "layer=model.layers.*@output"]
    assert cli(["capture", str(clean_dir), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", str(NEW),
                "--out", str(tmp_path / "ref"), *components]) == 0
    assert cli(["blame", str(faulty_dir), "--reference", str(tmp_path / "ref"), "--dtype", "float32",
                "--report-dir", str(tmp_path / "out"), *components]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "blame.json").read_text())
    assert data["ranking"][0]["component"] == "model.layers.1.self_attn" and data["confident"]
    assert "model.layers.1.self_attn (attention, layer 1) is the cause" in out
    assert data["passes"] <= 1 + 2 + 1  # off, bisection over 4 layers, the attention alone


def test_selection_keeps_one_compiled_graph(clean, reference):
    """Replacing different sets of components reuses the same graphs (per-module masks)."""
    from fxreplace.instrument import instrument
    from fxreplace.replacer import TensorReplacer
    from fxreplace.runner import Runner, RunnerConfig

    model = instrument(copy.deepcopy(clean), [c.target for c in resolve_components(clean, get_family(ARCH).components)])
    runner = Runner(model, clean.config, TensorReplacer(reference.store),
                    RunnerConfig(prefill_buckets=(16,), batch_buckets=(2,), max_len=32), compile="eager")
    outputs = {}
    for selection in [(), ("model.layers.1",), ("model.layers.2.mlp.gate", "model.layers.0.self_attn"), ()]:
        outputs[selection] = runner.generate(reference.store.prompt_token_ids, 2, replace=selection)
    assert runner.graphs_compiled == 2  # the prefill bucket and the decode bucket, whatever is replaced
    with pytest.raises(KeyError, match="no replacement tensors for"):
        ReplacementContext({"a": torch.zeros(2, 3)}, torch.ones(2, dtype=torch.bool)).select(["b"])


def test_verdict_rests_on_kl_and_top5_error():
    """The case of issue 12: KL fell 18x and top-5 error halved, while diverged prompts stayed 5 of 8."""
    def summary(kl, top5, top1, diverged):
        return {"mean_kl": kl, "mean_top5_error": top5, "top1_agreement": top1, "prompts_diverged": diverged,
                "status_counts": {"diverged": 7}}

    off, on = summary(0.00406, 0.08, 0.9, 5), summary(0.000219, 0.04, 0.9, 5)
    assert explained(off, on)["kl"] == pytest.approx(1 - 0.000219 / 0.00406)
    decided = verdict({"off": off, "on": on}, "the router logits")
    assert decided.outcome == "contributes" and "95% of the mean KL" in decided.sentence
    assert verdict({"off": off, "on": summary(1e-6, 1e-4, 1.0, 0)}).outcome == "explained"
    assert verdict({"off": off, "on": summary(0.004, 0.079, 0.95, 4)}).outcome == "not_the_cause"
