import json
import pickle

import pytest
import torch

from fxreplace import CaptureError, ReferenceStore, TensorReplacementConfig, load_legacy, load_token_ids


def stepwise(prompt_len, decode_steps, E=4, kv_cache=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    steps = [torch.randn(1, prompt_len, E, generator=g)]
    for i in range(1, decode_steps + 1):
        n = 1 if kv_cache else prompt_len + i
        steps.append(torch.randn(1, n, E, generator=g))
    return steps


def test_flattens_full_recompute_and_kv_cache_steps():
    full = stepwise(3, 2)
    kv = stepwise(3, 2, kv_cache=True, seed=1)
    store = ReferenceStore.from_captures([{"m": full}, {"m": kv}])
    rows0 = store.rows(0, "m")
    assert rows0.shape == (5, 4)
    assert torch.equal(rows0[:3], full[0][0])
    assert torch.equal(rows0[3], full[1][0, -1]) and torch.equal(rows0[4], full[2][0, -1])
    rows1 = store.rows(1, "m")
    assert torch.equal(rows1[3], kv[1][0, 0]) and torch.equal(rows1[4], kv[2][0, 0])
    assert store.num_steps == [3, 3]


def test_flat_dict_input_keeps_prompt_keys():
    a, b = torch.randn(4, 8), torch.randn(2, 8)
    store = ReferenceStore.from_captures({7: {"m": a}, 3: {"m": b}})
    assert store.prompt_ids == [7, 3]
    assert torch.equal(store.rows(7, "m"), a) and torch.equal(store.rows(3, "m"), b)
    with pytest.raises(KeyError, match="prompt 5 is not in the reference store"):
        store.rows(5, "m")


def test_packs_modules_of_different_width_and_dtype():
    caps = [{"a": [torch.randn(1, 2, 4)], "b": [torch.randn(1, 2, 3)], "c": [torch.randn(1, 2, 5).bfloat16()]}]
    store = ReferenceStore.from_captures(caps)
    assert [(g.dtype, g.width, g.modules) for g in store.groups] == [
        (torch.float32, 4, ("a",)), (torch.float32, 3, ("b",)), (torch.bfloat16, 5, ("c",))]
    assert store.dtype("c") == torch.bfloat16 and store.feature_dim("b") == 3
    assert torch.equal(store.rows(0, "b"), caps[0]["b"][0][0])
    assert all(torch.count_nonzero(p[:, -1]) == 0 for p in store.packed), "the last row of every group is the zero row"


def test_modules_of_one_dtype_and_width_share_a_module_major_group():
    caps = [{f"m{i}": [torch.randn(1, 3, 4)] for i in range(3)}, {f"m{i}": [torch.randn(1, 2, 4)] for i in range(3)}]
    store = ReferenceStore.from_captures(caps)
    (packed,) = store.packed
    assert packed.shape == (3, 6, 4), "[modules, rows + 1, width]"
    assert torch.equal(packed[1, 3:5], caps[1]["m1"][0][0])


@pytest.mark.parametrize(
    "captures, message",
    [
        ([], "captures are empty"),
        ("nope", "captures must be a list"),
        ([{"m": [torch.randn(2, 4)]}], r"prompt 0, module 'm', step 0: expected \[1, tokens, E\], got rank 2"),
        ([{"m": [torch.randn(2, 3, 4)]}], r"prompt 0, module 'm', step 0: batch dim must be 1"),
        ([{"m": [torch.randn(1, 3, 4), torch.randn(1, 2, 4)]}], r"prompt 0, module 'm', step 1: decode step has 2 tokens; expected 4 .* or 1"),
        ([{"m": [torch.randn(1, 3, 4), torch.randn(1, 1, 5)]}], r"prompt 0, module 'm', step 1: feature dim 5 differs from step 0's 4"),
        ([{"m": [torch.randn(1, 3, 4)]}, {"m": [torch.randn(1, 3, 6)]}], r"prompt 1: module 'm' has feature dim 6 .* prompt 0 has 4"),
        ([{"m": [torch.randn(1, 3, 4)], "n": [torch.randn(1, 3, 2)]}, {"m": [torch.randn(1, 3, 4)]}], r"prompt 1: modules differ from prompt 0: missing \['n'\]"),
        ([{"m": [torch.randn(1, 3, 4)], "n": [torch.randn(1, 2, 2)]}], r"prompt 0: module 'n' has 2 positions but module 'm' has 3"),
        ([{"m": []}], r"prompt 0, module 'm': expected a non-empty list"),
        ([{"m": [torch.randn(1, 0, 4)]}], r"prompt 0, module 'm', step 0: prefill has no tokens"),
        ([{}], r"prompt 0: expected a non-empty"),
        ({"a": {"m": torch.randn(2, 4)}}, "keyed by integer prompt index"),
        ({0: {"m": torch.randn(1, 2, 4)}}, r"prompt 0, module 'm': a flat capture must be \[positions, E\]"),
    ],
)
def test_bad_captures_name_prompt_module_and_step(captures, message):
    with pytest.raises(CaptureError, match=message):
        ReferenceStore.from_captures(captures)


def test_nonfinite_is_an_error_unless_allowed():
    steps = stepwise(3, 2)
    steps[2][0, -1, 1] = float("nan")
    caps = [{"ok": stepwise(3, 2)}, {"ok": stepwise(3, 2, seed=3)}]
    caps[1]["ok"] = steps
    with pytest.raises(CaptureError, match=r"prompt 1, module 'ok', position 4: capture holds NaN or Inf"):
        ReferenceStore.from_captures(caps)
    store = ReferenceStore.from_captures(caps, allow_nonfinite=True)
    assert torch.isnan(store.rows(1, "ok")[4, 1])


def test_token_ids_are_validated():
    caps = [{"m": [torch.randn(1, 2, 4)]}]
    with pytest.raises(CaptureError, match="got 2 prompt_token_ids for 1 prompts"):
        ReferenceStore.from_captures(caps, prompt_token_ids=[[1, 2], [3]])
    with pytest.raises(CaptureError, match="prompt 0: token ids must be non-negative integers"):
        ReferenceStore.from_captures(caps, prompt_token_ids=[[1, -2]])
    with pytest.raises(CaptureError, match="prompt 0: token ids are empty"):
        ReferenceStore.from_captures(caps, prompt_token_ids=[[]])
    store = ReferenceStore.from_captures(caps, prompt_token_ids=torch.tensor([[5, 6]]))
    assert store.prompt_token_ids == [[5, 6]]


def test_save_load_round_trip_is_memory_mapped(tmp_path):
    caps = [{"a": stepwise(3, 2), "b": [s.bfloat16() for s in stepwise(3, 2, E=2, seed=4)]}, {"a": stepwise(5, 0), "b": [torch.randn(1, 5, 2).bfloat16()]}]
    store = ReferenceStore.from_captures(
        caps, prompt_token_ids=[[1, 2, 3], [4, 5, 6, 7, 8]], metadata={"source_model": "tiny"},
        extras={"logits": [torch.randn(2, 3), torch.randn(0, 3)]},
    )
    store.save(tmp_path / "ref")
    index = json.loads((tmp_path / "ref" / "index.json").read_text())
    assert index["shards"] == [{"file": "reference.safetensors", "prompts": [0, 1]}]
    assert index["metadata"] == {"source_model": "tiny"}
    assert index["modules"] == {"a": ["float32", 4], "b": ["bfloat16", 2]}

    loaded = ReferenceStore.load(tmp_path / "ref")
    assert loaded.prompt_token_ids == [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert loaded.num_steps == [3, 1]
    for p in (0, 1):
        for m in ("a", "b"):
            assert torch.equal(loaded.rows(p, m), store.rows(p, m))
    assert torch.equal(loaded.extra("logits", 0), store.extra("logits", 0)) and loaded.extra("logits", 1).shape == (0, 3)
    assert ReferenceStore.load(tmp_path / "ref" / "reference.safetensors").modules == ["a", "b"]


def test_load_rejects_foreign_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CaptureError, match="not an fxreplace reference store"):
        ReferenceStore.load(tmp_path / "w.safetensors")
    with pytest.raises(FileNotFoundError, match="no reference store"):
        ReferenceStore.load(tmp_path / "missing")


def test_legacy_torch_save_files_load_with_weights_only(tmp_path):
    caps = [{"m": stepwise(3, 1)}]
    torch.save(caps, tmp_path / "tensors.pt")
    torch.save([[1, 2, 3]], tmp_path / "ids.pt")
    cfg = TensorReplacementConfig(tensors_path=tmp_path / "tensors.pt", prompt_token_ids_path=tmp_path / "ids.pt")
    tensors, ids = cfg.resolve()
    assert torch.equal(tensors[0]["m"][1], caps[0]["m"][1]) and ids == [[1, 2, 3]]
    torch.save(torch.tensor([[1, 2, 3]]), tmp_path / "ids_tensor.pt")
    assert load_token_ids(tmp_path / "ids_tensor.pt") == [[1, 2, 3]]


def test_legacy_pickle_needing_code_is_refused_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (exec, (f"import pathlib; pathlib.Path({str(marker)!r}).write_text('pwned')",))

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump([{"m": Payload()}], f)
    with pytest.raises(CaptureError, match="refusing to load .*evil.pt.*arbitrary code"):
        load_legacy(tmp_path / "evil.pt")
    assert not marker.exists()
    with pytest.raises(CaptureError, match="refusing to load"):
        TensorReplacementConfig(tensors_path=tmp_path / "evil.pt", prompt_token_ids=[[1]]).resolve()
    assert not marker.exists()


def test_config_requires_exactly_one_source(tmp_path):
    with pytest.raises(ValueError, match="give either tensors or tensors_path, not both"):
        TensorReplacementConfig(tensors=[], tensors_path="x")
    with pytest.raises(ValueError, match="give tensors or tensors_path"):
        TensorReplacementConfig()
    with pytest.raises(ValueError, match="give either prompt_token_ids or prompt_token_ids_path"):
        TensorReplacementConfig(tensors=[], prompt_token_ids=[[1]], prompt_token_ids_path="y")


def test_config_reads_store_directory_with_its_token_ids(tmp_path):
    ReferenceStore.from_captures([{"m": stepwise(2, 1)}], prompt_token_ids=[[9, 8]]).save(tmp_path / "ref")
    replacer = TensorReplacementConfig(tensors_path=tmp_path / "ref").build()
    assert replacer.register_request("r", [9, 8, 1]) == 0
    (tmp_path / "ids.json").write_text("[[9, 8]]")
    assert load_token_ids(tmp_path / "ids.json") == [[9, 8]]


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_loading_a_large_store_does_not_read_it_into_memory(tmp_path):
    prompts = 64
    caps = {p: {"m": torch.full((2048, 512), float(p))} for p in range(prompts)}  # 256 MiB of fp32
    ReferenceStore.from_captures(caps).save(tmp_path / "big")
    del caps
    before = _rss_mib()
    store = ReferenceStore.load(tmp_path / "big")
    assert _rss_mib() - before < 64, "loading must memory-map, not read 256 MiB"
    assert float(store.rows(40, "m")[7, 3]) == 40.0


# ---------------------------------------------------------------- streaming writer, shards, merge


def _prompt_captures(n_prompts, seed=0, E=(4, 2)):
    g = torch.Generator().manual_seed(seed)
    caps, ids = [], []
    for p in range(n_prompts):
        L, D = 2 + p % 3, 1 + p % 2
        caps.append({
            "a": [torch.randn(1, L, E[0], generator=g)] + [torch.randn(1, 1, E[0], generator=g) for _ in range(D)],
            "b": [torch.randn(1, L, E[1], generator=g).bfloat16()] + [torch.randn(1, 1, E[1], generator=g).bfloat16() for _ in range(D)],
        })
        ids.append([100 * seed + 10 * p + t for t in range(L)])
    return caps, ids


def test_writer_streams_prompts_into_shards_that_load_as_one_store(tmp_path):
    from fxreplace import StoreWriter
    from fxreplace.reference import Reference, load_reference

    caps, ids = _prompt_captures(7)
    tokens = [[p, p + 1] for p in range(7)]
    logits = [torch.randn(2, 5) for _ in range(7)]
    with StoreWriter(tmp_path / "ref", shard_bytes=100, metadata={"source_model": "tiny"}) as writer:
        for p in range(7):
            assert writer.add(ids[p], caps[p], extras=Reference.extras(tokens[p], logits[p])) == p
            on_disk = len(list((tmp_path / "ref").glob("shard-*.safetensors")))
            assert on_disk >= (p + 1) // 2, "rows go to disk as prompts arrive (>= 100 bytes each pair), not at close"
    loaded = ReferenceStore.load(tmp_path / "ref")
    assert len(loaded.shards) > 1 and loaded.prompt_token_ids == ids and loaded.metadata == {"source_model": "tiny"}
    expected = ReferenceStore.from_captures(caps, prompt_token_ids=ids)
    for p in range(7):
        for m in ("a", "b"):
            assert torch.equal(loaded.rows(p, m), expected.rows(p, m))
    reference = load_reference(tmp_path / "ref")
    assert reference.tokens(5) == tokens[5] and torch.equal(reference.logits(3), logits[3]) and reference.vocab_size == 5
    assert loaded.verify()["shards"] == len(loaded.shards)


def test_writer_checks_every_prompt_against_the_first(tmp_path):
    from fxreplace import StoreWriter

    caps, ids = _prompt_captures(2)
    writer = StoreWriter(tmp_path / "ref", shard_bytes=1)
    writer.add(ids[0], caps[0])
    with pytest.raises(CaptureError, match=r"prompt 1: module 'a' has feature dim 3 .* prompt 0 has 4"):
        writer.add(ids[1], {"a": [torch.randn(1, 5, 3)], "b": caps[1]["b"]})
    with pytest.raises(CaptureError, match="prompt 1: token ids must be given for every prompt or for none"):
        writer.add(None, caps[1])
    with pytest.raises(CaptureError, match="prompt 0 was already added"):
        writer.add(ids[1], caps[1], prompt_idx=0)
    with pytest.raises(CaptureError, match=r"prompt 1: 1 token ids but the capture's prefill covers 3 positions"):
        writer.add([5], caps[1])
    assert writer.add(ids[1], caps[1]) == 1
    writer.close()
    assert ReferenceStore.load(tmp_path / "ref").num_prompts == 2
    with pytest.raises(FileExistsError, match="is not empty"):
        StoreWriter(tmp_path / "ref")


def test_merge_keeps_disjoint_prompt_indices_and_renumbers_colliding_ones(tmp_path):
    from fxreplace import StoreWriter, merge_stores

    caps, ids = _prompt_captures(6)
    for rank in range(2):  # data-parallel capture: each engine gets every other prompt
        with StoreWriter(tmp_path / f"rank{rank}", shard_bytes=64) as w:
            for p in range(rank, 6, 2):
                w.add(ids[p], caps[p], prompt_idx=p)
    merged = ReferenceStore.load(merge_stores([tmp_path / "rank0", tmp_path / "rank1"], tmp_path / "merged"))
    assert sorted(merged.prompt_ids) == list(range(6))
    expected = ReferenceStore.from_captures(caps, prompt_token_ids=ids)
    for p in range(6):
        assert torch.equal(merged.rows(p, "b"), expected.rows(p, "b"))
        assert merged.prompt_token_ids[merged.internal_index(p)] == ids[p]

    for name in ("x", "y"):  # two writers numbering from 0
        with StoreWriter(tmp_path / name) as w:
            for p in range(3):
                w.add(ids[p], caps[p])
    again = ReferenceStore.load(merge_stores([tmp_path / "x", tmp_path / "y"], tmp_path / "xy"))
    assert again.prompt_ids == list(range(6))
    assert torch.equal(again.rows(4, "a"), expected.rows(1, "a"))
    other = ReferenceStore.from_captures([{"a": [torch.randn(1, 2, 4)]}])
    other.save(tmp_path / "other")
    with pytest.raises(CaptureError, match="other: modules/dtypes/widths differ"):
        merge_stores([tmp_path / "x", tmp_path / "other"], tmp_path / "bad")
