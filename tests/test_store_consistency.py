"""Nothing lost, nothing mixed: the writer, merge, from_captures and the loader refuse what
does not belong together before anything is written, a refused step loses nothing, and
save() places a whole store or none."""

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxreplace import CaptureError, ReferenceStore, StoreError, StoreWriter, TensorReplacer
from fxreplace.store import merge_stores, repack_store
from fxreplace.reference import Reference
from fxreplace.store import GENERATED_LOGITS, load_captures, load_legacy
from fxreplace.store.format import FORMAT_VERSION

pytestmark = pytest.mark.compat


def prompt(p, L=3, E=4, seed=0, dtype=torch.float32):
    """One prompt's step-wise capture of capture name 'a' (prefill L, one decode step) and its token ids."""
    g = torch.Generator().manual_seed(1000 * seed + p)
    caps = {"a": [torch.randn(1, L, E, generator=g).to(dtype), torch.randn(1, 1, E, generator=g).to(dtype)]}
    return [p] + [t for t in range(1, L)], caps


def generation(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Reference.extras([1, 2], torch.randn(2, vocab, generator=g))


def write(directory, prompts, *, vocab=16, shard_bytes=1, metadata=None, seed=0):
    with StoreWriter(directory, shard_bytes=shard_bytes, metadata={"vocab_size": vocab, **(metadata or {})}) as w:
        for p in prompts:
            ids, caps = prompt(p, seed=seed)
            w.add(ids, caps, prompt_idx=p, extras=generation(vocab, p))
    return directory


# ---------------------------------------------------------------- writer


def test_writer_refuses_logits_of_another_vocabulary_and_loses_nothing(tmp_path):
    w = StoreWriter(tmp_path / "ref", shard_bytes=1 << 20, metadata={"vocab_size": 16})
    for p in range(2):
        ids, caps = prompt(p)
        w.add(ids, caps, extras=generation(16))
    ids, caps = prompt(2)
    with pytest.raises(CaptureError, match=r"prompt 2: extra 'generated.logits' has .* \[20\] but prompt 0 has .* \[16\]"):
        w.add(ids, caps, extras=generation(20))
    with pytest.raises(CaptureError, match=r"prompt 2: token id 99 is not below the store's vocab_size 16"):
        w.add([99, 1, 2], caps, extras=generation(16))
    with pytest.raises(CaptureError, match="prompt 2 has the same token ids as prompt 0"):
        w.add(prompt(0)[0], caps, extras=generation(16))
    w.close()
    w.close()  # a second close is harmless
    store = ReferenceStore.load(tmp_path / "ref")
    assert store.prompt_ids == [0, 1]
    for p in range(2):
        assert torch.equal(store.rows(p, "a"), ReferenceStore.from_captures([prompt(p)[1]]).rows(0, "a"))


def test_writer_refuses_logits_wider_than_the_metadata_vocabulary(tmp_path):
    w = StoreWriter(tmp_path / "ref", metadata={"vocab_size": 16})
    ids, caps = prompt(0)
    with pytest.raises(CaptureError, match=r"prompt 0: extra 'generated.logits' has rows of width \[32\] but the store's vocab_size is 16"):
        w.add(ids, caps, extras=generation(32))


def test_writer_refuses_duplicates_across_shards(tmp_path):
    w = StoreWriter(tmp_path / "ref", shard_bytes=1)  # every prompt its own shard
    w.add(*prompt(0))
    w.add(*prompt(1))
    with pytest.raises(CaptureError, match="prompt 2 has the same token ids as prompt 0"):
        w.add(prompt(0)[0], prompt(2)[1])
    assert ReferenceStore.load(w.close()).prompt_ids == [0, 1]


def test_writer_keeps_a_shard_whose_write_failed(tmp_path, monkeypatch):
    import fxreplace.store.writer as writer_module

    w = StoreWriter(tmp_path / "ref", shard_bytes=1 << 20)
    for p in range(3):
        w.add(*prompt(p))
    real = writer_module._write_shard

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "_write_shard", disk_full)
    with pytest.raises(OSError, match="No space left"):
        w.close()
    monkeypatch.setattr(writer_module, "_write_shard", real)
    w.close()  # the retry writes every buffered prompt
    assert ReferenceStore.load(tmp_path / "ref").prompt_ids == [0, 1, 2]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"shard_bytes": -1}, ValueError, "shard_bytes must be a positive int.*-1"),
    ({"shard_bytes": "big"}, ValueError, "shard_bytes must be a positive int.*'big'"),
    ({"metadata": {"when": object()}}, CaptureError, "metadata: must be JSON-serializable"),
    ({"metadata": {"vocab_size": -3}}, CaptureError, r"metadata\['vocab_size'\] must be a positive int, got -3"),
    ({"metadata": {"prompt_texts": "hi"}}, CaptureError, r"metadata\['prompt_texts'\] must be a list"),
    ({"allow_nonfinite": "no"}, TypeError, "allow_nonfinite must be True or False"),
])
def test_writer_checks_its_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        StoreWriter(tmp_path / "ref", **kwargs)
    assert not (tmp_path / "ref").exists()


def test_writer_paths(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="file is a file"):
        StoreWriter(tmp_path / "file")
    with pytest.raises(TypeError, match="directory must be a path.*int 5"):
        StoreWriter(5)
    w = StoreWriter(tmp_path / "ref")
    with pytest.raises(CaptureError, match="prompt 0: extras must be a dict"):
        w.add(*prompt(0), extras=[torch.zeros(1)])


def test_writer_per_prompt_metadata_follows_prompt_index(tmp_path):
    texts = ["zero", None, "two"]
    with StoreWriter(tmp_path / "ref", shard_bytes=1, metadata={"prompt_texts": texts}) as w:
        for p in (2, 0, 1):  # finishing out of order, one shard each
            w.add(*prompt(p), prompt_idx=p)
        with pytest.raises(CaptureError, match=r"prompt 3 has no entry in metadata\['prompt_texts'\] \(3 entries"):
            w.add(*prompt(3), prompt_idx=3)
    store = ReferenceStore.load(tmp_path / "ref")
    assert store.prompt_ids == [2, 0, 1] and store.metadata["prompt_texts"] == ["two", "zero", None]
    copy = ReferenceStore.load(store.save(tmp_path / "copy"))
    assert copy.metadata["prompt_texts"] == ["two", "zero", None]


def test_writer_sync_lists_every_written_prompt_and_rewrites_the_index_only_when_a_shard_was_added(tmp_path):
    texts = ["zero", "one", None, "three"]
    index = tmp_path / "ref" / "index.json"
    w = StoreWriter(tmp_path / "ref", metadata={"vocab_size": 16, "prompt_texts": texts})
    for p in (1, 0):  # an engine idling after each request: one shard per sync
        w.add(*prompt(p), prompt_idx=p)
        w.sync()
        listed = json.loads(index.read_text())
    assert [s["prompts"] for s in listed["shards"]] == [[1], [0]]
    assert listed["metadata"] == {"vocab_size": 16, "prompt_texts": ["one", "zero"]}
    written = index.stat()
    w.sync()  # idle again, nothing new: the index on disk is left as it is
    assert (index.stat().st_ino, index.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    w.add(*prompt(3), prompt_idx=3)
    w.close()
    store = ReferenceStore.load(tmp_path / "ref")
    assert store.prompt_ids == [1, 0, 3] and store.metadata["prompt_texts"] == ["one", "zero", "three"]
    assert [s["prompts"] for s in json.loads(index.read_text())["shards"]] == [[1], [0], [3]]


# ---------------------------------------------------------------- loader across shards


def _hand_merged(tmp_path, parts):
    """A directory store made of other stores' shard files by hand (what a bad merge would leave)."""
    out = tmp_path / "mixed"
    out.mkdir()
    shards = []
    for k, src in enumerate(parts):
        name = f"shard-{k:05d}.safetensors"
        os.link(src / "reference.safetensors", out / name)
        shards.append({"file": name, "prompts": [k]})
    (out / "index.json").write_text(json.dumps({"format": "fxreplace-reference", "version": FORMAT_VERSION, "shards": shards}))
    return out


def _single(tmp_path, name, p, vocab, metadata=None):
    ids, caps = prompt(p)
    logits = generation(vocab, p)
    ReferenceStore.from_captures([caps], prompt_token_ids=[ids], metadata={"vocab_size": vocab, **(metadata or {})},
                                 extras={k: [v] for k, v in logits.items()}).save(tmp_path / name)
    return tmp_path / name


def test_loader_checks_every_shard_not_only_the_first(tmp_path):
    mixed_vocab = _hand_merged(tmp_path, [_single(tmp_path, "a", 0, 16), _single(tmp_path, "b", 1, 20)])
    with pytest.raises(StoreError, match=r"shard-00001.safetensors: metadata 'vocab_size' is 20 but "
                                         r".*shard-00000.safetensors has 16"):
        ReferenceStore.load(mixed_vocab)
    other_arch = _single(tmp_path, "c", 2, 16, metadata={"architecture": "MixtralForCausalLM"})
    with pytest.raises(StoreError, match=r"shard-00001.safetensors: metadata 'architecture' is 'MixtralForCausalLM' but "
                                         r".*shard-00000.safetensors has absent"):
        ReferenceStore.load(_hand_merged(tmp_path / "c", [_single(tmp_path, "d", 0, 16), other_arch]))


def test_loader_refuses_extras_of_other_shapes_across_shards(tmp_path):
    a, b = _single(tmp_path, "a", 0, 16), tmp_path / "b"
    ids, caps = prompt(1)
    ReferenceStore.from_captures([caps], prompt_token_ids=[ids], metadata={"vocab_size": 16},
                                 extras={GENERATED_LOGITS: [torch.zeros(2, 16, dtype=torch.float64)],
                                         "generated.tokens": [torch.tensor([1, 2])]}).save(b)
    with pytest.raises(StoreError, match=r"shard-00001.safetensors.*extra 'generated.logits' holds torch.float64"):
        ReferenceStore.load(_hand_merged(tmp_path, [a, b]))


def test_loader_refuses_duplicate_prompts_across_shards(tmp_path):
    ids, caps = prompt(0)
    for name, seed in (("a", 0), ("b", 1)):
        ReferenceStore.from_captures([prompt(0, seed=seed)[1]], prompt_token_ids=[ids]).save(tmp_path / name)
    with pytest.raises(StoreError, match="shard-00001.safetensors: prompt 1 has the same token ids as prompt 0"):
        ReferenceStore.load(_hand_merged(tmp_path, [tmp_path / "a", tmp_path / "b"]))


def test_loader_names_a_link_to_a_text_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\nworld\n")
    for name in ("ref.pt", "ref.safetensors"):
        (tmp_path / name).symlink_to(tmp_path / "notes.txt")
        with pytest.raises(CaptureError, match=rf"{name} \(a link to .*notes.txt\)"):
            load_captures(tmp_path / name)
    with pytest.raises(CaptureError, match="not a file"):
        load_legacy(tmp_path)
    with pytest.raises(TypeError, match="path must be a path"):
        ReferenceStore.load(None)


# ---------------------------------------------------------------- merge


def test_merge_refuses_what_does_not_belong_together(tmp_path):
    a = write(tmp_path / "a", [0, 1])
    b = write(tmp_path / "b", [2, 3])
    with pytest.raises(StoreError, match="the same store is given twice"):
        merge_stores([a, a], tmp_path / "out")
    (tmp_path / "alias").symlink_to(a)
    with pytest.raises(StoreError, match="the same store is given twice"):
        merge_stores([a, tmp_path / "alias"], tmp_path / "out")
    dup = write(tmp_path / "dup", [1, 4], seed=7)  # prompt 1's tokens again, other tensors
    with pytest.raises(StoreError, match="dup: prompt 1 has the same token ids as prompt 1 of .*a"):
        merge_stores([a, dup], tmp_path / "out")
    vocab = write(tmp_path / "vocab", [5], vocab=20)
    with pytest.raises(StoreError, match="vocab: metadata 'vocab_size' is 20 but .*a has 16"):
        merge_stores([a, vocab], tmp_path / "out")
    arch = write(tmp_path / "arch", [6], metadata={"architecture": "LlamaForCausalLM"})
    with pytest.raises(StoreError, match="arch: metadata 'architecture' is 'LlamaForCausalLM' but .*a has absent"):
        merge_stores([a, arch], tmp_path / "out")
    with StoreWriter(tmp_path / "bf16", metadata={"vocab_size": 16}) as w:
        ids, caps = prompt(7, dtype=torch.bfloat16)
        w.add(ids, caps, extras=generation(16))
    with pytest.raises(StoreError, match="bf16: capture names/dtypes/widths differ"):
        merge_stores([a, tmp_path / "bf16"], tmp_path / "out")
    with pytest.raises(TypeError, match="stores must be a list of store paths"):
        merge_stores(str(a), tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="file is not an empty directory"):
        merge_stores([a, b], tmp_path / "file")
    assert not (tmp_path / "out").exists(), "a refused merge writes nothing"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    merged = ReferenceStore.load(merge_stores([a, b], tmp_path / "out"))
    assert merged.prompt_ids == [0, 1, 2, 3] and merged.metadata == {"vocab_size": 16}


def test_merge_concatenates_prompt_texts_and_requires_the_rest_to_agree(tmp_path):
    a = write(tmp_path / "a", [0, 1], metadata={"prompt_texts": ["zero", "one"]})
    b = write(tmp_path / "b", [0, 1], seed=1, metadata={"prompt_texts": ["two", "three"]})  # a's prompts again
    with pytest.raises(StoreError, match="same token ids"):
        merge_stores([a, b], tmp_path / "bad")
    c = tmp_path / "c"
    with StoreWriter(c, metadata={"vocab_size": 16, "prompt_texts": [None, "five"]}) as w:
        for p in (0, 1):
            w.add(prompt(p + 4)[0], prompt(p + 4)[1], extras=generation(16))
    merged = ReferenceStore.load(merge_stores([a, c], tmp_path / "out"))
    assert merged.prompt_ids == [0, 1, 2, 3]  # renumbered: both numbered from 0
    assert merged.metadata == {"vocab_size": 16, "prompt_texts": ["zero", "one", None, "five"]}
    assert json.loads((tmp_path / "out" / "index.json").read_text())["metadata"]["prompt_texts"] == ["zero", "one", None, "five"]


# ---------------------------------------------------------------- from_captures, replacer


def test_two_prompts_with_the_same_tokens_are_refused():
    ids, caps0 = prompt(0)
    _, caps1 = prompt(1, seed=3)
    with pytest.raises(CaptureError, match="prompt 1 has the same token ids as prompt 0"):
        ReferenceStore.from_captures([caps0, caps1], prompt_token_ids=[ids, ids])
    with pytest.raises(CaptureError, match="prompt 1 has the same token ids as prompt 0"):
        TensorReplacer([caps0, caps1], prompt_token_ids=[ids, ids])
    with pytest.raises(CaptureError, match="prompt 1 has the same token ids as prompt 0"):
        ReferenceStore.from_captures([caps0, caps0], prompt_token_ids=[ids, ids])  # equal tensors: refused too
    store = ReferenceStore.from_captures([caps0, caps1], prompt_token_ids=[ids, [7, 8, 9]])
    with pytest.raises(CaptureError, match="prompts 0 and 1 have the same token ids"):
        TensorReplacer(store, prompt_token_ids=[ids, ids])


@pytest.mark.parametrize("kwargs, error, match", [
    ({"allow_nonfinite": 1}, TypeError, "allow_nonfinite must be True or False"),
    ({"metadata": ["vocab_size", 5]}, CaptureError, "metadata must be a dict"),
    ({"metadata": {"prompt_texts": ["only one"]}}, CaptureError, r"metadata\['prompt_texts'\] must be a list of one entry per prompt \(2 prompts\)"),
    ({"extras": [torch.zeros(1)]}, CaptureError, "extras must be a dict"),
])
def test_from_captures_checks_its_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ReferenceStore.from_captures([prompt(0)[1], prompt(1)[1]], **kwargs)


# ---------------------------------------------------------------- save


def test_save_replaces_a_store_whole_and_refuses_foreign_directories(tmp_path):
    three = ReferenceStore.load(write(tmp_path / "three", [0, 1, 2]))
    one = ReferenceStore.from_captures([prompt(5)[1]], prompt_token_ids=[prompt(5)[0]])
    three.save(tmp_path / "out")
    one.save(tmp_path / "out")  # replaces the three-shard store: no stale shard listed or left
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.json", "reference.safetensors"]
    assert ReferenceStore.load(tmp_path / "out").prompt_ids == [0]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"holds files that are not a store's \(\['notes.txt'\]\)"):
        one.save(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="file is a file"):
        one.save(tmp_path / "file")
    with pytest.raises(TypeError, match="directory must be a path"):
        one.save(3)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging directory left behind"


def test_a_store_replaced_while_it_loads_is_an_error_not_a_mix(tmp_path, monkeypatch):
    """A save that replaces the directory between the loader's reads of two shards: the shards
    read so far are the old store's, the rest the new one's; the loader says so instead."""
    import fxreplace.store.reference_store as reference_store

    old = ReferenceStore.load(write(tmp_path / "old", [0, 1, 2]))
    new = ReferenceStore.load(write(tmp_path / "new", [0, 1, 2], seed=1))
    old.save(tmp_path / "out")
    load_shard, calls = reference_store._load_shard, []

    def save_meanwhile(file, ids):
        calls.append(file.name)
        if len(calls) == 2:
            new.save(tmp_path / "out")
        return load_shard(file, ids)

    monkeypatch.setattr(reference_store, "_load_shard", save_meanwhile)
    with pytest.raises(StoreError, match="was replaced while it loaded"):
        ReferenceStore.load(tmp_path / "out")
    monkeypatch.undo()
    assert torch.equal(ReferenceStore.load(tmp_path / "out").rows(2, "a"),
                       new.rows(2, "a"))


def test_a_save_whose_directory_another_saver_moves_aside_retries(tmp_path, monkeypatch):
    """Between this save's failed rename (the directory was there, not empty) and its next look,
    another saver moves the directory aside: it is missing, not a file, so this save retries."""
    import fxreplace.store.format as fmt

    old = ReferenceStore.load(write(tmp_path / "old", [0, 1]))
    new = ReferenceStore.load(write(tmp_path / "new", [0, 1], seed=1))
    old.save(tmp_path / "out")
    rename, calls = os.rename, []

    def another_saver_meanwhile(src, dst):
        calls.append(dst)
        if len(calls) == 1:  # this save's first try fails, and the other saver moves the store aside
            rename(tmp_path / "out", tmp_path / "moved-aside")
            raise OSError(errno.ENOTEMPTY, "Directory not empty")
        return rename(src, dst)

    monkeypatch.setattr(fmt.os, "rename", another_saver_meanwhile)
    new.save(tmp_path / "out")
    monkeypatch.undo()
    assert torch.equal(ReferenceStore.load(tmp_path / "out").rows(1, "a"), new.rows(1, "a"))


SAVER = textwrap.dedent("""
    import sys, torch
    from fxreplace import ReferenceStore, StoreWriter
    who, out, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    n = 12  # the savers' stores have the same prompts and shard names, other values: a mix would load
    with StoreWriter(out + f".src{who}", shard_bytes=1, metadata={"who": who}) as w:  # a shard per prompt
        for p in range(n):
            w.add([who, p], {"a": [torch.full((1, 2, 4), float(100 * who + p))]})
    store = ReferenceStore.load(out + f".src{who}")
    for _ in range(rounds):
        store.save(out)
    print("saved", who)
""")


def test_concurrent_savers_never_interleave(tmp_path):
    out = tmp_path / "shared"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, str(who), str(out), "15"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for who in (0, 1)]
    while any(p.poll() is None for p in procs):  # meanwhile a reader finds a whole store or none
        try:
            store = ReferenceStore.load(out)
        except (FileNotFoundError, StoreError):  # read while being replaced: an error, never a mix
            continue
        finally:
            time.sleep(0.02)
        who = store.metadata["who"]
        assert store.num_prompts == 12
        assert all(float(store.rows(p, "a")[0, 0]) == 100 * who + p for p in range(store.num_prompts))
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err[-2000:]
    store = ReferenceStore.load(out)
    who = store.metadata["who"]
    assert all(float(store.rows(p, "a")[0, 0]) == 100 * who + p for p in range(12)), "the store mixes two saves"
    assert store.verify()["prompts"] == 12
    assert sorted(p.name for p in out.iterdir()) == ["index.json"] + [f"shard-{k:05d}.safetensors" for k in range(12)]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------- property: random stores, random merges

WIDTHS = st.sampled_from([1, 3, 8])


@st.composite
def store_plans(draw):
    n = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    parts = draw(st.integers(1, min(3, n)))
    owner = draw(st.lists(st.integers(0, parts - 1), min_size=n, max_size=n))
    owner[:parts] = range(parts)  # every part holds a prompt
    shard_bytes = draw(st.sampled_from([1, 64, 1 << 20]))
    return {"lengths": lengths, "owner": owner, "parts": parts, "shard_bytes": shard_bytes,
            "widths": (draw(WIDTHS), draw(WIDTHS)), "vocab": draw(st.sampled_from([8, 12])),
            "subset": draw(st.lists(st.integers(0, parts - 1), min_size=1, max_size=parts, unique=True)),
            "fault": draw(st.sampled_from([None, "width", "dtype", "vocab", "duplicate", "twice", "metadata"]))}


def _captures(p, L, widths, dtype=torch.float32):
    g = torch.Generator().manual_seed(p)
    return ([p, 1] + list(range(L)),
            {"a": [torch.randn(1, L + 2, widths[0], generator=g).to(dtype), torch.randn(1, 1, widths[0], generator=g).to(dtype)],
             "b": [torch.randn(1, L + 2, widths[1], generator=g).to(dtype), torch.randn(1, 1, widths[1], generator=g).to(dtype)]})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=store_plans())
def test_random_stores_merge_bit_exact_and_inconsistent_ones_never_do(tmp_path_factory, plan):
    root = tmp_path_factory.mktemp("prop")
    widths, vocab = plan["widths"], plan["vocab"]
    for k in range(plan["parts"]):
        with StoreWriter(root / f"part{k}", shard_bytes=plan["shard_bytes"], metadata={"vocab_size": vocab}) as w:
            for p, (L, owner) in enumerate(zip(plan["lengths"], plan["owner"])):
                if owner == k:
                    ids, caps = _captures(p, L, widths)
                    w.add(ids, caps, prompt_idx=p, extras=generation(vocab, p))
                    with pytest.raises(CaptureError):  # an inconsistent add is refused and changes nothing
                        w.add(ids, caps, extras=generation(vocab + 1, p))
    subset = [root / f"part{k}" for k in plan["subset"]]
    merged = ReferenceStore.load(merge_stores(subset, root / "merged"))
    chosen = [p for p, owner in enumerate(plan["owner"]) if owner in plan["subset"]]
    assert sorted(merged.prompt_ids) == chosen  # disjoint indices are kept
    for p in chosen:
        ids, caps = _captures(p, plan["lengths"][p], widths)
        expected = ReferenceStore.from_captures([caps])
        i = merged.internal_index(p)
        assert merged.prompt_token_ids[i] == ids
        for name in ("a", "b"):
            assert torch.equal(merged.rows(p, name), expected.rows(0, name))
        assert torch.equal(merged.extra(GENERATED_LOGITS, p), generation(vocab, p)[GENERATED_LOGITS])

    fault = plan["fault"]
    if fault is None:
        return
    bad = root / "bad"
    p = len(plan["lengths"])  # a new prompt
    ids, caps = _captures(p, 2, widths)
    meta, extras = {"vocab_size": vocab}, generation(vocab, p)
    if fault == "width":
        ids, caps = _captures(p, 2, (widths[0] + 1, widths[1]))
    elif fault == "dtype":
        ids, caps = _captures(p, 2, widths, torch.bfloat16)
    elif fault == "vocab":
        meta, extras = {"vocab_size": vocab + 1}, generation(vocab + 1, p)
    elif fault == "duplicate":
        ids, caps = _captures(chosen[0], plan["lengths"][chosen[0]], widths)
    elif fault == "metadata":
        meta = {"vocab_size": vocab, "dtype": "float32"}
    if fault == "twice":
        inputs = subset + [subset[0]]
    else:
        with StoreWriter(bad, metadata=meta) as w:
            w.add(ids, caps, prompt_idx=p, extras=extras)
        inputs = subset + [bad]
    with pytest.raises(StoreError):
        merge_stores(inputs, root / "refused")
    assert not (root / "refused").exists()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 5), min_size=1, max_size=9), written=st.sampled_from([1, 200, 600]),
       repacked=st.sampled_from([1, 500, 2000, 1 << 20]), first=st.integers(0, 3))
def test_a_repacked_store_holds_the_same_prompts_bit_for_bit_in_fewer_shards(tmp_path_factory, lengths, written,
                                                                              repacked, first):
    root = tmp_path_factory.mktemp("repack")
    prompts = range(first, first + len(lengths))  # indices need not start at 0
    texts = [f"text {p}" for p in range(first + len(lengths))]
    with StoreWriter(root / "src", shard_bytes=written, metadata={"vocab_size": 16, "prompt_texts": texts}) as w:
        for p, L in zip(prompts, lengths):
            ids, caps = _captures(p, L, (3, 8))
            w.add(ids, caps, prompt_idx=p, extras=generation(16, p))
            if p % 3 == 0:
                w.sync()  # an idle: a small shard of its own
    src = ReferenceStore.load(root / "src")
    out = ReferenceStore.load(repack_store(root / "src", root / "out", shard_bytes=repacked))
    assert out.prompt_ids == src.prompt_ids and out.prompt_token_ids == src.prompt_token_ids
    assert (out.num_steps, out.prefill, out.metadata) == (src.num_steps, src.prefill, src.metadata)
    assert out.finite_checked and out.verify()["prompts"] == len(lengths)
    for p in prompts:
        for name in ("a", "b"):
            assert torch.equal(out.rows(p, name), src.rows(p, name))
        assert torch.equal(out.extra(GENERATED_LOGITS, p), src.extra(GENERATED_LOGITS, p))
    sizes = [sum(t.numel() * t.element_size() for t in s.packed) for s in src.shards]
    assert len(out.shards) <= len(src.shards)
    if repacked >= sum(sizes) + 2000:  # room for every shard and its extras: one shard
        assert len(out.shards) == 1
    assert all(s.zero_row == s.rows and not s.packed[0][s.rows].any() for s in out.shards)
    replacer = TensorReplacer(out, src.prompt_token_ids)
    p = prompts[-1]
    replacer.register_request("r", src.prompt_token_ids[src.internal_index(p)])
    ctx = replacer.build_context_for_batch(["r"], [1], [lengths[-1] + 2])  # the decode step's row
    assert bool(ctx.mask[0]) and torch.equal(ctx["b"][0], src.rows(p, "b")[-1])


def test_repack_refuses_a_damaged_shard_and_writes_nothing(tmp_path):
    write(tmp_path / "src", range(4), shard_bytes=1)
    shard = tmp_path / "src" / "shard-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x40  # a byte of the last tensor's data: loading reads headers only, it still loads
    shard.write_bytes(bytes(raw))
    assert ReferenceStore.load(tmp_path / "src").num_prompts == 4
    with pytest.raises(StoreError, match=r"shard-00002.safetensors: tensor .* differs .* corrupted"):
        repack_store(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]
    write(tmp_path / "other", range(2))
    with pytest.raises(FileExistsError, match="other is not an empty directory"):
        repack_store(tmp_path / "src", tmp_path / "other")
    with pytest.raises(ValueError, match="shard_bytes must be a positive int"):
        repack_store(tmp_path / "other", tmp_path / "out", shard_bytes=0)
    live = StoreWriter(tmp_path / "live")
    live.add(*prompt(0))
    live.sync()  # complete as of this sync, but a capturing engine may still add to it
    with pytest.raises(StoreError, match=r"a store writer is still writing .*live .*delete .*\.fxreplace-writing"):
        repack_store(tmp_path / "live", tmp_path / "out")
    live.close()
    assert ReferenceStore.load(repack_store(tmp_path / "live", tmp_path / "out")).num_prompts == 1


# ---------------------------------------------------------------- config and replacer arguments


def test_config_checks_paths_and_sections_where_they_enter(tmp_path):
    from fxreplace import TensorReplacementConfig
    from fxreplace.config import ConfigError

    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"tensors_path: the directory .*empty' holds no reference store"):
        TensorReplacementConfig(tensors_path=tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"tensors holds the data itself, got the path '.*notes.txt'; give a path as tensors_path"):
        TensorReplacementConfig(tensors=str(tmp_path / "notes.txt"))
    with pytest.raises(ConfigError, match="tensors_path must be a path, got int 3"):
        TensorReplacementConfig(tensors_path=3)
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=r"tensors_path: '.*link' \(a link to '.*gone'\) does not exist"):
        TensorReplacementConfig(tensors_path=tmp_path / "link")
    with pytest.raises(ConfigError, match=r"capture 'out': '.*notes.txt' is a file"):
        TensorReplacementConfig(capture={"out": str(tmp_path / "notes.txt")})
    with pytest.raises(ConfigError, match=r"capture 'out': '.*notes.txt/sub' cannot be created"):
        TensorReplacementConfig(capture={"out": str(tmp_path / "notes.txt" / "sub")})
    assert TensorReplacementConfig(capture={"out": str(tmp_path / "new" / "ref")}).capture["out"].endswith("ref")


def test_replacer_checks_its_arguments():
    with pytest.raises(TypeError, match="allow_nonfinite must be True or False, got 'yes'"):
        TensorReplacer([prompt(0)[1]], allow_nonfinite="yes")


def test_a_refused_registration_leaves_the_previous_one():
    caps = [prompt(p)[1] for p in range(2)]
    replacer = TensorReplacer(caps, prompt_token_ids=[prompt(p)[0] for p in range(2)])
    assert replacer.register_request("r", prompt(0)[0] + [3]) == 0
    with pytest.raises(ValueError, match="request 'r' is already registered"):
        replacer.register_request("r", prompt(1)[0])
    with pytest.raises(KeyError, match="request 's': its 2 tokens start with no stored prompt"):
        replacer.register_request("s", [9, 9])
    with pytest.raises(ValueError, match="request 't': token ids must be integers"):
        replacer.register_request("t", [0.5, 1.5])
    assert replacer.requests == {"r": 0}
