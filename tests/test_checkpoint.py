"""Checkpoints load with each weight in memory once: no file mapping held beside the parameters."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from fxreplace.checkpoint import load_checkpoint, weight_files
from fxreplace.models import tiny_model


def mapped(paths) -> set[str]:
    """Which of ``paths`` this process has memory-mapped now."""
    names = {str(p.resolve()) for p in paths}
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if line.rstrip().split()[-1] in names}


@pytest.mark.parametrize("arch,disk_dtype,dtype", [
    ("Qwen3MoeForCausalLM", torch.float32, torch.float32),  # experts fused on load: converted tensors
    ("Qwen3MoeForCausalLM", torch.bfloat16, torch.float32),  # upcast on load
    ("LlamaForCausalLM", torch.bfloat16, torch.bfloat16),  # loaded as stored
])
def test_sharded_checkpoint_loads_without_a_mapping(tmp_path, arch, disk_dtype, dtype):
    saved = tiny_model(arch).to(disk_dtype)
    saved.save_pretrained(tmp_path, max_shard_size="100KB")
    files = weight_files(tmp_path)
    assert len(files) > 1
    with safe_open(str(files[0]), framework="pt") as f:  # the check sees a mapping where there is one
        assert mapped(files) == {str(files[0].resolve())}
        del f
    model = load_checkpoint(tmp_path, dtype)
    assert not mapped(files), "the checkpoint's files stay mapped beside the parameters"
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert list(model.state_dict()) == list(expected.state_dict())
    for name, value in expected.state_dict().items():
        assert model.state_dict()[name].dtype == dtype
        assert torch.equal(model.state_dict()[name], value), name
    assert not model.training and model.config.name_or_path == str(tmp_path)
    assert model.generation_config.to_dict() == expected.generation_config.to_dict()


@pytest.mark.compat
@pytest.mark.parametrize("layout", ["bin", "sharded-bf16"])
def test_loaded_weights_are_the_saved_ones(tmp_path, layout):
    """Every checkpoint layout and transformers version: an older checkpoint's pytorch_model.bin, or
    (transformers 4) safetensors shards, go through from_pretrained."""
    saved = tiny_model("LlamaForCausalLM")
    if layout == "bin":
        saved.config.save_pretrained(tmp_path)
        torch.save(saved.state_dict(), tmp_path / "pytorch_model.bin")  # an older checkpoint's format
        assert weight_files(tmp_path) == []
    else:
        saved = saved.to(torch.bfloat16)
        saved.save_pretrained(tmp_path, max_shard_size="100KB")
    model = load_checkpoint(tmp_path, torch.float32)
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], value.float()), name
