"""ReplacementConfig: one configuration for the vLLM section, the CLI and the runner,
validated when it is made, errors naming the field."""

import pytest
import torch

from fxreplace import ConfigError, ReferenceStore, ReplacementConfig, Target, TensorReplacementConfig
from fxreplace import TensorReplacer
from fxreplace.replacer.sources import reference_capture_names, reference_token_ids
from fxreplace.store import load_token_ids
from fxreplace.sharding import ShardSpec


def stepwise(prompt_len, decode_steps, E=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, prompt_len, E, generator=g)] + [torch.randn(1, 1, E, generator=g) for _ in range(decode_steps)]


@pytest.fixture
def ref_dir(tmp_path):
    ReferenceStore.from_captures([{"m": stepwise(2, 1)}], prompt_token_ids=[[9, 8]]).save(tmp_path / "ref")
    return tmp_path / "ref"


def test_config_requires_exactly_one_source(ref_dir):
    with pytest.raises(ConfigError, match="give either tensors or tensors_path, not both"):
        ReplacementConfig(tensors=[], tensors_path=ref_dir)
    with pytest.raises(ConfigError, match="give tensors or tensors_path"):
        ReplacementConfig()
    with pytest.raises(ConfigError, match="give either prompt_token_ids or prompt_token_ids_path"):
        ReplacementConfig(tensors=[], prompt_token_ids=[[1]], prompt_token_ids_path=ref_dir)


def test_config_reads_store_directory_with_its_token_ids(ref_dir, tmp_path):
    replacer = TensorReplacer.from_config(ReplacementConfig(tensors_path=ref_dir))
    assert replacer.register_request("r", [9, 8, 1]) == 0
    with pytest.raises(KeyError, match="start with no stored prompt"):  # the one default: "error"
        replacer.register_request("u", [1, 2])
    assert TensorReplacer.from_config(ReplacementConfig(tensors_path=ref_dir, on_unknown="passthrough")).register_request("u", [1]) is None
    (tmp_path / "ids.json").write_text("[[9, 8]]")
    assert load_token_ids(tmp_path / "ids.json") == [[9, 8]]


def test_neuron_tool_name_is_the_same_config(ref_dir):
    assert TensorReplacementConfig is ReplacementConfig
    cfg = TensorReplacementConfig(tensors_path=str(ref_dir))
    assert cfg.tensors_path == str(ref_dir) and cfg.on_unknown == "error"


@pytest.mark.parametrize("bad, match", [
    ({"tensor_path": "ref"}, r"unknown fxreplace config field 'tensor_path' \(did you mean 'tensors_path'\?\)"),
    ({"tensors_path": "/no/such/ref"}, r"tensors_path: '/no/such/ref' does not exist"),
    ({"tensors_path": 5}, "tensors_path must be a path"),
    ({"tensors": [], "targets": 5}, "targets must be a list .* got int 5"),
    ({"tensors": [], "targets": "model.layers.*.mlp.gate"}, "targets must be a list .*wrap a single pattern in a list"),
    ({"tensors": [], "targets": [{"patern": "x"}]}, r"targets\[0\]: unknown target field 'patern' \(did you mean 'pattern'\?\)"),
    ({"tensors": [], "targets": [{"point": "output"}]}, r"targets\[0\]: a target dict needs 'pattern'"),
    ({"tensors": [], "targets": ["a", {"pattern": "b", "point": "outptu"}]}, r"targets\[1\]: unknown point 'outptu'"),
    ({"tensors": [], "targets": [{"pattern": "b", "adapter": "nope"}]}, r"targets\[0\]: unknown adapter 'nope'"),
    ({"tensors": [], "targets": []}, "targets is empty"),
    ({"tensors": [], "on_unknown": "drop"}, "on_unknown must be 'error' or 'passthrough'"),
    ({"tensors": [], "select_captures": "yes"}, "select_captures must be true or false, got 'yes'"),
    ({"capture": {"out": "ref"}, "on_unknown": "passthru"}, "on_unknown must be 'error' or 'passthrough'"),
    ({"capture": {"out": "ref"}, "select_captures": "yes"}, "select_captures must be true or false, got 'yes'"),
    ({"tensors": [], "name_map": {"model.layers.*.mlp.gate": "model.layers.*.block_sparse_moe.gate"}},
     r"'name_map' is replaced .*\"pattern\": \"model.layers.\*.block_sparse_moe.gate\", \"name\": \"model.layers.\{\}.mlp.gate\""),
    ([1], "must be a dict of fields"),
])
def test_from_dict_errors_name_the_field(bad, match):
    with pytest.raises(ConfigError, match=match):
        ReplacementConfig.from_dict(bad)


def test_dict_round_trip_and_target_forms(ref_dir):
    shard = ShardSpec("expert", 2, 1)
    cfg = ReplacementConfig.from_dict({
        "tensors_path": ref_dir, "on_unknown": "passthrough", "select_captures": True,
        "targets": ["a.*", Target("b", point="output[0]"),
                    {"pattern": "c.*.router", "name": "c.{}.gate", "adapter": "softmax_topk_renorm",
                     "shard": {"mode": "expert", "world_size": 2, "rank": 1}}],
    })
    assert repr(cfg.targets) == repr((Target("a.*"), Target("b", point="output[0]"),  # ShardSpec compares by identity
                                      Target("c.*.router", adapter="softmax_topk_renorm", shard=shard, name="c.{}.gate")))
    data = cfg.to_dict()
    assert repr(data) == repr({"tensors_path": str(ref_dir),
                               "targets": [{"pattern": "a.*"}, {"pattern": "b", "point": "output[0]"},
                                           {"pattern": "c.*.router", "adapter": "softmax_topk_renorm", "shard": shard,
                                            "name": "c.{}.gate"}],
                               "on_unknown": "passthrough", "select_captures": True})
    assert repr(ReplacementConfig.from_dict(data)) == repr(cfg)
    assert "select_captures" not in ReplacementConfig(tensors_path=ref_dir).to_dict()  # the default is left out


def test_reference_token_ids_from_each_source(ref_dir, tmp_path):
    assert reference_token_ids(ReplacementConfig(tensors_path=ref_dir)) == [[9, 8]]  # the store's own
    assert reference_token_ids(ReplacementConfig(tensors=[{"m": stepwise(2, 1)}], prompt_token_ids=[[1, 2]])) == [[1, 2]]
    (tmp_path / "ids.json").write_text("[[4, 5]]")
    (tmp_path / "broken.pt").write_bytes(b"not read")  # given token ids: the tensors file is not opened
    cfg = ReplacementConfig(tensors_path=tmp_path / "broken.pt", prompt_token_ids_path=tmp_path / "ids.json")
    assert reference_token_ids(cfg) == [[4, 5]]
    assert reference_token_ids(ReplacementConfig(tensors=[{"m": stepwise(2, 1)}])) is None


def test_capture_names_from_each_source_without_packing_the_tensors(ref_dir, monkeypatch):
    import fxreplace.replacer

    def no_replacer(*args, **kwargs):
        raise AssertionError("a front end asking for the capture names packs no copy of the reference")

    monkeypatch.setattr(fxreplace.replacer, "TensorReplacer", no_replacer)
    assert reference_capture_names(ReplacementConfig(tensors_path=ref_dir)) == ["m"]  # from the store's index
    two = {"a": stepwise(2, 1), "b": stepwise(2, 1, E=3)}
    assert reference_capture_names(ReplacementConfig(tensors=[two, two])) == ["a", "b"]
    assert reference_capture_names(ReplacementConfig(tensors={7: {"x.gate": torch.randn(3, 4)}})) == ["x.gate"]
    assert reference_capture_names(ReplacementConfig(tensors=ReferenceStore.load(ref_dir))) == ["m"]
