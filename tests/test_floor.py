"""The precision noise floor and what it does to the verdicts, on tiny float32 models of three
families: Qwen3-MoE and Llama (registered) and OLMoE (not registered by fxreplace: its
components are given). The oracle is independent of blame's search and of fxreplace's
runner: a plain full-sequence HF forward over the reference's tokens, whose KL against the
reference says how much of a faulty bf16 model's divergence its fault causes (the same
weights without the fault, in bf16, diverge by the rest)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, OlmoeConfig

from fxreplace.blame import BlameError, blame
from fxreplace.capture import capture_reference
from fxreplace.cli import main as cli
from fxreplace.engines.protocol import Engine, Generation
from fxreplace.floor import FLOOR_MARGIN, NoiseFloor, engine_floor, measure_floor
from fxreplace.metrics import WORSE, verdict
from fxreplace.models import get_family, tiny_model
from fxreplace.targets import Target

LAYERS, NEW = 4, 8
OLMOE_COMPONENTS = {"attention": Target("model.layers.*.self_attn", point="output[0]"),
                    "router": Target("model.layers.*.mlp.gate"),
                    "experts": Target("model.layers.*.mlp", point="output"),
                    "layer": Target("model.layers.*", point="output")}


def olmoe():
    """An OLMoE, a family fxreplace does not register."""
    config = OlmoeConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                         initializer_range=0.2, max_position_embeddings=256, eos_token_id=None, pad_token_id=None,
                         bos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


FAMILIES = {
    "qwen3-moe": (lambda: tiny_model("Qwen3MoeForCausalLM", num_hidden_layers=LAYERS),
                  get_family("Qwen3MoeForCausalLM").components, "experts"),
    "llama": (lambda: tiny_model("LlamaForCausalLM", num_hidden_layers=LAYERS),
              get_family("LlamaForCausalLM").components, "mlp"),
    "olmoe (unregistered)": (olmoe, OLMOE_COMPONENTS, "experts"),
}


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (int(n),), generator=g).tolist() for n in torch.randint(6, 16, (4,), generator=g)]


@pytest.fixture(scope="module")
def setups():
    """Per family: the clean model, its reference (every component) and its bf16 floor, built once."""
    cache = {}

    def get(name):
        if name not in cache:
            build, components, block = FAMILIES[name]
            clean = build()
            reference = capture_reference(clean, prompts(), [], NEW, components=components, progress=False)
            cache[name] = clean, components, block, reference, measure_floor(clean, reference, torch.bfloat16)
        return cache[name]

    return get


def oracle_kl(model, reference, dtype) -> float:
    """Mean KL(reference || model in ``dtype``) over every generated step, from one plain forward
    of each prompt and its reference tokens (no runner, no cache, no replacement)."""
    model = copy.deepcopy(model).to(dtype)
    kls = []
    with torch.no_grad():
        for p in range(reference.num_prompts):
            prompt = reference.prompt_tokens(p)
            logits = model(input_ids=torch.tensor([prompt + reference.tokens(p)[:-1]])).logits[0, len(prompt) - 1:]
            ref, tgt = torch.log_softmax(reference.logits(p).double(), -1), torch.log_softmax(logits.double(), -1)
            kls.append((ref.exp() * (ref - tgt)).sum(-1))
    return torch.cat(kls).mean().item()


def scaled_attention(model, layer, factor):
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.layers[layer].self_attn.o_proj.weight.mul_(factor)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_the_floor_is_the_reference_model_in_bf16(setups, family):
    clean, _, _, reference, floor = setups(family)
    whole = floor.aggregate(range(reference.num_prompts))
    # the oracle's bf16 divergence, measured without fxreplace's runner, is the floor's
    assert whole["mean_kl"] == pytest.approx(oracle_kl(clean, reference, torch.bfloat16), rel=0.3)
    assert whole["mean_kl"] > 1e-5 and floor.dtype == "bfloat16" and floor.covers(range(reference.num_prompts))
    assert NoiseFloor.from_dict(json.loads(json.dumps(floor.to_dict()))) == floor  # stored as JSON in the reference


class Recompute(Engine):
    """Another engine than the embedded one: each step the whole sequence again, no cache, no batch."""

    def __init__(self, model, dtype):
        self.model, self.dtype, self.vocab_size = copy.deepcopy(model).to(dtype), dtype, model.config.vocab_size

    def generate(self, prompts, max_new_tokens, replace):
        assert replace is False, "a floor replaces nothing"
        done = []
        for i, prompt in enumerate(prompts):
            out = Generation(str(i), list(prompt))
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    logits = self.model(input_ids=torch.tensor([list(prompt) + out.tokens])).logits[0, -1].float()
                    out.logits.append(logits)
                    out.tokens.append(int(logits.argmax()))
            done.append(out)
        return done


def test_any_engine_running_the_reference_model_measures_its_floor(setups):
    """The floor is an engine's: the reference model in the target's dtype, nothing replaced. Another
    engine over the same model and dtype measures what the embedded one does (up to its rounding)."""
    clean, _, _, reference, floor = setups("qwen3-moe")
    other = engine_floor(Recompute(clean, torch.bfloat16), reference, torch.bfloat16, program="recomputed")
    ours, theirs = floor.aggregate(range(reference.num_prompts)), other.aggregate(range(reference.num_prompts))
    assert other.dtype == "bfloat16" and other.program == "recomputed" and other.covers(range(reference.num_prompts))
    assert theirs["mean_kl"] == pytest.approx(ours["mean_kl"], rel=0.3) and theirs["mean_kl"] > 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_pure_bf16_drift_is_within_the_floor(setups, family):
    clean, components, _, reference, floor = setups(family)
    result = blame(clean, reference, components=components, dtype=torch.bfloat16, floor=floor, progress=False)
    assert result.verdict.startswith("within precision noise: the target is "), result.verdict
    assert result.diffuse and not result.confident and not result.origins and result.floor["within"]
    assert all(0.5 <= m <= FLOOR_MARGIN for m in result.floor["multiples"].values()), result.floor
    assert result.rounds == 1  # the first round says it: nothing to search beyond the precision


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fault_on_bf16_drift_is_the_first_origin_well_above_the_floor(setups, family):
    clean, components, _, reference, floor = setups(family)
    target = scaled_attention(clean, 2, 1.2)
    # the oracle: the same weights without the fault diverge by the floor; the fault causes the rest
    fault_part = 1 - oracle_kl(clean, reference, torch.bfloat16) / oracle_kl(target, reference, torch.bfloat16)
    assert 0.5 < fault_part < 0.99
    result = blame(target, reference, components=components, dtype=torch.bfloat16, floor=floor, progress=False)
    first = result.origins[0]
    assert (first.component, first.kind, first.layer) == ("model.layers.2.self_attn", "attention", 2), result.verdict
    assert result.floor["multiples"]["kl"] > 4 and not result.floor["within"]
    assert first.share >= 0.5 and first.share / result.floor["noise_share"] > 1.5  # its part, in floors
    assert result.verdict.startswith("beyond precision noise: ") and "1 source above the precision floor: layer 2 " \
        "attention" in result.verdict and "precision noise at the floor: " in result.verdict
    assert result.confident and not result.diffuse


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fault_on_substantial_drift_is_named_alone_with_a_floor_or_without(setups, family):
    """A fault about the size of the precision drift beside it (the target 1.4x-10x its floor: within it
    for Llama): given the clean model, blame names the faulty component alone, with its share, its
    multiple of the floor and what it removes beyond the drift arising there, where the floor alone
    ("within precision noise") would hide it; without a floor, it names no drift as an origin, the
    precision's own parts (a layer no kind explains, a kind beside the fault) stay unnamed."""
    clean, components, _, reference, _ = setups(family)
    target = scaled_attention(clean, 2, 1.06)
    fault_part = 1 - oracle_kl(clean, reference, torch.bfloat16) / oracle_kl(target, reference, torch.bfloat16)
    assert 0.25 < fault_part < 0.95
    floored = blame(target, reference, components=components, dtype=torch.bfloat16, clean=clean, progress=False)
    assert [(o.component, o.layer) for o in floored.origins] == [("model.layers.2.self_attn", 2)], floored.verdict
    first = floored.origins[0]
    assert first.share >= 0.25 and f"{first.share / floored.floor['noise_share']:.2g}x the floor" in floored.verdict
    if first.share < floored.floor["noise_share"]:  # less than the floor's whole part: told by the drift arising there
        assert first.drift is not None and first.share - first.drift >= 0.1
        assert "beyond the precision drift arising there" in floored.verdict
    if floored.floor["within"]:  # within the noise as a whole, yet the fault is named
        assert floored.verdict.startswith("within precision noise: ") and first.drift is not None and \
            "1 source standing out from the precision drift arising in it: layer 2 attention" in floored.verdict, floored.verdict
    bare = blame(target, reference, components=components, dtype=torch.bfloat16, progress=False)
    named = [(o.component, o.layer) for o in bare.origins + bare.candidates]
    assert set(named) <= {("model.layers.2.self_attn", 2)}, bare.verdict
    assert all(o.component for o in bare.origins) and "no scale" in bare.verdict


@pytest.mark.parametrize("family", FAMILIES)
def test_two_faults_in_one_layer_are_both_named(setups, family):
    clean, components, block, reference, _ = setups(family)
    target = scaled_attention(clean, 1, 1.5)
    with torch.no_grad():
        target.model.layers[1].mlp.gate.weight.mul_(-1.0) if block == "experts" else \
            target.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    result = blame(target, reference, components=components, progress=False)
    named = {(o.kind, o.layer) for o in result.origins}
    guilty_block = ("router" if block == "experts" else "mlp", 1)
    assert {("attention", 1), guilty_block} <= named, result.verdict
    assert "look at the norms" not in result.verdict and result.confident
    assert all(o.share >= 0.1 for o in result.origins)


def test_a_bf16_reference_is_refused_unless_allowed(setups, tmp_path, capsys):
    clean, components, _, _, _ = setups("qwen3-moe")
    low = capture_reference(copy.deepcopy(clean).to(torch.bfloat16), prompts(), [], NEW, components=components,
                            progress=False)
    with pytest.raises(BlameError, match="captured in bfloat16, below float32"):
        blame(clean, low, progress=False)
    allowed = blame(clean, low, dtype=torch.bfloat16, allow_low_precision_reference=True, progress=False)
    assert allowed.verdict.startswith("caution: the reference is bfloat16")
    low.save(tmp_path / "ref")
    with pytest.raises(SystemExit) as exit_:
        cli(["validate", "builtin:Qwen3MoeForCausalLM", "--reference", str(tmp_path / "ref"), "--report-dir",
             str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: the reference was captured in bfloat16")
    assert "hint: " in err[0] and "--allow-low-precision-reference" in err[0]


def test_replacement_that_makes_it_worse_is_stated():
    def summary(kl, top5, diverged):
        return {"mean_kl": kl, "mean_top5_error": top5, "top1_agreement": 1 - diverged / 8, "prompts_diverged": diverged,
                "status_counts": {"diverged": diverged}, "prompts": {}}

    worse = verdict({"off": summary(0.001, 0.02, 0), "on": summary(0.2, 0.9, 2)}, "the router logits")
    assert worse.outcome == WORSE and "makes the target worse" in worse.sentence and "did not diverge" not in worse.sentence
    grew = verdict({"off": summary(0.01, 0.1, 2), "on": summary(0.2, 0.9, 4)}, "the router logits")
    assert grew.outcome == WORSE and "mean KL 0.01 -> 0.2" in grew.sentence


def test_cli_captures_the_floor_and_gates_on_it(setups, tmp_path, capsys):
    """capture --noise-floor stores the floor; validate scores the target against it, --fail-on
    floor=K gates on it, result.json and report.html carry it; a faulty target fails the gate."""
    clean, _, _, _, _ = setups("qwen3-moe")
    clean.save_pretrained(tmp_path / "clean")
    scaled_attention(clean, 2, 1.5).save_pretrained(tmp_path / "faulty")
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()))
    with_floor = ["capture", str(tmp_path / "clean"), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens",
                  str(NEW), "--out", str(tmp_path / "ref"), "--noise-floor", "bfloat16"]
    assert cli(with_floor) == 0
    assert cli(with_floor) == 0  # the same command again: its own floor file is part of the reference it replaces
    assert "noise floor (the model in bfloat16" in capsys.readouterr().out
    assert sorted(json.loads((tmp_path / "ref" / "noise_floors.json").read_text())) == ["bfloat16"]
    common = ["--reference", str(tmp_path / "ref"), "--fail-on", "floor=2"]
    assert cli(["validate", str(tmp_path / "clean"), *common, "--report-dir", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "within precision noise" in out and "gate passed (--fail-on floor=2)" in out
    data = json.loads((tmp_path / "ok" / "result.json").read_text())
    assert data["noise_floor"]["dtype"] == "bfloat16" and data["verdict"]["within_floor"] is True
    # the floor is the target's program: the clean checkpoint, loaded in bf16 as the target is, is its own floor
    # (another program, e.g. the model cast with .bfloat16(), flips other near-ties: see docs/blame.md)
    assert data["verdict"]["floor_multiples"]["kl"] == pytest.approx(1.0, rel=0.05), data["verdict"]
    assert data["program"] == {"engine": "embedded", "compile": False, "dtype": "bfloat16"}
    page = (tmp_path / "ok" / "report.html").read_text()
    assert "id='noise-floor'" in page and "noise floor: the reference in bfloat16" in page
    assert data["gate"] == {"conditions": ["floor=2"], "passed": True, "overall": [], "prompts": {}}
    assert "id='gate' class='passed'" in page
    assert cli(["validate", str(tmp_path / "faulty"), *common, "--report-dir", str(tmp_path / "bad")]) == 1
    out = capsys.readouterr().out
    assert "beyond precision noise" in out and "x the floor > 2x over the" in out
    # one scale: the gate fails where the verdict says beyond the floor, both reports say why, and blame finds
    # the planted fault on that scale (it does not say "nothing to blame")
    bad = json.loads((tmp_path / "bad" / "result.json").read_text())
    assert bad["verdict"]["within_floor"] is False and bad["gate"]["passed"] is False
    multiple = bad["verdict"]["floor_multiples"]["kl"]
    assert multiple > 2 and f"mean KL {multiple:.3g}x the floor" in bad["gate"]["overall"][0]
    assert "id='gate' class='failed'" in (tmp_path / "bad" / "report.html").read_text()
    assert cli(["blame", str(tmp_path / "faulty"), "--reference", str(tmp_path / "ref"), "--from-validation",
                str(tmp_path / "bad"), "--clean", str(tmp_path / "clean")]) == 0
    blamed = json.loads((tmp_path / "bad" / "blame.json").read_text())  # beside the validation's pages
    assert [o["component"] for o in blamed["origins"]] == ["model.layers.2.self_attn"], blamed["verdict"]
    assert "href='blame.html'" in (tmp_path / "bad" / "report.html").read_text()
    out = capsys.readouterr().out
    assert f"next: the first origin alone, for the compiler team: fxreplace repro write {tmp_path / 'faulty'}" in out
    # the next step as printed, without --clean: the reference records the model it came from
    assert cli(["repro", "write", str(tmp_path / "faulty"), "--reference", str(tmp_path / "ref"), "--blame",
                str(tmp_path / "bad" / "blame.json"), "--out", str(tmp_path / "repro")]) == 0
    assert (tmp_path / "repro" / "run.py").is_file()
    # without a floor: the verdict has no scale, and a floor gate is refused before any pass
    capture = ["capture", str(tmp_path / "clean"), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens",
               str(NEW), "--out", str(tmp_path / "bare")]
    assert cli(capture) == 0
    assert cli(["validate", str(tmp_path / "clean"), "--reference", str(tmp_path / "bare"), "--report-dir",
                str(tmp_path / "bare-out")]) == 0
    assert "no scale: " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli(["validate", str(tmp_path / "clean"), "--reference", str(tmp_path / "bare"), "--fail-on", "floor=2",
             "--report-dir", str(tmp_path / "bare-out")])
    assert exit_.value.code == 2 and "--noise-floor bfloat16" in capsys.readouterr().err


def test_an_unregistered_family_end_to_end_through_the_cli(setups, tmp_path, capsys):
    """OLMoE: capture refuses in one line naming the CLI option; the components given to capture
    --component are recorded, and blame reuses them without being told again."""
    clean, _, _, _, _ = setups("olmoe (unregistered)")
    clean.save_pretrained(tmp_path / "clean")
    scaled_attention(clean, 1, 1.5).save_pretrained(tmp_path / "faulty")
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()[:2]))
    capsys.readouterr()  # save_pretrained's progress bars
    capture = ["capture", str(tmp_path / "clean"), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens",
               str(NEW)]
    for extra, option in ((["--out", str(tmp_path / "a")], "--target"),
                          (["--components", "--out", str(tmp_path / "b")], "--component")):
        with pytest.raises(SystemExit) as exit_:
            cli(capture + extra)
        err = [line for line in capsys.readouterr().err.splitlines() if "Loading weights" not in line and line.strip()]
        assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "; hint: " in err[0], err
        assert f"{option} " in err[0].split("; hint: ")[1] and "OlmoeForCausalLM" in err[0]
    given = [arg for kind, target in OLMOE_COMPONENTS.items()
             for arg in ("--component", f"{kind}={target.pattern}@{target.point}")]
    assert cli(capture + ["--out", str(tmp_path / "ref"), *given]) == 0
    capsys.readouterr()
    assert cli(["blame", str(tmp_path / "faulty"), "--reference", str(tmp_path / "ref"), "--dtype", "float32",
                "--report-dir", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "blame.json").read_text())
    assert [(o["kind"], o["layer"]) for o in data["origins"]] == [("attention", 1)] and data["confident"], data["verdict"]
    assert data["kinds"] == ["attention", "router", "experts"]


def test_blame_examines_the_program_validate_ran(tmp_path, capsys):
    """validate --compile records its program; blame --from-validation runs that compiled program
    and says so; a flag contradicting it is refused."""
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()[:2]))
    arch = "builtin:Qwen3MoeForCausalLM"
    assert cli(["capture", arch, "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "4", "--components",
                "--out", str(tmp_path / "ref")]) == 0
    assert cli(["validate", arch, "--reference", str(tmp_path / "ref"), "--compile", "--report-dir",
                str(tmp_path / "val")]) == 0
    assert json.loads((tmp_path / "val" / "result.json").read_text())["program"] == {
        "engine": "embedded", "compile": True, "dtype": "bfloat16"}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli(["blame", arch, "--reference", str(tmp_path / "ref"), "--from-validation", str(tmp_path / "val"),
             "--dtype", "float32"])
    assert exit_.value.code == 2 and "--dtype float32 contradicts the validation" in capsys.readouterr().err
    # as docs/own-model.md runs it: the same --report-dir, no --from-validation
    assert cli(["blame", arch, "--reference", str(tmp_path / "ref"), "--report-dir", str(tmp_path / "val")]) == 0
    out = capsys.readouterr().out
    assert f"blame examines the program validated in {tmp_path / 'val'}" in out
    assert "program examined: engine embedded, compiled (inductor), bfloat16\n" in out
    assert json.loads((tmp_path / "val" / "blame.json").read_text())["program"] == {
        "engine": "embedded", "compile": True, "dtype": "bfloat16"}
    assert "Program examined: engine embedded, compiled (inductor), bfloat16" in (tmp_path / "val" / "blame.html").read_text()


def test_the_cli_says_a_replacement_makes_the_target_worse(setups, tmp_path, capsys):
    """A port that stores its experts in another order (the router's rows permuted with them) computes
    the same function, so without replacement it agrees with the reference; with the reference's router
    logits its tokens go to the wrong experts. validate says the replacement makes it worse, never that
    the target did not diverge; its gate (on the target as it runs) passes; blame finds nothing to blame."""
    clean, _, _, _, _ = setups("qwen3-moe")
    port = copy.deepcopy(clean)
    order = torch.randperm(port.config.num_experts, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer in port.model.layers:
            for weight in (layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                weight.copy_(weight[order])
    clean.save_pretrained(tmp_path / "clean")
    port.save_pretrained(tmp_path / "port")
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()))
    assert cli(["capture", str(tmp_path / "clean"), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens",
                str(NEW), "--out", str(tmp_path / "ref")]) == 0  # the family's router logits
    capsys.readouterr()
    assert cli(["validate", str(tmp_path / "port"), "--reference", str(tmp_path / "ref"), "--dtype", "float32",
                "--fail-on", "diverged", "--report-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    assert data["verdict"]["outcome"] == WORSE and data["summary"]["off"]["prompts_diverged"] == 0, data["verdict"]
    assert data["summary"]["on"]["mean_kl"] > 10 * max(data["summary"]["off"]["mean_kl"], 1e-9)
    assert "makes the target worse: without replacement every step is within" in out and "did not diverge" not in out
    assert cli(["blame", str(tmp_path / "port"), "--reference", str(tmp_path / "ref"), "--dtype", "float32",
                "--clean", str(tmp_path / "clean"), "--report-dir", str(tmp_path / "blame")]) == 0
    assert "does not diverge from the reference" in capsys.readouterr().out


def test_the_readme_gate_scales_a_compiled_target_by_the_compiled_floor(tmp_path, monkeypatch):
    """The README's flow on docs/own-model.md's stand-in checkpoint, each command in a subprocess as a user
    runs it: the compiled target is gated against the reference compiled the same way, so the unmodified
    checkpoint passes and a planted router fault fails; a reference holding only the eager program's floor
    is refused for a compiled gate in one line naming the command that measures the right one."""
    block = re.findall(r"```python\n(.*?)```", (Path(__file__).parents[1] / "docs" / "own-model.md").read_text(), re.S)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/own-model.md", "exec"), {"__name__": "own_model"})  # my-checkpoint, prompts.jsonl
    faulty = AutoModelForCausalLM.from_pretrained(tmp_path / "my-checkpoint")
    with torch.no_grad():
        faulty.model.layers[1].mlp.gate.weight.mul_(3.0)  # a router that routes otherwise: the port's fault
    faulty.save_pretrained(tmp_path / "faulty")

    def fxreplace(*args):
        return subprocess.run([sys.executable, "-m", "fxreplace", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=900)

    done = fxreplace("capture", "my-checkpoint", "--prompts", "prompts.jsonl", "--components", "--noise-floor",
                     "bfloat16", "--compile", "--max-new-tokens", "12", "--out", "ref/")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "noise floor (the model in bfloat16 compiled with inductor" in done.stdout
    floors = json.loads((tmp_path / "ref" / "noise_floors.json").read_text())
    assert sorted(floors) == ["bfloat16", "bfloat16+inductor"]
    gate = ["--reference", "ref/", "--compile", "--fail-on", "floor=3"]
    clean = fxreplace("validate", "my-checkpoint", *gate, "--junit", "accuracy.xml", "--report-dir", "out/")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-2000:]
    assert "gate passed (--fail-on floor=3)" in clean.stdout
    assert "(the floor: the reference in bfloat16 compiled with inductor" in clean.stdout
    bad = fxreplace("validate", "faulty", *gate, "--report-dir", "bad/")
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    assert "gate failed (--fail-on floor=3)" in bad.stdout
    # a reference whose floor is the eager program's: refused for a compiled gate, before the target loads
    del floors["bfloat16+inductor"]
    (tmp_path / "ref" / "noise_floors.json").write_text(json.dumps(floors))
    other = fxreplace("validate", "my-checkpoint", *gate, "--report-dir", "other/")
    assert other.returncode == 2, other.stderr[-3000:]
    line = other.stderr.strip().splitlines()[-1]
    assert ("needs the noise floor of the program gated (the reference in bfloat16, compiled with inductor), and ref/ "
            "holds the reference in bfloat16: a floor of another program does not scale this one") in line, line
    assert "hint: capture the reference with `--noise-floor bfloat16 --compile`" in line, line


def test_gate_verdict_and_blame_read_one_rule_at_the_border(monkeypatch):
    """A 4-token prompt where the floor never diverged and the target diverges at once, at ~1x the floor in KL
    and top-5 error: the first-divergence multiple alone would read "5x sooner" from a handful of tokens. It does
    not count (too little evidence; the verdict says so), so the verdict, the floor=K gate and blame's test
    (NoiseFloor.within, which its search reads) all say within. Where the floor diverged too, it counts for all."""
    from fxreplace.validation import Gate, ValidationResult

    def off(first):
        prompt = {"mean_kl": 0.011, "mean_top5_error": 0.13, "first_divergence": first}
        return {"mean_kl": 0.011, "mean_top5_error": 0.13, "top1_agreement": 0.75, "prompts_diverged": 1,
                "status_counts": {"matched": 3, "within_tolerance": 0, "diverged": 1}, "prompts": {"0": prompt}}

    def judged(floor_first, target_first, k):
        floor = NoiseFloor("bfloat16", {0: {"mean_kl": 0.01, "mean_top5_error": 0.1, "first_divergence": floor_first,
                                            "steps": 4}})
        summary = off(target_first)
        said = verdict({"off": summary}, floor=floor)
        result = ValidationResult(floor=floor)
        monkeypatch.setattr(result, "summary", lambda: {"off": summary})
        return floor.multiples(summary)["first_divergence"], said, Gate(floor=k).overall(result), floor.within(summary)

    multiple, said, failed, within = judged(None, 0, 3)
    assert multiple == 5.0  # (4 steps + 1) / 1: what the verdict used to decide on
    assert said.within_floor is True and within is True and failed == []
    assert "first divergence not scored (the floor never diverged" in said.sentence
    multiple, said, failed, within = judged(2, 0, 2)  # the floor diverged at step 2: a measured rate
    assert multiple == 3.0 and said.within_floor is False and within is False
    assert failed == ["first divergence 3x sooner > 2x over the 1 validated prompts"]
    assert "first divergence 3.0x sooner" in said.sentence
