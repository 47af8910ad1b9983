"""The core works with torch alone: in a fresh interpreter where transformers,
vLLM, matplotlib and tqdm cannot be imported, store, replacer, instrument,
passes, export and sharding run end to end on the HF-independent family."""

import re
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    for blocked in ("transformers", "vllm", "matplotlib", "tqdm"):
        sys.modules[blocked] = None  # any import of it raises ModuleNotFoundError

    import torch
    import fxreplace
    from fxreplace import ReferenceStore, ShardSpec, Target, TensorReplacer
    from fxreplace.models import get_family, tiny_model

    names = ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    prompt = [5, 7, 9, 11]
    captures = [{n: [torch.randn(1, 4, 8)] for n in names}]
    ReferenceStore.from_captures(captures, prompt_token_ids=[prompt]).save(sys.argv[1])
    replacer = TensorReplacer(ReferenceStore.load(sys.argv[1]))
    replacer.register_request("r", prompt)
    ctx = replacer.build_context(["r"], [0, 1, 2, 3], is_prefill=True)

    plain = tiny_model("NeuronMoeForCausalLM")
    ids = torch.tensor([prompt])
    expected = plain(ids)
    model = fxreplace.instrument(tiny_model("NeuronMoeForCausalLM"), get_family("NeuronMoeForCausalLM").targets)
    assert model.targets == names
    assert torch.equal(model(ids, replacements=replacer.warmup_context(4)), expected)
    assert not torch.allclose(model(ids, replacements=ctx), expected)

    program = fxreplace.export(tiny_model("NeuronMoeForCausalLM"), (ids,), targets=names)
    torch.testing.assert_close(program.module()(input_ids=ids, **fxreplace.export_inputs(program, ctx)), model(ids, replacements=ctx))

    sharded = Target("model.layers.*.mlp.router", shard=ShardSpec("sequence", 2, torch.tensor(1)))
    half = fxreplace.instrument(tiny_model("NeuronMoeForCausalLM"), [sharded])
    assert half(ids[:, 2:], replacements=ctx).shape == (1, 2, 128)

    try:
        get_family("Qwen3MoeForCausalLM")
    except KeyError as error:
        assert "fxreplace[hf]" in str(error), error
    else:
        raise AssertionError("an HF family registered without transformers")
    loaded = sorted(m for m in ("transformers", "vllm", "matplotlib", "tqdm") if sys.modules.get(m) is not None)
    assert not loaded, loaded
    print("torch-only core OK")
""")


def test_core_without_transformers(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ref")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch-only core OK" in result.stdout


def test_cli_without_the_hf_extra_says_what_to_install():
    script = ("import sys\nfor blocked in ('transformers', 'matplotlib', 'tqdm'):\n    sys.modules[blocked] = None\n"
              "from fxreplace.cli import main\nmain(['demo'])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2  # the user's environment lacks it: a user's mistake to fix, in one line
    assert re.fullmatch(r"error: fxreplace demo needs (transformers|matplotlib|tqdm); hint: pip install 'fxreplace\[hf\]'",
                        result.stderr.strip()), result.stderr[-2000:]
