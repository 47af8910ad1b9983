"""Reference capture, teacher-forced validation, the CLI and the demo."""

import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from fxreplace import TensorReplacer
from fxreplace.capture import capture_reference
from fxreplace.cli import main as cli
from fxreplace.metrics import compare_logits
from fxreplace.models import tiny_model
from fxreplace.reference import Reference, load_reference
from fxreplace.engines.embedded.runner import Runner, RunnerConfig
from fxreplace.engines.protocol import Engine
from fxreplace.store import ReferenceStore, unfinished
from fxreplace.validation import logit_validation

ARCH = "Qwen3MoeForCausalLM"
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26], [43, 38]]
STEPS = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def reference(model):
    return capture_reference(model, PROMPTS, ["model.layers.*.mlp.gate"], STEPS, progress=False)


def test_capture_equals_forward_hook_oracle_and_hf_generate(model, reference):
    for p, prompt in enumerate(PROMPTS):
        seen = {}
        hooks = [model.get_submodule(f"model.layers.{i}.mlp.gate").register_forward_hook(
            lambda mod, args, out, i=i: seen.setdefault(i, []).append(out[0].detach().clone())) for i in range(2)]
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        for h in hooks:
            h.remove()
        assert reference.tokens(p) == gen.sequences[0, len(prompt):].tolist()
        torch.testing.assert_close(reference.logits(p), torch.cat(gen.logits), atol=1e-5, rtol=0)
        for i in range(2):
            hook_rows = torch.cat(seen[i][:STEPS])  # HF's router sees [tokens, hidden]: rows per position
            torch.testing.assert_close(reference.store.rows(p, f"model.layers.{i}.mlp.gate"), hook_rows, atol=1e-5, rtol=0)


def test_capture_restores_the_model(model, reference):
    assert type(model).__name__ == ARCH and not hasattr(model, "_fxreplace")
    assert "forward" not in model.get_submodule("model.layers.0.mlp.gate").__dict__


def test_reference_round_trips_through_disk(tmp_path, reference):
    reference.save(tmp_path / "ref")
    loaded = load_reference(tmp_path / "ref")
    assert loaded.metadata["architecture"] == ARCH and loaded.metadata["vocab_size"] == 128
    for p in range(len(PROMPTS)):
        assert loaded.prompt_tokens(p) == PROMPTS[p] and loaded.tokens(p) == reference.tokens(p)
        assert torch.equal(loaded.logits(p), reference.logits(p))
        assert torch.equal(loaded.store.rows(p, "model.layers.1.mlp.gate"), reference.store.rows(p, "model.layers.1.mlp.gate"))


def test_bad_inputs_give_clear_errors(model, reference):
    with pytest.raises(ValueError, match=r"prompt 1 has token ids outside \[0, 128\)"):
        capture_reference(model, [[1, 2], [1, 500]], ["model.layers.*.mlp.gate"], 2, progress=False)
    with pytest.raises(ValueError, match="no reference generation"):
        Reference(ReferenceStore.from_captures([{"m": [torch.zeros(1, 2, 3)]}], prompt_token_ids=[[1, 2]]))
    with pytest.raises(ValueError, match=r"reference logits \(128,\) and target logits \(64,\) differ in shape .*another model"):
        compare_logits(torch.zeros(128), torch.zeros(64))


@dataclass
class Gen:
    req_id: str
    tokens: list
    logits: list
    observed: dict = field(default_factory=dict)


class PlantedEngine(Engine):
    """Replays the reference except that, in one prompt, one step picks another token."""

    def __init__(self, reference, prompt, step):
        self.reference, self.prompt, self.step, self.calls = reference, prompt, step, []

    def generate(self, prompts, max_new_tokens, replace):
        out = []
        for inputs in prompts:
            p = next(i for i in range(self.reference.num_prompts) if inputs[: len(PROMPTS[i])] == PROMPTS[i])
            start = len(inputs) - len(PROMPTS[p])
            self.calls.append((p, start))
            logits = [self.reference.logits(p)[s].clone() for s in range(start, self.reference.num_generated(p))]
            if p == self.prompt and start <= self.step:
                logits[self.step - start][self.reference.tokens(p)[self.step]] = -1e9  # argmax moves elsewhere
            out.append(Gen(f"r{len(self.calls)}", [int(l.argmax()) for l in logits], logits))
        return out


def test_teacher_forcing_records_the_planted_divergence_and_continues(reference):
    engine = PlantedEngine(reference, prompt=1, step=3)
    result = logit_validation(engine, reference, modes=("off",), progress=False)
    rows = result.table("off")
    assert len(rows) == len(PROMPTS) * STEPS, "every reference step validated exactly once"
    diverged = [(r.prompt, r.step, r.round) for r in rows if not r.top1_agree]
    assert diverged == [(1, 3, 0)]
    assert (1, 4) in engine.calls, "the retry starts after the divergent step, extended with reference tokens"
    assert result.summary()["off"]["prompts"][1]["first_divergence"] == 3
    assert json.loads(result.to_json())["summary"]["off"]["prompts_diverged"] == 1


def test_an_engine_reads_its_capabilities_defaults_and_a_non_engine_is_refused(reference):
    """An engine overrides only what it has; validation reads the rest from the base's defaults
    (no teacher forcing: each divergence costs one more call). Not an Engine: a TypeError naming it."""
    engine = PlantedEngine(reference, prompt=1, step=3)
    assert (engine.teacher_forcing, engine.per_request_selection, engine.components, engine.vocab_size) == (
        False, False, (), None)
    assert engine.close() is None

    class Loose:  # generate() alone, as a Protocol once allowed
        generate = PlantedEngine.generate

    with pytest.raises(TypeError, match="logit_validation's engine must be an fxreplace.engines.protocol.Engine "
                                        r"\(subclass it: generate\(\) and the capabilities it has\), got Loose"):
        logit_validation(Loose(), reference, modes=("off",), progress=False)


class NanEngine(PlantedEngine):
    def generate(self, prompts, max_new_tokens, replace):
        gens = super().generate(prompts, max_new_tokens, replace)
        for (p, start), g in zip(self.calls[-len(gens):], gens):
            if p == self.prompt and start <= self.step:
                g.logits[self.step - start] = torch.full_like(g.logits[0], float("nan"))
        return gens


def test_nan_logits_are_validated_flagged_and_stop_the_prompt(reference):
    result = logit_validation(NanEngine(reference, prompt=0, step=2), reference, modes=("off",), progress=False)
    rows = [r for r in result.table("off") if r.prompt == 0]
    assert [r.step for r in rows] == [0, 1, 2] and rows[-1].nan and rows[-1].status == "diverged"
    assert result.summary()["off"]["prompts"][0]["nan"] is True
    assert len([r for r in result.table("off") if r.prompt == 1]) == STEPS, "other prompts carry on"


def test_runner_validation_with_a_perturbed_model_resolves_retries_to_their_prompt(model, reference):
    import copy

    from fxreplace.instrument import instrument

    target = instrument(copy.deepcopy(model), ["model.layers.*.mlp.gate"])  # the runner passes replacements=
    banned = reference.tokens(0)[2]  # the target can never pick it: prompt 0 diverges by step 2 at the latest

    def ban(module, args, out):
        out[..., banned] -= 1e4
        return out

    target.lm_head.register_forward_hook(ban)
    replacer = TensorReplacer(reference.store)
    resolved = []
    register = replacer.register_request
    replacer.register_request = lambda rid, tokens, prompt_idx=None: resolved.append((list(tokens), register(rid, tokens, prompt_idx))) or resolved[-1][1]
    runner = Runner(target, target.config, replacer=replacer, runner_config=RunnerConfig(prefill_buckets=(32,), batch_buckets=(4,), max_len=64))
    result = logit_validation(runner, reference, modes=("on",), progress=False)
    first = result.summary()["on"]["prompts"][0]["first_divergence"]
    assert first == reference.tokens(0).index(banned)
    retries = [(tokens, p) for tokens, p in resolved if len(tokens) > len(PROMPTS[p])]
    assert retries, "teacher forcing retried"
    for tokens, p in retries:
        assert tokens[: len(PROMPTS[p])] == PROMPTS[p]
    assert replacer.requests == {}


def test_forced_validation_records_what_retries_record(model, reference):
    """An engine that teacher-forces inside its decode steps validates in one call per prompt and
    records every step as the retries of an engine that re-runs would (same steps, rounds, statuses)."""
    import copy

    from fxreplace.instrument import instrument

    target = instrument(copy.deepcopy(model), ["model.layers.*.mlp.gate"])
    with torch.no_grad():
        target.model.layers[1].self_attn.o_proj.weight.mul_(3.0)  # diverges at several steps
    results, calls = {}, {}
    for forcing in (False, True):
        runner = Runner(target, target.config, replacer=TensorReplacer(reference.store),
                        runner_config=RunnerConfig(prefill_buckets=(32,), batch_buckets=(4,), max_len=64,
                                                   teacher_forcing=forcing))
        results[forcing] = logit_validation(runner, reference, modes=("off",), progress=False)
        calls[forcing] = runner.forwards
    retried, forced = (sorted(results[f].table("off"), key=lambda s: (s.prompt, s.step)) for f in (False, True))
    assert max(s.round for s in retried) >= 2, "the target diverges more than once in some prompt"
    assert [(s.prompt, s.step, s.round, s.top1_agree, s.status, s.target_token) for s in forced] == \
        [(s.prompt, s.step, s.round, s.top1_agree, s.status, s.target_token) for s in retried]
    torch.testing.assert_close([s.kl for s in forced], [s.kl for s in retried], atol=1e-5, rtol=1e-4)
    assert calls[True] == len(PROMPTS) + STEPS - 1 < calls[False]


def test_cli_capture_validate_inspect(tmp_path, capsys):
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS[:2]))
    assert cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "4",
                "--out", str(tmp_path / "ref")]) == 0
    assert cli(["validate", f"builtin:{ARCH}", "--reference", str(tmp_path / "ref"), "--report-dir", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.html").exists()
    assert cli(["inspect", f"builtin:{ARCH}"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.gate" in out and "top-1 agreement" in out
    (tmp_path / "bad.json").write_text("[[1, 2, 999]]")
    with pytest.raises(SystemExit, match=r"prompt 0 has token ids outside \[0, 128\)"):
        cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=r"reference holds no captures for targets \['model.layers.0.mlp'"):
        cli(["validate", f"builtin:{ARCH}", "--reference", str(tmp_path / "ref"), "--target", "model.layers.*.mlp"])
    tiny_model(ARCH, vocab_size=256).save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit, match="reference has vocab size 128 but .*other has 256: it was captured from another model"):
        cli(["validate", str(tmp_path / "other"), "--reference", str(tmp_path / "ref")])


def test_demo_end_to_end_compiled(tmp_path):
    """The README's main job, shortened: compiled bf16 target, both modes, report written. In a
    process of its own, as the README runs it (in the suite's process, about one run in two left
    torch's dispatch keys excluded as the demo ended, failing every later compile of that xdist
    worker: a leak not yet traced to its call, in torch or fxreplace)."""
    proc = subprocess.run([sys.executable, "-m", "fxreplace", "demo", "--prompts", "4", "--new-tokens", "8",
                           "--report-dir", str(tmp_path / "report")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "verdict:" in out and "router agreement" in out
    assert "graphs compiled: 2 " in out, "one prefill and one decode bucket; on/off must not recompile"
    for name, min_size in [("report.html", 2000), ("error_per_step.png", 10000), ("router_agreement.png", 5000), ("result.json", 1000)]:
        assert (tmp_path / "report" / name).stat().st_size > min_size, name
    summary = json.loads((tmp_path / "report" / "result.json").read_text())["summary"]
    assert set(summary) == {"off", "on"}
    assert summary["on"]["mean_kl"] < summary["off"]["mean_kl"], "reference routing brings the bf16 target closer"
    assert json.loads((tmp_path / "report" / "result.json").read_text())["noise_floor"]["dtype"] == "bfloat16"
    blamed = json.loads((tmp_path / "report" / "blame.json").read_text())  # the demo ends with a blame summary
    assert "blame verdict: within precision noise" in out and blamed["passes"] == len(blamed["pass_log"])
    assert blamed["noise_floor"]["within"] and blamed["floor_seconds"] == 0  # the floor stored beside the reference
    planted = json.loads((tmp_path / "report" / "blame-planted" / "blame.json").read_text())
    assert sorted((o["kind"], o["layer"]) for o in planted["origins"]) == [("attention", 0), ("router", 3)], \
        planted["verdict"]
    assert planted["verdict"].startswith("beyond precision noise") and "above the precision floor" in planted["verdict"]
    # ... and with the repro of the planted fault's first origin, which disagrees already in eager
    assert "verdict: the port: the target's component disagrees with the reference already in eager" in out
    assert (tmp_path / "report" / "repro" / "README.md").is_file()


def test_cli_bad_model_directory_and_arguments(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"empty holds no config.json: not a Hugging Face model directory"):
        cli(["inspect", str(tmp_path / "empty")])
    (tmp_path / "noweights").mkdir()
    tiny_model(ARCH).config.save_pretrained(tmp_path / "noweights")
    with pytest.raises(SystemExit, match=r"cannot load the model in .*noweights"):
        cli(["inspect", str(tmp_path / "noweights")])
    for argv in (["inspect", f"builtin:{ARCH}", "--tokens", "0"], ["demo", "--new-tokens", "-1"]):
        with pytest.raises(SystemExit):
            cli(argv)
        assert "must be a positive integer, got" in capsys.readouterr().err


def test_cli_unwritable_out_fails_before_capture(tmp_path, monkeypatch):
    import fxreplace.capture

    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS[:1]))
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(fxreplace.capture, "capture_reference", lambda *a, **k: pytest.fail("capture ran"))
    with pytest.raises(SystemExit, match=r"--out .*file/ref is not a writable directory"):
        cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "prompts.json"), "--out", str(tmp_path / "file" / "ref")])


def test_cli_validate_refuses_a_reference_of_another_architecture(tmp_path, reference):
    """Mixtral's and Qwen3-MoE's routers share capture names, expert count and vocabulary:
    only the recorded architecture tells the reference is not this model's."""
    reference.save(tmp_path / "ref")
    with pytest.raises(SystemExit, match=r"captured from Qwen3MoeForCausalLM .*model.layers.0.mlp.gate.* but "
                                         r"builtin:MixtralForCausalLM is MixtralForCausalLM"):
        cli(["validate", "builtin:MixtralForCausalLM", "--reference", str(tmp_path / "ref"),
             "--report-dir", str(tmp_path / "rep")])
    tiny_model("MixtralForCausalLM").save_pretrained(tmp_path / "mixtral")
    with pytest.raises(SystemExit, match=r"captured from Qwen3MoeForCausalLM .* is MixtralForCausalLM"):
        cli(["validate", str(tmp_path / "mixtral"), "--reference", str(tmp_path / "ref"), "--engine", "vllm",
             "--engine-args", '{"gpu_memory_utilization": 0.2}'])  # fits beside other jobs: the check under test is next


class SlowEngine(PlantedEngine):
    def generate(self, prompts, max_new_tokens, replace):
        import time

        time.sleep(0.5)  # a compile, or a long wave
        return super().generate(prompts, max_new_tokens, replace)


def test_a_busy_engine_still_prints_progress_lines(reference, monkeypatch, capsys):
    import fxreplace.validation

    monkeypatch.setattr(fxreplace.validation, "HEARTBEAT_S", 0.1)
    logit_validation(SlowEngine(reference, prompt=1, step=3), reference, modes=("off",))
    err = capsys.readouterr().err
    assert "validate (off): engine busy for 0 s (round 0: 3 prompts, up to 8 steps; a compiled engine compiles" in err
    assert "round 1: 1 prompts, up to 4 steps)" in err, "every call, not only the first"


def test_capture_streams_into_shards_equal_to_the_in_memory_capture(model, reference, tmp_path):
    streamed = capture_reference(model, PROMPTS, ["model.layers.*.mlp.gate"], STEPS, progress=False,
                                 out=tmp_path / "ref", shard_bytes=1)
    assert len(streamed.store.shards) == len(PROMPTS), "one shard per prompt as it completed"
    assert not unfinished(tmp_path / "ref")
    for p in range(len(PROMPTS)):
        assert streamed.tokens(p) == reference.tokens(p)
        assert torch.equal(streamed.logits(p), reference.logits(p))
        for name in reference.store.capture_names:
            assert torch.equal(streamed.store.rows(p, name), reference.store.rows(p, name))


# argv: the store's folder and the number of prompts (the first ones of the list)
_KILLED_CAPTURE = """
import sys
from fxreplace.capture import capture_reference
from fxreplace.models import tiny_model
prompts = [[1 + i % 97, 2 + i // 97, 3] for i in range(int(sys.argv[2]))]
capture_reference(tiny_model("Qwen3MoeForCausalLM"), prompts, ["model.layers.*.mlp.gate"], 8, progress=False,
                  out=sys.argv[1], shard_bytes=1)
"""


def test_capture_killed_midway_keeps_its_completed_prompts_and_says_unfinished(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "ref"
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CAPTURE, str(out), "2000"], env=one_thread)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            index = out / "index.json"
            if index.exists() and json.loads(index.read_text())["shards"][2:]:
                break
            time.sleep(0.05)
        assert child.poll() is None, "the capture ended before it could be killed midway"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert unfinished(out)
    partial = load_reference(out)
    assert 3 <= partial.num_prompts < 2000
    kept = [partial.prompt_tokens(p) for p in range(partial.num_prompts)]
    assert kept == [[1 + i % 97, 2 + i // 97, 3] for i in range(partial.num_prompts)]
    # captured again as the killed one ran (one thread: this process's pool may hold others, set by an
    # in-process engine of an earlier test, and bit-equal rows need the same program)
    subprocess.run([sys.executable, "-c", _KILLED_CAPTURE, str(tmp_path / "again"), str(len(kept))], env=one_thread,
                   check=True)
    again = load_reference(tmp_path / "again")
    for p in range(partial.num_prompts):
        assert partial.tokens(p) == again.tokens(p)
        assert torch.equal(partial.store.rows(p, "model.layers.0.mlp.gate"), again.store.rows(p, "model.layers.0.mlp.gate"))


def test_cli_validate_is_one_teacher_forced_pass_per_mode(model, tmp_path, monkeypatch):
    """A target diverging at many steps still costs one engine call per mode: the runner reads the
    reference's tokens instead of re-running each diverged prompt."""
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    assert cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens",
                str(STEPS), "--out", str(tmp_path / "ref")]) == 0
    bad = tiny_model(ARCH)
    with torch.no_grad():
        bad.model.layers[0].self_attn.o_proj.weight.mul_(3.0)
    bad.save_pretrained(tmp_path / "bad")
    calls = []
    generate = Runner.generate
    monkeypatch.setattr(Runner, "generate", lambda self, *a, **k: calls.append(k.get("forced")) or generate(self, *a, **k))
    assert cli(["validate", str(tmp_path / "bad"), "--dtype", "float32", "--reference", str(tmp_path / "ref"),
                "--report-dir", str(tmp_path / "rep")]) == 0
    summary = json.loads((tmp_path / "rep" / "result.json").read_text())["summary"]
    assert sum(p["divergences"] for p in summary["off"]["prompts"].values()) > len(PROMPTS), "diverges at many steps"
    assert len(calls) == 2 and all(forced is not None for forced in calls), "one forced call per mode"
    assert summary["off"]["steps"] == summary["on"]["steps"] == len(PROMPTS) * STEPS


def test_cli_reads_a_sharded_bf16_checkpoint(tmp_path, capsys):
    """Checkpoints as users have them: several safetensors shards and an index, bf16 on disk. The
    capture is the bf16 weights' in fp32; the target validates in bf16 against it, the weights as saved."""
    checkpoint = tmp_path / "ckpt"
    bf16 = tiny_model(ARCH).to(torch.bfloat16)
    bf16.save_pretrained(checkpoint, max_shard_size="100KB")
    assert len(list(checkpoint.glob("model-*.safetensors"))) > 1 and (checkpoint / "model.safetensors.index.json").exists()
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    assert cli(["capture", str(checkpoint), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", str(STEPS),
                "--out", str(tmp_path / "ref")]) == 0
    captured = load_reference(tmp_path / "ref")
    rounded = tiny_model(ARCH)  # the weights as bf16 holds them; buffers (rotary frequencies) as computed
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.to(torch.bfloat16))
    expected = capture_reference(rounded, PROMPTS, ["model.layers.*.mlp.gate"], STEPS, progress=False)
    for p in range(len(PROMPTS)):
        assert captured.tokens(p) == expected.tokens(p)
        torch.testing.assert_close(captured.logits(p), expected.logits(p), atol=1e-5, rtol=0)
    assert cli(["validate", str(checkpoint), "--dtype", "bfloat16", "--reference", str(tmp_path / "ref"),
                "--report-dir", str(tmp_path / "rep")]) == 0
    summary = json.loads((tmp_path / "rep" / "result.json").read_text())["summary"]
    assert summary["off"]["steps"] == len(PROMPTS) * STEPS
