"""Greedy ids: the kernel's argmax is torch's (first of equal maxima, a NaN the largest) on every row shape, the
decode loop reads its greedy ids through this machine's choice, and numpy's form runs (named, with the reason)
where the kernel cannot or is pinned off."""
import pytest
import torch

from greedy_rows import assert_batched_greedy_rows_equal_target_only, kernel_form_pinned, pinned_forms
from specplug import argmax_kernel, machine
from specplug.sampling import argmax_ids


def _kernel() -> argmax_kernel.ArgmaxRows:
    lib, reason = argmax_kernel.load()
    if lib is None:
        pytest.skip(reason)  # no C compiler here: the fallback is tested below
    return argmax_kernel.ArgmaxRows(lib)


@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 33, 100, 8192 + 7])
def test_kernel_argmax_is_torchs_with_ties_nans_and_infinities(width):
    kernel = _kernel()
    g = torch.Generator().manual_seed(width)
    for trial in range(40):
        x = torch.randn(6, width, generator=g).round()  # rounded: many equal maxima
        special = torch.rand(6, width, generator=g) < 0.05
        x[special] = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0][trial % 5]
        assert kernel(x) == x.argmax(-1).tolist(), (width, trial)


def test_probe_rows_catch_an_argmax_that_breaks_ties_late_or_ignores_nans():
    x = argmax_kernel.probe_rows()
    want = x.argmax(-1).tolist()
    last_of_equal = (x.shape[-1] - 1 - x.flip(-1).nan_to_num(nan=-float("inf")).argmax(-1)).tolist()
    assert last_of_equal != want
    assert x.nan_to_num(nan=-float("inf")).argmax(-1).tolist() != want
    body_only = x[8:9]  # a NaN that only the vector body sees, where a kernel forgetting it has no tail to help
    assert body_only.nan_to_num(nan=-float("inf")).argmax(-1).tolist() != want[8:9]
    assert _kernel()(x) == want


def test_rows_of_any_shape_flatten_in_order():
    kernel = _kernel()
    x = torch.randn(3, 4, 300, generator=torch.Generator().manual_seed(3))
    assert kernel(x) == x.reshape(-1, 300).argmax(-1).tolist()
    assert kernel(x[:0]) == []


def test_argmax_ids_takes_any_layout_and_dtype():
    x = torch.randn(7, 515, generator=torch.Generator().manual_seed(4))
    assert argmax_ids(x) == x.argmax(-1).tolist()
    assert argmax_ids(x[:, :300]) == x[:, :300].argmax(-1).tolist()  # not contiguous
    assert argmax_ids(x.bfloat16()) == x.bfloat16().argmax(-1).tolist()
    assert argmax_ids(x.double()) == x.double().argmax(-1).tolist()


def test_pinning_numpys_form_runs_it(monkeypatch):
    _kernel()
    with pinned_forms(monkeypatch, "greedy_ids=numpy"):
        assert argmax_kernel.chosen() is argmax_kernel.by_numpy
        [choice] = [c for c in machine.machine_choices() if c.name == argmax_kernel.CHOICE]
        assert choice.value == argmax_kernel.NUMPY and choice.source == "override"


def test_pinning_the_kernel_where_it_cannot_run_is_refused(monkeypatch, without_a_compiler):
    with pinned_forms(monkeypatch, "greedy_ids=kernel"):
        with pytest.raises(ValueError, match="greedy_ids=kernel is pinned, but .*nonexistent"):
            argmax_kernel.chosen()


def test_without_a_compiler_greedy_ids_run_numpys_form_and_name_the_reason(without_a_compiler):
    assert argmax_kernel.chosen() is argmax_kernel.by_numpy
    [choice] = [c for c in machine.machine_choices() if c.name == argmax_kernel.CHOICE]
    assert choice.value == argmax_kernel.NUMPY and without_a_compiler in choice.why


def test_the_loop_reads_greedy_ids_through_the_targets_chosen_form(tiny_dirs, monkeypatch):
    """A kernel that answered wrongly would show in the output: the loop must not read greedy ids elsewhere."""
    import specplug

    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    assert target.lean is not None  # float32 logits in one block: the kernel's kind
    want = specplug.generate(target, None, "def add(a, b):", max_new_tokens=12, sampling=specplug.GREEDY).tokens
    token = next(t for t in range(5, 50) if t not in want)
    assert target.greedy_form is argmax_kernel.chosen()
    monkeypatch.setattr(target, "greedy_form", lambda x: [token] * (x.numel() // x.shape[-1]))
    got = specplug.generate(target, None, "def add(a, b):", max_new_tokens=12, sampling=specplug.GREEDY).tokens
    assert got == [token] * 12


@pytest.mark.parametrize("form", ["kernel", "numpy"])
def test_either_greedy_ids_form_keeps_batched_speculative_greedy_rows_equal_to_target_only(form, tiny_dirs,
                                                                                         monkeypatch):
    import specplug

    with kernel_form_pinned(monkeypatch, "greedy_ids", form, argmax_kernel.load):
        target = specplug.Target.from_pretrained(tiny_dirs["target"])
        assert (target.greedy_form is argmax_kernel.by_numpy) == (form == "numpy")
        draft = specplug.get_proposer("draft-model", target=target, model=tiny_dirs["draft"])
        assert_batched_greedy_rows_equal_target_only(target, draft)
