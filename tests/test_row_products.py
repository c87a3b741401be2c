"""float32 products through the rows kernel: every row of any product is its one-row product, close to torch's
product, and where the kernel cannot run (no compiler, rows that drift, a pinned choice) few_rows' products run
and the reason is recorded; a weight that 16 bits hold exactly is read in 16 bits with the float32 reads' bits;
the zoo's greedy speculative output stays target-only's on it."""
import pytest
import torch

import specplug
from specplug import few_rows, machine, row_products
from specplug.lean_llama import Product
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)
from drifting_kernels import assert_drifting_rows_are_refused


def _kernel(weight: torch.Tensor, bias: torch.Tensor | None = None,
            narrow: torch.Tensor | None = None) -> row_products.RowProduct:
    lib, reason = row_products.load()
    if lib is None:
        pytest.skip(reason)  # no C compiler here: the fallback is tested below
    return row_products.RowProduct(lib, weight, bias, narrow)


def _held_in(dtype: torch.dtype, out_features: int, in_features: int) -> torch.Tensor:
    """A float32 weight that ``dtype`` holds exactly, with that dtype's extremes in every column: subnormals,
    its largest finite values, zeros of both signs."""
    w = few_rows.sensitive_inputs(out_features, in_features, torch.float32, "cpu", False)[0]
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.smallest_normal / 8, -info.smallest_normal / 2, info.max / 2 ** 20, 0.0, -0.0])
    w[::7] = extremes.repeat(in_features // 5 + 1)[:in_features]
    return w.to(dtype).float()


@pytest.mark.parametrize("out_features,in_features,bias", [(7, 5, False), (33, 100, True), (512, 1536, True)])
def test_kernel_products_agree_with_torchs_to_float32_rounding(out_features, in_features, bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(37, in_features, generator=g)
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    got = _kernel(weight, b)(x).double()
    assert ((got - exact).abs() <= 1e-6 * (x.double().abs() @ weight.double().abs().T) + 1e-6).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [44, 45, 46, 47])
@pytest.mark.parametrize("in_features", [131, 136])  # a tail past the 8 lanes, and none
def test_every_row_of_a_kernel_product_is_its_one_row_product(out_features, in_features, bias):
    """The property a verify pass relies on, for every row count (within and across the kernel's blocks of 6
    rows) and every tail of its blocks of 2 outputs, on inputs that expose any change of summation order."""
    w, x, b = few_rows.sensitive_inputs(out_features, in_features, torch.float32, "cpu", bias)
    x = torch.cat([x, x.flip(0)])
    kernel = _kernel(w, b)
    one = torch.cat([kernel(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(kernel(x[:rows]), one[:rows]), rows


@pytest.mark.parametrize("bias", [False, True])
def test_each_output_adds_its_eight_lane_sums_in_the_documented_order(bias):
    """((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then the bias, for every row and output of a block:
    with K = 8 each lane holds one exact product, and lanes that lose different low bits in another order
    (2^24 + 1 is no float32) tell the orders apart."""
    g = torch.Generator().manual_seed(5)
    lanes = torch.tensor([2.0 ** 24, 1.0, -(2.0 ** 24), 3.0, 2.0 ** 23, 1.5, -(2.0 ** 23), 0.75])
    w = torch.stack([lanes[torch.randperm(8, generator=g)] for _ in range(7)])
    x = 2.0 ** torch.randint(-2, 3, (13, 8), generator=g).float()  # powers of two: every product exact
    b = torch.tensor([0.5, -0.25, 1.0, 0.0, -0.0, 2.0, 0.125]) if bias else None
    a = x[:, None, :] * w[None, :, :]
    want = ((a[..., 0] + a[..., 1]) + (a[..., 2] + a[..., 3])) + ((a[..., 4] + a[..., 5]) + (a[..., 6] + a[..., 7]))
    want = want + (0.0 if b is None else b)
    assert not torch.equal(a.sum(-1) + (0.0 if b is None else b), want)  # the data tells orders apart
    assert torch.equal(_kernel(w, b)(x), want)


def test_a_targets_float32_products_run_through_the_kernel_as_one_product_at_any_row_count():
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    if row_products.supports(weight):
        pytest.skip(row_products.supports(weight))
    product = Product(weight)
    assert isinstance(product.tiles, row_products.RowProduct)
    [choice] = [c for c in machine.machine_choices() if c.name == row_products.CHOICE]
    assert choice.value == row_products.KERNEL
    x = torch.randn(100, 64)
    assert torch.equal(product(x), torch.cat([product(x[i:i + 1]) for i in range(100)]))
    assert Product(weight, one_row_copy=True).tiles is None  # a drafter keeps its own fast form


def test_a_kernel_whose_rows_differ_from_one_row_products_is_not_used(monkeypatch):
    weight = torch.randn(64, 64)
    if row_products.supports(weight):
        pytest.skip(row_products.supports(weight))
    assert_drifting_rows_are_refused(monkeypatch, row_products, row_products.RowProduct, weight,
                                     row_products.TORCH, row_products.KERNEL, 8, 2.0 ** -20)


def test_without_a_compiler_float32_products_run_through_few_rows_and_say_why(without_a_compiler):
    assert Product(torch.randn(64, 64)).tiles is None
    [choice] = [c for c in machine.machine_choices() if c.name == row_products.CHOICE]
    assert choice.value == row_products.TORCH and without_a_compiler in choice.why


def test_pinning_torch_keeps_float32_products_off_the_kernel(monkeypatch):
    monkeypatch.setenv(machine.OVERRIDE_ENV, f"{row_products.CHOICE}={row_products.TORCH}")
    assert row_products.choose(torch.randn(64, 64)) is None
    assert "float32" in row_products.supports(torch.randn(32, 64).to(torch.bfloat16))


def test_greedy_speculative_output_on_the_kernel_equals_target_only_single_and_batched():
    target = specplug.Target.from_pretrained("zoo:pycode", matmul_dtype="float32")
    kernels = {type(p.tiles).__name__ for layer in target.lean.layers for p in layer.products()}
    if "RowProduct" not in kernels:  # each weight's form is the machine's choice; a mix must keep greedy rows too
        pytest.skip(f"none of the target's products is on the rows kernel here: {kernels}")
    prompts = ["def parse(text):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]
    want = [specplug.generate(target, None, p, max_new_tokens=48, sampling=specplug.GREEDY).tokens for p in prompts]
    proposer = specplug.get_proposer("draft-model", target=target)
    got = specplug.generate_batch(target, proposer, prompts, max_new_tokens=48, sampling=specplug.GREEDY,
                                  num_speculative_tokens=6, strict=True)
    assert [r.tokens for r in got] == want
    assert all(r.stats.accepted_tokens > 0 for r in got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_features", [45, 47])
def test_a_weight_read_in_16_bits_gives_the_float32_reads_bits_in_every_row(dtype, out_features):
    """131 inputs: 16 blocks of 8 read as vectors and a tail of 3 read one by one, so both widenings are
    checked, on rows that expose any change of summation order; every row is still its one-row product."""
    weight = _held_in(dtype, out_features, 131)
    b = torch.randn(out_features)
    x = few_rows.sensitive_inputs(out_features, 131, torch.float32, "cpu", False)[1]
    full, read16 = _kernel(weight, b), _kernel(weight, b, weight.to(dtype))
    one = torch.cat([read16(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in (1, 2, 3, 4, 5, 9, 16, x.shape[0]):
        assert torch.equal(read16(x[:rows]), full(x[:rows])), rows
        assert torch.equal(read16(x[:rows]), one[:rows]), rows


def test_the_16_bit_copy_is_the_dtype_that_holds_the_weight_exactly_or_none():
    g = torch.Generator().manual_seed(0)
    half = torch.randn(8, 8, generator=g).half().float()
    assert row_products.exact_16bit(half).dtype == torch.float16
    bf16_only = half.bfloat16().float() * 2.0 ** 40  # beyond half's range, within bfloat16's
    assert row_products.exact_16bit(bf16_only).dtype == torch.bfloat16
    assert row_products.exact_16bit(torch.randn(8, 8, generator=g)) is None


def test_a_16_bit_checkpoints_float32_weight_is_read_in_16_bits_and_says_so():
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).half().float()
    if row_products.supports(weight):
        pytest.skip(row_products.supports(weight))
    product = Product(weight)
    assert product.tiles.narrow.dtype == torch.float16 and product.nbytes() == 64 * 64 * 2
    [choice] = [c for c in machine.machine_choices() if c.name == row_products.READS]
    assert choice.value in (row_products.SIXTEEN, row_products.FLOAT32) and "float16 64x64" in choice.key
    float32_trained = Product(torch.randn(64, 64))
    assert float32_trained.tiles.narrow is None and float32_trained.nbytes() == 0


def test_pinning_float32_reads_keeps_no_16_bit_copy(monkeypatch):
    monkeypatch.setenv(machine.OVERRIDE_ENV, f"{row_products.READS}={row_products.FLOAT32}")
    weight = torch.randn(64, 64).half().float()
    if row_products.supports(weight):
        pytest.skip(row_products.supports(weight))
    assert row_products.choose(weight).narrow is None


def test_16_bit_reads_that_differ_from_the_float32_reads_are_not_used(monkeypatch):
    weight = torch.randn(64, 64).half().float()
    if row_products.supports(weight):
        pytest.skip(row_products.supports(weight))
    real = row_products.RowProduct.__call__

    def off_by_a_bit(self, x):  # a widening that rounds
        y = real(self, x)
        return y if self.narrow is None else y * (1 + 2.0 ** -22)

    monkeypatch.setattr(row_products.RowProduct, "__call__", off_by_a_bit)
    assert row_products.choose(weight).narrow is None
    [choice] = [c for c in machine.machine_choices() if c.name == row_products.READS]
    assert choice.value == row_products.FLOAT32 and "differ" in choice.why
