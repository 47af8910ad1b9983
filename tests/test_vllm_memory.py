"""vLLM's memory chosen for the run (no engine starts here; tests/test_vllm_validate.py runs the
command with these defaults): on the CPU backend fxreplace sizes the KV cache from what the run's
requests need, keeps the user's own sizing, and refuses in one line what does not fit."""

import json
from pathlib import Path

import psutil
import pytest

from fxreplace.engines.vllm import preflight
from fxreplace.loading import SetupError
from fxreplace.models import tiny_model

ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "ckpt"
    tiny_model(ARCH).save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def no_user_sizing(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the user's own sizing is tested explicitly


def test_the_kv_cache_holds_every_token_of_every_layer_and_no_more_than_needed(checkpoint):
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    tokens = 8 * 256
    options = preflight.with_kv_cache(checkpoint, {"max_model_len": 256}, tokens, "float32")
    sized = options["kv_cache_memory_bytes"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    assert sized >= tokens * per_token and options["max_model_len"] == 256
    assert sized <= max(preflight.MIN_KV_CACHE, 4 * tokens * per_token)  # not vLLM's 0.92 of the machine
    many = preflight.with_kv_cache(checkpoint, {}, 64 * 4096, "float32")["kv_cache_memory_bytes"]
    half = preflight.with_kv_cache(checkpoint, {}, 64 * 4096, "bfloat16")["kv_cache_memory_bytes"]
    assert many > sized and half * 2 == many  # it grows with the tokens and shrinks with the dtype


@pytest.mark.parametrize("given", [{"kv_cache_memory_bytes": 1 << 30}, {"gpu_memory_utilization": 0.3}])
def test_the_users_own_sizing_is_kept(checkpoint, given):
    assert preflight.with_kv_cache(checkpoint, given, 1 << 20, "float32") == given


def test_vllms_own_environment_variable_is_kept(checkpoint, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert "kv_cache_memory_bytes" not in preflight.with_kv_cache(checkpoint, {}, 1 << 20, "float32")


def _free(monkeypatch, available: int):
    memory = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory._replace(available=available))


def test_a_kv_cache_that_does_not_fit_is_one_line_naming_what_it_needs(checkpoint, monkeypatch):
    _free(monkeypatch, preflight.CPU_HEADROOM + 100 * 2**20)  # 100 MiB beside vLLM's processes
    with pytest.raises(SetupError, match=r"vLLM needs 0\.25 GiB of KV cache for 4096 tokens beside 0\.\d\d GiB of "
                                         r"weights, and 0\.1 GiB are free"):
        preflight.with_kv_cache(checkpoint, {}, 4096, "float32")


def test_the_default_is_not_refused_for_vllms_utilization_on_a_busy_machine(monkeypatch):
    """vLLM's 0.92 default never applies where fxreplace sizes the cache, so a machine with a third of its
    memory free runs the defaults; a utilization the user gives is still checked."""
    _free(monkeypatch, psutil.virtual_memory().total // 3)
    preflight.check_memory({})
    with pytest.raises(SetupError, match=r"vLLM would reserve 0\.9 of this machine's memory"):
        preflight.check_memory({"gpu_memory_utilization": 0.9})
