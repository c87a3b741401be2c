"""Weight-only int8 drafting (``eagle``, ``draft-model`` and ``mtp`` with ``weights=int8``): the products multiply by
what their scales say, the output stays exactly the target's (sampled, greedy, batched), the float weights they
replace are let go, and a wrong setting is a clear error naming the proposer."""
import pytest
import torch

import specplug
from specplug import int8_products, machine
from specplug.lean_llama import Product
from specplug.proposers.draft_model import DraftModelProposer
from specplug.proposers.eagle import EagleProposer
from specplug.proposers.mtp import MTPProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)


PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
SETTINGS = {
    "temperature-1": specplug.SamplingParams(temperature=1.0),
    "top-k-3-top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
}

pytestmark = pytest.mark.skipif(not int8_products.available("cpu"), reason="no int8 kernel in this torch build")


def test_int8_product_rounds_each_weight_to_its_rows_scale():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    weight[3] *= 100  # one loud row must not coarsen the others: scales are per row
    product = int8_products.Int8Product(weight, bias=torch.ones(48))
    scales = weight.abs().amax(1) / 127
    error = (product.dequantized() - weight).abs()
    # half a step (the step a bf16 rounding of the row's max / 127; its max may clip by that rounding, 2^-8)
    assert bool((error <= 0.5 * scales[:, None] * (1 + 2.0 ** -7) + 1e-6).all())
    assert float(error[3].max()) > 100 * float(error[0].max())
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    want = x @ product.dequantized().T + 1
    # the kernel takes bf16 inputs: allow their rounding, relative to the size of each output row
    torch.testing.assert_close(product(x), want, atol=0.02 * float(want.abs().max()), rtol=0)
    assert product(x).dtype == torch.float32 and product(x[0]).shape == (48,)


def random_eagle(target, **options):
    return EagleProposer(target, head="random", seed=3, init_std=0.15, weights="int8", **options)


@pytest.mark.parametrize("setting", SETTINGS)
def test_eagle_with_int8_weights_is_exact(setting, small_target):
    sampling = SETTINGS[setting]
    expected = exact_distribution(small_target, PROMPT, 3, sampling)
    counts = sampled_distribution(small_target, random_eagle(small_target, vocab=[0, 2, 3, 5]), PROMPT, 3,
                                  sampling, 1500)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


def random_mtp(target, **options):
    return MTPProposer(target, head="random", seed=3, num_heads=2, init_std=0.3, weights="int8", **options)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("share_lm_head", [False, True])
def test_mtp_with_int8_weights_over_a_subset_is_exact(setting, share_lm_head, small_target):
    sampling = SETTINGS[setting]
    proposer = random_mtp(small_target, vocab=[0, 2, 3, 5], sampled_vocab=[0, 2, 3, 5], share_lm_head=share_lm_head)
    expected = exact_distribution(small_target, PROMPT, 3, sampling)
    counts = sampled_distribution(small_target, proposer, PROMPT, 3, sampling, 1500)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


def test_draft_model_with_int8_weights_is_exact(small_vocab_dirs, small_target):
    sampling = SETTINGS["temperature-1"]
    proposer = DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], weights="int8")
    expected = exact_distribution(small_target, PROMPT, 3, sampling)
    counts = sampled_distribution(small_target, proposer, PROMPT, 3, sampling, 1500)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


def test_int8_drafters_decode_greedy_as_target_only_single_and_batched(tiny_dirs, tiny_target):
    prompts = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n"]
    greedy = specplug.SamplingParams(temperature=0)
    base = [specplug.generate(tiny_target, None, p, max_new_tokens=60, sampling=greedy).tokens for p in prompts]
    for proposer in (random_eagle(tiny_target), random_mtp(tiny_target, vocab=list(range(0, tiny_target.vocab_size, 2))),
                     DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], weights="int8")):
        for prompt, want in zip(prompts, base):
            out = specplug.generate(tiny_target, proposer, prompt, max_new_tokens=60, sampling=greedy,
                                    num_speculative_tokens=4, strict=True)
            assert out.tokens == want, proposer.name
            assert out.stats.draft_tokens > 0
        batched = specplug.generate_batch(tiny_target, proposer, prompts, max_new_tokens=60, sampling=greedy,
                                          num_speculative_tokens=4)
        assert [r.tokens for r in batched] == base, proposer.name


def test_int8_drafters_hold_int8_copies_instead_of_float_weights(small_vocab_dirs, small_target, tmp_path):
    from specplug import heads
    from specplug.proposers.eagle import EagleHead

    module = EagleHead.for_target(small_target.model.config, seed=1)
    heads.save_head(tmp_path / "e", "eagle", module.state_dict(), module.config, small_target, dtype=torch.float32)
    floats = EagleProposer(small_target, head=tmp_path / "e", weights="float32")
    int8 = EagleProposer(small_target, head=tmp_path / "e", weights="int8")
    products = [*int8.lean_layer.products(), int8.fc]
    assert all(p.int8 is not None and p.int8.weight.dtype == torch.int8 and p.weight is None for p in products)
    # the loaded head's float linear weights are released: about a quarter of the float32 bytes remain
    assert int8.memory_bytes() < 0.35 * floats.memory_bytes()
    from specplug.proposers.mtp import MTPHeads

    mtp = MTPHeads.for_target(small_target.model, num_heads=2, share_lm_head=True)
    heads.save_head(tmp_path / "m", "mtp", mtp.state_dict(), mtp.config, small_target, dtype=torch.float32)
    mtp_floats, mtp_int8 = (MTPProposer(small_target, head=tmp_path / "m", weights=w) for w in ("loaded", "int8"))
    assert all(p.int8 is not None for block in mtp_int8.blocks for p in block)
    assert mtp_int8.memory_bytes() < 0.35 * mtp_floats.memory_bytes()
    loaded = DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], weights="loaded")
    narrow = DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], weights="int8")
    assert narrow.memory_bytes() < loaded.memory_bytes()  # int8 copies in place of float one-row copies


def test_int8_is_the_default_where_the_kernel_runs(small_vocab_dirs, small_target):
    # weights this small are not worth a timing probe (specplug.machine.MIN_BYTES): the default stands
    assert EagleProposer(small_target, head="random").weights == "int8"
    assert MTPProposer(small_target, head="random").weights == "int8"
    assert DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"]).weights == "int8"
    # HF's forward (no lean path) multiplies by the weights as loaded
    assert DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], fast=False).weights == "loaded"


def test_bad_weights_setting_names_the_proposer(small_vocab_dirs, small_target):
    with pytest.raises(ValueError, match="eagle: weights must be one of"):
        EagleProposer(small_target, head="random", weights="int4")
    with pytest.raises(ValueError, match="mtp: weights must be one of 'int8', 'loaded'"):
        MTPProposer(small_target, head="random", weights="float32")
    with pytest.raises(ValueError, match="draft-model: weights must be one of 'loaded', 'int8', 'bf16'"):
        DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], weights="fp8")
    with pytest.raises(ValueError, match="draft-model: weights='int8' needs the lean path"):
        DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], weights="int8", fast=False)


def test_int8_stays_up_to_the_last_row_count_where_the_wide_form_is_not_clearly_faster(monkeypatch):
    """Timings replaced (no test asserts how fast a kernel is): int8 taking a second a row, the wide form three
    seconds at any row count, int8 keeps products of up to 2 rows (4 rows: 4 s against 3 s)."""
    rows = {}

    def seconds(forms, repeats=9):
        for form in forms.values():
            form()
        return {"int8": 1.0 * rows["n"], "wide": 3.0}

    monkeypatch.setattr(machine, "seconds", seconds)
    upto = int8_products.rows_through_int8("demo", machine.MIN_BYTES, lambda n: rows.update(n=n), lambda n: None)
    assert upto == 2
    rows_never_slower = int8_products.rows_through_int8("demo 2", machine.MIN_BYTES, lambda n: rows.update(n=0),
                                                        lambda n: None)
    assert rows_never_slower is None  # int8 at every row count: no wide copy is kept
    assert int8_products.rows_through_int8("small", machine.MIN_BYTES - 1, None, None) is None  # not probed


def test_an_int8_product_takes_few_rows_through_int8_and_more_through_its_wide_form(monkeypatch):
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    narrow = int8_products.Int8Product(weight)
    wide = Product(weight.to(int8_products.wide_dtype("cpu")))
    monkeypatch.setenv(machine.OVERRIDE_ENV, "int8_rows=2")
    product = Product(weight, int8=True)
    assert torch.equal(product(x[:2]), narrow(x[:2])) and torch.equal(product(x[:1]), narrow(x[:1]))
    assert torch.equal(product(x), wide(x))
    assert product.nbytes() > narrow.nbytes()  # the wide copy is counted
    monkeypatch.setenv(machine.OVERRIDE_ENV, "int8_rows=all")
    machine.forget()
    everywhere = Product(weight, int8=True)
    assert everywhere.wide is None and torch.equal(everywhere(x), narrow(x))
    monkeypatch.setenv(machine.OVERRIDE_ENV, "int8_rows=many")
    machine.forget()
    with pytest.raises(ValueError, match="int8_rows='many' is not a row count or 'all'"):
        Product(weight, int8=True)
