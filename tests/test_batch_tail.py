"""benchmarks/batch_tail.py splits a wave (every request joining at the first step) at the step its first row
finishes: before it every row ran, after it the draining tail."""
import argparse
from types import SimpleNamespace

import pytest

import specplug
from benchmark_scripts import load_benchmark
from specplug.metrics import GenerationStats

tail = load_benchmark("batch_tail")


def row(step_times, tokens, prefill=0.5):
    stats = GenerationStats(prefill_time=prefill)
    for t in step_times:
        stats.record_step(1, 1, 1, 2, t)
    return SimpleNamespace(stats=stats, tokens=[0] * tokens)


def test_a_wave_splits_where_its_first_row_finishes():
    wave = tail.split([row([1.0, 1.0, 1.0], 6), row([1.0, 1.0, 1.0, 0.5, 0.5], 10), row([1.0, 1.0, 1.0, 0.5], 8)],
                      wall=5.0)
    assert (wave.full_steps, wave.full_time, wave.tail_steps, wave.tail_time) == (3, 3.0, 2, 1.0)
    assert wave.row_steps == [3, 4, 5] and wave.tokens == 24 and wave.prefill == 0.5
    assert wave.goodput == pytest.approx(24 / 5.0) and wave.goodput_without_tail == pytest.approx(24 / 4.0)


def test_a_wave_whose_rows_finish_together_has_no_tail():
    wave = tail.split([row([1.0, 2.0], 2), row([1.0, 2.0], 2)], wall=3.5)
    assert (wave.full_steps, wave.tail_steps, wave.tail_time) == (2, 0, 0.0)


def test_a_real_wave_counts_every_row_and_token(tiny_target):
    prompts = ["def add(a, b):", "import os\n", "for i in range(3):\n"]
    wave = tail.run_wave(tiny_target, specplug.get_proposer("ngram"), prompts, gamma=3, tokens=12)
    assert wave.tokens == 36 and len(wave.row_steps) == 3
    assert wave.full_steps == wave.row_steps[0] and wave.full_steps + wave.tail_steps == wave.row_steps[-1]
    assert 0 < wave.prefill + wave.full_time + wave.tail_time <= wave.wall


@pytest.mark.parametrize("spec, parsed", [("ngram:2", ("ngram", 2)),
                                          ("draft-model:cost-model", ("draft-model", "cost-model"))])
def test_a_variant_is_a_proposer_with_a_gamma_or_a_policy(spec, parsed):
    assert tail.parse_variant(spec) == parsed


@pytest.mark.parametrize("spec", ["ngram", "ngram:x", ":4"])
def test_a_variant_without_a_gamma_or_policy_is_refused(spec):
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:γ or NAME:POLICY"):
        tail.parse_variant(spec)
