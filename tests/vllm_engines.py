"""Running a vLLM engine script in a subprocess for the tests.

Each engine gets its own process (an engine leaves state behind that keeps a
later one in the same process from starting; TP=2 needs its own process group)
and its own session, so a timeout kills the engine core and every worker with
the script (orphaned vLLM workers busy-poll and starve everything after them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest


def engine_env(tp: int = 1, compiled: bool = False) -> dict:
    """The environment of a test engine: one OpenMP thread, a 1 GiB KV cache, one
    core per TP worker, callable ``collective_rpc``; the test run's own VLLM_*/FXREPLACE_*
    settings are not inherited. Compiled engines use the eager Dynamo backend when
    ``FXREPLACE_TEST_DYNAMO_EAGER`` is set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if tp > 1 else "0")
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # else a NUMA assertion
    if compiled and os.environ.get("FXREPLACE_TEST_DYNAMO_EAGER"):
        env["VLLM_CPU_CI_ENV"] = "1"
    return env


def run_python(args: list[str], *, timeout_s: float, tp: int = 1, compiled: bool = False,
               env: dict | None = None) -> str:
    """``python *args`` in its own session with :func:`engine_env` (updated with ``env``); its
    stdout (fails the test on a non-zero exit or a timeout, showing stderr)."""
    proc = subprocess.Popen([sys.executable, *args], env={**engine_env(tp, compiled), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{args[:3]} did not finish within {timeout_s} s:\n{stderr[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a finished run
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, (stdout[-2000:], stderr[-6000:])
    return stdout


def result_line(stdout: str):
    """The JSON after the last ``RESULT `` line of a script's stdout."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1][len("RESULT "):])
