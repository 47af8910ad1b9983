"""A vLLM engine's start: Ctrl-C ends it within seconds; fxreplace's own start-up error in a
worker reaches the command in its own words.

An error of fxreplace's in an engine process at start-up (a target that names no module, an
instrumentation that changed the model: :func:`report_start_error`) would reach the command only
as vLLM's "Engine core initialization failed": :func:`start_errors` gives the engine's processes
(which inherit the environment) a file to write it to, and raises it again in the command.

While ``vllm.LLM(...)`` starts, its client waits for the engine core in a single ``zmq`` poll of
up to ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s). pyzmq retries a poll interrupted by a signal and
drops the exception the signal's handler raised (its ``_check_rc`` raises
``InterruptedSystemCall`` over it), so a KeyboardInterrupt raised there never arrives and the
user waits out the timeout. :func:`interruptible_start` stops the processes the start created on
the first Ctrl-C, removes their shared memory and raises KeyboardInterrupt; when that is dropped,
an alarm a moment later says what the command left
(its ``interrupted``, :attr:`fxreplace.engines.registry.EngineRun.interrupted`) and exits 130 itself:
nothing is being written while an engine starts. (The engine's own processes, reached by the
same Ctrl-C half-started, may print their tracebacks above that line.)
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Callable

from ...config import ConfigError
from ...unchanged import InstrumentationChangedError
from ...targets import TargetError
from . import shm


def _say_stopped() -> None:
    print("interrupted: the vLLM engine was starting; its processes are stopped", file=sys.stderr, flush=True)


#: how long a KeyboardInterrupt may take to leave the start before the process exits by itself
GRACE_S = 1.0


@contextmanager
def engine_start(interrupted: Callable[[], None] | None = None):
    """Around a vLLM engine's start (``with engine_start(): llm = LLM(...)``): Ctrl-C ends it
    within seconds (:func:`interruptible_start`, ``interrupted`` saying the last words), and an
    engine process's fxreplace error is raised here in its own words (:func:`start_errors`)."""
    with start_errors(), interruptible_start(interrupted):
        yield


@contextmanager
def interruptible_start(interrupted: Callable[[], None] | None = None):
    """Run a vLLM engine's start so that Ctrl-C ends it within seconds, the processes it started
    stopped and their shared memory removed; when the KeyboardInterrupt is lost, ``interrupted``
    (the command's words; None: the engine's) is said before the process exits. Only the main
    thread receives signals: elsewhere the start runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import psutil  # a vLLM dependency

    this = psutil.Process()
    before = {p.pid for p in _children(this)}
    segments = shm.Cleanup()

    def stop(signum, frame):
        created = [p for p in _children(this) if p.pid not in before]
        for p in created:  # half-started: nothing of theirs to keep, and a gentler signal makes them print more
            _quietly(p.kill)
        psutil.wait_procs([p for p in created if p.ppid() == this.pid], timeout=5)  # reaped, not left as zombies
        segments.after_teardown(wait_s=1.0, own_wait_s=5.0)
        signal.signal(signal.SIGALRM, functools.partial(_exit_interrupted, interrupted or _say_stopped))
        signal.setitimer(signal.ITIMER_REAL, GRACE_S)
        raise KeyboardInterrupt

    previous, previous_alarm = signal.signal(signal.SIGINT, stop), signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        signal.signal(signal.SIGINT, previous)


def _children(process) -> list:
    try:
        return process.children(recursive=True)
    except Exception:  # noqa: BLE001 - the process table changed meanwhile: nothing more to stop
        return []


def _quietly(action) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - exited meanwhile
        pass


def _exit_interrupted(say: Callable[[], None], signum, frame) -> None:
    """The KeyboardInterrupt was dropped inside the engine's wait: say what was left and exit."""
    say()
    os._exit(128 + signal.SIGINT)  # the status of a process a SIGINT stopped, as the command line's own exit


#: set while an engine starts: the file an engine process writes fxreplace's start-up error to
START_ERROR_ENV = "FXREPLACE_START_ERROR"
#: the errors a worker reports by name, raised again by the command as the same class
_REPORTED = {cls.__name__: cls for cls in (InstrumentationChangedError, TargetError, ConfigError)}


def report_start_error(error: Exception) -> None:
    """In an engine process: write ``error`` (one of fxreplace's, a user's to act on) where the
    command that starts the engine reads it; the first process to fail is the one reported."""
    path = os.environ.get(START_ERROR_ENV)
    kind = next((name for name, cls in _REPORTED.items() if isinstance(error, cls)), None)
    if not path or kind is None:
        return
    with open(path, "a") as f:  # start_errors made it empty: the first report is kept
        if f.tell() == 0:
            json.dump({"type": kind, "message": str(error)}, f)


@contextmanager
def start_errors():
    """Around an engine's start: when it fails, raise the fxreplace error an engine process
    reported (:func:`report_start_error`) instead of vLLM's own words for the failure."""
    fd, path = tempfile.mkstemp(prefix="fxreplace-start-", suffix=".json")
    os.close(fd)
    saved = os.environ.get(START_ERROR_ENV)
    os.environ[START_ERROR_ENV] = path
    try:
        yield
    except Exception as failure:
        with open(path) as f:
            text = f.read()
        if not text:
            raise
        reported = json.loads(text)
        raise _REPORTED[reported["type"]](reported["message"]) from failure
    finally:
        if saved is None:
            os.environ.pop(START_ERROR_ENV, None)
        else:
            os.environ[START_ERROR_ENV] = saved
        os.unlink(path)
