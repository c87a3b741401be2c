"""Exactness with power: speculative output follows the target's enumerated distribution, and the same
harness rejects the three classic bugs (p/q swapped, residual replaced by p, greedy draft with soft q).

Threshold: p-value < specplug.testing.EXACTNESS_ALPHA (1e-3) rejects. Seeds are fixed, so each verdict is
deterministic; the mutants land below 1e-20 with these sample sizes, the honest decoders well above 1e-3.
"""
import pytest
import torch

import specplug
import specplug.verifier.rule as rule
from specplug.proposers.draft_model import DraftModelProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]  # every token occurs, so ngram always finds a match
N_TOKENS = 3  # with gamma 2: rejections at each position, all-accepted + bonus, and the budget cut
N_SAMPLES = 3000

SETTINGS = {
    "temperature-1": specplug.SamplingParams(temperature=1.0),
    "top-k-3": specplug.SamplingParams(temperature=1.0, top_k=3),
    "top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_p=0.8),
}


def make(name, small_vocab_dirs, target):
    options = {"model": small_vocab_dirs["draft"]} if name.startswith("draft-model") else {}
    if name == "draft-model:hf":  # HF's forward instead of the lean one
        name, options["fast"] = "draft-model", False
    return specplug.get_proposer(name, target=target, **options)


def pvalue(target, proposer, sampling, n=N_SAMPLES):
    expected = exact_distribution(target, PROMPT, N_TOKENS, sampling)
    counts = sampled_distribution(target, proposer, PROMPT, N_TOKENS, sampling, n)
    return chi_square_pvalue(counts, expected)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", ["draft-model", "draft-model:hf", "ngram"])
def test_speculative_sampling_matches_target_distribution(name, setting, small_vocab_dirs, small_target):
    assert pvalue(small_target, make(name, small_vocab_dirs, small_target), SETTINGS[setting]) > EXACTNESS_ALPHA


def test_target_only_loop_matches_target_distribution(small_target):
    assert pvalue(small_target, None, SETTINGS["temperature-1"]) > EXACTNESS_ALPHA


def _swapped_acceptance(p_x, q_x):
    return torch.clamp(q_x / p_x, max=1.0)


def _swapped_residual(p, q, original=rule.residual_distribution):
    return original(q, p) if bool(q.sum() > 0) else p


@pytest.mark.parametrize("name", ["draft-model", "ngram"])
def test_harness_rejects_swapped_p_and_q(name, small_vocab_dirs, small_target, monkeypatch):
    monkeypatch.setattr(rule, "acceptance_probability", _swapped_acceptance)
    monkeypatch.setattr(rule, "residual_distribution", _swapped_residual)
    assert pvalue(small_target, make(name, small_vocab_dirs, small_target), SETTINGS["temperature-1"], 1000) < EXACTNESS_ALPHA


@pytest.mark.parametrize("name", ["draft-model", "ngram"])
def test_harness_rejects_residual_replaced_by_p(name, small_vocab_dirs, small_target, monkeypatch):
    monkeypatch.setattr(rule, "residual_distribution", lambda p, q: p)
    assert pvalue(small_target, make(name, small_vocab_dirs, small_target), SETTINGS["temperature-1"], 1000) < EXACTNESS_ALPHA


class GreedyWithSoftQ(DraftModelProposer):
    """The vLLM-style bug: drafts the argmax but reports the soft distribution as q."""

    @staticmethod
    def _sample(q, rng):
        return int(q.argmax())


def test_harness_rejects_greedy_draft_reporting_soft_q(small_vocab_dirs, small_target):
    dishonest = GreedyWithSoftQ(target=small_target, model=small_vocab_dirs["draft"])
    assert pvalue(small_target, dishonest, SETTINGS["temperature-1"], 1000) < EXACTNESS_ALPHA


def test_speculative_sampling_with_bf16_products_matches_target_distribution(small_vocab_dirs):
    """The zoo's default arithmetic (bf16 linear products, float32 elsewhere) changes p, not the rule."""
    target = specplug.Target.from_pretrained(small_vocab_dirs["target"], matmul_dtype="bfloat16")
    assert target.matmul_dtype == torch.bfloat16
    proposer = make("draft-model", small_vocab_dirs, target)
    assert pvalue(target, proposer, SETTINGS["temperature-1"]) > EXACTNESS_ALPHA
