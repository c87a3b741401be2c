"""The policy replay (benchmarks/policy_replay.py) follows the engine: a static γ replayed over a recorded trace
takes the steps the engine took and drafts the tokens it drafted, so a policy's replayed run is the run it
would have had, priced by a fixed table."""
import time
from collections import Counter

import pytest

import specplug
from benchmark_scripts import load_benchmark as load
from specplug.batch import generate_batch
from specplug.policies import CostModelPolicy, FixedPolicy

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "the cat sat on the mat. the cat", "x = 1\ny = 2\nx = 1\n",
           "hello hello hello"]


def engine_steps(target, gamma: int, tokens: int, batch_size: int, recorder_class) -> list[dict]:
    recorder = recorder_class(FixedPolicy(gamma))
    generate_batch(target, specplug.get_proposer("ngram", target=target), PROMPTS, max_new_tokens=tokens,
                   sampling=[specplug.GREEDY] * len(PROMPTS), num_speculative_tokens=recorder,
                   max_batch_size=batch_size)
    return recorder.steps


def replayed_steps(replay, policy, trace, saved, own: dict | None = None) -> list[tuple[int, int]]:
    """(rows, drafted tokens) of each step the replay priced (``own``: see :func:`replay.replay`)."""
    table, steps = replay.CostTable(saved), []
    priced = table.step

    def counting(batch_size, drafted, backlog_rows):
        steps.append((batch_size, sum(drafted)))
        return priced(batch_size, drafted, backlog_rows)

    table.step = counting
    goodput = replay.replay(policy, trace, table, saved["batch_size"], saved["tokens"], "ngram", own=own)
    assert goodput > 0
    return steps


def test_a_static_gamma_replayed_over_a_recorded_trace_takes_the_steps_the_engine_took(tiny_target):
    replay, ab = load("policy_replay"), load("policy_ab")
    trace = replay.record(tiny_target, "ngram", PROMPTS, 24, depth=4)
    assert [len(r["output"]) for r in trace] == [24] * len(PROMPTS)
    for gamma in (2, 4):
        steps = engine_steps(tiny_target, gamma, 24, 2, ab.StepRecorder)
        saved = {"batch_size": 2, "tokens": 24, "runs": [{"variant": f"γ={gamma}", "seconds": 1.0, "tokens": 96,
                                                          "steps": steps}]}
        assert any(s["drafted"] for s in steps)  # the trace must exercise drafting, or this tests nothing
        assert replayed_steps(replay, FixedPolicy(gamma), trace, saved) == [(s["batch_size"], s["drafted"])
                                                                           for s in steps]
        # and the cost-model policy runs through the same loop, its calls as the engine makes them
        assert replayed_steps(replay, CostModelPolicy(max_gamma=4), trace, saved)


def test_the_replay_charges_a_static_gamma_nothing_against_itself_but_a_backlog(tiny_target):
    """``--losses`` prices each step against every row drafting the reference γ from the same positions: the
    reference replayed against itself loses only what its rows' drafters paid catching up."""
    replay, ab = load("policy_replay"), load("policy_ab")
    trace = replay.record(tiny_target, "ngram", PROMPTS, 24, depth=4)
    steps = engine_steps(tiny_target, 2, 24, 2, ab.StepRecorder)
    saved = {"batch_size": 2, "tokens": 24, "runs": [{"variant": "γ=2", "seconds": 1.0, "tokens": 96, "steps": steps}]}
    table = replay.CostTable(saved)
    for gamma, phase in ((0, "off"), (2, "k 1-2")):
        totals: dict[str, float] = {}
        replay.replay(FixedPolicy(gamma), trace, table, 2, 24, "ngram", losses=(gamma, totals))
        assert phase in totals and all(abs(v) < 1e-12 for p, v in totals.items() if p != phase)  # last tokens: k = 0
        # each request's drafter catches up once, when it first drafts
        assert 0.0 <= totals[phase] <= table.catch_up * len(PROMPTS) * (gamma > 0) + 1e-12


def test_the_replay_splits_a_run_by_the_rows_in_each_step_as_the_engine_ran_them(tiny_target):
    """``--by-rows``: a run's steps and table seconds by the rows in a step add up to the run (a draining batch's
    tail is its steps with fewer rows), with as many steps at each row count as the engine took."""
    replay, ab = load("policy_replay"), load("policy_ab")
    trace = replay.record(tiny_target, "ngram", PROMPTS, 24, depth=4)
    steps = engine_steps(tiny_target, 2, 24, 3, ab.StepRecorder)
    saved = {"batch_size": 3, "tokens": 24, "runs": [{"variant": "γ=2", "seconds": 1.0, "tokens": 96, "steps": steps}]}
    table, by_rows = replay.CostTable(saved), {}
    goodput = replay.replay(FixedPolicy(2), trace, table, 3, 24, "ngram", by_rows=by_rows)
    counts = Counter(s["batch_size"] for s in steps)
    assert {rows: n for rows, (n, _) in by_rows.items()} == counts and len(counts) > 1  # 4 requests, 3 rows: a tail
    assert table.per_run + sum(seconds for _, seconds in by_rows.values()) == pytest.approx(24 * len(PROMPTS) / goodput)


def test_the_ab_recorder_times_the_policys_own_calls_and_only_them(tiny_target):
    ab = load("policy_ab")

    class Slow(FixedPolicy):
        """γ = 2, each choice and each update taking 2 ms; ``inside``: the seconds spent in them, as timed here."""
        calls, inside = 0, 0.0

        def choose(self, seq, max_k):
            start = time.perf_counter()
            Slow.calls += 1
            time.sleep(0.002)
            k = super().choose(seq, max_k)
            Slow.inside += time.perf_counter() - start
            return k

        def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
            start = time.perf_counter()
            Slow.calls += 1
            time.sleep(0.002)
            Slow.inside += time.perf_counter() - start

    recorder = ab.StepRecorder(Slow(2))
    start = time.perf_counter()
    generate_batch(tiny_target, specplug.get_proposer("ngram", target=tiny_target), PROMPTS, max_new_tokens=12,
                   sampling=[specplug.GREEDY] * len(PROMPTS), num_speculative_tokens=recorder, max_batch_size=2)
    wall = time.perf_counter() - start
    assert Slow.calls > 0
    # a sleep may overrun on a busy machine: bound by the time the calls really took, not by 2 ms each
    assert Slow.inside <= recorder.policy_time < Slow.inside + 0.5 * (wall - Slow.inside)


class Seeing(FixedPolicy):
    """A static γ that writes down the scoring time it is shown at each step (once a step, not once a row)."""

    def __init__(self, gamma):
        super().__init__(gamma)
        self.seen, self._last = [], None

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        step = seq.scratch.get("batch_step")
        if step is not self._last:
            self._last = step
            self.seen.append(verify_time)


def test_a_slow_spell_makes_the_policy_see_dearer_steps_while_the_clock_stays_the_tables(tiny_target):
    replay, ab = load("policy_replay"), load("policy_ab")
    trace = replay.record(tiny_target, "ngram", PROMPTS, 24, depth=4)
    steps = engine_steps(tiny_target, 2, 24, 2, ab.StepRecorder)
    saved = {"batch_size": 2, "tokens": 24, "runs": [{"variant": "γ=2", "seconds": 1.0, "tokens": 96, "steps": steps}]}
    table = replay.CostTable(saved)
    plain, slowed = Seeing(2), Seeing(2)
    spell = replay.SlowSpell(2, 5, 3.0)
    assert replay.replay(plain, trace, table, 2, 24, "ngram") == replay.replay(slowed, trace, table, 2, 24, "ngram",
                                                                                spell=spell)
    assert spell.steps == len(slowed.seen) == len(plain.seen) > 5
    assert [s / p for s, p in zip(slowed.seen, plain.seen)] == pytest.approx([1, 1, 3, 3, 3] + [1] * (spell.steps - 5))
    # a spell is counted over every run it is passed to, as a kept policy lives through them
    replay.replay(Seeing(2), trace, table, 2, 24, "ngram", spell=spell)
    assert spell.steps == 2 * len(plain.seen)


def test_the_replay_times_the_policys_own_calls_and_digests_its_choices_so_two_versions_compare_exactly(tiny_target):
    """``own``: the seconds the policy's own calls took and a digest of every step's ks; a rule rewritten only for
    speed must leave the digest as it was (the replay is deterministic), and a different choice changes it."""
    replay, ab = load("policy_replay"), load("policy_ab")
    trace = replay.record(tiny_target, "ngram", PROMPTS, 24, depth=4)
    steps = engine_steps(tiny_target, 2, 24, 2, ab.StepRecorder)
    saved = {"batch_size": 2, "tokens": 24, "runs": [{"variant": "γ=2", "seconds": 1.0, "tokens": 96, "steps": steps}]}

    class Slow(FixedPolicy):
        def choose_batch(self, seqs, max_ks):
            time.sleep(0.001)
            return [self.choose(s, m) for s, m in zip(seqs, max_ks)]

    digests = []
    for policy in (CostModelPolicy(max_gamma=4), CostModelPolicy(max_gamma=4), FixedPolicy(2), FixedPolicy(3), Slow(2)):
        own: dict = {}
        assert len(replayed_steps(replay, policy, trace, saved, own)) == own["steps"]
        digests.append(own["choices"].hexdigest())
        if isinstance(policy, Slow):
            assert own["seconds"] >= 0.001 * own["steps"]  # its sleep is inside the calls timed
    assert digests[0] == digests[1] and digests[2] == digests[4]  # the same choices, the same digest
    assert len(set(digests[1:4])) == 3  # γ = 2 and γ = 3 choose otherwise, and so does the cost model here
