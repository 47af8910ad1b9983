"""Values are checked where they enter, by type and range, with an error naming the argument,
instead of failing deep inside a forward or an engine (each case below did)."""

from __future__ import annotations

import pytest
import torch

from fxreplace import ReplacementConfig, instrument
from fxreplace.config import ConfigError
from fxreplace.models import tiny_model
from fxreplace.sharding import ShardSpec
from fxreplace.store import ReferenceStore
from fxreplace.targets import Target, TargetError

ARCH = "Qwen3MoeForCausalLM"


def test_a_target_that_is_not_a_pattern_or_a_target_is_named():
    with pytest.raises(TargetError, match=r"targets\[1\] must be a pattern \(str\) or a Target, got int 3"):
        instrument(tiny_model(ARCH), ["model.layers.*.mlp.gate", 3])
    with pytest.raises(TargetError, match=r"Target pattern must be a qualified module name \(str\), got int 3"):
        Target(3)


def test_a_name_template_with_more_fields_than_wildcards_is_refused_when_made():
    with pytest.raises(TargetError, match=r"name template '\{\}\.\{\}' uses 2 field\(s\) but the pattern has 1 wildcard"):
        Target("model.layers.*.mlp.gate", name="{}.{}")
    with pytest.raises(TargetError, match=r"named fields \['layer'\]"):
        Target("model.layers.*.mlp.gate", name="model.layers.{layer}.mlp.gate")
    assert Target("model.layers.*.mlp.gate", name="r.{0}").name == "r.{0}"


@pytest.mark.parametrize("rank", [1.0, "1", True])
def test_a_shard_rank_must_be_an_integer(rank):
    with pytest.raises(ValueError, match="rank must be an int or a 0-d integer tensor"):
        ShardSpec("expert", 2, rank)
    assert ShardSpec("expert", 2, torch.tensor(1)).world_size == 2


def test_config_typos_are_refused_naming_the_field(tmp_path):
    ReferenceStore.from_captures([{"m": [torch.zeros(1, 2, 3)]}], prompt_token_ids=[[1, 2]]).save(tmp_path / "ref")
    with pytest.raises(ConfigError, match="on_unknown must be 'error' or 'passthrough', got 'passthru'"):
        ReplacementConfig(tensors_path=tmp_path / "ref", on_unknown="passthru")
    with pytest.raises(ConfigError, match="select_captures must be true or false, got 'yes'"):
        ReplacementConfig(tensors_path=tmp_path / "ref", select_captures="yes")


def test_a_vllm_capture_into_a_store_is_refused_before_any_engine_process_starts(tmp_path):
    from fxreplace.engines.vllm.capture import capture_with_vllm
    from fxreplace.engines.vllm.testing import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(ARCH, tmp_path / "ckpt")
    ReferenceStore.from_captures([{"m": [torch.zeros(1, 2, 3)]}], prompt_token_ids=[[1, 2]]).save(tmp_path / "ref")
    with pytest.raises(ConfigError, match=r"capture out .*ref' is not empty \(\['index.json', 'reference.safetensors'\]\)"):
        capture_with_vllm(str(ckpt), [[1, 2, 3]], tmp_path / "ref", max_new_tokens=1)
    assert ReferenceStore.load(tmp_path / "ref").prompt_token_ids == [[1, 2]]


def test_the_runner_refuses_a_dtype_mismatch_zero_tokens_and_a_bucket_past_its_cache():
    import copy

    from fxreplace.engines.embedded.runner import Runner, RunnerConfig

    hf = tiny_model(ARCH)
    target = copy.deepcopy(hf).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"weights are torch.bfloat16 but Runner's dtype .* is torch.float32; "
                                         r"hint: Runner\(\.\.\., dtype=torch.bfloat16\)"):
        Runner(target, hf.config)  # was a raw index_copy_() dtype error from the KV cache at the first step
    assert Runner(target, hf.config, dtype="bfloat16").dtype == torch.bfloat16  # a dtype's name is that dtype
    with pytest.raises(ValueError, match=r"Runner's dtype must be a torch dtype or its name .*got 'bf16'"):
        Runner(target, hf.config, dtype="bf16")
    with pytest.raises(ValueError, match=r"prefill_buckets \(16, 64\) hold a bucket longer than max_len 32"):
        RunnerConfig(prefill_buckets=(16, 64), max_len=32)
    runner = Runner(hf, hf.config, runner_config=RunnerConfig(prefill_buckets=(8,), batch_buckets=(1,), max_len=16))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        runner.generate([[1, 2, 3]], 0, replace=False)  # generated one token before
    assert len(runner.generate([[1, 2, 3]], 1, replace=False)[0].tokens) == 1


def test_a_prompt_index_must_be_an_int():
    from fxreplace import TensorReplacer

    store = ReferenceStore.from_captures([{"m": [torch.zeros(1, 2, 3)]}], prompt_token_ids=[[1, 2]])
    replacer = TensorReplacer(store)
    with pytest.raises(TypeError, match="a prompt index must be an int, got str '0'"):
        replacer.register_request("r", prompt_idx="0")  # was "prompt 0 is not in the reference store (prompts: [0])"
    assert replacer.register_request("r", prompt_idx=0) == 0


def test_a_feed_made_under_inference_mode_is_filled_and_cleared_outside_it():
    from fxreplace import TensorReplacer

    store = ReferenceStore.from_captures([{"m": [torch.ones(1, 2, 3)]}], prompt_token_ids=[[1, 2]])
    replacer = TensorReplacer(store)
    with torch.inference_mode():  # an engine's start-up often runs under it
        feed = replacer.warmup_context(4)
    replacer.register_request("a", prompt_idx=0)
    replacer.build_context_for_batch(["a"], [2], [0, 1, 0, 0], out=feed)
    assert feed.mask.tolist() == [True, True, False, False]
    feed.mask.fill_(False)  # was "Inplace update to inference tensor outside InferenceMode is not allowed"
    with torch.inference_mode():
        feed.mask.fill_(True)
    assert feed.mask.all()
