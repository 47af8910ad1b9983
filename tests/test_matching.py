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


class _CountingDict(dict):
    """The index's hash table, counting the lookups a request makes."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def test_lookup_work_is_bounded_by_the_request_not_the_stored_prompts():
    # Work is counted, not timed: a timing ratio between two indexes fails on a loaded CI machine.
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50000, int(n)) for n in rng.integers(1, 2049, 5000)]
    index = PromptIndex(prompts)
    index._by_hash = _CountingDict(index._by_hash)
    compared = []
    table_array = index._table.array
    index._table.array = lambda i: compared.append(i) or table_array(i)

    stranger = rng.integers(0, 50000, 300)
    assert index.longest_prefix(stranger) is None
    assert index._by_hash.lookups <= stranger.size, "one hash lookup per prefix length at most"
    assert compared == [], "no stored prompt's tokens are read when no hash matches"

    index._by_hash.lookups = 0
    retry = np.concatenate([prompts[123], rng.integers(0, 50000, 40)])
    expected = max((i for i, p in enumerate(prompts) if retry[: p.size].tolist() == p.tolist()), key=lambda i: prompts[i].size)
    assert index.longest_prefix(retry) == expected
    assert index._by_hash.lookups <= retry.size
    assert len(compared) == 1, "only the prompt whose hash matches is verified"
