"""The ``suffix`` proposer: exact at any temperature, greedy-equal to target-only, q = continuation
frequencies drawn honestly, and a global cache that stays bounded, keeps concurrent requests apart and
never holds a rejected draft."""
import gc
import random
import tracemalloc
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import specplug
from specplug.proposers.suffix import _DICT_BYTES, _ENTRY_BYTES, _NODE_BYTES, SuffixCache, SuffixProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.types import SequenceState

# exactness on the 6-token target: "1 2" is followed by 3, 4, 3 before, so q is not a point mass
PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
N_TOKENS = 3
N_SAMPLES = 2000
SETTINGS = {
    "temperature-1": specplug.SamplingParams(temperature=1.0),
    "top-k-3": specplug.SamplingParams(temperature=1.0, top_k=3),
    "top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_p=0.8),
}
# small bounds, so the run also evicts and hits the depth bound
BOUNDED = dict(max_depth=8, max_cached_requests=40, max_cached_tokens=400, prompt_tail=6)
PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self", "for i in range(10):\n", "import os\n"]


def brute_counts(seqs, depth):
    """Occurrences of every string of 1..depth tokens in ``seqs``: what a suffix tree must hold."""
    out = Counter()
    for s in seqs:
        for i in range(len(s)):
            for length in range(1, min(depth, len(s) - i) + 1):
                out[tuple(s[i:i + length])] += 1
    return dict(out)


def cached_seqs(cache):
    return [list(s) for s in cache.sequences.values()]


def cached(proposer):
    return cached_seqs(proposer.cache)


def stub_seq(ids, temperature=1.0, seed=0, vocab=16, num_prompt=None):
    params = specplug.SamplingParams(temperature=temperature, seed=seed)
    target = SimpleNamespace(device=torch.device("cpu"), vocab_size=vocab)
    return SequenceState(ids=list(ids), num_prompt=len(ids) if num_prompt is None else num_prompt,
                         sampling=params, rng=params.generator(), target=target)


# --- exactness ----------------------------------------------------------------------------------------------

def pvalue(target, proposer, sampling, n=N_SAMPLES):
    expected = exact_distribution(target, PROMPT, N_TOKENS, sampling)
    counts = sampled_distribution(target, proposer, PROMPT, N_TOKENS, sampling, n)
    return chi_square_pvalue(counts, expected)


class Drafts(SuffixProposer):
    """Counts what was drafted: the exactness runs must draft from soft q's, from both trees."""

    def __init__(self, **options):
        super().__init__(**options)
        self.soft = self.drafted = 0

    def propose(self, seq, k):
        proposal = super().propose(seq, k)
        self.drafted += proposal.k
        self.soft += proposal.q is not None and bool((proposal.q.max(-1).values < 1).any())
        return proposal


@pytest.mark.parametrize("setting", SETTINGS)
def test_suffix_sampling_matches_target_distribution(setting, small_target):
    proposer = Drafts(target=small_target, **BOUNDED)
    assert pvalue(small_target, proposer, SETTINGS[setting]) > EXACTNESS_ALPHA
    assert proposer.soft > N_SAMPLES // 4 and proposer.drafted > N_SAMPLES
    assert proposer.cache.evicted > 0


class ArgmaxWithSoftQ(SuffixProposer):
    """The classic bug: drafts the most frequent continuation but reports the frequencies as q."""

    @staticmethod
    def _draw(ids, counts, total, u):
        return counts.index(max(counts))


def test_harness_rejects_suffix_drafting_argmax_with_soft_q(small_target):
    proposer = ArgmaxWithSoftQ(target=small_target, **BOUNDED)
    assert pvalue(small_target, proposer, SETTINGS["temperature-1"], 800) < EXACTNESS_ALPHA


# --- greedy -------------------------------------------------------------------------------------------------

def test_greedy_output_equals_target_only_and_repeats_come_from_the_cache(tiny_target):
    proposer = specplug.get_proposer("suffix", target=tiny_target)
    for prompt in PROMPTS:
        base = specplug.generate(tiny_target, None, prompt, max_new_tokens=200, sampling=specplug.GREEDY)
        runs = [specplug.generate(tiny_target, proposer, prompt, max_new_tokens=200, sampling=specplug.GREEDY,
                                  num_speculative_tokens=6, strict=True) for _ in range(2)]
        assert len(base.tokens) == 200
        for run in runs:
            assert run.tokens == base.tokens
            assert run.stats.target_calls <= base.stats.target_calls
        # the second sample is the first one again: the global cache drafts it from the first step on
        assert runs[1].stats.target_calls <= 200 / 6
        assert runs[1].stats.target_calls < runs[0].stats.target_calls


def test_greedy_draft_is_the_argmax_with_a_one_hot_q():
    proposer = SuffixProposer()
    seq = stub_seq([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2], temperature=0)
    proposer.begin(seq)
    proposal = proposer.propose(seq, 1)
    assert proposal.tokens.tolist() == [3] and proposal.is_point_mass


# --- q: continuation frequencies, drawn honestly --------------------------------------------------------------

def test_q_is_the_continuation_frequency_and_the_draft_is_drawn_from_it():
    ids = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]  # "1 2" was followed by 3, 4, 3
    drawn = Counter()
    for seed in range(600):
        proposer = SuffixProposer()
        seq = stub_seq(ids, seed=seed)
        proposer.begin(seq)
        proposal = proposer.propose(seq, 1)
        q = proposal.q[0]
        assert torch.allclose(q[[3, 4]], torch.tensor([2 / 3, 1 / 3])) and float(q.sum()) == pytest.approx(1)
        drawn[proposal.tokens.item()] += 1
    assert set(drawn) == {3, 4}
    assert chi_square_pvalue(drawn, {3: 2 / 3, 4: 1 / 3}) > EXACTNESS_ALPHA


def test_drafting_continues_from_the_drawn_token():
    # after "1 2 3" comes 9 (certain); after "1 2 4" comes 7: the second row follows the first draw
    ids = [5, 1, 2, 3, 9, 6, 1, 2, 4, 7, 8, 1, 2, 3, 9, 0, 1, 2]
    seen = set()
    for seed in range(40):
        proposer = SuffixProposer(min_token_prob=0.0)
        seq = stub_seq(ids, seed=seed)
        proposer.begin(seq)
        proposal = proposer.propose(seq, 2)
        tokens = proposal.tokens.tolist()
        assert tokens in ([3, 9], [4, 7])
        assert proposal.q[1, tokens[1]] == 1.0
        seen.add(tuple(tokens))
    assert seen == {(3, 9), (4, 7)}


def test_draft_length_adapts_to_match_length_and_confidence():
    ids = [7, 1, 2, 3, 4, 5, 6, 8, 1, 2]  # context "1 2" matches 2 tokens; what follows is certain
    for options, expected in (({}, [3, 4]),  # factor 1.0: at most 2 tokens for a match of 2
                              ({"factor": 2.0}, [3, 4, 5, 6]),
                              ({"factor": 0.5}, [3]),
                              # a depth-3 tree holds 3-token strings: the context shrinks to "2" to leave room
                              ({"max_depth": 3, "factor": 4.0}, [3, 4])):
        proposer = SuffixProposer(**options)
        seq = stub_seq(ids, temperature=0)
        proposer.begin(seq)
        assert proposer.propose(seq, 8).tokens.tolist() == expected, options
    # min_token_prob: the best continuation of "1 2" has frequency 2/3; a path below the threshold stops
    ids = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]
    for threshold, k in ((0.6, 1), (0.7, 0)):
        proposer = SuffixProposer(min_token_prob=threshold)
        seq = stub_seq(ids)
        proposer.begin(seq)
        assert proposer.propose(seq, 1).k == k


def test_a_later_request_drafts_an_earlier_output_from_its_first_step():
    proposer = SuffixProposer()
    prompt, output = [3, 4, 5, 6], [9, 8, 7, 9, 8, 6]
    first = stub_seq(prompt, temperature=0)
    proposer.begin(first)
    first.ids.extend(output)
    proposer.observe(first, None)
    proposer.end(first)
    second = stub_seq(prompt, temperature=0)
    proposer.begin(second)
    assert proposer.propose(second, 4).tokens.tolist() == output[:4]


# --- the cache ----------------------------------------------------------------------------------------------

def test_tree_holds_exactly_the_substring_counts_through_inserts_and_evictions():
    rng = random.Random(0)
    for _ in range(60):
        depth = rng.choice([1, 2, 3, 5, 64])
        cache = SuffixCache(depth, max_requests=rng.choice([-1, 3]), max_tokens=rng.choice([-1, 50]))
        for _ in range(rng.randint(1, 8)):
            cache.add([rng.randrange(rng.choice([1, 2, 4])) for _ in range(rng.randint(1, 25))])
            cache.check()
            assert cache.tree.substring_counts() == brute_counts(cached_seqs(cache), depth)
        while cache.sequences:
            cache.evict_oldest()
            cache.check()
            assert cache.tree.substring_counts() == brute_counts(cached_seqs(cache), depth)
        assert cache.tree.num_nodes == 0


def test_eviction_keeps_the_cache_within_its_bounds_oldest_first():
    rng = random.Random(1)
    max_tokens, max_requests = 3000, 20
    worst_bytes_per_token = 2 * (_NODE_BYTES + _DICT_BYTES + _ENTRY_BYTES + 8) + 4  # <= 2 nodes (and dicts) a token
    cache = SuffixCache(max_depth=16, max_requests=max_requests, max_tokens=max_tokens)
    added = []
    for _ in range(120):  # ~10x the token bound passes through
        seq = [rng.randrange(50) for _ in range(rng.randint(50, 400))]
        cache.add(seq)
        added.append(seq)
        assert cache.num_tokens <= max_tokens and len(cache.sequences) <= max_requests
        assert cache.tree.num_nodes <= 2 * cache.num_tokens
        assert len(cache.tree.kids) <= 2 * max_tokens + 1  # freed node ids are reused: no growth with churn
        assert cache.memory_bytes() <= max_tokens * worst_bytes_per_token + max_requests * 100
        kept = cached_seqs(cache)
        assert kept == added[len(added) - len(kept):]  # the newest ones, in order: the oldest went first
    assert cache.evicted > 100
    cache.add(list(range(50)) * 100)  # longer than the whole bound: its last max_tokens tokens stay
    assert cached_seqs(cache) == [(list(range(50)) * 100)[-max_tokens:]]
    cache.check()


def test_reported_memory_is_what_the_cache_holds():
    rng = random.Random(2)
    seqs = [[rng.randrange(40) for _ in range(300)] for _ in range(30)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = SuffixCache(max_depth=32, max_requests=-1, max_tokens=-1)
        for s in seqs:
            cache.add(s)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.8 * held <= cache.memory_bytes() <= 1.25 * held


class Spy(SuffixProposer):
    """After every step: the local tree holds exactly the accepted tokens, and the global cursors reach
    exactly as far back as the longest suffix of the context that the cached outputs contain."""

    def __init__(self, **options):
        super().__init__(**options)
        self.rejected = self.steps = 0

    def observe(self, seq, verdict):
        super().observe(seq, verdict)
        state = seq.scratch[self.name]
        assert list(state.writer.tokens) == seq.ids
        assert state.tree.substring_counts() == brute_counts([seq.ids], self.max_depth)
        assert len(state.cursors) - 1 == longest_cached_suffix(seq.ids, cached(self), self.max_depth)
        self.steps += 1
        self.rejected += verdict.accepted < verdict.proposed


def longest_cached_suffix(ids, seqs, depth):
    grams = set(brute_counts(seqs, depth))
    m = 0
    while m < min(depth, len(ids)) and tuple(ids[len(ids) - m - 1:]) in grams:
        m += 1
    return m


def test_rejected_drafts_never_enter_the_cache(tiny_target):
    spy = Spy(target=tiny_target, max_depth=8, prompt_tail=4)
    prompt = tiny_target.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):")
    for seed in range(4):
        params = specplug.SamplingParams(temperature=1.0, seed=seed)
        specplug.generate(tiny_target, spy, prompt, max_new_tokens=40, sampling=params,
                          num_speculative_tokens=4, strict=True)
        spy.cache.check()
        assert spy.cache.tree.substring_counts() == brute_counts(cached(spy), spy.max_depth)
    assert spy.rejected >= 10  # the random target rejects a lot: the check above had something to catch
    # and what was cached is exactly prompt tail + the accepted output of each request
    assert all(s[:4] == prompt[-4:] for s in cached(spy))


def test_two_requests_sharing_one_cache_do_not_corrupt_each_other(tiny_target):
    spy = Spy(target=tiny_target, max_depth=16)
    long_prompt, short_prompt = PROMPTS[1], PROMPTS[0]
    specplug.generate(tiny_target, spy, long_prompt, max_new_tokens=30, sampling=specplug.GREEDY)
    base = {p: specplug.generate(tiny_target, None, p, max_new_tokens=n, sampling=specplug.GREEDY).tokens
            for p, n in ((long_prompt, 120), (short_prompt, 30))}
    runs = {p: specplug.decode_steps(tiny_target, spy, p, max_new_tokens=n, sampling=specplug.GREEDY,
                                     num_speculative_tokens=4, strict=True)
            for p, n in ((long_prompt, 120), (short_prompt, 30))}
    results, versions = {}, set()
    while runs:  # step the two requests in turn; the short one ends (and is cached) mid-way
        for p in list(runs):
            try:
                next(runs[p])
            except StopIteration as done:
                results[p] = done.value
                del runs[p]
            versions.add(spy.cache.version)
    assert results[long_prompt].tokens == base[long_prompt]
    assert results[short_prompt].tokens == base[short_prompt]
    assert len(versions) >= 2  # the cache changed under the running request
    spy.cache.check()
    assert spy.cache.tree.substring_counts() == brute_counts(cached(spy), spy.max_depth)
    assert len(spy.cache.sequences) == 3 and spy.memory_bytes() == spy.cache.memory_bytes()


def test_a_running_request_sees_outputs_cached_while_it_runs():
    proposer = SuffixProposer(min_token_prob=0.0, prompt_tail=0)
    proposer.cache.add([1, 2, 3, 4, 5, 6, 7, 8])
    running = stub_seq([9, 1, 2, 3])
    proposer.begin(running)
    assert proposer.propose(running, 1).tokens.tolist() == [4]  # one continuation so far: a point mass
    other = stub_seq([7], num_prompt=1)
    proposer.begin(other)
    other.ids.extend([1, 2, 3, 0, 0])  # ends with "1 2 3" followed by 0: splits the cached path mid-edge
    proposer.end(other)
    proposal = proposer.propose(running, 1)
    assert proposal.q is not None and proposal.q[0, [4, 0]].tolist() == [0.5, 0.5]


def test_options_are_checked():
    for bad in ({"max_depth": 0}, {"factor": -1}, {"min_token_prob": 1.5}, {"prompt_tail": -1}):
        with pytest.raises(ValueError, match="suffix"):
            SuffixProposer(**bad)
    with pytest.raises(TypeError, match="suffix"):
        specplug.get_proposer("suffix", no_such_option=1)
    assert "suffix" in specplug.list_proposers()
