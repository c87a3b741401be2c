"""The few-rows linear path: same numbers as F.linear, only for 2..16 rows, and only where installed."""
import pytest
import torch

import specplug
from specplug import few_rows
from specplug.target import KVState


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


def test_bf16_product_of_one_row_equals_that_row_of_a_many_row_product():
    """A verify pass multiplies k + 1 rows where target-only decoding multiplies one: the rows must agree to the
    last bit, or the two paths drift apart (oneDNN's one-row kernel sums in another order)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 512, bias=False)
    assert few_rows.install(layer, weight_dtype=torch.bfloat16) == 1
    x = torch.randn(40, 9, 1536)  # the one-row kernel's sums differ in a few of these 184,320 outputs
    rows = torch.stack([torch.cat([layer(block[i:i + 1]) for i in range(9)]) for block in x])
    for m in range(2, 10):
        assert torch.equal(layer(x[:, :m]), rows[:, :m]), m


def test_unknown_matmul_dtype_is_a_clear_error(tiny_dirs):
    with pytest.raises(ValueError, match="matmul_dtype='int3'"):
        specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="int3")
