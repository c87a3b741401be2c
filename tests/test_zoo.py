"""The bundled zoo: loads offline, drafts exactly, and its tokenizer round-trips source text."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

import specplug
from specplug import zoo
from specplug.bench import agreement
from specplug.bench.workloads import humaneval_prompts


@pytest.fixture(scope="module")
def pycode():
    return specplug.Target.from_pretrained("zoo:pycode")


def test_zoo_loads_with_the_hub_offline():
    code = ("import specplug; t = specplug.Target.from_pretrained('zoo:pycode'); "
            "p = specplug.get_proposer('draft-model', target=t); "
            "r = specplug.generate(t, p, 'def f(x):', max_new_tokens=8, sampling=specplug.GREEDY); "
            "print(len(r.tokens))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "8"


def test_zoo_lists_the_bundled_pair():
    assert {"pycode", "pycode-draft"} <= set(zoo.available())


def test_draft_model_defaults_to_the_zoo_draft_for_the_zoo_target(pycode):
    proposer = specplug.get_proposer("draft-model", target=pycode)
    assert proposer.draft.model.config.num_hidden_layers < pycode.model.config.num_hidden_layers


@pytest.mark.parametrize("prompt", humaneval_prompts(5), ids=[f"humaneval-{i}" for i in range(5)])
def test_greedy_speculative_output_equals_target_only_on_humaneval(prompt, pycode):
    proposer = specplug.get_proposer("draft-model", target=pycode)
    base = specplug.generate(pycode, None, prompt, max_new_tokens=64, sampling=specplug.GREEDY)
    spec = specplug.generate(pycode, proposer, prompt, max_new_tokens=64, sampling=specplug.GREEDY,
                             num_speculative_tokens=4, strict=True)
    assert spec.tokens == base.tokens
    assert spec.stats.target_calls < base.stats.target_calls  # a trained pair accepts something


@pytest.mark.parametrize("prompt", humaneval_prompts(3), ids=[f"humaneval-{i}" for i in range(3)])
def test_target_only_greedy_output_follows_hf_generate_until_a_rounding_tie(prompt, pycode):
    """The lean forward is the model users loaded: HF's own greedy ``generate`` on it agrees token for token, up
    to a position where the two tokens' logits are within bf16 rounding. Only there may they part: the lean
    products sum each element in one order for any row count, oneDNN's order may change with the row count (on
    an AMD Zen 4 at in_features 1536, so HF's prompt pass rounds unlike its steps)."""
    ids = torch.tensor([pycode.encode(prompt)])
    with torch.inference_mode():
        hf = pycode.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                                   min_new_tokens=64, pad_token_id=pycode.tokenizer.pad_token_id)
    ours = specplug.generate(pycode, None, prompt, max_new_tokens=64, sampling=specplug.GREEDY)
    found = agreement.agreement(pycode, [(ids[0].tolist(), ours.tokens, hf[0, ids.shape[1]:].tolist())])
    assert found in (agreement.EQUAL, agreement.TIES)


def test_tokenizer_round_trips_source_text(pycode):
    import json as module

    for text in (inspect.getsource(module), "def f(x):\n\tréturn x  # ünïcode ✓\n\n\n", "    \r\n  \t"):
        assert pycode.tokenizer.decode(pycode.tokenizer.encode(text, add_special_tokens=False)) == text


def test_verify_pass_scores_each_position_bit_identically_to_a_one_token_step(pycode):
    """With bf16 products (the zoo's default where the CPU has them), scoring k + 1 positions at once gives the
    very logits k + 1 one-token steps give, so greedy speculative decoding cannot part from target-only."""
    if pycode.matmul_dtype != torch.bfloat16:
        pytest.skip(f"this CPU runs the zoo with {pycode.matmul_dtype or pycode.dtype} products")
    lean, gen = pycode.lean, torch.Generator().manual_seed(0)
    cache = lean.new_cache()
    lean.run(cache, pycode.encode(inspect.getsource(inspect)[:2000]))
    start = cache.length
    for n in (2, 5, 9) * 4:
        tokens = torch.randint(0, pycode.vocab_size, (n,), generator=gen).tolist()
        together, _ = lean.run(cache, tokens)
        cache.crop(start)
        one_by_one = torch.cat([lean.run(cache, [t])[0] for t in tokens])
        cache.crop(start)
        assert torch.equal(together, one_by_one), n


@pytest.mark.slow
def test_zoo_greedy_batched_output_equals_target_only_row_by_row(pycode):
    """Row by row at B = 1, 4, 16, with draft-model and target-only, where the load probe found a product path
    on which every verified position is bit-identical to a one-token step (else the note says why not)."""
    if not pycode.verify_bit_identical:
        pytest.skip(f"no bit-identical product path on this machine: {pycode.lean_note}")
    prompts = humaneval_prompts(16)
    want = [specplug.generate(pycode, None, p, max_new_tokens=32, sampling=specplug.GREEDY).tokens for p in prompts]
    draft = specplug.get_proposer("draft-model", target=pycode)
    for B in (1, 4, 16):
        for proposer in (None, draft):
            got = specplug.generate_batch(pycode, proposer, prompts, max_new_tokens=32, sampling=specplug.GREEDY,
                                          max_batch_size=B)
            assert [r.tokens for r in got] == want, (B, proposer)


def test_zoo_target_says_whether_its_verify_passes_are_bit_identical(pycode):
    assert set(pycode.bit_identity) == {"single", "batched"}
    assert pycode.verify_bit_identical == all(pycode.bit_identity.values())
    if not pycode.verify_bit_identical:
        assert "not bit-identical" in pycode.lean_note
