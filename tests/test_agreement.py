"""Another engine's greedy output agrees with ours token for token, or parts only at a rounding tie."""
import pytest
import torch

import specplug
from specplug.bench import agreement
from specplug.bench.report import tables
from specplug.testing import tiny_llama

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny Llama whose LM head gives token b the very row of a, the argmax after PROMPT: a and b tie exactly
    there. Returns the target and (a, b)."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("tied")
    model = LlamaForCausalLM.from_pretrained(tiny_llama(root / "random", 40, seed=3))
    with torch.no_grad():
        a = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
        b = (a + 1) % 40
        model.lm_head.weight[b] = model.lm_head.weight[a]
    model.save_pretrained(root / "tied")
    return specplug.Target.from_pretrained(root / "tied"), (a, b)


def test_first_parting_is_the_first_differing_position_or_where_one_output_ends():
    assert agreement.first_parting([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_parting([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.first_parting([1, 2, 3], [1, 2]) == 2


def test_logits_within_two_rounding_units_of_the_product_dtype_are_a_tie():
    ulp = 2.0 ** -5  # bf16 between 4 and 8
    logits = torch.tensor([5.625, 5.625 + ulp, 5.625 + 4 * ulp])
    assert agreement.within_rounding(logits, 0, 1, torch.bfloat16)
    assert not agreement.within_rounding(logits, 0, 2, torch.bfloat16)
    assert not agreement.within_rounding(logits, 0, 1, torch.float32)


def test_identical_outputs_agree(tied):
    target, _ = tied
    ours = specplug.generate(target, None, PROMPT, max_new_tokens=6, sampling=specplug.GREEDY).tokens
    assert agreement.agreement(target, [(PROMPT, ours, list(ours))]) == agreement.EQUAL


def test_an_output_that_parts_at_an_exact_tie_parted_at_rounding_ties(tied):
    target, (a, b) = tied
    ours = specplug.generate(target, None, PROMPT, max_new_tokens=6, sampling=specplug.GREEDY).tokens
    assert ours[0] in (a, b)
    theirs = [b if ours[0] == a else a, *ours[1:]]
    assert agreement.agreement(target, [(PROMPT, ours, ours), (PROMPT, ours, theirs)]) == agreement.TIES


def test_an_output_that_parts_at_a_clear_winner_differs(tied):
    target, (a, b) = tied
    ours = specplug.generate(target, None, PROMPT, max_new_tokens=6, sampling=specplug.GREEDY).tokens
    worst = int(agreement.logits_after(target, PROMPT).argmin())
    ties = [b if ours[0] == a else a, *ours[1:]]
    assert agreement.agreement(target, [(PROMPT, ours, ties), (PROMPT, ours, [worst, *ours[1:]])]) == agreement.DIFFER
    assert agreement.agreement(target, [(PROMPT, ours, ours[:3])]) == agreement.DIFFER  # stopped early


def test_the_peer_table_marks_ties_apart_from_differences():
    row = {"peer": "vllm-target-only", "workload": "w", "temperature": 0.0, "gamma": 0, "tokens_per_second": 1.0,
           "speedup": 1.0, "mean_acceptance_length": None, "ours_over_peer": 1.0, "ours": "target-only",
           "greedy_equal_to_ours": False}
    report = {"settings": {"peer": "vllm", "max_new_tokens": 8, "repeats": 1}, "baseline": [], "cells": [],
              "target": {"name": "tiny"},
              "peer": [dict(row, greedy_agreement=agreement.TIES), dict(row, greedy_agreement=agreement.DIFFER),
                       row]}  # the last as written before agreement was recorded
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(tables(report, wide=False)[1])
    text = console.export_text()
    assert text.count("ties") >= 2 and text.count("NO") == 2  # two rows and the caption; two differences
