"""``fxreplace blame`` on planted faults in tiny float32 models of two families (a 4-layer
Qwen3-MoE: attention, router, experts; a 4-layer dense Llama: attention, mlp). The clean
model is the reference; the target is the same checkpoint with faults planted (or the
whole model in bf16: diffuse drift). The search must name every planted component with
its kind and layer, first, in few rounds; NaN must be located; a reference lacking
components must be refused, or completed from the clean model on demand."""

from __future__ import annotations

import copy
from collections import Counter
import json
import math
import shutil
import time

import pytest
import torch

from fxreplace.blame import LAYER, MAX_BATCH, MAX_ORIGINS, PROBES, SIGNIFICANT, BlameError, blame, resolve_components
from fxreplace.blame.ondemand import OnDemand
from fxreplace.capture import capture_reference
from fxreplace.cli import main as cli
from fxreplace.context import PerRequest, ReplacementContext
from fxreplace.models import get_family, tiny_model
from fxreplace.reference import load_reference
from fxreplace.store import ReferenceStore
from fxreplace.targets import Target
from fxreplace.metrics import EXPLAINS, explained, verdict

ARCH = "Qwen3MoeForCausalLM"
DENSE = "LlamaForCausalLM"
LAYERS = 4
NEW = 6
KINDS = ["attention", "router", "routing", "experts", "layer"]


def prompts(n=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (length,), generator=g).tolist() for length in (6, 9, 12)[:n]]


def attention(layer):
    return lambda m: m.model.layers[layer].self_attn.o_proj.weight.mul_(1.5)


def router(layer):
    return lambda m: m.model.layers[layer].mlp.gate.weight.mul_(-1.0)


def experts(layer):
    return lambda m: m.model.layers[layer].mlp.experts.gate_up_proj[0].mul_(3.0)  # expert 0 only


def mlp(layer):
    return lambda m: m.model.layers[layer].mlp.down_proj.weight.mul_(2.0)


def embedding_row(m):
    """Noise in the embedding row of the first prompt's first token (what layer 0's attention spreads)."""
    w = m.model.embed_tokens.weight
    w[prompts()[0][0]] += w.std() * torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0))


def nan_in_attention(layer):
    return lambda m: m.model.layers[layer].self_attn.o_proj.weight[0, 0].fill_(float("nan"))


def plant(model, *faults):
    """A copy of ``model`` with the faults planted."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for fault in faults:
            fault(model)
    return model


# (family, faults) -> the origins the search must name, in layer order
SCENARIOS = {
    "attention": (ARCH, [attention(1)], [("model.layers.1.self_attn", "attention", 1)]),
    "router": (ARCH, [router(2)], [("model.layers.2.mlp.gate", "router", 2)]),
    "experts": (ARCH, [experts(3)], [("model.layers.3.mlp", "experts", 3)]),
    "two": (ARCH, [attention(0), router(3)], [("model.layers.0.self_attn", "attention", 0),
                                              ("model.layers.3.mlp.gate", "router", 3)]),
    "dense-attention": (DENSE, [attention(2)], [("model.layers.2.self_attn", "attention", 2)]),
    "embedding": (ARCH, [embedding_row], [("model.embed_tokens", "embedding", 0)]),
    "dense-embedding": (DENSE, [embedding_row], [("model.embed_tokens", "embedding", 0)]),
    "dense-attention-0": (DENSE, [attention(0)], [("model.layers.0.self_attn", "attention", 0)]),
    "dense-mlp": (DENSE, [mlp(1)], [("model.layers.1.mlp", "mlp", 1)]),
    "dense-two": (DENSE, [mlp(0), attention(2)], [("model.layers.0.mlp", "mlp", 0),
                                                  ("model.layers.2.self_attn", "attention", 2)]),
}


@pytest.fixture(scope="module")
def cleans():
    return {arch: tiny_model(arch, num_hidden_layers=LAYERS) for arch in (ARCH, DENSE)}


@pytest.fixture(scope="module")
def references(cleans):
    return {arch: capture_reference(model, prompts(), [], NEW, components=get_family(arch).components, progress=False)
            for arch, model in cleans.items()}


@pytest.fixture(scope="module")
def blamed(cleans, references):
    cache = {}

    def get(name):
        if name not in cache:
            if name == "bf16":
                cache[name] = blame(cleans[ARCH], references[ARCH], dtype=torch.bfloat16, progress=False)
            elif name == "nan":
                cache[name] = blame(plant(cleans[ARCH], nan_in_attention(1)), references[ARCH], progress=False)
            else:
                arch, faults, _ = SCENARIOS[name]
                cache[name] = blame(plant(cleans[arch], *faults), references[arch], progress=False)
        return cache[name]

    return get


def test_store_holds_every_kind_as_rows_per_layer(cleans, references):
    clean, reference = cleans[ARCH], references[ARCH]
    components = reference.metadata["components"]
    assert len(components) == LAYERS * len(KINDS) + 1
    assert components.pop("model.embed_tokens") == {"kind": "embedding", "layer": None}  # the first layer's input
    with torch.no_grad():
        embedded = clean.model.embed_tokens(torch.tensor(prompts()[0] + reference.tokens(0)[:-1]))
    torch.testing.assert_close(reference.store.rows(0, "model.embed_tokens"), embedded)
    hidden, experts_ = clean.config.hidden_size, clean.config.num_experts
    for name, info in components.items():
        assert info["kind"] in KINDS and 0 <= info["layer"] < LAYERS
        rows = reference.store.rows(0, name)
        assert rows.shape == (len(prompts()[0]) + NEW - 1, experts_ if info["kind"] in ("router", "routing") else hidden), name
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
        assert (found[0].kind, found[0].layer) == ("embedding", None), arch  # before the layers: it feeds layer 0
        assert {c.layer for c in found[1:]} == set(range(model.config.num_hidden_layers)), arch
    from fxreplace.engines.vllm.sites import MODEL_CODE  # vLLM's package registers the families' sites in its code

    assert get_family(ARCH).components_for(MODEL_CODE)["layer"].adapter == "residual_stream_pair"


@pytest.mark.parametrize("name", ["attention", "router", "experts", "dense-attention", "dense-mlp"])
def test_single_fault_is_ranked_first(blamed, name):
    result = blamed(name)
    (component, kind, layer), = SCENARIOS[name][2]
    top = result.ranking[0]
    assert (top.component, top.kind, top.layer) == (component, kind, layer), result.table()
    assert result.confident and not result.diffuse and result.origin_layer == layer and result.guilty is top
    assert [(o.component, o.kind, o.layer) for o in result.origins] == [(component, kind, layer)]
    assert top.explained >= EXPLAINS and top.kl_on < 1e-3 * top.kl_off and top.kl_off > 1e-3 and top.origin
    assert result.verdict.startswith("1 source: ") and component in result.verdict
    # the ranking lists components only; the layers' streams are the per-layer shares
    assert all(b.kind != LAYER for b in result.ranking)
    shares = {s.layer: s.share for s in result.layer_shares}
    assert shares[layer] > 0.9 and all(abs(v) < 0.1 for k, v in shares.items() if k != layer)
    # one round localises 4 layers (off beside 4 streams), one more tries the origin layer's kinds
    kinds = len(result.kinds)
    assert result.rounds == 2 and len(result.passes) == 1 + LAYERS + kinds < 1 + LAYERS * (kinds + 1)


@pytest.mark.parametrize("name", ["embedding", "dense-embedding", "dense-attention-0"])
def test_the_first_layers_part_goes_to_the_earliest_component_explaining_it(blamed, name):
    """An embedding row's error reaches every later position through layer 0's attention, whose
    replacement alone removes >= 90% of it too: the embedding, the layer's input, is named (searched
    with the layer's kinds, before them); a fault in that attention stays the attention's."""
    result = blamed(name)
    (component, kind, layer), = SCENARIOS[name][2]
    assert [(o.component, o.kind, o.layer) for o in result.origins] == [(component, kind, layer)], result.verdict
    assert result.confident and result.ranking[0].component == component and result.explained >= EXPLAINS
    alone = {b.component: b.explained for b in result.ranking if not b.with_replaced}
    if kind == "embedding":
        assert alone["model.layers.0.self_attn"] >= EXPLAINS, alone  # layer 0's kinds alone would name the attention
        assert result.verdict.startswith(f"1 source: embedding {component}, the input of layer 0 ("), result.verdict
    else:
        assert alone["model.embed_tokens"] < SIGNIFICANT, alone
    assert result.rounds == 2  # the embedding is tried in the attribution's round, beside the layer's kinds


def test_a_component_after_the_layers_feeds_no_layer(cleans, references):
    """A declared final norm follows the layers (model order), whatever the declaration's order: replacing
    it would remove every upstream error, so taken for a feeder of layer 0 it would be named there."""
    components = {"final_norm": Target("model.norm"), **get_family(DENSE).components}
    found = resolve_components(cleans[DENSE], components)
    assert (found[0].module_name, found[-1].module_name) == ("model.embed_tokens", "model.norm")
    result = blame(plant(cleans[DENSE], attention(0)), references[DENSE], clean=cleans[DENSE], components=components,
                   progress=False)
    assert [(o.component, o.layer) for o in result.origins] == [("model.layers.0.self_attn", 0)], result.verdict


def test_a_slow_round_still_prints_progress_lines(cleans, references, monkeypatch, capsys):
    """A person watching a long search sees a line every HEARTBEAT_S while a round runs."""
    import fxreplace.validation

    monkeypatch.setattr(fxreplace.validation, "HEARTBEAT_S", 0.01)
    model = plant(cleans[DENSE], mlp(1))
    # every forward outlasts a heartbeat: on a fast machine a round of this tiny model can finish first
    model.register_forward_pre_hook(lambda module, args: time.sleep(0.05))
    blame(model, references[DENSE], prompts=[0], progress=True)
    out = capsys.readouterr().out
    assert "engine busy for 0 s (blame round 1: " in out and "engine busy for 0 s (blame round 2: " in out, out


@pytest.mark.parametrize("name", ["two", "dense-two"])
def test_two_independent_faults_are_both_named_first(blamed, name):
    result = blamed(name)
    expected = SCENARIOS[name][2]  # in layer order; the origins come by share, the largest first
    assert sorted((o.component, o.kind, o.layer) for o in result.origins) == sorted(expected), result.table()
    assert [o.share for o in result.origins] == sorted((o.share for o in result.origins), reverse=True)
    named = [(o.component, o.kind, o.layer) for o in result.origins]
    assert [(b.component, b.kind, b.layer) for b in result.ranking[:2]] == named
    assert all(b.origin for b in result.ranking[:2]) and not any(b.origin for b in result.ranking[2:])
    assert result.confident and not result.diffuse and result.explained >= EXPLAINS
    assert result.verdict.startswith("2 independent sources: ")
    assert all(f"layer {layer} {kind} {component}" in result.verdict for component, kind, layer in expected)
    assert all(o.share >= 0.1 for o in result.origins) and sum(o.share for o in result.origins) >= EXPLAINS
    # the origin found second (downstream) was measured with the first (upstream) replaced beside it
    second = next(b for b in result.ranking if b.component == expected[1][0])
    assert second.with_replaced == [expected[0][0]]
    assert result.rounds <= 4 and len(result.passes) < 1 + LAYERS * (len(result.kinds) + 1)


def test_nan_is_located_at_its_first_component(blamed):
    result = blamed("nan")
    where = result.nonfinite
    assert (where.component, where.kind, where.layer) == ("model.layers.1.self_attn", "attention", 1), result.verdict
    assert (where.prompt, where.position, where.step) == (0, 0, None)
    assert result.verdict.startswith("non-finite values (NaN/inf) first appear in model.layers.1.self_attn")
    assert not result.diffuse and not result.confident and result.rounds == 2  # the first round, then one observing pass


def test_bf16_drift_is_reported_as_diffuse(blamed):
    result = blamed("bf16")
    assert result.diffuse and not result.confident and result.guilty is None
    assert result.verdict.startswith("diffuse drift"), result.verdict
    components = {(k, n) for k in KINDS if k != LAYER for n in range(LAYERS)} | {("embedding", None)}
    assert {(b.kind, b.layer) for b in result.ranking} == components  # the heat map: every component measured
    assert [s.layer for s in result.layer_shares] == list(range(LAYERS))


def prompt_set(seed, n=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (int(length),), generator=g).tolist() for length in torch.randint(6, 16, (n,), generator=g)]


@pytest.mark.parametrize("model_seed, prompt_seed", [(0, 0), (3, 3)])
def test_bf16_drift_is_diffuse_for_other_weights_and_prompts(model_seed, prompt_seed):
    """Precision drift leaves a substantial part in the layers holding no origin, whichever
    layer holds the largest part (here layer 0: 72%); a planted fault leaves them at ~0. Without a
    noise floor, the strongest component beside it is a candidate the verdict names, never an origin."""
    clean = tiny_model(ARCH, num_hidden_layers=LAYERS, seed=model_seed)
    g = torch.Generator().manual_seed(prompt_seed)
    texts = [torch.randint(0, 128, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist() for _ in range(2)]
    reference = capture_reference(clean, texts, [], 2 * NEW, components=get_family(ARCH).components, progress=False)
    result = blame(clean, reference, dtype=torch.bfloat16, progress=False)
    assert result.diffuse and not result.confident and result.verdict.startswith("diffuse drift"), result.verdict
    assert not result.origins and ("as precision drift does" in result.verdict or "without a noise floor" in result.verdict
                                   or f"more than {MAX_ORIGINS} places" in result.verdict), result.verdict
    assert all(o.component in result.verdict for o in result.candidates)
    assert max(s.share for s in result.layer_shares) > 0.5  # one layer holds most, yet no component is the fix


def test_a_fault_masked_by_a_later_one_is_found(cleans):
    """bench_blame's two faults at L=4: after layer 3's flipped router, layer 1's attention adds 2%
    of the divergence (below SIGNIFICANT), so layer 3's part holds it too; the router explains
    layer 3's part above the stream below, and the search then finds the attention upstream."""
    clean = cleans[ARCH]
    reference = capture_reference(clean, prompt_set(0), [], NEW, components=get_family(ARCH).components,
                                  progress=False)
    result = blame(plant(clean, attention(1), router(3)), reference, progress=False)
    shares = {s.layer: s.share for s in result.layer_shares}
    assert shares[1] < SIGNIFICANT and shares[3] > EXPLAINS, result.table()  # masked: layer 1 looks clean alone
    assert sorted((o.component, o.kind, o.layer) for o in result.origins) == [
        ("model.layers.1.self_attn", "attention", 1), ("model.layers.3.mlp.gate", "router", 3)]
    assert [b.component for b in result.ranking[:2]] == [o.component for o in result.origins]  # by share
    assert result.confident and not result.diffuse and result.explained >= EXPLAINS
    assert result.verdict.startswith("2 independent sources: layer ")


def test_blame_json_table_and_heat_map(blamed, tmp_path):
    result = blamed("two")
    html = result.write_report(tmp_path)
    data = json.loads((tmp_path / "blame.json").read_text())
    assert data["passes"] == len(result.passes) and data["rounds"] == result.rounds
    assert [o["component"] for o in data["origins"]] == [o.component for o in result.origins]
    assert sorted(o["component"] for o in data["origins"]) == ["model.layers.0.self_attn", "model.layers.3.mlp.gate"]
    row = data["ranking"][0]
    assert {"component", "kind", "layer", "kl_off", "kl_on", "top5_off", "top5_on", "top1_off", "top1_on",
            "explained_kl", "explained_top5", "explained", "share", "with_replaced", "origin"} <= set(row)
    assert {"layer", "explained", "share"} <= set(data["layer_shares"][0]) and data["budget"] >= data["passes"]
    assert (tmp_path / "blame_heatmap.png").stat().st_size > 1000
    page = html.read_text()
    assert "blame_heatmap.png" in page and "model.layers.3.mlp.gate" in page and "arising there" in page
    table = result.table()
    assert "top-5 off" in table and "explained: the part of the divergence" in table and "Order: the origins first" in table
    assert f"{len(result.passes)} validation passes in {result.rounds} rounds" in table


def test_checks_before_the_first_pass(cleans, references):
    target = plant(cleans[ARCH], router(2))
    mixtral = tiny_model("MixtralForCausalLM", num_hidden_layers=2)
    other = capture_reference(mixtral, prompts(1), [], 2, components=get_family("MixtralForCausalLM").components,
                              progress=False)
    with pytest.raises(BlameError, match="captured from MixtralForCausalLM .* the target \\(Qwen3MoeForCausalLM\\)"):
        blame(target, other, progress=False)
    with pytest.raises(BlameError, match="no prompts to validate"):
        blame(target, references[ARCH], prompts=[], progress=False)
    with pytest.raises(BlameError, match="prompts \\[5\\] are not in the reference"):
        blame(target, references[ARCH], prompts=[5], progress=False)
    wide = tiny_model(ARCH, num_hidden_layers=LAYERS, vocab_size=160)
    with pytest.raises(BlameError, match="vocab size 128 but the target .* has 160"):
        blame(wide, references[ARCH], progress=False)


@pytest.fixture(scope="module")
def routers_only(cleans, tmp_path_factory):
    """The README's capture: the family's targets (routers), no components."""
    directory = tmp_path_factory.mktemp("routers_only") / "reference"
    capture_reference(cleans[ARCH], prompts(), get_family(ARCH).targets, NEW, progress=False).save(directory)
    return directory


def test_reference_without_components_is_refused(cleans, routers_only, tmp_path, capsys):
    target = plant(cleans[ARCH], router(2))
    with pytest.raises(BlameError, match="lacks 17 of the 21 components .*kinds attention, embedding, experts, layer, routing.*"
                                         "`fxreplace capture .* --components"):
        blame(target, routers_only, progress=False)
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(SystemExit, match="error: the reference lacks .*--clean"):
        cli(["blame", str(tmp_path / "target"), "--reference", str(routers_only), "--dtype", "float32",
             "--report-dir", str(tmp_path / "out")])


def test_clean_captures_on_demand_and_reuses(cleans, references, routers_only, blamed):
    target = plant(cleans[ARCH], router(2))
    result = blame(target, routers_only, clean=cleans[ARCH], progress=False)
    full = blamed("router")
    assert result.verdict == full.verdict and result.ranking[0].component == full.ranking[0].component
    # the same rows and shares (routing and experts both explain all of a router fault: their order is rounding's)
    shares = lambda r: {b.component: b.share for b in r.ranking}
    assert shares(result).keys() == shares(full).keys()
    assert all(abs(shares(result)[c] - shares(full)[c]) < 1e-6 for c in shares(full)), (result.table(), full.table())
    # the streams the localisation probes (log_5 L rounds of PROBES) plus the origin layer's kinds (its router
    # is in the reference already), of 20
    kinds = len(result.kinds)
    assert len(result.captured) == LAYERS + kinds - 1 <= PROBES * math.ceil(math.log(LAYERS, PROBES + 1)) + kinds
    assert set(result.captured) == {f"model.layers.{k}" for k in range(LAYERS)} | {
        "model.layers.2.self_attn", "model.layers.2.mlp.experts", "model.layers.2.mlp"}  # the router: in the reference
    # appended under the reference as stores of their own, read back next time instead of captured
    comps = resolve_components(cleans[ARCH], get_family(ARCH).components)
    again = OnDemand(cleans[ARCH], load_reference(routers_only), comps, routers_only)
    assert all(again.present(n) for n in result.captured) and not again.ensure(result.captured)
    for name in result.captured:
        torch.testing.assert_close(again.rows(name, 1), references[ARCH].store.rows(1, name))


def test_on_demand_capture_stores_only_the_requested_components(cleans, references, routers_only, tmp_path):
    """One component asked: one teacher-forced capture of it alone, appended on disk as a part holding
    only it, its rows those of the full capture; the engine's store holds what is present, no blanks."""
    import shutil

    directory = tmp_path / "ref"
    shutil.copytree(routers_only, directory, ignore=shutil.ignore_patterns("blame-components"))  # none captured yet
    clean = cleans[ARCH]
    comps = resolve_components(clean, get_family(ARCH).components)
    loads = []
    on_demand = OnDemand(lambda: loads.append(1) or clean, load_reference(directory), comps, directory)
    assert on_demand.store() is on_demand.reference.store and not loads, "nothing captured: the reference itself"
    asked = "model.layers.1.self_attn"
    ran = []
    hooks = [layer.register_forward_hook(lambda *_, k=k: ran.append(k)) for k, layer in enumerate(clean.model.layers)]
    hooks.append(clean.lm_head.register_forward_hook(lambda *_: ran.append("lm_head")))
    try:
        assert on_demand.ensure({asked, "model.layers.0.mlp.gate"}) and loads == [1]  # the router is there already
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == [0], "the forward ends at layer 1's router (held by the reference, checked): no later layer runs"
    parts = sorted((directory / "blame-components").iterdir())
    assert len(parts) == 1 and ReferenceStore.load(parts[0]).capture_names == [asked]
    for p in range(on_demand.reference.num_prompts):
        torch.testing.assert_close(on_demand.rows(asked, p), references[ARCH].store.rows(p, asked))
    store = on_demand.store()
    assert sorted(store.capture_names) == sorted(on_demand.reference.store.capture_names + [asked])
    assert not hasattr(clean, "_fxreplace"), "the clean model is restored after its capture"
    other = copy.deepcopy(clean)
    with torch.no_grad():
        other.model.layers[0].self_attn.o_proj.weight.mul_(3.0)
    refused = OnDemand(other, load_reference(directory), comps, directory)
    with pytest.raises(ValueError, match="model.layers.2.mlp.gate differs from the reference.s for prompt 0 .*"
                                         "not the model the reference was captured from"):
        refused.ensure({"model.layers.2.self_attn"})  # its router, computed next, is the witness
    with pytest.raises(ValueError, match="does not reproduce the reference.s tokens for prompt"):
        refused.ensure({f"model.layers.{LAYERS - 1}.mlp"})  # nothing the reference holds after it: the whole forward
    assert len(list((directory / "blame-components").iterdir())) == 1, "a refused capture leaves no part"


def test_captured_parts_join_the_reference_where_they_lie(cleans, references, blamed, tmp_path):
    """Each part is laid out like the reference (here a shard per prompt), so the engine's store joins
    them with no row copied: its rows are the full capture's, its group tensors the reference's and the
    parts' memory-mapped ones; in memory alike. The verdict is the full reference's. A repack keeps the
    parts aligned; a part laid out otherwise (written before they were) is refused, saying what to do."""
    from fxreplace.store import StoreWriter, repack_store

    clean = cleans[ARCH]
    directory = tmp_path / "ref"
    capture_reference(clean, prompts(), get_family(ARCH).targets, NEW, out=directory, shard_bytes=1, progress=False)
    result = blame(plant(clean, attention(1)), directory, clean=clean, progress=False)
    full = blamed("attention")
    assert [(o.kind, o.layer) for o in result.origins] == [(o.kind, o.layer) for o in full.origins] == [("attention", 1)]
    # the same rows and shares; rows whose shares tie to ~1e-7 (a layer's router and experts here) may swap
    # places, as the parts were captured in forwards of their own
    assert result.ranking[0].component == full.ranking[0].component
    assert ({b.component: b.share for b in result.ranking}
            == pytest.approx({b.component: b.share for b in full.ranking}, abs=1e-5))
    comps = resolve_components(clean, get_family(ARCH).components)
    on_disk = OnDemand(clean, load_reference(directory), comps, directory)
    in_memory = OnDemand(clean, load_reference(directory), comps, None)
    for name in result.captured[:2]:
        assert in_memory.ensure({name})
    for on_demand in (on_disk, in_memory):
        reference, parts, store = on_demand.reference.store, on_demand.parts, on_demand.store()
        assert len(reference.shards) == 2 and len(parts) >= 2
        assert all(part.layout_difference(reference) is None and len(part.shards) == 2 for part in parts)
        for name in store.capture_names:
            for p in range(reference.num_prompts):
                torch.testing.assert_close(store.rows(p, name), references[ARCH].store.rows(p, name))
        held = [t for s in range(2) for source in (reference, *parts) for t in source.shards[s].packed]
        joined = [t for shard in store.shards for t in shard.packed]
        assert [t.untyped_storage().data_ptr() for t in joined] == [t.untyped_storage().data_ptr() for t in held]
    assert all(part.shards[0].path is not None for part in on_disk.parts), "memory-mapped from blame-components/"

    packed = tmp_path / "packed"
    repack_store(directory, packed)  # the reference's two shards become one; so do its parts'
    again = OnDemand(clean, load_reference(packed), comps, packed)
    assert len(again.reference.store.shards) == 1 and set(result.captured) <= set(again.store().capture_names)
    assert not again.ensure(result.captured)

    first = directory / "blame-components" / "00000"
    old = ReferenceStore.load(first)
    shutil.rmtree(first)
    with StoreWriter(first, metadata=old.metadata) as writer:  # one shard: as parts were written before
        for p in range(old.num_prompts):
            writer.add(old.prompt_token_ids[p], {n: old.rows(p, n) for n in old.capture_names}, prompt_idx=p)
    with pytest.raises(BlameError, match=f"{first} holds components captured for this reference but laid out otherwise "
                                         r"\(it has 1 shards, not 2\); hint: delete .*blame-components: blame captures"):
        OnDemand(clean, load_reference(directory), comps, directory)


def test_the_deciding_round_carries_the_origin_layers_kinds():
    """At 16 layers the first round narrows an attention fault in layer 9 to layers 8-9; the round
    deciding between them also replaces their kinds (they fit beside its stream), so the search
    needs no third round. At 32 layers the first round leaves four layers (16-19): their three
    streams and sixteen kinds still fit one batch of the runner, so two rounds again."""
    for layers, fault, left in ((16, 9, 2), (32, 19, 4)):
        clean = tiny_model(ARCH, num_hidden_layers=layers)
        reference = capture_reference(clean, prompts(), get_family(ARCH).targets, NEW, progress=False)  # routers only
        result = blame(plant(clean, attention(fault)), reference, clean=clean, progress=False)
        assert [(o.kind, o.layer) for o in result.origins] == [("attention", fault)] and result.confident, result.verdict
        per_round = Counter(p.round for p in result.passes)
        assert result.rounds == 2 and max(per_round.values()) * len(prompts()) <= MAX_BATCH, per_round
        kinds = len(result.kinds)
        assert per_round[1] == PROBES + 1 and per_round[2] == left - 1 + left * kinds, per_round


def test_a_second_origin_is_bracketed_by_the_streams_already_measured():
    """Two faults at 16 layers (attention in layer 4, router in layer 12): after the first origin, the
    first round's streams past it (the origin replaced beside them is the stream alone) already place
    the second between layers 11 and 13, so its deciding round (carrying its kinds) is the third and last."""
    clean = tiny_model(ARCH, num_hidden_layers=16)
    reference = capture_reference(clean, prompts(), get_family(ARCH).targets, NEW, progress=False)
    result = blame(plant(clean, attention(4), router(12)), reference, clean=clean, progress=False)
    assert sorted((o.kind, o.layer) for o in result.origins) == [("attention", 4), ("router", 12)], result.verdict
    assert result.confident and result.rounds == 3, Counter(p.round for p in result.passes)


def test_cli_blame_with_explicit_components(cleans, tmp_path, capsys):
    """A family-less workflow: components given as KIND=PATTERN[@POINT]."""
    clean = cleans[ARCH]
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean.save_pretrained(clean_dir)
    plant(clean, attention(1)).save_pretrained(faulty_dir)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()))
    components = ["--component", "attention=model.layers.*.self_attn@output[0]", "--component", "layer=model.layers.*@output"]
    assert cli(["capture", str(clean_dir), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", str(NEW),
                "--out", str(tmp_path / "ref"), *components]) == 0
    assert cli(["blame", str(faulty_dir), "--reference", str(tmp_path / "ref"), "--dtype", "float32",
                "--report-dir", str(tmp_path / "out"), *components]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "blame.json").read_text())
    assert data["ranking"][0]["component"] == "model.layers.1.self_attn" and data["confident"]
    assert "1 source: layer 1 attention model.layers.1.self_attn" in out and "explained: the part" in out
    assert data["passes"] == 1 + LAYERS + 1 and data["rounds"] == 2  # off beside 4 streams, then the attention


def test_selection_keeps_one_compiled_graph(cleans, references):
    """Replacing different sets of components, per call or per request, reuses the same graphs."""
    from fxreplace.instrument import instrument
    from fxreplace.replacer import TensorReplacer
    from fxreplace.engines.embedded.runner import Runner, RunnerConfig

    clean, reference = cleans[ARCH], references[ARCH]
    model = instrument(copy.deepcopy(clean), [c.target for c in resolve_components(clean, get_family(ARCH).components)])
    runner = Runner(model, clean.config, TensorReplacer(reference.store),
                    RunnerConfig(prefill_buckets=(16,), batch_buckets=(4,), max_len=32), compile="eager")
    faulty = ("model.layers.2.mlp.gate", "model.layers.0.self_attn")
    ids = reference.store.prompt_token_ids
    outputs = {}
    for selection in [(), ("model.layers.1",), faulty, ()]:
        outputs[selection] = runner.generate(ids, 2, replace=selection)
    # the same two selections side by side, as copies of the prompts in one call
    both = runner.generate(list(ids) * 2, 2, replace=PerRequest([()] * len(ids) + [faulty] * len(ids)))
    assert runner.graphs_compiled == 2  # the prefill bucket and the decode bucket, whatever is replaced
    for got, want in zip(both, outputs[()] + outputs[faulty]):
        assert got.tokens == want.tokens
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits))
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


def test_blame_runs_the_target_itself_when_its_dtype_matches_and_restores_it(cleans, references):
    """No copy of the weights when the dtype already matches: the search's forwards are the
    target's own modules (a deep copy would run copies of them, hooks included)."""
    target = plant(cleans[ARCH], router(2))
    ran = []
    hook = target.model.embed_tokens.register_forward_hook(lambda mod, args, out: ran.append(mod))
    try:
        result = blame(target, references[ARCH], dtype=torch.float32, progress=False)
    finally:
        hook.remove()
    assert ran and all(mod is target.model.embed_tokens for mod in ran) and result.passes
    assert type(target).__name__ == ARCH and not hasattr(target, "_fxreplace")
    assert "forward" not in target.get_submodule("model.layers.2.mlp.gate").__dict__
    ran.clear()
    hook = target.model.embed_tokens.register_forward_hook(lambda mod, args, out: ran.append(mod))
    try:
        blame(target, references[ARCH], dtype=torch.bfloat16, progress=False)
    finally:
        hook.remove()
    assert ran and not any(mod is target.model.embed_tokens for mod in ran), "another dtype: a converted copy runs"
    assert next(target.parameters()).dtype == torch.float32
