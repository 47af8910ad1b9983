import json
import pickle
import re

import pytest
import torch

from fxreplace import CaptureError, ReferenceStore, TensorReplacementConfig
from fxreplace import TensorReplacer
from fxreplace.replacer.sources import reference_source
from fxreplace.store import load_legacy, load_token_ids
from fxreplace.store.format import FORMAT_VERSION


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


def test_packs_capture_names_of_different_width_and_dtype():
    caps = [{"a": [torch.randn(1, 2, 4)], "b": [torch.randn(1, 2, 3)], "c": [torch.randn(1, 2, 5).bfloat16()]}]
    store = ReferenceStore.from_captures(caps)
    assert [(g.dtype, g.width, g.capture_names) for g in store.groups] == [
        (torch.float32, 4, ("a",)), (torch.float32, 3, ("b",)), (torch.bfloat16, 5, ("c",))]
    assert store.dtype("c") == torch.bfloat16 and store.feature_dim("b") == 3
    assert torch.equal(store.rows(0, "b"), caps[0]["b"][0][0])
    assert all(torch.count_nonzero(p[-1]) == 0 for p in store.packed), "the last row of every group is the zero row"


def test_capture_names_of_one_dtype_and_width_share_a_position_major_group():
    caps = [{f"m{i}": [torch.randn(1, 3, 4)] for i in range(3)}, {f"m{i}": [torch.randn(1, 2, 4)] for i in range(3)}]
    store = ReferenceStore.from_captures(caps)
    (packed,) = store.packed
    assert packed.shape == (6, 3, 4), "[rows + 1, capture names, width]"
    assert torch.equal(packed[3:5, 1], caps[1]["m1"][0][0])


@pytest.mark.parametrize(
    "captures, message",
    [
        ([], "captures are empty"),
        ("nope", "captures must be a list"),
        ([{"m": [torch.randn(2, 4)]}], r"prompt 0, capture 'm', step 0: expected \[1, tokens, E\], got rank 2"),
        ([{"m": [torch.randn(2, 3, 4)]}], r"prompt 0, capture 'm', step 0: batch dim must be 1"),
        ([{"m": [torch.randn(1, 3, 4), torch.randn(1, 2, 4)]}], r"prompt 0, capture 'm', step 1: decode step has 2 tokens; expected 4 .* or 1"),
        ([{"m": [torch.randn(1, 3, 4), torch.randn(1, 1, 5)]}], r"prompt 0, capture 'm', step 1: feature dim 5 differs from step 0's 4"),
        ([{"m": [torch.randn(1, 3, 4)]}, {"m": [torch.randn(1, 3, 6)]}], r"prompt 1: capture 'm' has feature dim 6 .* prompt 0 has 4"),
        ([{"m": [torch.randn(1, 3, 4)], "n": [torch.randn(1, 3, 2)]}, {"m": [torch.randn(1, 3, 4)]}], r"prompt 1: capture names differ from prompt 0: missing \['n'\]"),
        ([{"m": [torch.randn(1, 3, 4)], "n": [torch.randn(1, 2, 2)]}], r"prompt 0: capture 'n' has 2 positions but capture 'm' has 3"),
        ([{"m": []}], r"prompt 0, capture 'm': expected a non-empty list"),
        ([{"m": [torch.randn(1, 0, 4)]}], r"prompt 0, capture 'm', step 0: prefill has no tokens"),
        ([{}], r"prompt 0: expected a non-empty"),
        ({"a": {"m": torch.randn(2, 4)}}, "keyed by integer prompt index"),
        ({0: {"m": torch.randn(1, 2, 4)}}, r"prompt 0, capture 'm': a flat capture must be \[positions, E\]"),
    ],
)
def test_bad_captures_name_prompt_capture_and_step(captures, message):
    with pytest.raises(CaptureError, match=message):
        ReferenceStore.from_captures(captures)


def test_nonfinite_is_an_error_unless_allowed():
    steps = stepwise(3, 2)
    steps[2][0, -1, 1] = float("nan")
    caps = [{"ok": stepwise(3, 2)}, {"ok": stepwise(3, 2, seed=3)}]
    caps[1]["ok"] = steps
    with pytest.raises(CaptureError, match=r"prompt 1, capture 'ok', position 4: capture holds NaN or Inf"):
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
    assert ReferenceStore.load(tmp_path / "ref" / "reference.safetensors").capture_names == ["a", "b"]


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
    tensors, ids = reference_source(cfg)
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
        reference_source(TensorReplacementConfig(tensors_path=tmp_path / "evil.pt", prompt_token_ids=[[1]]))
    assert not marker.exists()


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_loading_a_large_store_and_its_replacer_do_not_read_it_into_memory(tmp_path):
    from fxreplace import TensorReplacer

    prompts = 64
    caps = {p: {"m": torch.full((2048, 512), float(p))} for p in range(prompts)}  # 256 MiB of fp32
    ReferenceStore.from_captures(caps).save(tmp_path / "big")
    del caps
    before = _rss_mib()
    store = ReferenceStore.load(tmp_path / "big")
    assert _rss_mib() - before < 64, "loading must memory-map, not read 256 MiB"
    replacer = TensorReplacer(store)
    assert _rss_mib() - before < 64, "a replacer over a store costs O(index): no finite check reads the rows"
    replacer.register_request("r", None, prompt_idx=40)
    assert float(replacer.build_context(["r"], [7], is_prefill=True)["m"][0, 3]) == 40.0


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
    copy = ReferenceStore.load(loaded.save(tmp_path / "copy"))
    assert len(copy.shards) == len(loaded.shards) and copy.prompt_token_ids == ids
    assert torch.equal(copy.rows(6, "b"), expected.rows(6, "b")) and torch.equal(copy.extra("generated.logits", 2), logits[2])


def test_writer_checks_every_prompt_against_the_first(tmp_path):
    from fxreplace import StoreWriter

    caps, ids = _prompt_captures(2)
    writer = StoreWriter(tmp_path / "ref", shard_bytes=1)
    writer.add(ids[0], caps[0])
    with pytest.raises(CaptureError, match=r"prompt 1: capture 'a' has feature dim 3 .* prompt 0 has 4"):
        writer.add(ids[1], {"a": [torch.randn(1, 5, 3)], "b": caps[1]["b"]})
    with pytest.raises(CaptureError, match="prompt 1: token ids must be given for every prompt or for none"):
        writer.add(None, caps[1])
    with pytest.raises(CaptureError, match="prompt 0 was already added"):
        writer.add(ids[1], caps[1], prompt_idx=0)
    with pytest.raises(CaptureError, match=r"prompt 1: 1 token ids but the capture's prefill covers 3 positions"):
        writer.add([5], caps[1])
    writer.sync()  # a complete store already (e.g. an idle capturing engine); adding continues
    assert ReferenceStore.load(tmp_path / "ref").prompt_ids == [0]
    assert writer.add(ids[1], caps[1]) == 1
    with pytest.raises(FileExistsError, match="another store writer is writing"):
        StoreWriter(tmp_path / "ref")  # e.g. two engines given the same out: never two writers
    writer.close()
    assert ReferenceStore.load(tmp_path / "ref").num_prompts == 2
    assert sorted(p.name for p in (tmp_path / "ref").iterdir() if p.name.startswith(".")) == []
    with pytest.raises(FileExistsError, match="is not empty"):
        StoreWriter(tmp_path / "ref")


def test_stores_laid_out_alike_join_side_by_side_without_copying_a_row(tmp_path):
    """A store written with shards ending where another's end (``StoreWriter(shard_bytes=None)`` and
    ``sync()``, or ``from_captures(shard_sizes=)`` in memory) joins it: the joined store's shards list
    both stores' group tensors (the memory-mapped ones themselves), its rows are each store's, and the
    replacer reads it as it reads a copy holding every capture name. Stores laid out otherwise, or
    holding the same capture names, are refused, naming what differs."""
    from fxreplace import StoreError, StoreWriter

    caps, ids = _prompt_captures(7)
    with StoreWriter(tmp_path / "ref", shard_bytes=100) as writer:
        for p in range(7):
            writer.add(ids[p], caps[p])
    ref = ReferenceStore.load(tmp_path / "ref")
    sizes = torch.bincount(ref.prompt_shard).tolist()
    assert len(sizes) > 1 and sizes[0] > 1
    flat = {p: {"c": torch.randn(int(ref.lengths[p]), 6)} for p in range(7)}  # another name and width, the same rows
    with StoreWriter(tmp_path / "part", shard_bytes=None) as writer:
        for p in range(7):
            writer.add(ids[p], flat[p])
            if p + 1 in torch.tensor(sizes).cumsum(0).tolist():
                writer.sync()
    on_disk = ReferenceStore.load(tmp_path / "part")
    in_memory = ReferenceStore.from_captures(flat, prompt_token_ids=ids, shard_sizes=sizes)
    copy = ReferenceStore.from_captures({p: {"a": ref.rows(p, "a"), "b": ref.rows(p, "b"), **flat[p]} for p in range(7)},
                                        prompt_token_ids=ids)
    for part in (on_disk, in_memory):
        assert ref.layout_difference(part) is None
        joined = ReferenceStore.join([ref, part])
        assert joined.capture_names == ["a", "b", "c"] and len(joined.shards) == len(sizes)
        for s, shard in enumerate(joined.shards):
            held = [*ref.shards[s].packed, *part.shards[s].packed]
            assert [t.untyped_storage().data_ptr() for t in shard.packed] == [t.untyped_storage().data_ptr() for t in held]
        for p in range(7):
            for name in ("a", "b", "c"):
                assert torch.equal(joined.rows(p, name), copy.rows(p, name))
        contexts = []
        for store in (joined, copy):
            replacer = TensorReplacer(store)
            for p in (1, 4, 6):
                replacer.register_request(f"r{p}", ids[p])
            contexts.append(replacer.build_context(["r1", "r4", "r6"], [1, 2, 3], is_prefill=False))
        for name in ("a", "b", "c"):
            assert torch.equal(contexts[0][name], contexts[1][name])

    one_shard = ReferenceStore.from_captures(flat, prompt_token_ids=ids)
    with pytest.raises(StoreError, match=f"store 1 is laid out otherwise .*: it has 1 shards, not {len(sizes)}"):
        ReferenceStore.join([ref, one_shard])
    moved = [sizes[0] - 1, sizes[1] + 1, *sizes[2:]]  # the first shard's last prompt starts the second
    n, row = int(ref.lengths[sizes[0] - 1]), int(ref.offsets[sizes[0] - 1])
    with pytest.raises(StoreError, match=f"its prompt {sizes[0] - 1} has {n} rows from row 0 of shard 1, not {n} rows from "
                                         f"row {row} of shard 0"):
        ReferenceStore.join([ref, ReferenceStore.from_captures(flat, prompt_token_ids=ids, shard_sizes=moved)])
    other_ids = [list(t) for t in ids]
    other_ids[3][0] += 1
    with pytest.raises(StoreError, match="its prompt 3 has other token ids"):
        ReferenceStore.join([ref, ReferenceStore.from_captures(flat, prompt_token_ids=other_ids, shard_sizes=sizes)])
    with pytest.raises(StoreError, match="store 1 holds capture names an earlier store holds too: a, b"):
        ReferenceStore.join([ref, ref])
    with pytest.raises(CaptureError, match=r"shard_sizes must be positive ints adding up to the 7 prompts, got 3, 3"):
        ReferenceStore.from_captures(flat, prompt_token_ids=ids, shard_sizes=[3, 3])


def test_merge_keeps_disjoint_prompt_indices_and_renumbers_colliding_ones(tmp_path):
    from fxreplace import StoreWriter
    from fxreplace.store import merge_stores

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

    for name, first in (("x", 0), ("y", 3)):  # two writers of other prompts, both numbering from 0
        with StoreWriter(tmp_path / name) as w:
            for p in range(first, first + 3):
                w.add(ids[p], caps[p])
    again = ReferenceStore.load(merge_stores([tmp_path / "x", tmp_path / "y"], tmp_path / "xy"))
    assert again.prompt_ids == list(range(6))
    assert torch.equal(again.rows(4, "a"), expected.rows(4, "a"))
    other = ReferenceStore.from_captures([{"a": [torch.randn(1, 2, 4)]}])
    other.save(tmp_path / "other")
    with pytest.raises(CaptureError, match="other: capture names/dtypes/widths differ"):
        merge_stores([tmp_path / "x", tmp_path / "other"], tmp_path / "bad")


# ---------------------------------------------------------------- integrity: files that lie


def _valid_store(tmp_path):
    caps = [{"a": stepwise(3, 2), "b": [s.bfloat16() for s in stepwise(3, 2, E=2, seed=4)]},
            {"a": stepwise(2, 1, seed=5), "b": [s.bfloat16() for s in stepwise(2, 1, E=2, seed=6)]}]
    ReferenceStore.from_captures(caps, prompt_token_ids=[[1, 2, 3], [4, 5]], metadata={"vocab_size": 50}).save(tmp_path / "ref")
    return tmp_path / "ref" / "reference.safetensors"


def _read_raw(file):
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write_raw(file, header, body, header_len=None):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes((len(text) if header_len is None else header_len).to_bytes(8, "little") + text + body)


def _edit_header(file, edit):
    header, body = _read_raw(file)
    edit(header)
    _write_raw(file, header, body)


def _edit_index(file, edit):
    def apply(header):
        index = json.loads(header["__metadata__"]["fxreplace_index"])
        edit(index)
        header["__metadata__"]["fxreplace_index"] = json.dumps(index)

    _edit_header(file, apply)


def _edit_tensor(file, name, values):
    """Overwrite a tensor's bytes in place (same dtype and size)."""
    header, body = _read_raw(file)
    begin, end = header[name]["data_offsets"]
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()
    assert len(raw) == end - begin
    _write_raw(file, header, body[:begin] + raw + body[end:])


def _set_tensor(file, name, tensor):
    """Replace a tensor by one of another dtype/size, rewriting the file (index kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors[name] = tensor
    save_file(tensors, str(file), metadata=meta)


def _transpose(header):
    header["group.0"]["shape"] = header["group.0"]["shape"][::-1]


def _dtype_i32(header):
    header["group.0"]["dtype"] = "I32"


def _wider_index(index):
    index["groups"][0]["width"] = 6


def _more_modules(index):
    index["groups"][0]["modules"].append("ghost")


def _overlap(header):
    a, b = header["prompt.lengths"]["data_offsets"]
    header["prompt.offsets"]["data_offsets"] = [a + 8, b + 8]


@pytest.mark.parametrize(
    "break_it, field, message",
    [
        (lambda f: _edit_header(f, _dtype_i32), "group.0", "the tensor is torch.int32 but the index says torch.float32"),
        (lambda f: _edit_header(f, _transpose), "group.0", r"shape \[4, 1, 9\] but the index needs \[rows\+1=9, modules=1, width=4\]"),
        (lambda f: _edit_index(f, _wider_index), "group.0", r"shape \[9, 1, 4\] but the index needs \[rows\+1=9, modules=1, width=6\]"),
        (lambda f: _edit_index(f, _more_modules), "group.0", r"index needs \[rows\+1=9, modules=2"),
        (lambda f: _edit_tensor(f, "prompt.lengths", torch.tensor([5, 4])), "group.0", r"rows\+1=10, .* \(2 prompts of 9 rows in all\)"),
        (lambda f: _edit_tensor(f, "prompt.offsets", torch.tensor([0, 1])), "prompt.offsets", "prompt 1 starts at row 1 .* must start at 5"),
        (lambda f: _edit_tensor(f, "prompt.lengths", torch.tensor([6, 0])), "prompt.lengths", "prompt 1 has 0 rows"),
        (lambda f: _set_tensor(f, "tokens.values", torch.tensor([1.5, 2, 3, 4, 5])), "tokens.values", "must be a 1-D integer tensor, got torch.float32"),
        (lambda f: _set_tensor(f, "tokens.values", torch.tensor([1, 2, 3, 4, 99])), "tokens.values", "token id 99 is not below the vocab size 50"),
        (lambda f: (_set_tensor(f, "tokens.values", torch.tensor([1, 2, 4, 5])), _set_tensor(f, "tokens.offsets", torch.tensor([0, 2, 4]))),
         "tokens.values", "prompt 0 has 2 token ids but its capture's prefill covers 3 positions"),
        (lambda f: _edit_index(f, lambda i: i["prefill"].__setitem__(0, 4)), "prefill", "prompt 0: a prefill of 4 positions plus 2 decode steps is not its 5 rows"),
        (lambda f: _edit_header(f, lambda h: h["__metadata__"].__setitem__("fxreplace_index", "{not json")), "fxreplace_index", "the store index is not JSON"),
    ],
    ids=["dtype-i32-over-f32", "transposed-shape", "index-width-past-tensor", "index-modules-past-tensor",
         "prompt-longer-than-rows", "offsets-overlap-rows", "empty-prompt", "float-token-ids", "token-id-past-vocab",
         "token-ids-shorter-than-prefill", "prefill-disagrees-with-rows", "index-not-json"],
)
def test_a_header_that_lies_is_refused_naming_file_and_field(tmp_path, break_it, field, message):
    file = _valid_store(tmp_path)
    break_it(file)
    for path in (file, file.parent):
        with pytest.raises(CaptureError, match=message) as err:
            ReferenceStore.load(path)
        assert str(file) in str(err.value) and f"field {field!r}" in str(err.value)


def test_damaged_files_are_refused_naming_the_file(tmp_path):
    from fxreplace.store import StoreError

    file = _valid_store(tmp_path)
    header, body = _read_raw(file)
    cases = {
        "truncated": (lambda: file.write_bytes(file.read_bytes()[:-10]), "data_offsets .* run past the end .* truncated"),
        "tiny": (lambda: file.write_bytes(b"\x01\x02"), "truncated: 2 bytes"),
        "header-larger-than-file": (lambda: _write_raw(file, header, body, header_len=10**9), "header length field says 1000000000 bytes but the file has only"),
        "header-not-json": (lambda: file.write_bytes(file.read_bytes()[:8] + b"\xff" * 16 + file.read_bytes()[24:]), "header is not JSON"),
        "overlapping-offsets": (lambda: _edit_header(file, _overlap), "data_offsets overlap"),
        "size-mismatch": (lambda: _edit_header(file, lambda h: h["group.0"].__setitem__("shape", [1, 9, 3])), "needs 108 bytes but data_offsets"),
        "not-a-store": (lambda: file.write_text("hello, I am a text file " * 10), "header length field says"),
    }
    for name, (damage, message) in cases.items():
        _write_raw(file, header, body)
        damage()
        with pytest.raises(StoreError, match=message) as err:
            ReferenceStore.load(file)
        assert str(file) in str(err.value), name


def test_links_to_system_files_and_bad_directory_indexes_are_named(tmp_path):
    from fxreplace.store import StoreError

    (tmp_path / "passwd.safetensors").symlink_to("/etc/passwd")
    with pytest.raises(StoreError, match=r"passwd.safetensors \(a link to /etc/passwd\)"):
        ReferenceStore.load(tmp_path / "passwd.safetensors")
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    with pytest.raises(StoreError, match=r"zero.safetensors \(a link to /dev/zero\): not a regular file"):
        ReferenceStore.load(tmp_path / "zero.safetensors")
    file = _valid_store(tmp_path)
    (file.parent / "index.json").write_text("{oops")
    with pytest.raises(StoreError, match=r"index.json: not a JSON store index"):
        ReferenceStore.load(file.parent)
    (file.parent / "index.json").write_text(json.dumps({"format": "fxreplace-reference", "version": FORMAT_VERSION, "shards": [{"file": "../../etc/passwd", "prompts": [0]}]}))
    with pytest.raises(StoreError, match=r"'shards\[0\].file': '../../etc/passwd' must be a file name inside the store directory"):
        ReferenceStore.load(file.parent)


def test_token_ids_are_refused_when_float_or_shorter_than_the_prefill():
    caps = [{"m": [torch.randn(1, 3, 4), torch.randn(1, 1, 4)]}]
    with pytest.raises(CaptureError, match=r"prompt 0: token ids must be non-negative integers, got \[1.5\]"):
        ReferenceStore.from_captures(caps, prompt_token_ids=[[1.5, 2, 3]])
    with pytest.raises(CaptureError, match="prompt 0: token ids must be integers, got dtype torch.float32"):
        ReferenceStore.from_captures(caps, prompt_token_ids=torch.tensor([[1.0, 2.0, 3.0]]))
    with pytest.raises(CaptureError, match="prompt 0: 2 token ids but the capture's prefill covers 3 positions"):
        ReferenceStore.from_captures(caps, prompt_token_ids=[[1, 2]])
    store = ReferenceStore.from_captures(caps, prompt_token_ids=[[1, 2, 3]])
    with pytest.raises(CaptureError, match="prompt 0: 1 token ids but the capture's prefill covers 3 positions"):
        TensorReplacer.from_config(TensorReplacementConfig(tensors=store, prompt_token_ids=[[7]]))
    flat = ReferenceStore.from_captures({0: {"m": torch.randn(5, 4)}}, prompt_token_ids=[[1, 2]])
    assert flat.prefill == [None], "flat rows may include generated positions: no prefill to compare with"


def test_verify_detects_flipped_bytes_that_loading_does_not_read(tmp_path):
    from fxreplace import TensorReplacer
    from fxreplace.store import StoreError

    file = _valid_store(tmp_path)
    assert ReferenceStore.load(file.parent).verify() == {"shards": 1, "bytes": ReferenceStore.load(file).verify()["bytes"], "prompts": 2, "finite": True}
    header, body = _read_raw(file)
    begin = header["group.0"]["data_offsets"][0]
    body = bytearray(body)
    body[begin + 5] ^= 0x10
    _write_raw(file, header, bytes(body))
    store = ReferenceStore.load(file)  # O(index): the flipped row is not read
    TensorReplacer(store)
    with pytest.raises(StoreError, match=r"reference.safetensors: tensor 'group.0': content digest .* differs .* corrupted"):
        store.verify()


def test_stores_written_without_the_finite_check_say_so(tmp_path):
    from fxreplace import TensorReplacer

    caps = [{"m": [torch.tensor([[[1.0, float("nan")]]])]}]
    ReferenceStore.from_captures(caps, allow_nonfinite=True).save(tmp_path / "ref")
    store = ReferenceStore.load(tmp_path / "ref")
    assert not store.finite_checked
    with pytest.raises(CaptureError, match="written with allow_nonfinite=True"):
        TensorReplacer(store)
    assert TensorReplacer(store, allow_nonfinite=True).capture_names == ["m"]
    assert store.verify()["finite"] is False
    with pytest.raises(CaptureError, match="prompt 0, capture 'm', position 0: capture holds NaN"):
        store.check_finite()


def test_cli_inspect_verify_reports_a_sound_store_and_names_a_flipped_tensor(tmp_path, capsys):
    from fxreplace.cli import main

    file = _valid_store(tmp_path)
    assert main(["inspect", "--verify", str(file.parent)]) == 0
    assert "OK: 2 prompts in 1 shard(s)" in capsys.readouterr().out
    header, body = _read_raw(file)
    begin = header["tokens.values"]["data_offsets"][0]
    body = bytearray(body)
    body[begin] ^= 0x01  # token 1 becomes 0: still a valid id, only the digest can tell
    _write_raw(file, header, bytes(body))
    assert ReferenceStore.load(file).prompt_token_ids[0] == [0, 2, 3]
    capsys.readouterr()
    assert main(["inspect", "--verify", str(file.parent)]) == 1  # a failed check, not a usage error
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"error: .*reference.safetensors: tensor 'tokens.values': content digest.*", err), err


def test_cli_repack_joins_an_idling_engines_small_shards(tmp_path, capsys):
    from fxreplace import StoreWriter
    from fxreplace.cli import main

    caps, ids = _prompt_captures(6)
    with StoreWriter(tmp_path / "ref") as writer:
        for p in range(6):
            writer.add(ids[p], caps[p])
            writer.sync()  # a capturing engine idles after every request: a shard each
    assert main(["repack", str(tmp_path / "ref"), "--out", str(tmp_path / "packed")]) == 0
    assert "6 prompts in 1 shard(s), repacked from 6 shard(s)" in capsys.readouterr().out
    packed, expected = ReferenceStore.load(tmp_path / "packed"), ReferenceStore.from_captures(caps, prompt_token_ids=ids)
    assert packed.prompt_token_ids == ids and all(torch.equal(packed.rows(p, "a"), expected.rows(p, "a")) for p in range(6))
    with pytest.raises(SystemExit, match="is not an empty directory"):
        main(["repack", str(tmp_path / "ref"), "--out", str(tmp_path / "packed")])
    with pytest.raises(SystemExit) as usage:
        main(["repack", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert usage.value.code == 2 and "no reference store at" in capsys.readouterr().err


def test_writer_memory_is_bounded_by_one_shard_not_by_the_store(tmp_path):
    from fxreplace import StoreWriter

    before = _rss_mib()
    with StoreWriter(tmp_path / "ref", shard_bytes=16 << 20) as writer:
        for p in range(48):  # 4 MiB of rows per prompt, 192 MiB in all
            writer.add([p + 1] * 2048, {"m": [torch.full((1, 2048, 512), float(p))]})
            assert _rss_mib() - before < 96, f"after prompt {p}: the writer holds more than a shard or two"
    store = ReferenceStore.load(tmp_path / "ref")
    assert len(store.shards) == 12 and float(store.rows(47, "m")[5, 7]) == 47.0


def test_stores_of_format_version_1_ask_for_a_new_capture(tmp_path):
    file = _valid_store(tmp_path)
    _edit_index(file, lambda index: index.__setitem__("version", 1))
    with pytest.raises(CaptureError, match=r"unsupported format 'fxreplace-reference' version 1 .* capture the reference again"):
        ReferenceStore.load(file)


def test_the_vllm_config_digest_of_an_in_memory_store_covers_its_token_ids():
    import hashlib

    from fxreplace.engines.vllm.config import _digest_value

    def digest(ids):
        h = hashlib.sha256()
        _digest_value(h, ReferenceStore.from_captures([{"m": [torch.zeros(1, 2, 3)]}], prompt_token_ids=ids))
        return h.hexdigest()

    assert digest([[1, 2]]) == digest([[1, 2]]) != digest([[1, 3]])


def test_an_in_memory_store_asks_for_huge_pages_for_its_rows_and_keeps_them_alive():
    """Decode steps read rows at random all over a group: its table is an anonymous mapping
    advised for transparent huge pages (``hg`` in smaps), which lives as long as the tensor."""
    import gc
    from pathlib import Path

    if not Path("/sys/kernel/mm/transparent_hugepage").exists():
        pytest.fail("this test runs on Linux with transparent huge pages (every CI and target machine)")
    caps = {p: {"m": torch.full((1024, 512), float(p))} for p in range(4)}  # 8 MiB of rows
    store = ReferenceStore.from_captures(caps)
    gc.collect()
    table = store.packed[0]
    address = table.data_ptr()
    flags = None
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    assert flags is not None and "hg" in flags, flags
    assert [float(store.rows(p, "m")[7, 3]) for p in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert torch.count_nonzero(table[-1]) == 0
    small = ReferenceStore.from_captures({0: {"m": torch.ones(3, 4)}})  # below one huge page: ordinary memory
    assert torch.equal(small.rows(0, "m"), torch.ones(3, 4))
