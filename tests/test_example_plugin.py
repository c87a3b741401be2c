"""The example third-party package in examples/ installs for real, registers through its entry point,
and decodes exactly (greedy equality and the distribution harness)."""
import json
import os
import subprocess
import sys

import pytest

import specplug
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution


def test_pip_installed_example_plugin_is_listed_with_its_distribution(example_site):
    env = dict(os.environ, PYTHONPATH=str(example_site))
    out = subprocess.run([sys.executable, "-m", "specplug.cli", "proposers", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {p["name"]: p["source"] for p in json.loads(out.stdout)["proposers"]}
    assert rows["bigram"] == "specplug-bigram"


@pytest.fixture(scope="module")
def bigram_cls(example_module):
    return example_module.BigramProposer


def test_example_plugin_keeps_greedy_output(bigram_cls, tiny_target):
    a = specplug.generate(tiny_target, bigram_cls(), "def add(a, b):", max_new_tokens=200, sampling=specplug.GREEDY)
    b = specplug.generate(tiny_target, None, "def add(a, b):", max_new_tokens=200, sampling=specplug.GREEDY)
    assert a.tokens == b.tokens and a.stats.accepted_tokens > 0


def test_example_plugin_sampling_matches_target_distribution(bigram_cls, small_target):
    prompt, sampling = [1, 2, 3, 4, 5, 0, 1, 2], specplug.SamplingParams(temperature=1.0)
    counts = sampled_distribution(small_target, bigram_cls(), prompt, 3, sampling, 3000)
    assert chi_square_pvalue(counts, exact_distribution(small_target, prompt, 3, sampling)) > EXACTNESS_ALPHA
