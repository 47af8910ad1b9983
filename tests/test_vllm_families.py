"""Every family with sites in vLLM's model code (``targets_for("vllm")``), end to end in a real vLLM engine.

Per family: the HF model's targets are captured (the reference, under the HF
capture names), each row forced to the least likely expert (or, for a dense
family, a large push along one feature); vLLM runs with the fxreplace plugin
configured only with the reference directory, so the family's own
vLLM targets and their capture-name mapping are what is tested. vLLM's
log-probabilities must equal HF's under the same forced values (float32, eager),
and a prompt not in the reference must equal the plain HF model.

A registration can therefore never claim what does not work: the families are
read from the registry, not listed here. Families without them (the
fused-router variants, a transform of the HF model that vLLM does not implement,
and families built without transformers) are checked to say so.

Each engine runs in its own subprocess (one module-scoped engine per family): an
in-process engine after test_vllm.py's ngram engine would fail (see that test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fxreplace.instrument import instrument
from fxreplace.models import families, get_family, tiny_model
from fxreplace.store import ReferenceStore
from fxreplace.engines.vllm.testing import capture_router_logits, force_routing, hf_logprobs, save_tiny_checkpoint
from test_vllm import GPT_OSS_CONFIG, max_diff

VLLM_FAMILIES = [arch for arch in families() if get_family(arch).targets_for("vllm")]
# What vLLM's implementation reads from the checkpoint beyond the family's tiny config
# (real checkpoints carry these fields): GPT-OSS always builds YaRN rotary embeddings.
VLLM_CONFIG = {"GptOssForCausalLM": GPT_OSS_CONFIG}
# Engine arguments a family needs on this CPU build: in float32 DeepSeek-V3 needs the
# reference MLA backend (vLLM picks AMX_MLA where the CPU has AMX; it refuses float32).
VLLM_ENGINE_ARGS = {"DeepseekV3ForCausalLM": {"attention_config": {"backend": "CPU_MLA"}}}
NEW = 4
ATOL = 1e-4
# DeepSeek-V3's tiny model has large activations (hidden values up to ~40, a 512-wide latent):
# float32 rounding alone reached 7.3e-5 on a 90-token prompt, against ~2 with nothing replaced.
FAMILY_ATOL = {"DeepseekV3ForCausalLM": 5e-4}


def atol(arch: str) -> float:
    return FAMILY_ATOL.get(arch, ATOL)

ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    import fxreplace.engines.vllm as fxv
    ckpt, ref_dir, prompts, engine_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=ckpt, dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4,
              enforce_eager=True, seed=0, distributed_executor_backend="uni", enable_prefix_caching=False,
              additional_config={"fxreplace": {"tensors_path": ref_dir, "on_unknown": "passthrough"}}, **engine_args)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    sp = SamplingParams(temperature=0.0, max_tokens=%d, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    state = fxv.get_state(runner)
    from fxreplace.models import architecture, get_family
    from fxreplace.targets import resolve_targets
    family = get_family(architecture(runner.model_config.hf_config, ""))
    declared = [[t.module_name, t.capture_name] for t in resolve_targets(runner.model, family.targets_for("vllm"))]
    def steps(logprobs):
        return [None if s is None else {str(t): v.logprob for t, v in s.items()} for s in logprobs]
    print("RESULT " + json.dumps({
        "targets": [[t.pattern, t.name] for t in state.targets], "declared": declared, "errors": state.errors,
        "tokens_replaced": state.tokens_replaced,
        "outs": [[list(o.outputs[0].token_ids), steps(o.outputs[0].logprobs), steps(o.prompt_logprobs)]
                 for o in outs]}), flush=True)
    llm.llm_engine.engine_core.shutdown()
""" % NEW)


class _Output:
    """The parts of a vLLM RequestOutput that :func:`test_vllm.max_diff` reads."""

    class _Logprob:
        def __init__(self, logprob):
            self.logprob = logprob

    def __init__(self, tokens, logprobs, prompt_logprobs):
        def steps(raw):
            return [None if s is None else {int(t): self._Logprob(v) for t, v in s.items()} for s in raw]

        completion = type("Completion", (), {})()
        completion.token_ids, completion.logprobs = tokens, steps(logprobs)
        self.outputs = [completion]
        self.prompt_logprobs = steps(prompt_logprobs)


class FamilyRun:
    """One family: the HF reference with forced values, and one vLLM engine's results."""

    def __init__(self, arch: str, directory):
        self.arch = arch
        config = VLLM_CONFIG.get(arch, {})
        self.ckpt = str(save_tiny_checkpoint(arch, directory / "ckpt", **config))
        self.hf = instrument(tiny_model(arch, **config), get_family(arch).targets)
        g = torch.Generator().manual_seed(0)
        # 24 tokens; 90 tokens (> max_num_batched_tokens: chunked prefill); not in the reference
        self.prompts = [[10 + i] + torch.randint(4, 128, (n - 1,), generator=g).tolist()
                        for i, n in enumerate((24, 90, 30))]
        self.known = 2
        self.forced = [force_routing(capture_router_logits(self.hf, self.hf.targets, p + [5] * NEW))
                       for p in self.prompts[: self.known]]
        self.captures = {i: f for i, f in enumerate(self.forced)}
        ref_dir = directory / "reference"
        ReferenceStore.from_captures(self.captures, prompt_token_ids=self.prompts[: self.known]).save(ref_dir)
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, self.ckpt, str(ref_dir), json.dumps(self.prompts),
                               json.dumps(VLLM_ENGINE_ARGS.get(arch, {}))],
                              env=env, capture_output=True, text=True, timeout=400)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"{arch}: vLLM engine failed:\n{proc.stderr[-4000:]}"
        self.result = json.loads(lines[-1][len("RESULT "):])
        self.outs = [_Output(*o) for o in self.result["outs"]]

    def diff(self, i: int, forced: bool = True) -> float:
        """Max |vLLM - HF| log-prob over prompt i's prompt and generated steps."""
        out = self.outs[i]
        seq = self.prompts[i] + list(out.outputs[0].token_ids)[:-1]
        return max_diff(hf_logprobs(self.hf, seq, self.forced[i] if forced else None), len(self.prompts[i]), out)


@pytest.fixture(scope="module", params=VLLM_FAMILIES)
def family(request, tmp_path_factory):
    return FamilyRun(request.param, tmp_path_factory.mktemp(f"fxreplace_family_{request.param}"))


def test_vllm_targets_cover_every_hf_capture(family):
    """Every HF capture has a vLLM module that reads it, and every module the family's
    vLLM targets name reads an HF capture (none is left unreplaced for want of one)."""
    captured = sorted(family.captures[0])
    assert sorted(name for _, name in family.result["targets"]) == captured
    assert sorted(family.result["declared"]) == sorted(family.result["targets"])
    assert family.result["errors"] == 0 and family.result["tokens_replaced"] > 0


def test_known_prompts_match_hf_with_forced_values(family):
    for i in range(family.known):
        forced, plain = family.diff(i), family.diff(i, forced=False)
        print(f"{family.arch} prompt {i}: max |dlogprob| forced vs HF {forced:.2e}, vs plain HF {plain:.2e}")
        assert forced < atol(family.arch), (family.arch, i, forced)
        assert plain > 0.1, (family.arch, i, plain)  # the forced values really change the outputs


def test_unknown_prompt_matches_plain_hf(family):
    assert family.diff(family.known, forced=False) < atol(family.arch)


def test_families_without_vllm_targets_say_why():
    """vLLM runs the checkpoint's own transformers architecture: a family that is a
    transform of an HF model (a fused router kernel) or is built without transformers
    (``build``) has no vLLM implementation to instrument; every other family registers
    vLLM sites (and is verified above)."""
    def not_in_vllm(family):
        return family.transform is not None or getattr(family, "build", None) is not None

    without = [arch for arch in families() if not get_family(arch).targets_for("vllm")]
    assert all(not_in_vllm(get_family(arch)) for arch in without), without
