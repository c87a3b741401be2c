"""bf16 products on the kernel (AMX tiles or AVX-512 BF16 dot products, whichever this CPU has): every row of any
product is its one-row product, close to exact arithmetic, and where the kernel cannot run (neither form, a shape
that does not tile, a pinned choice) oneDNN's products run and the reason is recorded."""
import pytest
import torch

from specplug import bf16_products, few_rows, machine
from specplug.lean_llama import Product
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)
from drifting_kernels import assert_drifting_rows_are_refused


def _load_with_flags(monkeypatch, flags: set[str]):
    bf16_products.load.cache_clear()
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    try:
        return bf16_products.load()
    finally:
        bf16_products.load.cache_clear()


@pytest.fixture(params=["this CPU's form", "the AVX-512 form"])
def kernel(request, monkeypatch) -> bf16_products.Compiled:
    """The kernel in the form this machine runs, and in its AVX-512 form where that was built (on a CPU with AMX
    the AVX-512 form is otherwise never run)."""
    if request.param == "the AVX-512 form":
        compiled, reason = _load_with_flags(monkeypatch, {"avx512f", "avx512_bf16"})
    else:
        compiled, reason = bf16_products.load()
    if compiled is None:
        pytest.skip(reason)  # not built here: the fallback is tested below
    return compiled


@pytest.mark.parametrize("out_features,in_features,bias", [(32, 64, False), (48, 96, True), (512, 1536, True)])
def test_tile_products_agree_with_exact_arithmetic_to_bf16_rounding(kernel, out_features, in_features, bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(37, in_features, generator=g)
    got = bf16_products.Bf16Product(kernel, weight, b)(x).double()
    exact = x.to(torch.bfloat16).double() @ weight.double().T + (0 if b is None else b.double())
    # the result is rounded to bf16 (8 significant bits): within one unit there, plus float32 accumulation
    assert ((got - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5 * in_features).all()


@pytest.mark.parametrize("out_features,bias", [(48, False), (48, True), (272, True)])
def test_every_row_of_a_tile_product_is_its_one_row_product(kernel, out_features, bias):
    """The property a verify pass relies on: rows scored together get the bits each gets alone, for any count
    (within and across 16-row tiles and 4-tile groups; for the AVX-512 form, 4-row blocks and column groups of
    8 and 4 with a remainder: 272 columns are 17 blocks), on inputs that expose any change of summation order."""
    w, x, b = few_rows.sensitive_inputs(out_features, 128, torch.bfloat16, "cpu", bias)
    x = torch.cat([x, x.flip(0)]).float()
    tiles = bf16_products.Bf16Product(kernel, w, b)
    one = torch.cat([tiles(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(tiles(x[:rows]), one[:rows]), rows


def test_lean_products_run_on_tiles_with_any_row_count_as_one_product():
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    if bf16_products.supports(weight):
        pytest.skip(bf16_products.supports(weight))
    product = Product(weight)
    assert product.tiles is not None and product.packed is None
    [choice] = [c for c in machine.machine_choices() if c.name == bf16_products.CHOICE]
    assert choice.value == bf16_products.load()[0].form
    x = torch.randn(100, 64)  # more rows than oneDNN keeps bit-identical: here one product, no pieces
    assert torch.equal(product(x), torch.cat([product(x[i:i + 1]) for i in range(100)]))


def test_shapes_the_tiles_do_not_take_run_through_onednn_and_say_why():
    weight = torch.randn(40, 64).to(torch.bfloat16)
    assert bf16_products.choose(weight) is None
    [choice] = [c for c in machine.machine_choices() if c.name == bf16_products.CHOICE]
    assert choice.value == bf16_products.ONEDNN and choice.why
    assert "float32" in bf16_products.supports(torch.randn(32, 64))


def test_tiles_whose_rows_differ_from_one_row_products_are_not_used(monkeypatch):
    weight = torch.randn(64, 64).to(torch.bfloat16)
    if bf16_products.supports(weight):
        pytest.skip(bf16_products.supports(weight))
    assert_drifting_rows_are_refused(monkeypatch, bf16_products, bf16_products.Bf16Product, weight,
                                     bf16_products.ONEDNN, bf16_products.load()[0].form, 16, 2.0 ** -10)


def test_pinning_onednn_keeps_products_off_the_tiles(monkeypatch):
    monkeypatch.setenv(machine.OVERRIDE_ENV, f"{bf16_products.CHOICE}={bf16_products.ONEDNN}")
    weight = torch.randn(64, 64).to(torch.bfloat16)
    assert bf16_products.choose(weight) is None
    assert Product(weight).tiles is None


def test_a_cpu_with_neither_amx_nor_avx512_bf16_runs_onednn_and_says_why(monkeypatch):
    kernel, reason = _load_with_flags(monkeypatch, {"avx2", "fma"})
    assert kernel is None and "AVX-512 BF16" in reason


def test_a_cpu_without_amx_runs_the_avx512_form_where_it_was_built(monkeypatch):
    kernel, reason = _load_with_flags(monkeypatch, {"avx512f", "avx512_bf16"})
    if kernel is None:
        pytest.skip(reason)  # this compiler or CPU built no AVX-512 BF16 form
    assert kernel.form == bf16_products.DOT
