"""Running a vLLM engine script in a subprocess for the tests.

Each engine gets its own process (an engine leaves state behind that keeps a
later one in the same process from starting; TP=2 needs its own process group)
and its own session, so a timeout kills the engine core and every worker with
the script (orphaned vLLM workers busy-poll and starve everything after them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fxreplace.engines.vllm import shm as shm_segments


def engine_env(tp: int = 1, compiled: bool = False) -> dict:
    """The environment of a test engine: one OpenMP thread, a 1 GiB KV cache, one
    core per TP worker; no VLLM_ALLOW_INSECURE_SERIALIZATION (users do not set it: fxreplace's
    worker methods are called by name); the test run's own VLLM_*/FXREPLACE_*
    settings are not inherited. Compiled engines use the eager Dynamo backend when
    ``FXREPLACE_TEST_DYNAMO_EAGER`` is set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if tp > 1 else "0")
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # else a NUMA assertion
    if compiled and os.environ.get("FXREPLACE_TEST_DYNAMO_EAGER"):
        env["VLLM_CPU_CI_ENV"] = "1"
    return env


def run_python(args: list[str], *, timeout_s: float, tp: int = 1, compiled: bool = False,
               env: dict | None = None, logs: Path | None = None) -> str:
    """``python *args`` in its own session with :func:`engine_env` (updated with ``env``); its
    stdout. A non-zero exit or a timeout fails the test with :func:`failure_report` (``logs``:
    a folder whose log files may hold the cause, a Ray cluster's)."""
    remove_leaked_shm()
    proc = subprocess.Popen([sys.executable, *args], env={**engine_env(tp, compiled), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(failure_report(f"did not finish within {timeout_s} s", args, stdout, stderr, logs), pytrace=False)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a finished run
        except ProcessLookupError:
            pass
    if proc.returncode != 0:
        pytest.fail(failure_report(f"exited with {proc.returncode}", args, stdout, stderr, logs), pytrace=False)
    return stdout


def remove_leaked_shm(shm: Path = shm_segments.SHM) -> list[str]:
    """Unlink every vLLM shared-memory segment of ``shm`` that no live process uses
    (:mod:`fxreplace.engines.vllm.shm`): what killed engines (a timeout's, another test run's) left.
    fxreplace removes its own engines' at teardown; a killed one cannot."""
    return shm_segments.remove_unused(shm_segments.segments(shm), shm)


_CAUSE = re.compile(r"Error|Exception|Killed|killed|memory|Traceback|died|FAILED|Timeout")


def failure_report(what: str, args: list[str], stdout: str, stderr: str, logs: Path | None) -> str:
    """Why an engine script failed, cause first: CI shows a failure's first lines, and an
    engine's stderr is mostly start-up logging. Then the lines of ``logs``' files that
    name an error (a Ray worker killed for memory says so only there), then the tails."""
    causes = [line for line in stderr.splitlines() if _CAUSE.search(line)][-12:]
    log_causes = []
    for path in sorted(logs.rglob("*")) if logs is not None else ():
        if path.is_file() and path.suffix in (".log", ".out", ".err"):
            found = [line for line in path.read_text(errors="replace").splitlines() if _CAUSE.search(line)]
            log_causes += [f"{path.relative_to(logs)}: {line[:300]}" for line in found[-3:]]
    return "\n".join([f"python {' '.join(args[:4])} ... {what}; its error lines:", *causes,
                      *(["error lines of its logs:", *log_causes[-20:]] if log_causes else []),
                      "--- stderr tail ---", stderr[-6000:], "--- stdout tail ---", stdout[-2000:]])


def result_line(stdout: str):
    """The JSON after the last ``RESULT `` line of a script's stdout."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1][len("RESULT "):])
