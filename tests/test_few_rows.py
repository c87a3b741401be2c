"""The few-rows linear path: same numbers as F.linear, only for 2..16 rows, and only where installed."""
import pytest
import torch

import specplug
from specplug import few_rows
from specplug.target import KVState
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)



def test_few_rows_linear_equals_f_linear_for_every_row_count():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True)
    want = {n: layer(x) for n, x in ((n, torch.randn(1, n, 64)) for n in (1, 2, 5, 16, 17, 40))}
    assert few_rows.install(layer) == 1
    torch.manual_seed(0)
    torch.nn.Linear(64, 96)  # same draws as above
    for n, x in ((n, torch.randn(1, n, 64)) for n in (1, 2, 5, 16, 17, 40)):
        torch.testing.assert_close(layer(x), want[n], atol=1e-5, rtol=1e-5)


def test_target_scores_the_same_with_and_without_the_few_rows_path(tiny_dirs):
    fast = specplug.Target.from_pretrained(tiny_dirs["target"])
    plain = specplug.Target.from_pretrained(tiny_dirs["target"], few_rows_linear=False)
    assert fast.model.lm_head.forward.__func__ is few_rows._forward
    assert "forward" not in vars(plain.model.lm_head)
    ids = fast.encode("def add(a, b):\n    return")
    a, b = KVState(), KVState()
    torch.testing.assert_close(fast.forward(a, ids).logits, plain.forward(b, ids).logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fast.forward(a, [5, 6, 7]).logits, plain.forward(b, [5, 6, 7]).logits,
                               atol=1e-4, rtol=1e-4)


def test_few_rows_path_leaves_other_dtypes_alone():
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert few_rows.install(layer) == 0


def test_bf16_products_keep_linear_weights_narrow_and_everything_else_float32(tiny_dirs):
    fp32 = specplug.Target.from_pretrained(tiny_dirs["target"])
    bf16 = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="bfloat16")
    assert bf16.matmul_dtype == torch.bfloat16 and fp32.matmul_dtype is None
    assert bf16.lean is not None, bf16.lean_note  # the lean path still reproduces HF's forward
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.embedding.weight.dtype == torch.float32 and bf16.dtype == torch.float32
    assert bf16.model.model.norm.weight.dtype == torch.float32
    ids = fp32.encode("def add(a, b):\n    return")
    want, got = fp32.forward(KVState(), ids).logits, bf16.forward(KVState(), ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05 * float(want.abs().max()), rtol=0)
    assert not torch.equal(got, want)  # the products really ran in bf16


def one_row_products(layer, x):
    return torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_products_keep_one_row_bits_up_to_the_probed_count_and_in_pieces_beyond(dtype):
    """A verify pass multiplies k + 1 rows (B·(k + 1) batched) where a step multiplies one. Wherever the probe
    reports n > 1 identical rows, every product — over up to n rows, or split into pieces of n — gives each
    row the bits of its one-row product. (What n is depends on the machine's kernels; it is not asserted.)"""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 512, bias=False)
    assert few_rows.install(layer, weight_dtype=dtype) == 1
    n = few_rows.identical_rows(layer.weight)
    assert 1 <= n <= few_rows.PROBE_ROWS
    x = torch.randn(3 * few_rows.PROBE_ROWS + 5, 1536)
    rows = one_row_products(layer, x)
    for m in sorted({2, 3, n, n + 1, 2 * n + 3, x.shape[0]}):
        got = layer(x[:m])
        if n > 1:
            assert torch.equal(got, rows[:m]), m
        torch.testing.assert_close(got, rows[:m], atol=0.05, rtol=0.02)


@pytest.fixture
def fresh_probes():
    few_rows.forget_probes()
    yield
    few_rows.forget_probes()


def kernel_rounding_differently_above(rows: int, monkeypatch, calls: list | None = None):
    """Make F.linear round differently, as a kernel summing in another order does, for products over more than
    ``rows`` rows (a reversed or rotated sum is not enough: some CPUs' kernels give it the same bits)."""
    real = torch.nn.functional.linear

    def kernel(x, w, b=None):
        if calls is not None:
            calls.append(x.shape[0])
        return real(x, w, b) * (1 + 2.0 ** -6) if x.shape[0] > rows else real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", kernel)


def test_probe_finds_the_row_count_above_which_the_kernel_sums_in_another_order(monkeypatch, fresh_probes):
    kernel_rounding_differently_above(5, monkeypatch)
    weight = torch.randn(64, 256).to(torch.bfloat16)
    assert few_rows.identical_rows(weight) == 5
    x = torch.randn(23, 256)
    rows = torch.cat([few_rows.linear(x[i:i + 1], weight) for i in range(23)])
    assert torch.equal(few_rows.linear(x, weight), rows)  # split into pieces of 5
    probe, = few_rows.probes()
    assert (probe.rows, probe.out_features, probe.in_features, probe.dtype) == (5, 64, 256, "bfloat16")
    assert "up to 5" in probe.describe()


def test_a_kernel_that_agrees_only_on_two_rows_splits_products_into_pairs(monkeypatch, fresh_probes):
    """A one-row product is padded to two rows, so two rows always agree; a kernel that sums in another order
    from three rows on leaves pairs, and a 9-row product runs as five products."""
    calls = []
    kernel_rounding_differently_above(2, monkeypatch, calls)
    weight = torch.randn(32, 128).to(torch.bfloat16)
    assert few_rows.identical_rows(weight) == 2
    calls.clear()
    x = torch.randn(9, 128)
    got = few_rows.linear(x, weight)
    assert calls == [2, 2, 2, 2, 2]  # four pairs and a padded last row
    assert torch.equal(got, torch.cat([few_rows.linear(x[i:i + 1], weight) for i in range(9)]))


def test_probe_is_cached_per_shape_dtype_and_thread_count(fresh_probes):
    a, b = torch.empty(48, 96, dtype=torch.bfloat16), torch.empty(48, 96, dtype=torch.bfloat16)
    few_rows.identical_rows(a)
    few_rows.identical_rows(b)
    few_rows.identical_rows(a.float())
    few_rows.identical_rows(a, bias=torch.zeros(48, dtype=torch.bfloat16))
    assert len(few_rows.probes()) == 3
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        few_rows.identical_rows(a)
    finally:
        torch.set_num_threads(threads)
    assert sorted(p.threads for p in few_rows.probes()) == sorted([threads] * 3 + [threads + 1])


def test_target_reports_the_rows_its_products_keep_bit_identical(tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="bfloat16")
    shapes = {(tuple(m.weight.shape), m.weight.dtype) for m in target.model.modules()
              if isinstance(m, torch.nn.Linear)}
    found = {(p.out_features, p.in_features): p.rows for p in few_rows.probes() if p.dtype == "bfloat16"}
    assert {shape for shape, dtype in shapes if dtype == torch.bfloat16} <= set(found)
    assert target.identical_rows == min(found[shape] for shape, _ in shapes)


def test_unknown_matmul_dtype_is_a_clear_error(tiny_dirs):
    with pytest.raises(ValueError, match="matmul_dtype='int3'"):
        specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="int3")


def test_packed_weights_give_the_very_bits_of_unpacked_products():
    """A bf16 weight packed once for oneDNN (where that is faster here) must not move a bit of any product:
    every row count, pieces included, with a bias."""
    torch.manual_seed(0)
    weight, bias = torch.randn(1536, 512).to(torch.bfloat16), torch.randn(1536).to(torch.bfloat16)
    packed = few_rows.packed_copy(weight, bias)
    if packed is None:
        pytest.skip("packed bf16 products are not available, not the same bits, or not faster on this machine")
    x = torch.randn(80, 512)
    for m in (1, 2, 5, 16, 36, 37, 80):
        assert torch.equal(few_rows.linear(x[:m], weight, bias, packed), few_rows.linear(x[:m], weight, bias)), m


def test_a_packed_form_that_rounds_differently_is_not_used(monkeypatch):
    if few_rows._pack_refusal():
        pytest.skip(few_rows._pack_refusal())
    real = few_rows._packed_product
    monkeypatch.setattr(few_rows, "_packed_product", lambda flat, packed, bias: real(flat, packed, bias) * (1 + 2 ** -7))
    weight = torch.randn(40, 24).to(torch.bfloat16)
    assert few_rows.packed_copy(weight, torch.randn(40).to(torch.bfloat16)) is None
    choice, = [c for c in specplug.machine.machine_choices() if c.name == "packed_same_bits" and "40x24" in c.key]
    assert choice.value == "no"


def test_a_cpu_on_which_onednn_cannot_pack_runs_unpacked_products_and_says_why(monkeypatch):
    def refuse(weight):  # as torch does on CPUs without avx512bw or avx_ne_convert
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    few_rows._pack_refusal.cache_clear()
    try:
        weight = torch.randn(48, 32).to(torch.bfloat16)
        assert few_rows.packed_copy(weight) is None
        choice, = [c for c in specplug.machine.machine_choices() if c.name == "packed_bf16" and "48x32" in c.key]
        assert choice.value == "F.linear" and "cannot pack" in choice.why
        assert few_rows.linear(torch.randn(5, 32), weight).shape == (5, 48)  # products still run, unpacked
    finally:
        few_rows._pack_refusal.cache_clear()
