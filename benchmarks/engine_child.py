"""A benchmark's engine child process, driven over its stdin/stdout.

The child prints ``READY`` once started and answers each ``sample`` line on stdin
with one ``RESULT {json}`` line; closing stdin ends it. Shared by the vLLM
benchmarks, which keep several such engines alive side by side and take samples
from them in turn.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile


class EngineChild:
    def __init__(self, name: str, cmd: list[str], env: dict):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr: shown if the child fails
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)

    def expect(self, prefix: str) -> str:
        """The rest of the next stdout line starting with ``prefix``; exits with the child's log if it died."""
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.log.seek(0)
        sys.exit(f"{self.name} failed:\n{self.log.read()[-3000:]}")

    def sample(self) -> dict:
        self.proc.stdin.write("sample\n")
        self.proc.stdin.flush()
        return json.loads(self.expect("RESULT "))

    def close(self, timeout_s: float = 120) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout_s)
