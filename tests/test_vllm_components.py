"""Every family's components in vLLM's model code (``components_for("vllm")``) in a real vLLM engine (float32), and
per-request selection of captures (``select_captures``).

Per family: the reference is the clean HF model with its components captured; vLLM
loads the same checkpoint with two planted faults, layer 0's attention output
projection scaled and, in layer 1, the router weight negated (dense families: the
MLP's down projection scaled). One engine, built the way ``fxreplace blame --engine
vllm`` builds it (:class:`~fxreplace.engines.vllm.engine.VllmBlameEngine`: every component
instrumented, mapped from the reference's components by kind and layer), serves one
mixed batch whose requests select different captures. Requests whose selection
removes both faults must match the clean HF model's log-probabilities; with no
replacement, or with one fault left, they must not.

The families are read from the registry, so a registration cannot claim vLLM
components that do not work. Each engine runs in its own subprocess (see
test_vllm_families.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from fxreplace.components import recorded_components
from fxreplace.capture import capture_reference
from fxreplace.models import families, get_family, tiny_model
from fxreplace.reference import load_reference
from fxreplace.engines.vllm.testing import hf_logprobs, save_tiny_checkpoint
from test_vllm import max_diff
from test_vllm_families import VLLM_CONFIG, VLLM_ENGINE_ARGS, _Output, atol

COMPONENT_FAMILIES = [arch for arch in families() if get_family(arch).components_for("vllm")]
# vLLM's default compiled mode for one family (one graph must serve every selection; its
# components are also exercised eagerly by test_blame_vllm.py), eager for the others
COMPILED = {"Qwen3MoeForCausalLM"}
NEW = 4

ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import SamplingParams
    from fxreplace.engines.vllm.engine import VllmBlameEngine
    ckpt, ref_dir, prompts, selections = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    blame_engine = VllmBlameEngine(ckpt, ref_dir, logprobs=5, max_model_len=128, max_num_seqs=16,
                                   enforce_eager=sys.argv[5] == "eager", distributed_executor_backend="uni",
                                   enable_prefix_caching=False, **json.loads(sys.argv[6]))
    def params(selection):
        extra = {"fxreplace": "off"} if selection is None else {"fxreplace": {"captures": selection}}
        return SamplingParams(temperature=0.0, max_tokens=%d, logprobs=5, prompt_logprobs=5, ignore_eos=True,
                              extra_args=extra)
    refusals = []  # bad selections, refused in the front end before the batch below
    for bad in ({"captures": ["model.layers.0.self_atn"]}, {"capture": []}):
        try:
            blame_engine.engine.llm.generate([{"prompt_token_ids": prompts[0]}],
                                             SamplingParams(max_tokens=1, extra_args={"fxreplace": bad}), use_tqdm=False)
            refusals.append(None)
        except Exception as exc:
            refusals.append(str(exc))
    requests = [(p, s) for p in prompts for s in selections]  # one mixed batch
    outs = blame_engine.engine.llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                                            [params(s) for _, s in requests], use_tqdm=False)
    def steps(logprobs):
        return [None if s is None else {str(t): v.logprob for t, v in s.items()} for s in logprobs]
    print("RESULT " + json.dumps({
        "refusals": refusals,
        "components": sorted((c.kind, c.layer, c.capture_name, c.target.pattern) for c in blame_engine.components),
        "outs": [[list(o.outputs[0].token_ids), steps(o.outputs[0].logprobs), steps(o.prompt_logprobs)]
                 for o in outs]}), flush=True)
    blame_engine.close()
""" % NEW)


class ComponentRun:
    """One family: clean HF reference with components, a faulty checkpoint, one engine."""

    def __init__(self, arch: str, directory):
        family = get_family(arch)
        config = VLLM_CONFIG.get(arch, {})
        self.arch, self.kinds = arch, list(family.components_for("vllm"))
        self.clean = tiny_model(arch, **config)
        g = torch.Generator().manual_seed(0)
        self.prompts = [[10 + i] + torch.randint(4, 128, (n - 1,), generator=g).tolist() for i, n in enumerate((20, 33))]
        ref_dir = directory / "reference"
        capture_reference(self.clean, self.prompts, [], NEW, components=family.components, progress=False).save(ref_dir)
        ckpt = save_tiny_checkpoint(arch, directory / "ckpt", **config)
        weights = load_file(str(ckpt / "model.safetensors"))
        second = "router" if "router" in self.kinds else "mlp"
        if second == "router":
            key = next(k for k in weights if k.startswith("model.layers.1.") and k.endswith(("gate.weight", "router.weight")))
            weights[key] = -weights[key]
        else:
            weights["model.layers.1.mlp.down_proj.weight"] *= 1.5
        weights["model.layers.0.self_attn.o_proj.weight"] *= 1.5
        save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        block = next(k for k in self.kinds if k in ("experts", "mlp"))
        names = {(info["kind"], info["layer"]): n for n, info in recorded_components(load_reference(ref_dir)).items()}
        self.recorded = set(names)  # (kind, layer): DeepSeek-V3's dense first layer has no router
        # label -> (the capture names a request selects, None: off; whether that removes both faults)
        self.selections = {
            "off": (None, False),
            f"attention.0+{second}.1": ([names["attention", 0], names[second, 1]], True),
            f"layer.0+{block}.1": ([names["layer", 0], names[block, 1]], True),
            "layer.1": ([names["layer", 1]], True),
            "attention.0 only": ([names["attention", 0]], False),
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.mode = "compiled" if arch in COMPILED else "eager"
        if self.mode == "compiled" and os.environ.get("FXREPLACE_TEST_DYNAMO_EAGER"):
            env["VLLM_CPU_CI_ENV"] = "1"
        proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(ckpt), str(ref_dir), json.dumps(self.prompts),
                               json.dumps([s for s, _ in self.selections.values()]), self.mode,
                               json.dumps(VLLM_ENGINE_ARGS.get(arch, {}))],
                              env=env, capture_output=True, text=True, timeout=400)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"{arch}: vLLM engine failed:\n{proc.stderr[-4000:]}"
        self.result = json.loads(lines[-1][len("RESULT "):])
        outs = iter(_Output(*o) for o in self.result["outs"])
        self.outs = {(i, label): next(outs) for i in range(len(self.prompts)) for label in self.selections}

    def diff(self, i: int, label: str) -> float:
        """Max |vLLM - clean HF| log-prob over prompt i's prompt and generated steps."""
        out = self.outs[i, label]
        seq = self.prompts[i] + list(out.outputs[0].token_ids)[:-1]
        return max_diff(hf_logprobs(self.clean, seq), len(self.prompts[i]), out)


@pytest.fixture(scope="module", params=COMPONENT_FAMILIES)
def run(request, tmp_path_factory):
    return ComponentRun(request.param, tmp_path_factory.mktemp(f"fxreplace_components_{request.param}"))


def test_every_component_maps_to_a_vllm_module(run):
    layers = run.clean.config.num_hidden_layers
    found = {(kind, layer) for kind, layer, _, _ in run.result["components"]}
    # vLLM's components declare no embedding yet (the HF components start with it): blame through
    # vLLM searches the layers' components only
    assert found == {(kind, layer) for kind, layer in run.recorded if kind in run.kinds}
    assert {layer for _, layer in found} == set(range(layers)) and {kind for kind, _ in found} == set(run.kinds)


def test_bad_selection_is_refused_naming_it(run):
    """Refused in the front end, naming the capture; the engine then serves the batch."""
    unknown, malformed = run.result["refusals"]
    assert unknown is not None and "selects capture(s) ['model.layers.0.self_atn'] that the reference does not hold" \
        in unknown and "model.layers.0.self_attn" in unknown  # the closest name is suggested
    assert malformed is not None and "must be 'off' or {'captures': [capture names]}, got {'capture': []}" in malformed


def test_selected_components_restore_the_clean_model(run):
    for i in range(len(run.prompts)):
        for label, (_, restores) in run.selections.items():
            d = run.diff(i, label)
            print(f"{run.arch} ({run.mode}) prompt {i} {label}: max |dlogprob| vs clean HF {d:.2e}")
            if restores:
                assert d < atol(run.arch), (run.arch, i, label, d)
            else:
                assert d > 0.1, (run.arch, i, label, d)  # a fault is left: the outputs differ
