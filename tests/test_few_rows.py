"""The few-rows linear path: same numbers as F.linear, only for 2..16 rows, and only where installed."""
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
