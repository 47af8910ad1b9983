import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fxreplace.matching import PromptIndex


def test_longest_verified_prefix_wins():
    index = PromptIndex([[1, 2, 3], [1, 2, 3, 4, 5], [40, 50]])
    assert index.longest_prefix([1, 2, 3, 4, 5]) == 1
    assert index.longest_prefix([1, 2, 3, 77, 88]) == 0, "retry of prompt 0 with generated tokens"
    assert index.longest_prefix([1, 2, 3, 4]) == 0, "shorter than prompt 1"
    assert index.longest_prefix([40, 50, 60]) == 2
    assert index.longest_prefix([1, 2]) is None
    assert index.longest_prefix([9]) is None


def test_identical_prompts_resolve_to_lowest_index():
    assert PromptIndex([[3, 4], [3, 4]]).longest_prefix([3, 4, 5]) == 0


def test_hash_hit_without_matching_tokens_is_rejected():
    index = PromptIndex([[1, 2, 3], [7, 8]])
    # Forge a collision: make prompt 1's hash bucket also claim the hash of [1, 2, 3]'s 2-prefix.
    forged = int(index._prefix_hashes(np.array([1, 2]))[-1])
    index._by_hash[forged] = [1]
    assert index.longest_prefix([1, 2, 3, 4]) == 0
    assert index.longest_prefix([1, 2, 9]) is None


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=8),
    query=st.lists(st.integers(0, 4), min_size=0, max_size=10),
)
def test_matches_brute_force(prompts, query):
    expected, best = None, -1
    for i, p in enumerate(prompts):
        if len(p) > best and query[: len(p)] == p:
            expected, best = i, len(p)
    assert PromptIndex(prompts).longest_prefix(query) == expected


def test_lookup_cost_does_not_grow_with_stored_prompts():
    rng = np.random.default_rng(0)
    small = PromptIndex([rng.integers(0, 50000, 2048) for _ in range(10)])
    large = PromptIndex([rng.integers(0, 50000, int(n)) for n in rng.integers(1, 2049, 5000)])
    query = rng.integers(0, 50000, 2100)

    def per_call(index):
        start = time.perf_counter()
        for _ in range(50):
            index.longest_prefix(query)
        return (time.perf_counter() - start) / 50

    # Work per call is bounded by the request length: 500x more prompts must not cost 500x.
    assert per_call(large) < 20 * per_call(small) + 1e-3
