"""The decode loop: greedy equality, cache hygiene, stopping, streaming and clear errors."""
import pytest
import torch

import specplug
from specplug.proposers.draft_model import DraftModelProposer

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self", "for i in range(10):\n", "import os\n"]


def proposer(name, tiny_dirs, target):
    options = {"model": tiny_dirs["draft"]} if name == "draft-model" else {}
    return specplug.get_proposer(name, target=target, **options)


@pytest.mark.parametrize("name", ["draft-model", "ngram"])
def test_greedy_speculative_output_equals_target_only_token_for_token(name, tiny_dirs, tiny_target):
    prop = proposer(name, tiny_dirs, tiny_target)
    for prompt in PROMPTS:
        base = specplug.generate(tiny_target, None, prompt, max_new_tokens=200, sampling=specplug.GREEDY)
        spec = specplug.generate(tiny_target, prop, prompt, max_new_tokens=200, sampling=specplug.GREEDY,
                                 num_speculative_tokens=4, strict=True)
        assert len(base.tokens) == 200
        assert spec.tokens == base.tokens
        assert spec.stats.target_calls <= base.stats.target_calls


class CacheChecker(DraftModelProposer):
    """After every step: the target's cache for the row and the draft's cache (HF's, or every lean layer's) match
    the bookkeeping and the accepted sequence."""

    def observe(self, seq, verdict):
        super().observe(seq, verdict)
        target_state, draft_state = seq.target_cache, seq.scratch[self.name]
        assert target_state.get_seq_length() == target_state.length == len(seq.ids) - 1
        if self.lean is None:
            assert draft_state.cache.get_seq_length() == draft_state.length
        else:
            assert {layer.length for layer in draft_state.layers} == {draft_state.length}
        if verdict.accepted < verdict.proposed:  # after a rejection the draft is exactly in step
            assert draft_state.length == len(seq.ids) - 1
        else:  # all accepted: its last draft was never fed, it catches up next step
            assert draft_state.length == len(seq.ids) - 2
        self.steps = getattr(self, "steps", 0) + 1
        self.rejections = getattr(self, "rejections", 0) + (verdict.accepted < verdict.proposed)


@pytest.mark.parametrize("fast", [True, False], ids=["lean-draft", "hf-draft"])
def test_caches_track_the_accepted_sequence_through_rejections(tiny_dirs, tiny_target, fast):
    checker = CacheChecker(target=tiny_target, model=tiny_dirs["draft"], fast=fast)
    result = specplug.generate(tiny_target, checker, "def add(a, b):", max_new_tokens=60, strict=True,
                               sampling=specplug.SamplingParams(temperature=1.0, seed=3), num_speculative_tokens=4)
    assert len(result.tokens) == 60
    assert checker.rejections >= checker.steps // 2  # the random pair rejects a lot: a real test of rollback


def test_same_seed_gives_same_output(tiny_dirs, tiny_target):
    prop = proposer("draft-model", tiny_dirs, tiny_target)
    params = specplug.SamplingParams(temperature=1.0, seed=11)
    a = specplug.generate(tiny_target, prop, "import os\n", max_new_tokens=40, sampling=params)
    b = specplug.generate(tiny_target, prop, "import os\n", max_new_tokens=40, sampling=params)
    assert a.tokens == b.tokens


def test_prompt_may_be_token_ids(tiny_target):
    ids = tiny_target.encode("def add(a, b):")
    a = specplug.generate(tiny_target, None, ids, max_new_tokens=10, sampling=specplug.GREEDY)
    b = specplug.generate(tiny_target, None, "def add(a, b):", max_new_tokens=10, sampling=specplug.GREEDY)
    assert a.tokens == b.tokens and a.prompt_ids == ids


def test_generation_stops_at_eos(tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    free = specplug.generate(target, None, "def add(a, b):", max_new_tokens=30, sampling=specplug.GREEDY)
    eos = free.tokens[5]
    target.tokenizer.eos_token = None
    target.model.generation_config.eos_token_id = eos
    for prop in (None, specplug.get_proposer("ngram", target=target)):
        result = specplug.generate(target, prop, "def add(a, b):", max_new_tokens=30, sampling=specplug.GREEDY)
        first = free.tokens.index(eos)
        assert result.tokens == free.tokens[: first + 1] and result.finish_reason == "eos"


def test_generation_stops_after_stop_string(tiny_dirs, tiny_target):
    free = specplug.generate(tiny_target, None, "def add(a, b):", max_new_tokens=40, sampling=specplug.GREEDY)
    stop = free.text[10:13]
    prop = proposer("ngram", tiny_dirs, tiny_target)
    result = specplug.generate(tiny_target, prop, "def add(a, b):", max_new_tokens=40, sampling=specplug.GREEDY,
                               stop=[stop])
    assert result.finish_reason == "stop"
    assert stop in result.text and free.text.startswith(result.text)
    assert stop not in tiny_target.decode(result.tokens[:-1])  # no token more than needed


def test_max_new_tokens_is_exact_even_when_a_step_emits_several(tiny_dirs, tiny_target):
    prop = proposer("ngram", tiny_dirs, tiny_target)
    for n in (1, 2, 7):
        result = specplug.generate(tiny_target, prop, "def add(a, b):", max_new_tokens=n, sampling=specplug.GREEDY)
        assert len(result.tokens) == n and result.finish_reason == "length"


def test_stream_yields_each_steps_tokens_and_text(tiny_dirs, tiny_target):
    prop = proposer("ngram", tiny_dirs, tiny_target)
    chunks = list(specplug.stream(tiny_target, prop, "def add(a, b):", max_new_tokens=50, sampling=specplug.GREEDY))
    whole = specplug.generate(tiny_target, prop, "def add(a, b):", max_new_tokens=50, sampling=specplug.GREEDY)
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert whole.text.startswith("".join(c.text for c in chunks))
    seen = []
    specplug.generate(tiny_target, prop, "def add(a, b):", max_new_tokens=50, sampling=specplug.GREEDY,
                      callback=seen.append)
    assert [c.tokens for c in chunks] == seen


def test_stats_report_the_speculation_metrics(tiny_dirs, tiny_target):
    result = specplug.generate(tiny_target, proposer("ngram", tiny_dirs, tiny_target), "def add(a, b):",
                               max_new_tokens=100, sampling=specplug.GREEDY, num_speculative_tokens=3)
    s = result.stats
    d = s.to_dict()
    assert s.new_tokens == 100 == sum(s.step_emitted)
    assert s.accepted_tokens + s.target_calls == s.new_tokens  # every step: accepted + 1
    assert d["mean_acceptance_length"] == pytest.approx(100 / s.target_calls)
    assert len(d["per_position_acceptance"]) <= 3
    for key in ("acceptance_rate", "draft_cost_ratio", "predicted_speedup", "token_latency_p50_s",
                "token_latency_p99_s", "tokens_per_second"):
        assert key in d
    agg = specplug.aggregate([s, s])
    assert agg["new_tokens"] == 200 and agg["requests"] == 2


class EndCounter(specplug.types.Proposer):
    """Proposes nothing useful; counts begin() and end() calls."""

    name = "end-counter"

    def __init__(self, fail_at=None):
        self.begun = self.ended = self.calls = 0
        self.fail_at = fail_at

    def begin(self, seq):
        self.begun += 1

    def propose(self, seq, k):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom")
        return specplug.Proposal.point_mass([seq.ids[-1]] * k)

    def end(self, seq):
        self.ended += 1


def test_proposer_hears_end_when_a_stream_is_abandoned_or_decoding_fails(tiny_target):
    counter = EndCounter()
    chunks = specplug.stream(tiny_target, counter, "def add(a, b):", max_new_tokens=40)
    next(chunks)
    chunks.close()  # the consumer walks away
    assert (counter.begun, counter.ended) == (1, 1)
    failing = EndCounter(fail_at=2)
    with pytest.raises(specplug.SpeculationError):  # seeded: no early EOS before the second propose()
        specplug.generate(tiny_target, failing, "def add(a, b):", max_new_tokens=40, strict=True,
                          sampling=specplug.SamplingParams(seed=0))
    assert (failing.begun, failing.ended) == (1, 1)
    done = EndCounter()
    specplug.generate(tiny_target, done, "def add(a, b):", max_new_tokens=10)
    assert (done.begun, done.ended) == (1, 1)


def test_batch_rows_hear_end_when_the_batch_fails(tiny_target):
    from specplug.batch import generate_batch

    failing = EndCounter(fail_at=3)
    with pytest.raises(specplug.SpeculationError):
        generate_batch(tiny_target, failing, ["def add(a, b):", "import os\n"], max_new_tokens=30, strict=True,
                       sampling=specplug.SamplingParams(seed=0))
    assert failing.begun == 2 and failing.ended == 2
