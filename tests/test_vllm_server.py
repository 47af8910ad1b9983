"""fxreplace inside vLLM's OpenAI-compatible server (a real subprocess, API server
and engine core in separate processes), tiny Qwen3-MoE in float32.

Two servers, one after the other: eager and vLLM's default compiled mode
(Dynamo + Inductor; ``FXREPLACE_TEST_DYNAMO_EAGER=1`` as in test_vllm.py). Each
runs exactness over HTTP (completions with token-id prompts and logprobs,
compared with HF run with the same forced router logits), then 100
concurrent requests (known prompts, teacher-forcing retries, unknown prompts,
clients that disconnect early). The worker's request map is read from the file
the plugin writes when ``FXREPLACE_DEBUG_STATE`` is set.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from test_vllm import ATOL, NEW, Ref

STARTUP_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on a free port with the given
    ``--additional-config`` and extra arguments; ``env`` adds to its environment."""

    def __init__(self, ckpt: str, tmp, mode: str, additional_config: dict, *args: str, env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_path = str(tmp / "fxreplace_state.json")
        self.log_path = tmp / "server.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
        environ.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", FXREPLACE_DEBUG_STATE=self.state_path,
                       **(env or {}))
        if mode == "compiled" and os.environ.get("FXREPLACE_TEST_DYNAMO_EAGER"):
            environ["VLLM_CPU_CI_ENV"] = "1"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               *(["--enforce-eager"] if mode == "eager" else []),
               "--seed", "0", "--max-model-len", "256", "--block-size", "32", "--max-num-seqs", "16",
               "--max-num-batched-tokens", "64", "--uvicorn-log-level", "warning",
               "--additional-config", json.dumps(additional_config), *args]
        self.log = open(self.log_path, "w")
        # own session: teardown signals this server and its engine process, nothing else
        self.proc = subprocess.Popen(cmd, env=environ, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, n=4000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-n:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready after {STARTUP_S} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()

    def idle(self, timeout=60) -> bool:
        """Whether the engine reports no running or waiting request (polled, bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = httpx.get(self.url + "/metrics", timeout=5).text
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))]
            if values and not any(values):
                return True
            time.sleep(0.5)
        return False

    def state(self) -> dict:
        with open(self.state_path) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return Ref(tmp_path_factory.mktemp("fxreplace_vllm_server"))


@pytest.fixture(scope="module", params=["eager", "compiled"])
def server(ref, tmp_path_factory, request):
    config = {"fxreplace": {"tensors_path": ref.ref_dir, "on_unknown": "passthrough"}}
    # engine core in its own process (the multi-process path), its worker inside it:
    # one vLLM import less to start than the default multiproc executor
    srv = Server(ref.ckpt, tmp_path_factory.mktemp("server"), request.param, config,
                 "--distributed-executor-backend", "uni")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def body(ref, prompt, max_tokens=NEW, **extra) -> dict:
    return {"model": ref.ckpt, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 5, "ignore_eos": True, "return_tokens_as_token_ids": True, **extra}


def parse(choice) -> tuple[list[int], list[dict[int, float]]]:
    """Generated token ids and each step's top logprobs ``{token_id: logprob}``."""
    lp = choice["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    tops = [{int(t.removeprefix("token_id:")): v for t, v in step.items()} for step in lp["top_logprobs"]]
    return tokens, tops


def http_diff(ref: Ref, prompt: list[int], tokens, tops, forced: dict | None) -> float:
    """Largest |server - HF| over the returned logprobs; HF replaces with ``forced`` rows."""
    from fxreplace.engines.vllm.testing import hf_logprobs

    lp = hf_logprobs(ref.hf, list(prompt) + tokens[:-1], forced)
    return max(abs(v - lp[len(prompt) - 1 + j, t].item()) for j, step in enumerate(tops) for t, v in step.items())


def test_server_known_prompts_exact(ref, server):
    for name in ref.known:
        r = httpx.post(server.url + "/v1/completions", json=body(ref, ref.prompts[name]), timeout=60)
        assert r.status_code == 200, r.text
        tokens, tops = parse(r.json()["choices"][0])
        assert len(tokens) == NEW
        assert http_diff(ref, ref.prompts[name], tokens, tops, ref.forced[name]) < ATOL, name
        assert http_diff(ref, ref.prompts[name], tokens, tops, None) > 0.1, name  # replacement changed outputs
    # per-request switch: the same known prompt served without replacement
    r = httpx.post(server.url + "/v1/completions", json=body(ref, ref.prompts["short"], vllm_xargs={"fxreplace": "off"},
                                                              cache_salt="plain"), timeout=60)
    tokens, tops = parse(r.json()["choices"][0])
    assert http_diff(ref, ref.prompts["short"], tokens, tops, None) < ATOL
    r = httpx.post(server.url + "/v1/completions", json=body(ref, ref.prompts["unknown"]), timeout=60)
    tokens, tops = parse(r.json()["choices"][0])
    assert http_diff(ref, ref.prompts["unknown"], tokens, tops, None) < ATOL
    # fxreplace's own log lines reach the server's output through vLLM's handler
    log = server.log_tail(10**7)
    assert "fxreplace: instrumented 2 target(s) of Qwen3MoeForCausalLM" in log
    assert "matches no reference prompt; served without replacement" in log


def test_server_100_concurrent_requests(ref, server):
    g = torch.Generator().manual_seed(1)
    jobs = []  # (kind, prompt index name or prompt, request body)
    for i in range(100):
        kind = ["known", "known", "retry", "unknown", "disconnect"][i % 5]
        name = ref.known[i % 3]
        if kind == "known":
            jobs.append((kind, name, ref.prompts[name], body(ref, ref.prompts[name])))
        elif kind == "retry":  # teacher forcing: the prompt plus k reference tokens, a new request
            k = 1 + i % 4
            prompt = ref.prompts[name] + [5] * k
            jobs.append((kind, name, prompt, body(ref, prompt, max_tokens=NEW - k)))
        elif kind == "unknown":
            prompt = [14] + torch.randint(4, 128, (20 + i % 30,), generator=g).tolist()
            jobs.append((kind, None, prompt, body(ref, prompt)))
        else:  # long generations the client abandons
            prompt = ref.prompts[name] if i % 2 else [15] + torch.randint(4, 128, (30,), generator=g).tolist()
            jobs.append((kind, i, prompt, body(ref, prompt, max_tokens=200, stream=i % 4 == 0)))

    async def one(client, kind, key, prompt, payload):
        if kind != "disconnect":
            r = await client.post("/v1/completions", json=payload)
            return r.status_code, (r.json() if r.status_code == 200 else r.text)
        if payload.get("stream"):  # read the first chunk, then hang up
            async with client.stream("POST", "/v1/completions", json=payload) as r:
                async for _ in r.aiter_lines():
                    break
            return "disconnected", None
        try:  # give up after a short while: the task is cancelled, the connection closed
            r = await asyncio.wait_for(client.post("/v1/completions", json=payload), timeout=0.5)
            return r.status_code, None  # finished in time (allowed)
        except asyncio.TimeoutError:
            return "cancelled", None

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, *job) for job in jobs)), timeout=240)

    results = asyncio.run(main())
    failures = [(job[0], status, str(data)[:300]) for job, (status, data) in zip(jobs, results)
                if status not in (200, "cancelled", "disconnected")]
    assert not failures, failures
    assert sum(s in ("cancelled", "disconnected") for s, _ in results) >= 10  # the early hang-ups happened
    worst = {"known": 0.0, "retry": 0.0, "unknown": 0.0}
    for (kind, key, prompt, _), (status, data) in zip(jobs, results):
        if kind == "disconnect":
            continue
        tokens, tops = parse(data["choices"][0])
        forced = ref.forced[key] if key is not None else None
        worst[kind] = max(worst[kind], http_diff(ref, prompt, tokens, tops, forced))
    assert all(v < ATOL for v in worst.values()), worst

    # Every request has finished or was aborted. Finished ids reach the worker with a later
    # step, so run two probes one after the other: afterwards the worker's map holds at
    # most the last probe ("short" = prompt 0), and every other registration was released.
    assert server.idle(), "requests still running after all clients finished"
    before = server.state()["registered"]
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json=body(ref, ref.prompts["short"], max_tokens=2), timeout=60)
        assert r.status_code == 200
    state = server.state()
    assert before >= 80 and state["registered"] == before + 2  # every non-cancelled request was registered
    assert list(state["requests"].values()) in ([], [0]), state["requests"]
    assert state["registered"] - state["released"] == len(state["requests"])
    assert state["errors"] == 0 and state["tokens_replaced"] > 0
    log = server.log_tail(10 ** 7)
    assert "step served without replacement" not in log and "Traceback" not in log, log[-3000:]
