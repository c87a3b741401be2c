"""``draft-model`` with bf16 products (``weights="bf16"``, or the machine's choice): the draft multiplies by a
bfloat16 copy with float32 activations, the output stays exactly the target's (sampled, greedy, batched, trees), the
default takes that form only where a probe finds a whole drafted token faster, and a wrong setting names the
proposer."""
import pytest
import torch

import specplug
from greedy_rows import assert_batched_greedy_rows_equal_target_only
from specplug import bf16_products, machine
from specplug.proposers.draft_model import DraftModelProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]


def test_bf16_drafting_multiplies_by_a_bf16_copy_and_leaves_the_loaded_draft_alone(tiny_dirs, tiny_target):
    proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], weights="bf16")
    assert proposer.weights == "bf16" and proposer.bf16_model is not None
    products = [p for layer in proposer.lean.layers for p in layer.products()]
    assert all(p.weight.dtype == torch.bfloat16 for p in products)
    assert proposer.lean.dtype == torch.float32  # activations: float32, as the target's bf16 products run
    assert all(p.dtype == torch.float32 for p in proposer.draft.model.parameters())


def test_draft_model_with_bf16_products_is_exact(small_vocab_dirs, small_target):
    sampling = specplug.SamplingParams(temperature=1.0)
    proposer = DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], weights="bf16")
    expected = exact_distribution(small_target, PROMPT, 3, sampling)
    counts = sampled_distribution(small_target, proposer, PROMPT, 3, sampling, 1500)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


@pytest.mark.parametrize("tree", [0, 8])
def test_bf16_drafting_decodes_greedy_as_target_only_single_and_batched(tree, tiny_dirs, tiny_target):
    proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], weights="bf16", tree=tree)
    prompt = "def add(a, b):\n"
    want = specplug.generate(tiny_target, None, prompt, max_new_tokens=40, sampling=specplug.GREEDY).tokens
    got = specplug.generate(tiny_target, proposer, prompt, max_new_tokens=40, sampling=specplug.GREEDY,
                            num_speculative_tokens=4, strict=True)
    assert got.tokens == want and got.stats.draft_tokens > 0
    assert_batched_greedy_rows_equal_target_only(tiny_target, proposer)


@pytest.mark.parametrize("form", ["bf16", "int8"])
def test_the_default_takes_the_form_this_machines_probe_chose(form, tiny_dirs, tiny_target, monkeypatch):
    """The probe's answer pinned (no test asserts how fast a form is); the draft counted as big enough to probe."""
    if bf16_products.load()[0] is None:
        pytest.skip(bf16_products.load()[1])
    monkeypatch.setattr(machine, "MIN_BYTES", 0)
    monkeypatch.setenv(machine.OVERRIDE_ENV, f"draft_products={form},int8_drafting=int8")
    machine.forget()
    try:
        proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"])
        assert proposer.weights == form and (proposer.bf16_model is not None) == (form == "bf16")
        [choice] = [c for c in machine.machine_choices() if c.name == "draft_products"]
        assert choice.value == form and choice.source == "override"
    finally:
        machine.forget()


def test_a_draft_too_small_to_matter_keeps_the_form_built_first(tiny_dirs, tiny_target):
    proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"])
    assert proposer.weights != "bf16" and proposer.bf16_model is None


def test_bf16_drafting_without_the_lean_path_is_a_clear_error(tiny_dirs, tiny_target):
    with pytest.raises(ValueError, match="draft-model: weights='bf16' needs the lean path"):
        DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], weights="bf16", fast=False)
