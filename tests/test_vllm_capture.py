"""vLLM capture mode (``fxreplace.engines.vllm.capture``) against HF capture, tiny Qwen3-MoE in float32.

The same checkpoint is captured by HF (``capture_reference``) and by vLLM; both
references must hold the same generated tokens, and the same router logits on
every row and raw logits on every step within 1e-4. The prompts make vLLM's hard
cases happen: a prompt longer than the 64-token step budget (chunked prefill),
prompts whose greedy continuation repeats itself (ngram drafts accepted, and
rejected), a KV cache of 8 blocks (preemption and recomputation), and an aborted
request. Then the vLLM-captured reference goes back into vLLM with replacement
(``fxreplace validate --engine vllm``): it must be reproduced exactly.

Two more families and the online path: GPT-OSS (eager CLI capture), and a dense
Llama served by the OpenAI server with two data-parallel engines, captured over HTTP
(each engine its own store, merged with ``merge_stores``).

Every engine runs in a subprocess: test_vllm.py's ngram engine leaves its process
unable to start another engine, and TP=2 needs its own process group anyway.
Engines: eager TP=1 (script: preemption, abort), compiled TP=1 and TP=2
(``fxreplace capture --engine vllm``), one validate engine, GPT-OSS eager, one
server. Compiled engines use vLLM's default Dynamo + Inductor
(``FXREPLACE_TEST_DYNAMO_EAGER=1``: eager backend).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx

import pytest
import torch
import vllm  # noqa: F401  (needs vLLM: no skip)

from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model
from fxreplace.reference import Reference, load_reference
from fxreplace.store import ReferenceStore, merge_stores, unfinished
from fxreplace.engines.vllm import ConfigError, FxReplaceConfig
from fxreplace.engines.vllm import shm
from fxreplace.engines.vllm.testing import save_tiny_checkpoint
from test_cli_failures import sigint_as_at_a_terminal
from test_vllm import GPT_OSS, GPT_OSS_CONFIG
from test_vllm_server import Server, parse
from vllm_engines import engine_env, remove_leaked_shm, result_line, run_python

ARCH = "Qwen3MoeForCausalLM"
LLAMA = "LlamaForCausalLM"
NEW = 16
ATOL = 1e-4
TIMEOUT_S = 420
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = dict(max_model_len=192, block_size=32, max_num_batched_tokens=64, max_num_seqs=8, speculative_config=SPEC)

SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        ckpt, prompts_path, out, engine = sys.argv[1:5]
        prompts = json.load(open(prompts_path))
        # 8 KV blocks of 32 tokens cannot hold every request at once: the scheduler preempts.
        llm = LLM(model=ckpt, dtype="float32", seed=0, enforce_eager=True, distributed_executor_backend="uni",
                  num_gpu_blocks_override=8, additional_config={"fxreplace": {"capture": {"out": out}}},
                  **json.loads(engine))
        sp = SamplingParams(temperature=0.0, max_tokens=%d, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:-1]], sp, use_tqdm=False)
        # An aborted request is dropped and counted; the last prompt is captured after it.
        llm.llm_engine.add_request("to-abort", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=50))
        llm.llm_engine.step()
        llm.llm_engine.step()
        llm.llm_engine.abort_request(["to-abort"])
        outs += llm.generate([{"prompt_token_ids": prompts[-1]}], sp, use_tqdm=False)
        counts = llm.collective_rpc("fxreplace_finish_capture")[0]
        print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "counts": counts}))
""" % NEW)


class Setup:
    """Checkpoint, prompts and the HF reference."""

    def __init__(self, directory):
        self.dir = directory
        self.ckpt = str(save_tiny_checkpoint(ARCH, directory / "ckpt"))
        g = torch.Generator().manual_seed(0)
        short = [10] + torch.randint(4, 128, (39,), generator=g).tolist()
        long = [11] + torch.randint(4, 128, (149,), generator=g).tolist()  # > the 64-token budget: chunked
        g = torch.Generator().manual_seed(1)
        seeds = [[12] + torch.randint(4, 128, (20,), generator=g).tolist() for _ in range(8)]
        # prompts 0 and 7 of this generator continue greedily with repeats that ngram drafts predict
        repeats = [seeds[0] + seeds[0][1:], seeds[7] + seeds[7][1:]]
        self.prompts = [short, long, *repeats]
        self.prompts_path = directory / "prompts.json"
        self.prompts_path.write_text(json.dumps(self.prompts))
        self.hf = capture_reference(tiny_model(ARCH), self.prompts, get_family(ARCH).targets, NEW, progress=False)
        self.script = directory / "capture.py"
        self.script.write_text(SCRIPT)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("fxreplace_vllm_capture"))


def run(args: list[str], tp: int = 1, compiled: bool = False) -> str:
    return run_python(args, timeout_s=TIMEOUT_S, tp=tp, compiled=compiled)


def compare(hf: Reference, captured: Reference) -> dict:
    """Largest |HF - vLLM| per kind over every prompt of ``hf``; asserts the structure is equal."""
    by_prompt = {tuple(captured.prompt_tokens(i)): i for i in range(captured.num_prompts)}
    assert captured.store.capture_names == hf.store.capture_names
    errors = {"router": 0.0, "logits": 0.0}
    for p in range(hf.num_prompts):
        q = by_prompt[tuple(hf.prompt_tokens(p))]
        assert captured.tokens(q) == hf.tokens(p), p
        for m in hf.store.capture_names:
            a, b = hf.store.rows(p, m), captured.store.rows(q, m)
            assert a.shape == b.shape, (p, m, a.shape, b.shape)  # every row once: none missing, none duplicated
            errors["router"] = max(errors["router"], (a - b).abs().max().item())
        errors["logits"] = max(errors["logits"], (hf.logits(p) - captured.logits(q)).abs().max().item())
    return errors


@pytest.fixture(scope="module")
def eager(setup):
    out = setup.dir / "vllm_eager"
    stdout = run([str(setup.script), setup.ckpt, str(setup.prompts_path), str(out), json.dumps(ENGINE)])
    result = result_line(stdout)
    return result, out


def test_eager_capture_equals_hf_under_chunking_speculation_preemption_and_abort(setup, eager):
    result, out = eager
    counts = result["counts"]
    assert counts["completed"] == len(setup.prompts) and counts["in_flight"] == 0, counts
    assert counts["dropped"] == 1, counts  # the aborted request
    assert counts["drafts_accepted"] > 0, counts  # speculation really accepted drafts
    assert counts["preemptions"] > 0, counts  # and the small KV cache really preempted
    captured = load_reference(out)
    assert captured.num_prompts == len(setup.prompts)  # the aborted request is not in it
    assert captured.metadata["engine"] == "vllm"
    assert json.loads((out / "capture.json").read_text())["dropped"] == 1
    # streamed: the engine idled twice (after each generate), each time writing a shard
    assert len(json.loads((out / "index.json").read_text())["shards"]) == 2
    assert result["tokens"] == [setup.hf.tokens(p) for p in range(setup.hf.num_prompts)]  # what vLLM returned
    errors = compare(setup.hf, captured)
    print(f"\nvLLM eager TP=1 vs HF: {errors}")
    assert errors["router"] < ATOL and errors["logits"] < ATOL, errors


def test_a_repacked_capture_is_the_same_reference_in_one_shard(setup, eager, tmp_path):
    """The engine's one shard per idle, joined by `fxreplace repack`: the same prompts,
    generations, logits and rows, and the same metadata (engine, targets, vocabulary)."""
    _, out = eager
    run(["-m", "fxreplace", "repack", str(out), "--out", str(tmp_path / "packed")])
    captured, packed = load_reference(out), load_reference(tmp_path / "packed")
    assert len(packed.store.shards) == 1 < len(captured.store.shards)
    assert packed.metadata == captured.metadata and packed.store.prompt_ids == captured.store.prompt_ids
    assert compare(captured, packed) == {"router": 0.0, "logits": 0.0}  # bit for bit


# Eager TP=2 adds nothing over these (test_vllm_tp.py covers its plumbing) and costs ~2 min.
@pytest.mark.parametrize("mode,tp", [("compiled", 1), ("compiled", 2)])
def test_cli_capture_equals_hf(setup, mode, tp):
    out = setup.dir / f"vllm_{mode}_tp{tp}"
    engine = dict(ENGINE, tensor_parallel_size=tp)
    if tp > 1:
        engine["distributed_executor_backend"] = "mp"
    args = ["-m", "fxreplace", "capture", setup.ckpt, "--engine", "vllm", "--prompts", str(setup.prompts_path),
            "--out", str(out), "--max-new-tokens", str(NEW), "--engine-args", json.dumps(engine)]
    segments_before = shm.segments()
    stdout = run(args + (["--eager"] if mode == "eager" else []), tp=tp, compiled=mode == "compiled")
    assert f"captured {len(setup.prompts)} prompts" in stdout and "(0 dropped)" in stdout, stdout
    # the engine's shared memory (TP: message queues, CPU group segments) went with it
    assert shm.unused(shm.segments() - segments_before) == []
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == []  # one store, written once (by TP rank 0)
    errors = compare(setup.hf, load_reference(out))
    print(f"\nvLLM {mode} TP={tp} vs HF: {errors}")
    assert errors["router"] < ATOL and errors["logits"] < ATOL, errors


def test_gptoss_capture_equals_hf(tmp_path):
    """GPT-OSS (router ``mlp.router`` observed at its output, sliding-window layers): the
    same checkpoint captured by HF and by vLLM (eager, a chunked prompt) agrees."""
    ckpt = str(save_tiny_checkpoint(GPT_OSS, tmp_path / "ckpt", **GPT_OSS_CONFIG))
    g = torch.Generator().manual_seed(2)
    prompts = [[10] + torch.randint(4, 128, (29,), generator=g).tolist(),
               [11] + torch.randint(4, 128, (99,), generator=g).tolist()]  # > the 64-token budget: chunked
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / "vllm"
    engine = dict(max_model_len=192, block_size=32, max_num_batched_tokens=64, max_num_seqs=4)
    stdout = run(["-m", "fxreplace", "capture", ckpt, "--engine", "vllm", "--eager", "--prompts",
                  str(tmp_path / "prompts.json"), "--out", str(out), "--max-new-tokens", str(NEW),
                  "--engine-args", json.dumps(engine)])
    assert f"captured {len(prompts)} prompts" in stdout and "(0 dropped)" in stdout, stdout
    hf = capture_reference(tiny_model(GPT_OSS, **GPT_OSS_CONFIG), prompts, get_family(GPT_OSS).targets, NEW,
                           progress=False)
    captured = load_reference(out)
    assert captured.metadata["architecture"] == GPT_OSS
    errors = compare(hf, captured)
    print(f"\nGPT-OSS vLLM eager vs HF: {errors}")
    assert errors["router"] < ATOL and errors["logits"] < ATOL, errors


def test_server_with_two_data_parallel_engines_captures_requests_over_http(tmp_path):
    """The OpenAI server with ``--data-parallel-size 2`` in capture mode: each engine
    writes its own store (``out/dp<rank>``, complete whenever it idles), one
    ``merge_stores`` call joins them, and the result equals HF capture. A dense model
    (Llama, target: every MLP's output): vLLM's MoE layers need an all-gather across
    data-parallel ranks that its CPU build lacks."""
    ckpt = str(save_tiny_checkpoint(LLAMA, tmp_path / "ckpt"))
    g = torch.Generator().manual_seed(3)
    prompts = [[10 + i] + torch.randint(4, 128, (20 + 9 * i,), generator=g).tolist() for i in range(6)]
    prompts[-1] += torch.randint(4, 128, (40,), generator=g).tolist()  # > the 64-token budget: chunked
    out = tmp_path / "capture"
    server = Server(ckpt, tmp_path, "eager", {"fxreplace": {"capture": {"out": str(out)}}},
                    "--data-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        server.wait_ready()

        async def complete_all():
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                return await asyncio.gather(*[client.post(server.url + "/v1/completions", json={
                    "model": ckpt, "prompt": p, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True,
                    "logprobs": 1, "return_tokens_as_token_ids": True}) for p in prompts])

        replies = asyncio.run(complete_all())
        assert [r.status_code for r in replies] == [200] * len(prompts), [r.text[:300] for r in replies]
        tokens = [parse(r.json()["choices"][0])[0] for r in replies]
        assert server.idle()
        assert sorted(p.name for p in out.iterdir()) == ["dp0", "dp1"], server.log_tail()
        counts = [json.loads((out / d / "capture.json").read_text()) for d in ("dp0", "dp1")]
    finally:
        server.stop()
    assert all(c["completed"] > 0 for c in counts), counts  # both engines served (and captured) requests
    assert sum(c["completed"] for c in counts) == len(prompts) and not any(c["dropped"] for c in counts), counts
    captured = load_reference(merge_stores([out / "dp0", out / "dp1"], tmp_path / "merged"))
    hf = capture_reference(tiny_model(LLAMA), prompts, get_family(LLAMA).targets, NEW, progress=False)
    assert tokens == [hf.tokens(p) for p in range(len(prompts))]  # what the server returned
    errors = compare(hf, captured)
    print(f"\nserver, data parallel 2, vLLM eager vs HF (Llama MLP outputs): {errors}")
    assert errors["router"] < ATOL and errors["logits"] < ATOL, errors


def test_vllm_capture_replayed_by_vllm_with_replacement_is_reproduced(setup, eager):
    _, reference_dir = eager
    report = setup.dir / "report"
    run(["-m", "fxreplace", "validate", setup.ckpt, "--reference", str(reference_dir), "--engine", "vllm",
         "--dtype", "float32", "--eager", "--report-dir", str(report)])
    result = json.loads((report / "result.json").read_text())
    on = [s for s in result["steps"] if s["mode"] == "on"]
    assert len(on) == len(setup.prompts) * NEW
    assert all(s["status"] == "matched" and s["top1_agree"] and s["round"] == 0 for s in on)
    worst = max(s["top5_error"] for s in on)
    print(f"\nvLLM replay of the vLLM capture: worst top-5 log-prob error {worst:.1e}")
    assert worst < 1e-5
    assert result["summary"]["on"]["prompts_diverged"] == 0


# --------------------------------------------------------------------------- refusals (no engine starts)


def _engine_config(setup, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from fxreplace.engines.vllm import register

    register()
    return EngineArgs(model=setup.ckpt, additional_config={"fxreplace": {"capture": {"out": str(setup.dir / "x")}}},
                      **kwargs).create_engine_config()


def test_capture_refuses_prefix_caching_and_async_scheduling_with_the_fix(setup):
    with pytest.raises(ConfigError, match="enable_prefix_caching=False"):
        _engine_config(setup, enable_prefix_caching=True)
    with pytest.raises(ConfigError, match="async_scheduling=False"):
        _engine_config(setup, async_scheduling=True)
    config = _engine_config(setup)  # left unset: capture turns both off
    assert not config.cache_config.enable_prefix_caching and not config.scheduler_config.async_scheduling


def test_capture_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="separate engines"):
        FxReplaceConfig(capture={"out": "/tmp/x"}, tensors_path="/tmp/ref")
    with pytest.raises(ConfigError, match="unknown capture field 'outdir'"):
        FxReplaceConfig(capture={"outdir": "/tmp/x"})
    with pytest.raises(ConfigError, match="needs 'out'"):
        FxReplaceConfig(capture={"targets": ["model.layers.*.mlp.gate"]})
    with pytest.raises(ConfigError, match=r"targets\[0\]"):
        FxReplaceConfig(capture={"out": "/tmp/x", "targets": [{"patern": "model.layers.*.mlp.gate"}]})
    config = FxReplaceConfig(capture={"out": "/tmp/x", "targets": ["model.layers.*.mlp.gate"]}).config
    assert config.capture["out"] == "/tmp/x" and config.capture["targets"][0].pattern == "model.layers.*.mlp.gate"


def test_a_generation_longer_than_its_first_logits_allocation_keeps_every_row():
    """A request's logits start in one allocation of at most ``FIRST_LOGIT_ROWS`` rows (its
    max_tokens may be the model length); a longer generation grows it, keeping every row. The
    store gets a copy of a generation that fills part of its allocation (it holds what it is
    given until the shard is written), the allocation itself when it is full."""
    import numpy as np
    from vllm import SamplingParams

    from fxreplace.engines.recording import RequestRows

    prompt = [5, 6, 7]
    record = RequestRows(prompt, SamplingParams(max_tokens=9), width=2, capacity=len(prompt) + 9,
                          bits=np.float32, arrival=0, logit_rows=2)
    logits = np.random.default_rng(0).standard_normal((8, 4), dtype=np.float32)
    for j, sampled in enumerate(logits[:7]):  # token j is sampled from position prompt - 1 + j
        record.put_token(len(prompt) - 1 + j, np.full(2, j, np.float32), sampled)
    assert record.generated == 7 and np.array_equal(record.generated_logits(7), logits[:7])
    assert np.array_equal(record.rows[len(prompt) - 1:len(prompt) + 6, 0], np.arange(7))
    assert not np.shares_memory(record.generated_logits(7), record.logits)  # 7 rows of 8 held: a copy
    record.put_logits(len(prompt) + 6, logits[7])
    assert np.shares_memory(record.generated_logits(8), record.logits)  # full: no copy


@pytest.fixture(scope="module")
def hf_reference(setup):
    """A reference of the checkpoint, with blame's components, captured by the runner engine (the HF model's
    own forwards)."""
    out = setup.dir / "hf_reference"
    subprocess.run([sys.executable, "-m", "fxreplace", "capture", setup.ckpt, "--prompts", str(setup.prompts_path),
                    "--out", str(out), "--max-new-tokens", "4", "--components"], check=True, capture_output=True,
                   timeout=TIMEOUT_S)
    return out


@pytest.mark.parametrize("command", ["capture", "validate", "blame"])
def test_ctrl_c_while_the_vllm_engine_starts_exits_130_within_seconds_leaving_nothing(setup, hf_reference, tmp_path,
                                                                                    command):
    """A terminal's Ctrl-C while `fxreplace capture|validate|blame --engine vllm` starts its engine (the
    worker loading the model, the command waiting for the engine core in a zmq poll that drops the
    KeyboardInterrupt): exit 130 within seconds with the command's one line, the engine's processes
    and shared memory (its queues and its processes' semaphores) gone."""
    out = tmp_path / "out"
    what = {"capture": ["--prompts", str(setup.prompts_path), "--out", str(out), "--max-new-tokens", "4"],
            "validate": ["--reference", str(hf_reference), "--report-dir", str(out)],
            "blame": ["--reference", str(hf_reference), "--report-dir", str(out)]}[command]
    # as a user runs it: vLLM's default multiprocessing engine (the engine core in a process of its own) and memory
    env = {k: v for k, v in engine_env().items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    remove_leaked_shm()
    segments_before = shm.segments()
    proc = subprocess.Popen([sys.executable, "-m", "fxreplace", command, setup.ckpt, "--engine", "vllm", "--eager",
                             *what], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=sigint_as_at_a_terminal)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any("Starting to load model" in line for line in lines):  # the worker's log: the engine starts
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        interrupted = time.monotonic()
        assert proc.wait(timeout=60) == 130, "".join(lines)[-3000:]
        assert time.monotonic() - interrupted < 20, "".join(lines)[-3000:]  # not vLLM's 600 s start timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    text = "".join(lines)
    assert "Timed out" not in text and lines[-1].startswith("interrupted: "), text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]  # the one line, no worker's trace
    assert not out.exists() or not any(out.iterdir())
    assert group_gone(proc.pid, within_s=10)  # the engine core and its worker went with the command
    assert shm.unused(shm.segments() - segments_before) == []


def group_gone(pgid: int, within_s: float) -> bool:
    """Whether the process group ``pgid`` is gone within ``within_s`` (a killed process's parent, killed too,
    leaves it to init to reap)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_ctrl_c_during_a_vllm_capture_exits_130_with_one_line_and_the_written_prompts_loadable(setup, tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group) while `fxreplace capture --engine vllm`
    generates: one line saying what --out holds, exit 130, the prompts written so far load, and the
    engine's processes and shared memory are gone."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[4 + i // 100, 4 + i % 100] + [4 + (i * 7 + j) % 100 for j in range(14)]
                                   for i in range(3000)]))
    out = tmp_path / "out"
    remove_leaked_shm()
    segments_before = shm.segments()
    proc = subprocess.Popen([sys.executable, "-m", "fxreplace", "capture", setup.ckpt, "--engine", "vllm", "--eager",
                             "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env(),
                            start_new_session=True,
                            preexec_fn=sigint_as_at_a_terminal)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not re.search(r"Processed prompts: +\d+%.* [1-9]\d*/3000", "".join(err)[-400:]):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err)[-3000:]
            time.sleep(0.2)  # generating: vLLM's progress bar counts finished prompts
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, "".join(err)[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    text = "".join(err)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    written = re.fullmatch(rf"interrupted: --out {re.escape(str(out.resolve()))} holds an unfinished store: the (\d+) "
                           r"prompts written so far load, the later ones are missing; the requests in flight were not "
                           r"written: capture again into a new --out for every prompt", last)
    assert written, last
    assert unfinished(out) and len(ReferenceStore.load(out).prompt_token_ids) == int(written.group(1)) > 0
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # the engine core and workers went with the command
    assert shm.unused(shm.segments() - segments_before) == []
