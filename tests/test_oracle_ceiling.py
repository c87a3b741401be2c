"""The oracle drafter (specplug.bench.oracle, benchmarks/oracle_ceiling.py) drafts target-only's own greedy output:
at α = 1 every draft is kept, below it a share is made wrong, and the output is target-only's whatever it drafts."""
import pytest

from benchmark_scripts import load_benchmark
from specplug.bench.oracle import OracleProposer, greedy_outputs

script = load_benchmark("oracle_ceiling")
PROMPTS = ["def add(a, b):", "import os\n", "for i in range(3):\n"]


@pytest.fixture(scope="module")
def outputs(tiny_target):
    return greedy_outputs(tiny_target, PROMPTS, max_new_tokens=12)


def _decode(target, drafter, batch_size):
    runs, _ = script.decode(target, drafter, PROMPTS, batch_size=batch_size, tokens=12, gamma=3)
    return runs


def test_the_oracle_at_full_acceptance_has_every_draft_kept(tiny_target, outputs):
    runs = _decode(tiny_target, OracleProposer(outputs, tiny_target.vocab_size), batch_size=2)
    assert [r.tokens for r in runs] == [outputs[tuple(tiny_target.encode(p))] for p in PROMPTS]
    for run in runs:
        assert run.stats.draft_tokens > 0 and run.stats.accepted_tokens == run.stats.draft_tokens


def test_a_wrong_oracle_is_rejected_yet_the_output_stays_target_only(tiny_target, outputs):
    runs = _decode(tiny_target, OracleProposer(outputs, tiny_target.vocab_size, alpha=0.0), batch_size=3)
    assert [r.tokens for r in runs] == [outputs[tuple(tiny_target.encode(p))] for p in PROMPTS]
    assert all(r.stats.draft_tokens > 0 and r.stats.accepted_tokens == 0 for r in runs)


def test_below_full_acceptance_about_that_share_of_drafted_tokens_is_right():
    drafter = OracleProposer({}, vocab_size=50, alpha=0.7, seed=1)
    right = sum(drafter._maybe_wrong(7) == 7 for _ in range(4000))
    assert right / 4000 == pytest.approx(0.7, abs=0.03)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_an_acceptance_outside_zero_to_one_is_refused(alpha):
    with pytest.raises(ValueError, match=r"oracle: alpha must lie in \[0, 1\]"):
        OracleProposer({}, vocab_size=50, alpha=alpha)
