import threading

import numpy as np

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxreplace import ReplacementContext, TensorReplacer
from fxreplace.active_context import get_replacement_tensor, set_active_context
from fxreplace.testing import build_context_loop, slot_owners


def captures_for(lengths, decode_steps, modules=("m0", "m1"), widths=(4, 3), dtype=torch.float32, seed=0, kv_cache=False):
    g = torch.Generator().manual_seed(seed)
    caps = []
    for L, D in zip(lengths, decode_steps):
        entry = {}
        for m, E in zip(modules, widths):
            steps = [torch.randn(1, L, E, generator=g).to(dtype)]
            steps += [torch.randn(1, 1 if kv_cache else L + i, E, generator=g).to(dtype) for i in range(1, D + 1)]
            entry[m] = steps
        caps.append(entry)
    return caps


@pytest.fixture
def replacer():
    caps = captures_for([3, 5, 2], [2, 1, 3])
    r = TensorReplacer(caps, prompt_token_ids=[[1, 2, 3], [1, 2, 3, 4, 5], [40, 50]])
    r.caps = caps
    return r


def test_register_resolves_longest_prefix_and_hint(replacer):
    assert replacer.register_request("a", [1, 2, 3, 4, 5]) == 1
    assert replacer.register_request("b", [1, 2, 3, 77]) == 0
    assert replacer.register_request("c", [1, 2, 3, 4, 5], prompt_idx=0) == 0, "hint removes the documented ambiguity"
    assert replacer.register_request("a", [1, 2, 3, 4, 5]) == 1, "re-registering with the same tokens is a no-op"
    with pytest.raises(ValueError, match=r"request 'a' is already registered \(5 tokens\) .* \(2 tokens\); release_request\('a'\)"):
        replacer.register_request("a", [40, 50])
    with pytest.raises(ValueError, match="request 'c' is already registered"):
        replacer.register_request("c", [1, 2, 3, 4, 5])
    with pytest.raises(KeyError, match="prompt 9 is not in the reference store"):
        replacer.register_request("d", [1], prompt_idx=9)
    with pytest.raises(KeyError, match=r"request 'e': its 2 tokens start with no stored prompt"):
        replacer.register_request("e", [7, 7])
    assert replacer.requests == {"a": 1, "b": 0, "c": 0}


def test_release_forgets_requests(replacer):
    replacer.register_request("a", [40, 50])
    passthrough = TensorReplacer(replacer.caps, prompt_token_ids=[[1, 2, 3], [1, 2, 3, 4, 5], [40, 50]],
                                 on_unknown="passthrough")
    passthrough.register_request("u", [9, 9])
    assert not passthrough.any_matched(["u", "never-registered"])
    assert replacer.any_matched(["x", "a"])
    assert replacer.release_request("a") is True
    assert not replacer.any_matched(["a"])
    assert replacer.release_request("a") is False
    assert replacer.requests == {}
    with pytest.raises(KeyError, match="request 'a' is not registered"):
        replacer.build_context(["a"], [0], is_prefill=False)


def test_prefill_chunk_not_starting_at_zero(replacer):
    replacer.register_request("a", [1, 2, 3, 4, 5])
    # chunk covering positions 2..5, then padding that happens to continue with a jump
    ctx = replacer.build_context(["a"], [2, 3, 4, 5, 0, 1, 2, 3], is_prefill=True)
    assert ctx.mask.tolist() == [True, True, True, True, False, False, False, False]
    rows = replacer.store.rows(1, "m0")
    assert torch.equal(ctx["m0"][:4], rows[2:6])
    assert torch.count_nonzero(ctx["m0"][4:]) == 0


def test_prefill_padding_that_repeats_last_position(replacer):
    replacer.register_request("a", [1, 2, 3])
    ctx = replacer.build_context(["a"], [0, 1, 2, 2, 2], is_prefill=True)
    assert ctx.mask.tolist() == [True, True, True, False, False]
    with pytest.raises(ValueError, match="a prefill batch holds exactly one request, got 2"):
        replacer.build_context(["a", "a"], [0, 1], is_prefill=True)


def test_decode_with_speculative_slots_and_out_of_range_positions(replacer):
    replacer.register_request("a", [1, 2, 3, 9])  # prompt 0: 3 + 2 positions
    replacer.register_request("b", [40, 50])  # prompt 2: 2 + 3 positions
    ctx = replacer.build_context(["a", "b"], [3, 4, 5, 6, 2, 3, 4, 5, 0, 0], is_prefill=False, tokens_per_req=4)
    assert ctx.mask.tolist() == [True, True, False, False, True, True, True, False, False, False]
    assert torch.equal(ctx["m1"][1], replacer.caps[0]["m1"][2][0, -1])
    assert torch.equal(ctx["m1"][6], replacer.caps[2]["m1"][3][0, -1])
    assert ctx["m0"].dtype == torch.float32 and ctx["m0"].shape == (10, 4)


def test_unknown_requests_pass_through_when_asked():
    caps = captures_for([2], [1])
    r = TensorReplacer(caps, prompt_token_ids=[[5, 6]], on_unknown="passthrough")
    assert r.register_request("known", [5, 6]) == 0
    assert r.register_request("stranger", [1, 1]) is None
    ctx = r.build_context(["known", "stranger", "never-registered"], [2, 0, 1], is_prefill=False)
    assert ctx.mask.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="on_unknown must be"):
        TensorReplacer(caps, on_unknown="ignore")


def test_build_context_for_mixed_batch(replacer):
    replacer.register_request("a", [1, 2, 3, 4, 5])
    replacer.register_request("b", [40, 50, 1])
    replacer.register_request("c", [1, 2, 3])
    # a: prefill chunk at 3..5 of prompt 1 (6 rows), b: one decode token, c: two speculative tokens, then padding.
    positions = [3, 4, 5, 4, 3, 4, 0, 0]
    ctx = replacer.build_context_for_batch(["a", "b", "c"], [3, 1, 2], positions)
    assert ctx.mask.tolist() == [True, True, True, True, True, True, False, False]
    assert torch.equal(ctx["m0"][3], replacer.store.rows(2, "m0")[4])
    with pytest.raises(ValueError, match="requests schedule 9 tokens but the batch has only 8 positions"):
        replacer.build_context_for_batch(["a", "b", "c"], [3, 4, 2], positions)
    with pytest.raises(ValueError, match="got 2 num_scheduled_tokens for 3 requests"):
        replacer.build_context_for_batch(["a", "b", "c"], [3, 4], positions)


def test_warmup_context_is_zero_and_off(replacer):
    ctx = replacer.warmup_context(6)
    assert isinstance(ctx, ReplacementContext)
    assert not ctx.mask.any() and ctx.mask.shape == (6,)
    assert set(ctx) == {"m0", "m1"} and ctx["m1"].shape == (6, 3)
    assert all(torch.count_nonzero(t) == 0 for t in ctx.values())
    assert set(dict(ctx)) == {"m0", "m1"}


def test_context_keeps_capture_dtype():
    r = TensorReplacer(captures_for([2], [0], dtype=torch.bfloat16), prompt_token_ids=[[1, 2]])
    r.register_request("a", [1, 2])
    assert r.build_context(["a"], [0, 1], True)["m0"].dtype == torch.bfloat16


def test_positions_must_be_one_dimensional(replacer):
    with pytest.raises(ValueError, match=r"positions must be 1-D \[num_slots\], got shape \(2, 2\)"):
        replacer.build_context([], [[0, 1], [2, 3]], is_prefill=False)


def test_without_token_ids_requests_need_a_hint():
    r = TensorReplacer(captures_for([2], [0]))
    with pytest.raises(ValueError, match="only be registered with an explicit prompt_idx"):
        r.register_request("a", [1, 2])
    assert r.register_request("a", None, prompt_idx=0) == 0


def test_active_context_is_thread_local(replacer):
    replacer.register_request("a", [1, 2, 3])
    mine = replacer.build_context(["a"], [0, 1, 2], True)
    seen = {}

    def worker():
        seen["before"] = get_replacement_tensor("m0")
        theirs = replacer.warmup_context(2)
        set_active_context(theirs)
        seen["after"] = get_replacement_tensor("m0")

    set_active_context(mine)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    try:
        assert seen["before"] is None
        assert seen["after"].shape == (2, 4)
        assert get_replacement_tensor("m0") is mine["m0"]
        assert get_replacement_tensor("not-a-module") is None
    finally:
        set_active_context(None)
    assert get_replacement_tensor("m0") is None


# ---------------------------------------------------------------- property tests


@st.composite
def scenario(draw):
    n_prompts = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 6), min_size=n_prompts, max_size=n_prompts))
    decode = draw(st.lists(st.integers(0, 4), min_size=n_prompts, max_size=n_prompts))
    kv_cache = draw(st.booleans())
    n_req = draw(st.integers(0, 4))
    # each request: a prompt (or None = unknown to the reference)
    req_prompts = draw(st.lists(st.one_of(st.none(), st.integers(0, n_prompts - 1)), min_size=n_req, max_size=n_req))
    return lengths, decode, kv_cache, req_prompts


def _setup(lengths, decode, kv_cache, req_prompts, seed, dtype=torch.float32, **layout):
    caps = captures_for(lengths, decode, seed=seed, kv_cache=kv_cache, dtype=dtype, **layout)
    r = TensorReplacer(caps, on_unknown="passthrough")
    return caps, r, _register(r, req_prompts)


def _register(r, req_prompts) -> list[str]:
    """Request ``req-i`` registered as prompt ``req_prompts[i]`` (None: not registered)."""
    req_ids = [f"req-{i}" for i in range(len(req_prompts))]
    for rid, p in zip(req_ids, req_prompts):
        if p is not None:
            r.register_request(rid, None, prompt_idx=p)
    return req_ids


def _assert_same(ctx, expected, mask):
    assert ctx.mask.tolist() == mask.tolist()
    for m, t in expected.items():
        assert torch.equal(ctx[m], t), m


@pytest.fixture(params=["small", "large"])
def row_path(request, monkeypatch):
    """Run a test on both row paths: small batches (slot arithmetic in Python, rows copied by
    numpy) and large ones (numpy arithmetic, rows copied by index_select)."""
    import fxreplace.replacer.rows as rows_module

    if request.param == "large":
        monkeypatch.setattr(rows_module, "_SMALL_BATCH", -1)
    return request.param


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenario(), tokens_per_req=st.integers(1, 4), extra_pad=st.integers(0, 5), data=st.data())
def test_decode_matches_per_slot_oracle(row_path, sc, tokens_per_req, extra_pad, data):
    lengths, decode, kv_cache, req_prompts = sc
    caps, r, req_ids = _setup(lengths, decode, kv_cache, req_prompts, seed=len(req_prompts))
    slots = len(req_ids) * tokens_per_req + extra_pad
    positions = data.draw(st.lists(st.integers(-1, 12), min_size=slots, max_size=slots))
    ctx = r.build_context(req_ids, positions, is_prefill=False, tokens_per_req=tokens_per_req)
    owners = slot_owners(slots, len(req_ids), is_prefill=False, tokens_per_req=tokens_per_req)
    _assert_same(ctx, *build_context_loop(caps, req_prompts, positions, owners))


@pytest.mark.parametrize("shard_bytes", [None, 1, 250], ids=["in memory", "a shard per prompt", "shards of 1-2 prompts"])
def test_consecutive_decode_steps_match_per_slot_oracle(shard_bytes, tmp_path):
    """An engine's decode steps: the same requests step after step (the lookup of the
    last batch is reused and, into the same out=, the steady-decode shortcut writes the
    rows), one running past its stored rows, a step back into range after it (the
    shortcut must rewrite the mask that step left False), a new registration and a
    reordered batch in between; every step against the oracle. The store is one shard, or
    several written to disk (a batch's rows then lie in one shard or in several)."""
    from fxreplace import ReferenceStore, StoreWriter
    from fxreplace.engines.protocol import StepLayout

    caps = captures_for([3, 5, 2, 4], [4, 2, 6, 3], seed=11)
    if shard_bytes is not None:
        with StoreWriter(tmp_path / "ref", shard_bytes=shard_bytes) as writer:
            for p, c in enumerate(caps):
                writer.add(None, c, prompt_idx=p)
        store = ReferenceStore.load(tmp_path / "ref")
        assert len(store.shards) == (4 if shard_bytes == 1 else 2 if shard_bytes == 250 else 0)
        caps_or_store = store
    else:
        caps_or_store = caps
    r = TensorReplacer(caps_or_store, on_unknown="passthrough")
    prompts = [2, 0, 3, 1]
    ids = [f"req-{i}" for i in range(4)]
    for rid, p in zip(ids[:3], prompts):
        r.register_request(rid, None, prompt_idx=p)
    feed = r.warmup_context(8)
    views = {n: feed.leading(n) for n in (2, 3, 4)}  # one out= per batch size, as engines keep them
    shortcut = []
    decode_into = r._decode_into
    r._decode_into = lambda *args: shortcut.append(decode_into(*args)) or shortcut[-1]

    def engine_step(batch, positions, out):
        """An engine's step: the steady-decode shortcut, else the general build."""
        return r.step_into(StepLayout(batch, [1] * len(batch), positions), out)

    batches = [(ids[:3], [3, 3, 4]), (ids[:3], [4, 4, 5]), (ids[:3], [5, 5, 6]), (ids[:3], [6, 6, 7]),
               (ids[:3], [2, 2, 3]), (ids, [7, 7, 8, 4]), (ids, [8, 8, 9, 5]), ([ids[3], ids[0], ids[2]], [6, 9, 10]),
               ([ids[0], ids[2]], [4, 4]), ([ids[0], ids[2]], [5, 5])]  # prompts 2 and 3 (one shard of 1-2 prompts)
    for step, (batch, positions) in enumerate(batches):
        if step == 5:
            r.register_request(ids[3], None, prompt_idx=prompts[3])
        out = views[len(positions)]
        assert engine_step(batch, torch.tensor(positions), out) is out
        owners = slot_owners(len(positions), len(batch), num_scheduled_tokens=[1] * len(batch))
        _assert_same(out, *build_context_loop(caps, [prompts[ids.index(b)] for b in batch], positions, owners))
        assert out.num_replaced == int(out.mask.sum())
    assert shortcut == [False, True, True, False, True, False, False, False, False, True]
    engine_step(ids[:3], [3, 3, 4], views[3])
    engine_step(ids[:3], [3, 3, 4], views[3])
    assert shortcut[-1]  # the batch the bad positions below arrive with takes the shortcut
    for bad in ([2.0, 2.0, 3.0], torch.tensor([2.0, 2.0, 3.0]), torch.tensor([[2, 2, 3]])):  # never a row for these
        with pytest.raises(ValueError, match="positions must be"):
            engine_step(ids[:3], bad, views[3])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenario(), start=st.integers(0, 8), run=st.integers(1, 8), pad=st.lists(st.integers(0, 12), max_size=6))
def test_prefill_matches_per_slot_oracle(row_path, sc, start, run, pad):
    lengths, decode, kv_cache, req_prompts = sc
    req_prompts = (req_prompts or [0])[:1]
    caps, r, req_ids = _setup(lengths, decode, kv_cache, req_prompts, seed=start)
    positions = list(range(start, start + run)) + pad
    ctx = r.build_context(req_ids, positions, is_prefill=True)
    owners = slot_owners(len(positions), 1, positions=positions, is_prefill=True)
    _assert_same(ctx, *build_context_loop(caps, req_prompts, positions, owners))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenario(), data=st.data())
def test_mixed_batch_matches_per_slot_oracle(row_path, sc, data):
    """Fresh, and into a dirty ``out=`` (every row and flag of it must be rewritten)."""
    lengths, decode, kv_cache, req_prompts = sc
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    # two capture names share a group (width 4): each one's tensor is a strided column of it
    caps, r, req_ids = _setup(lengths, decode, kv_cache, req_prompts, seed=7, dtype=dtype, modules=("m0", "m1", "m2"),
                              widths=(4, 4, 3))
    counts = data.draw(st.lists(st.integers(0, 5), min_size=len(req_ids), max_size=len(req_ids)))
    pad = data.draw(st.integers(0, 4))
    positions = []
    for c in counts:  # each request's tokens are consecutive from some start
        s = data.draw(st.integers(0, 10))
        positions += list(range(s, s + c))
    positions += data.draw(st.lists(st.integers(0, 10), min_size=pad, max_size=pad))
    ctx = r.build_context_for_batch(req_ids, counts, positions)
    owners = slot_owners(len(positions), len(req_ids), num_scheduled_tokens=counts)
    expected = build_context_loop(caps, req_prompts, positions, owners)
    _assert_same(ctx, *expected)
    dirty = r.warmup_context(len(positions) + 3)
    for block in dirty.storage:
        block.fill_(7.0)
    dirty.mask.fill_(True)
    out = dirty.leading(len(positions))
    assert r.build_context_for_batch(req_ids, counts, positions, out=out) is out
    _assert_same(out, *expected)
    assert dirty.mask[len(positions):].all()  # rows past the batch are not touched


@settings(max_examples=60, deadline=None)
@given(sc=scenario(), shard_bytes=st.sampled_from([1, 200]), data=st.data())
def test_sharded_store_matches_per_slot_oracle(sc, shard_bytes, data):
    """A store written prompt by prompt into several shard files gathers like one in memory."""
    import tempfile

    from fxreplace import ReferenceStore, StoreWriter

    lengths, decode, kv_cache, req_prompts = sc
    # two capture names share a group (width 4): each one's tensor is a strided column of it
    caps = captures_for(lengths, decode, modules=("m0", "m1", "m2"), widths=(4, 4, 3), seed=3, kv_cache=kv_cache)
    with tempfile.TemporaryDirectory() as tmp:
        with StoreWriter(f"{tmp}/ref", shard_bytes=shard_bytes) as writer:
            for p in reversed(range(len(caps))):  # shards hold prompts in any order
                writer.add(None, caps[p], prompt_idx=p)
        r = TensorReplacer(ReferenceStore.load(f"{tmp}/ref"), on_unknown="passthrough")
        req_ids = _register(r, req_prompts)
        counts = data.draw(st.lists(st.integers(0, 5), min_size=len(req_ids), max_size=len(req_ids)))
        positions = [s + j for c in counts for s in [data.draw(st.integers(0, 10))] for j in range(c)]
        positions += data.draw(st.lists(st.integers(0, 10), max_size=4))
        owners = slot_owners(len(positions), len(req_ids), num_scheduled_tokens=counts)
        expected = build_context_loop(caps, req_prompts, positions, owners)
        _assert_same(r.build_context_for_batch(req_ids, counts, positions), *expected)
        out = r.warmup_context(len(positions))
        _assert_same(r.build_context_for_batch(req_ids, counts, positions, out=out), *expected)
        dirty = r.warmup_context(len(positions) + 3)  # an engine's bound feed: a leading() view
        for block in dirty.storage:
            block.fill_(7.0)
        dirty.mask.fill_(True)
        _assert_same(r.build_context_for_batch(req_ids, counts, positions, out=dirty.leading(len(positions))), *expected)
        assert dirty.mask[len(positions):].all() and all(bool((b[len(positions):] == 7).all()) for b in dirty.storage)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenario(), shard_bytes=st.sampled_from([None, 1, 200]), data=st.data())
def test_a_context_of_some_names_holds_their_rows_only(row_path, sc, shard_bytes, data):
    """build_context(names=): a blame pass replacing a few components gathers their rows alone, equal to
    the full context's, into buffers of their columns only (adjacent columns of a group stay one block);
    out= reuses a context of the same names; names the store lacks are an error naming them."""
    import tempfile

    from fxreplace import ReferenceStore, StoreWriter

    lengths, decode, kv_cache, req_prompts = sc
    modules = ("m0", "m1", "m2", "m3", "m4")  # m0, m1, m3 share a group (width 4), m2 and m4 another
    caps = captures_for(lengths, decode, modules=modules, widths=(4, 4, 3, 4, 3), seed=5, kv_cache=kv_cache)
    names = data.draw(st.sets(st.sampled_from(modules)))
    with tempfile.TemporaryDirectory() as tmp:
        if shard_bytes is None:
            r = TensorReplacer(caps, on_unknown="passthrough")
        else:
            with StoreWriter(f"{tmp}/ref", shard_bytes=shard_bytes) as writer:
                for p in range(len(caps)):
                    writer.add(None, caps[p], prompt_idx=p)
            r = TensorReplacer(ReferenceStore.load(f"{tmp}/ref"), on_unknown="passthrough")
        req_ids = _register(r, req_prompts)
        positions = data.draw(st.lists(st.integers(0, 10), min_size=len(req_ids), max_size=len(req_ids) + 3))
        owners = slot_owners(len(positions), len(req_ids), is_prefill=False, tokens_per_req=1)
        expected, mask = build_context_loop(caps, req_prompts, positions, owners)
        ctx = r.build_context(req_ids, positions, is_prefill=False, names=names)
        assert set(ctx) == names and sum(s.shape[1] for s in ctx.storage) == len(names)
        _assert_same(ctx, {m: expected[m] for m in names}, mask)
        out = r.warmup_context(len(positions), names=names)
        assert r.build_context(req_ids, positions, is_prefill=False, names=names, out=out) is out
        _assert_same(out, {m: expected[m] for m in names}, mask)
        if names == {"m0", "m1", "m3"}:
            assert len(ctx.storage) == 1, "one group's columns: one block"
        if names and set(modules) - names:
            with pytest.raises(ValueError, match="the same names"):
                r.build_context(req_ids, positions, is_prefill=False, out=out)
    with pytest.raises(KeyError, match=r"no capture name \['m9'\]"):
        r.build_context(req_ids, positions, is_prefill=False, names=["m0", "m9"])


def test_a_large_batch_over_several_shards_matches_per_slot_oracle(tmp_path):
    """More slots than the small-batch paths take, rows in four shards (and unmatched requests,
    positions past a prompt, padding): the staging gather, into a fresh context, an out= one
    and a leading() view of a dirty feed."""
    from fxreplace import ReferenceStore, StoreWriter

    lengths, decode = [30, 25, 40, 12], [0, 0, 0, 0]
    caps = captures_for(lengths, decode, modules=("m0", "m1", "m2"), widths=(4, 4, 3), seed=5)
    with StoreWriter(tmp_path / "ref", shard_bytes=1) as writer:
        for p in (2, 0, 3, 1):
            writer.add(None, caps[p], prompt_idx=p)
    r = TensorReplacer(ReferenceStore.load(tmp_path / "ref"), on_unknown="passthrough")
    assert len(r.store.shards) == 4
    rng = np.random.default_rng(0)
    req_prompts = [[2, 0, 3, 1, None][i % 5] for i in range(40)]
    req_ids = [f"big-{i}" for i in range(len(req_prompts))]
    for rid, p in zip(req_ids, req_prompts):
        if p is not None:
            r.register_request(rid, None, prompt_idx=p)
    counts = [int(c) for c in rng.integers(1, 4, len(req_ids))]
    positions = [int(s) + j for c in counts for s in [rng.integers(0, 38)] for j in range(c)] + [0] * 5
    assert len(positions) > 64
    expected = build_context_loop(caps, req_prompts, positions, slot_owners(len(positions), len(req_ids),
                                                                            num_scheduled_tokens=counts))
    _assert_same(r.build_context_for_batch(req_ids, counts, positions), *expected)
    _assert_same(r.build_context_for_batch(req_ids, counts, positions, out=r.warmup_context(len(positions))), *expected)
    dirty = r.warmup_context(len(positions) + 3)
    for block in dirty.storage:
        block.fill_(7.0)
    _assert_same(r.build_context_for_batch(req_ids, counts, positions, out=dirty.leading(len(positions))), *expected)
    assert all(bool((b[len(positions):] == 7).all()) for b in dirty.storage)


# ---------------------------------------------------------------- bad batches, devices, buffers, threads


def test_batches_that_would_drop_or_truncate_are_errors(replacer):
    replacer.register_request("a", [1, 2, 3])
    replacer.register_request("b", [40, 50])
    with pytest.raises(ValueError, match=r"decode batch of 2 requests x 2 tokens needs 4 slots but has 3 positions: requests \['b'\]"):
        replacer.build_context(["a", "b"], [3, 4, 2], is_prefill=False, tokens_per_req=2)
    for bad in ([0, 1.5], torch.tensor([0.0, 1.0]), np.array([0.5, 1.0]), [True, False]):
        with pytest.raises(ValueError, match="positions must be integers"):
            replacer.build_context(["a"], bad, is_prefill=True)
    with pytest.raises(ValueError, match="num_scheduled_tokens must be integers"):
        replacer.build_context_for_batch(["a", "b"], [1.0, 1.0], [0, 1])
    with pytest.raises(ValueError, match="tokens_per_req must be an int >= 1, got 1.5"):
        replacer.build_context(["a"], [0, 1], is_prefill=False, tokens_per_req=1.5)
    with pytest.raises(ValueError, match=r"request 'c': token ids must be integers, got float64"):
        replacer.register_request("c", [1.0, 2.5, 3.0])
    ctx = replacer.build_context(["a", "b"], np.array([3, 4], dtype=np.int32), is_prefill=False)
    assert ctx.mask.tolist() == [True, True]


def test_each_capture_is_a_column_of_one_position_major_buffer_per_group():
    caps = captures_for([3], [0], modules=("m0", "m1", "m2"), widths=(4, 4, 3), seed=1)
    replacer = TensorReplacer(caps, prompt_token_ids=[[1, 2, 3]])
    replacer.register_request("a", [1, 2, 3])
    ctx = replacer.build_context(["a"], [0, 1, 2, 0], is_prefill=True)
    group = ctx.storage[ctx.places["m1"][0]]
    assert group.shape == (4, 2, 4) and group.is_contiguous(), "[slots, capture names, width]"
    assert ctx.places["m0"] == (0, 0) and ctx.places["m1"] == (0, 1)
    assert ctx["m1"].stride() == (8, 1) and ctx["m1"].data_ptr() == group[:, 1].data_ptr(), "a column of its group"
    assert torch.equal(ctx["m1"], torch.cat([replacer.store.rows(0, "m1")[:3], torch.zeros(1, 4)]))
    small = replacer.warmup_context(8).leading(4)
    assert all(s.is_contiguous() for s in small.storage), "a leading() view is the first rows of each group"
    assert replacer.build_context(["a"], [0, 1, 2, 0], True, out=small) is small
    assert all(torch.equal(small[m], ctx[m]) for m in ctx)
    assert all(small[m].stride() == ctx[m].stride() for m in ctx), "a view of a larger feed reads like a fresh build"


def test_to_the_same_device_keeps_the_buffers_for_out(replacer):
    replacer.register_request("a", [1, 2, 3])
    ctx = replacer.build_context(["a"], [0, 1, 2], True, device="cpu")
    assert ctx.to("cpu") is ctx and ctx.to(torch.device("cpu")) is ctx
    again = replacer.build_context(["a"], [3, 4, 5], True, device="cpu", out=ctx)
    assert again is ctx and ctx.mask.tolist() == [True, True, False]
    moved = replacer.warmup_context(3).to("meta")
    assert moved.storage and moved.storage[0].device.type == "meta" and moved["m0"].device.type == "meta"
    assert moved.to("meta") is moved
    assert replacer.build_context(["a"], [0, 1, 2], True, out=moved) is moved, "out= on another device than the store"
    with pytest.raises(ValueError, match="out= is on meta; it cannot also move the context to cpu"):
        replacer.build_context(["a"], [0, 1, 2], True, device="cpu", out=moved)


def test_a_living_context_keeps_its_buffers_before_any_tensor_is_read(replacer):
    replacer.register_request("a", [1, 2, 3, 4, 5])
    big = list(range(80))  # more slots than a small batch (which numpy views, holding its buffers)
    alive = replacer.build_context(["a"], big, True)  # its capture tensors are made when first read
    other = replacer.build_context(["a"], big[2:] + [0, 0], True)
    assert other.storage[0].data_ptr() != alive.storage[0].data_ptr(), "a living context's buffers were reused"
    assert torch.equal(alive["m0"], replacer.build_context(["a"], big, True)["m0"])


def test_fresh_contexts_recycle_only_buffers_nobody_holds(replacer):
    replacer.register_request("a", [1, 2, 3, 4, 5])
    first = replacer.build_context(["a"], [0, 1, 2], True)
    kept = first["m0"]  # the user keeps one capture tensor: its buffer must never be reused
    kept_values = kept.clone()
    ptr = first.storage[0].data_ptr()
    del first
    second = replacer.build_context(["a"], [2, 3, 4], True)
    assert second.storage[0].data_ptr() != ptr and torch.equal(kept, kept_values)
    ptr2 = second.storage[0].data_ptr()
    replacer.release(second)  # handed back explicitly: contexts never released are never reused
    del second
    third = replacer.build_context(["a"], [0, 1, 2], True)
    assert third.storage[0].data_ptr() == ptr2, "a dropped context's buffers serve the next build"
    assert torch.equal(third["m0"], kept_values)


def test_public_methods_are_safe_from_eight_threads():
    caps = captures_for([3, 5, 2, 4], [2, 1, 3, 2])
    token_ids = [[1, 2, 3], [7, 2, 3, 4, 5], [40, 50], [9, 9, 9, 9]]
    r = TensorReplacer(caps, prompt_token_ids=token_ids)
    errors, barrier = [], threading.Barrier(8)

    def worker(w):
        try:
            rng = np.random.default_rng(w)
            barrier.wait()
            for it in range(60):
                ids = [f"w{w}-{it}-{k}" for k in range(3)]
                prompts = rng.integers(0, 4, 3).tolist()
                for rid, p in zip(ids, prompts):
                    assert r.register_request(rid, token_ids[p] + [1]) == p
                    assert r.register_request(rid, token_ids[p] + [1]) == p
                snapshot = r.requests  # others register and release meanwhile
                assert all(snapshot[rid] == p for rid, p in zip(ids, prompts))
                counts = rng.integers(0, 4, 3).tolist()
                positions = [int(s) + j for c in counts for s in [rng.integers(0, 6)] for j in range(c)] + [0, 0]
                out = r.warmup_context(len(positions)) if it % 2 else None
                ctx = r.build_context_for_batch(ids, counts, positions, out=out)
                owners = slot_owners(len(positions), 3, num_scheduled_tokens=counts)
                expected, mask = build_context_loop(caps, prompts, positions, owners)
                assert ctx.mask.tolist() == mask.tolist()
                assert all(torch.equal(ctx[m], expected[m]) for m in expected)
                for rid in ids:
                    assert r.release_request(rid)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert r.requests == {}


# ---------------------------------------------------------------- padding as data, the engines' step


def _padded_owners(num_slots, counts, padding):
    """Request index owning each slot (None = padding): request i's tokens, then its padding."""
    owners = []
    for i, (c, pad) in enumerate(zip(counts, padding)):
        owners += [i] * c + [None] * pad
    return owners + [None] * (num_slots - len(owners))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenario(), shard_bytes=st.sampled_from([None, 1]), data=st.data())
def test_padding_between_requests_is_data(row_path, sc, shard_bytes, data):
    """build(..., padding=): request i's tokens, then padding[i] slots off, for any on_unknown. The same
    context as the padding given as a request of its own that the reference does not know (how
    vllm-neuron's layouts carried it before) and as the per-slot oracle; a StepLayout with that padding
    through step_into builds it too (None, writing nothing, when no request matched)."""
    import tempfile

    from fxreplace import ReferenceStore, StoreWriter
    from fxreplace.replacer.requests import StepLayout

    lengths, decode, kv_cache, req_prompts = sc
    caps = captures_for(lengths, decode, seed=9, kv_cache=kv_cache)
    counts = data.draw(st.lists(st.integers(0, 4), min_size=len(req_prompts), max_size=len(req_prompts)))
    padding = data.draw(st.lists(st.integers(0, 3), min_size=len(req_prompts), max_size=len(req_prompts)))
    positions = []
    for c, pad in zip(counts, padding):
        s = data.draw(st.integers(0, 10))
        positions += list(range(s, s + c)) + data.draw(st.lists(st.integers(0, 10), min_size=pad, max_size=pad))
    positions += data.draw(st.lists(st.integers(0, 10), max_size=3))
    expected = build_context_loop(caps, req_prompts, positions, _padded_owners(len(positions), counts, padding))
    with tempfile.TemporaryDirectory() as tmp:
        if shard_bytes is None:
            r = TensorReplacer(caps, on_unknown="passthrough")
        else:  # a prompt per shard: a batch's rows lie in several
            with StoreWriter(f"{tmp}/ref", shard_bytes=shard_bytes) as writer:
                for p in range(len(caps)):
                    writer.add(None, caps[p], prompt_idx=p)
            r = TensorReplacer(ReferenceStore.load(f"{tmp}/ref"), on_unknown="passthrough")
        req_ids = _register(r, req_prompts)
        _assert_same(r.build(req_ids, counts, positions, padding), *expected)
        as_requests = [x for rid, c, pad in zip(req_ids, counts, padding) for x in ((rid, c), ("\0padding", pad))]
        before = r.build_context_for_batch([rid for rid, _ in as_requests], [c for _, c in as_requests], positions)
        _assert_same(before, *expected)
        out = r.warmup_context(len(positions))
        out.mask.fill_(True)  # written only by a build
        layout = StepLayout(req_ids, counts, torch.tensor(positions, dtype=torch.int64), padding)
        stepped = r.step_into(layout, out)
        if any(p is not None for p in req_prompts):
            assert stepped is out
            _assert_same(out, *expected)
        else:
            assert stepped is None and out.mask.all(), "no request matched: nothing written"


def test_padding_is_checked(replacer):
    replacer.register_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="got 1 padding counts for 2 requests"):
        replacer.build(["a", "a"], [1, 1], [0, 1, 0], [1])
    with pytest.raises(ValueError, match=r"padding must be >= 0, got \[-1\]"):
        replacer.build(["a"], [1], [0, 1], [-1])
    with pytest.raises(ValueError, match="padding must be integers"):
        replacer.build(["a"], [1], [0, 1], [0.5])
    with pytest.raises(ValueError, match=r"requests schedule 4 slots \(tokens and padding\) but the batch has only 3"):
        replacer.build(["a"], [2], [0, 1, 0], [2])
    strict = replacer.build(["a"], [2], [0, 1, 0, 0], [1])  # on_unknown="error": padding is no request
    assert strict.mask.tolist() == [True, True, False, False]


def test_step_into_takes_decode_into_for_a_steady_decode_step(monkeypatch):
    from fxreplace.replacer.requests import StepLayout

    caps = captures_for([3, 5], [4, 4])
    r = TensorReplacer(caps, on_unknown="passthrough")
    ids = _register(r, [0, 1, None])
    out = r.warmup_context(3)
    calls = []
    decode_into = r._decode_into
    monkeypatch.setattr(r, "_decode_into", lambda *args: calls.append(decode_into(*args)) or calls[-1])
    for step in range(3):
        positions = [3 + step, 5 + step, 0]
        assert r.step_into(StepLayout(ids, [1, 1, 1], torch.tensor(positions)), out) is out
        _assert_same(out, *build_context_loop(caps, [0, 1, None], positions, [0, 1, 2]))
    assert calls == [False, False, False], "a request without a stored prompt: the general build"
    r.release_request(ids[2])
    r.register_request(ids[2], None, prompt_idx=0)
    for step in range(3):
        positions = [4 + step, 6 + step, 2 + step]
        assert r.step_into(StepLayout(ids, [1, 1, 1], torch.tensor(positions)), out) is out
        _assert_same(out, *build_context_loop(caps, [0, 1, 0], positions, [0, 1, 2]))
    assert calls == [False, False, False, False, True, True], "the same batch again: decode_into"
    padded = StepLayout(ids[:2], [1, 1], torch.tensor([5, 0, 8]), [1, 0])
    assert r.step_into(padded, out) is out and calls[-1] is True, "padding between requests: no decode_into"
    assert out.mask.tolist() == [True, False, True]


# ---------------------------------------------------------------- released buffers


def test_a_released_context_serves_the_next_build_of_its_shape(replacer):
    replacer.register_request("a", [1, 2, 3, 4, 5])
    first = replacer.build_context(["a"], [0, 1, 2], True)
    ptr = first.storage[0].data_ptr()
    assert replacer.release(first) is True
    assert replacer.release(first) is False, "released once"
    del first
    other_shape = replacer.build_context(["a"], [0, 1], True)
    assert other_shape.storage[0].data_ptr() != ptr
    second = replacer.build_context(["a"], [2, 3, 4], True)
    assert second.storage[0].data_ptr() == ptr
    assert torch.equal(second["m0"], replacer.store.rows(1, "m0")[2:5]) and second.mask.all()
    assert replacer.build_context(["a"], [2, 3, 4], True).storage[0].data_ptr() != ptr, "lent once"


def test_an_unreleased_context_is_never_reused(replacer):
    replacer.register_request("a", [1, 2, 3, 4, 5])
    alive = replacer.build_context(["a"], [0, 1, 2], True)
    for start in range(3):
        ctx = replacer.build_context(["a"], [start, start + 1, start + 2], True)
        assert ctx.storage[0].data_ptr() != alive.storage[0].data_ptr()
        del ctx
    assert torch.equal(alive["m0"], replacer.store.rows(1, "m0")[:3])
    assert replacer._pool._returned == [], "dropped without release: the pool keeps nothing of them"


@pytest.mark.parametrize("holder", ["the context", "a select()", "its storage"])
def test_a_released_context_still_read_is_not_overwritten(replacer, holder):
    """The rule of release(): its buffers wait until the context is gone elsewhere too (another
    holder of it, of a select() of it or of its storage still reads them)."""
    replacer.register_request("a", [1, 2, 3, 4, 5])
    ctx = replacer.build_context(["a"], [0, 1, 2], True)
    ptr, values = ctx.storage[0].data_ptr(), ctx["m0"].clone()
    held = {"the context": lambda: ctx, "a select()": lambda: ctx.select(["m0"]), "its storage": lambda: ctx.storage}[holder]()
    assert replacer.release(ctx)
    del ctx
    other = replacer.build_context(["a"], [2, 3, 4], True)
    assert other.storage[0].data_ptr() != ptr
    assert torch.equal(held["m0"] if isinstance(held, ReplacementContext) else held[0][:, 0], values)
    del held
    assert replacer.build_context(["a"], [2, 3, 4], True).storage[0].data_ptr() == ptr, "free once nothing holds it"


@pytest.mark.parametrize("view", ["a capture tensor", "leading()"])
def test_views_of_a_released_context_are_the_callers_to_clone(replacer, view):
    """What release() documents: views of the storage (a capture tensor, leading(), a slice, a numpy
    array) do not hold the buffers of a released context; the next build of that shape overwrites them."""
    replacer.register_request("a", [1, 2, 3, 4, 5])
    ctx = replacer.build_context(["a"], [0, 1, 2], True)
    ptr, before = ctx.storage[0].data_ptr(), ctx["m0"].clone()
    kept = ctx["m0"] if view == "a capture tensor" else ctx.leading(2)["m0"]
    assert replacer.release(ctx)
    del ctx
    again = replacer.build_context(["a"], [2, 3, 4], True)
    assert again.storage[0].data_ptr() == ptr == kept.data_ptr()
    assert torch.equal(kept, again["m0"][: kept.shape[0]]) and not torch.equal(kept, before[: kept.shape[0]])


def test_release_leaves_every_other_context_alone(replacer):
    replacer.register_request("a", [1, 2, 3, 4, 5])
    built = replacer.build_context(["a"], [0, 1, 2], True)
    warm = replacer.warmup_context(3)
    assert replacer.build_context(["a"], [0, 1, 2], True, out=warm) is warm
    moved = replacer.build_context(["a"], [0, 1, 2], True, device="meta")
    for other in (warm, built.leading(2), built.select(["m0"]), moved, ReplacementContext({"m0": torch.ones(3, 4)},
                                                                                          torch.ones(3, dtype=torch.bool))):
        assert replacer.release(other) is False
    assert len(replacer._pool._returned) == 1, "only the buffers the build copied to meta from"
    assert not TensorReplacer(replacer.caps).release(built), "another replacer's context"
    assert replacer.release(built)


def test_the_pool_keeps_a_few_released_sets():
    r = TensorReplacer(captures_for([8], [0]), on_unknown="passthrough")
    r.register_request("a", None, prompt_idx=0)
    held = [r.build(["a"], [n], list(range(n))) for n in range(1, 9)]  # eight shapes, each still read
    assert all(r.release(ctx) for ctx in held)
    assert len(r._pool._returned) == 4, "the four released last"
    ptrs = [ctx.storage[0].data_ptr() for ctx in held]
    del held
    assert r.build(["a"], [8], list(range(8))).storage[0].data_ptr() == ptrs[-1]
    assert r.build(["a"], [1], [0]).storage[0].data_ptr() != ptrs[0], "dropped from the pool: not reused"


def test_builds_and_releases_from_eight_threads():
    """No two living contexts share buffers, whichever thread releases them."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    caps = captures_for([40], [0], seed=4)
    r = TensorReplacer(caps, on_unknown="passthrough")
    r.register_request("a", None, prompt_idx=0)
    barrier = threading.Barrier(8)

    def worker(w):
        barrier.wait()
        for it in range(40):
            positions = [(w * 7 + it + j) % 40 for j in range(80)]  # large: index_select into pool buffers
            ctx = r.build(["a"], [80], positions)
            expected, _ = build_context_loop(caps, [0], positions, [0] * 80)
            assert all(torch.equal(ctx[m], expected[m]) for m in expected), (w, it)
            assert r.release(ctx)
            time.sleep(0.001)  # the others build meanwhile: still read, the context is not theirs to take
            assert all(torch.equal(ctx[m], expected[m]) for m in expected), (w, it, "after release")

    with ThreadPoolExecutor(8) as threads:
        list(threads.map(worker, range(8)))  # re-raises a worker's failure
