"""benchmarks/oracle_ceiling.py drafts target-only's own greedy output: at α = 1 every draft is kept, below it a
share is made wrong, and the output is target-only's whatever the oracle drafts."""
import pytest

import specplug
from benchmark_scripts import load_benchmark

oracle = load_benchmark("oracle_ceiling")
PROMPTS = ["def add(a, b):", "import os\n", "for i in range(3):\n"]


@pytest.fixture(scope="module")
def known(tiny_target):
    return oracle.reference(tiny_target, PROMPTS, tokens=12)


def test_the_oracle_at_full_acceptance_has_every_draft_kept(tiny_target, known):
    results, outputs = known
    drafter = oracle.OracleProposer(outputs, tiny_target.vocab_size)
    runs, _ = oracle.decode(tiny_target, drafter, PROMPTS, batch_size=2, tokens=12, gamma=3)
    assert [r.tokens for r in runs] == [r.tokens for r in results]
    for run in runs:
        assert run.stats.draft_tokens > 0 and run.stats.accepted_tokens == run.stats.draft_tokens


def test_a_wrong_oracle_is_rejected_yet_the_output_stays_target_only(tiny_target, known):
    results, outputs = known
    drafter = oracle.OracleProposer(outputs, tiny_target.vocab_size, alpha=0.0)
    runs, _ = oracle.decode(tiny_target, drafter, PROMPTS, batch_size=3, tokens=12, gamma=3)
    assert [r.tokens for r in runs] == [r.tokens for r in results]
    assert all(r.stats.draft_tokens > 0 and r.stats.accepted_tokens == 0 for r in runs)


def test_below_full_acceptance_about_that_share_of_drafted_tokens_is_right():
    drafter = oracle.OracleProposer({}, vocab_size=50, alpha=0.7, seed=1)
    right = sum(drafter._maybe_wrong(7) == 7 for _ in range(4000))
    assert right / 4000 == pytest.approx(0.7, abs=0.03)
