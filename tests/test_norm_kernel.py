"""The lean forward's RMSNorm kernel: close to torch's rms_norm, each row normalised as it would be alone, and
torch's form (named, with the reason) where the kernel cannot run or is pinned off."""
import pytest
import torch
import torch.nn.functional as F

from greedy_rows import assert_batched_greedy_rows_equal_target_only, kernel_form_pinned
from specplug import machine, norm_kernel


def _kernel(weight: torch.Tensor, eps: float = 1e-5) -> norm_kernel.RmsNorm:
    lib, reason = norm_kernel.load()
    if lib is None:
        pytest.skip(reason)  # no C compiler here: the fallback is tested below
    return norm_kernel.RmsNorm(lib, weight, eps)


@pytest.mark.parametrize("size", [512, 64, 40, 13])
def test_norm_kernel_agrees_with_torchs_rms_norm(size):
    g = torch.Generator().manual_seed(size)
    weight, x = torch.randn(size, generator=g), torch.randn(7, size, generator=g) * 5
    got = _kernel(weight, 1e-6)(x)
    torch.testing.assert_close(got, F.rms_norm(x.double(), (size,), weight.double(), 1e-6).float(),
                               atol=1e-6, rtol=1e-5)


def test_norm_kernel_normalises_each_row_as_it_would_alone():
    """A verify pass or a batched step (many rows, one call) gives every row the bits of its one-row call, as a
    one-token step makes it: what keeps speculative greedy output equal to target-only output."""
    g = torch.Generator().manual_seed(1)
    kernel = _kernel(torch.randn(96, generator=g))
    x = torch.randn(33, 96, generator=g) * 3
    together = kernel(x)
    for i in range(x.shape[0]):
        assert torch.equal(together[i], kernel(x[i:i + 1])[0]), f"row {i} differs when it shares the call"
    heads = x.reshape(11, 3, 96)  # Qwen3's per-head norms: rows are the last dimension's, whatever the shape
    assert torch.equal(kernel(heads), together.reshape(11, 3, 96))
    strided = torch.randn(5, 2, 96, generator=g)[:, 0]
    assert torch.equal(kernel(strided), kernel(strided.contiguous()))


def test_lean_layers_run_the_norm_kernel_or_say_why_not(tiny_dirs):
    from specplug import Target
    target = Target.from_pretrained(tiny_dirs["target"])
    w = target.lean.layers[0].norm_in.weight
    # other models this process loaded earlier have their own sizes' choices: take this layer's
    key = f"{w.numel()} {str(w.dtype).removeprefix('torch.')} {w.device.type}"
    choices = [c for c in machine.machine_choices() if c.name == norm_kernel.CHOICE and c.key == key]
    assert choices, "the norm form a lean layer runs is listed among the machine's choices"
    uses_kernel = target.lean.layers[0].norm_in.kernel is not None
    assert uses_kernel == (norm_kernel.load()[0] is not None and choices[-1].value == norm_kernel.KERNEL)


def test_pinning_torchs_norm_runs_it_and_pinning_the_kernel_where_it_cannot_run_is_refused(monkeypatch):
    machine.forget()
    try:
        monkeypatch.setenv(machine.OVERRIDE_ENV, "rms_norm=torch")
        assert norm_kernel.choose(torch.ones(64), 1e-5) is None
        [choice] = [c for c in machine.machine_choices() if c.name == norm_kernel.CHOICE]
        assert choice.value == norm_kernel.TORCH and choice.source == "override"
        monkeypatch.setenv(machine.OVERRIDE_ENV, "rms_norm=kernel")
        with pytest.raises(ValueError, match="rms_norm=kernel is pinned, but .*bfloat16"):
            norm_kernel.choose(torch.ones(64, dtype=torch.bfloat16), 1e-5)
    finally:
        machine.forget()


def test_without_a_compiler_the_norm_runs_torchs_form_and_names_the_reason(without_a_compiler):
    assert norm_kernel.choose(torch.ones(64), 1e-5) is None
    [choice] = [c for c in machine.machine_choices() if c.name == norm_kernel.CHOICE]
    assert choice.value == norm_kernel.TORCH and without_a_compiler in choice.why


@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_either_norm_form_keeps_batched_speculative_greedy_rows_equal_to_target_only(form, tiny_dirs, monkeypatch):
    import specplug

    monkeypatch.setenv(machine.OVERRIDE_ENV, f"rms_norm={form}")
    with kernel_form_pinned(monkeypatch, "rms_norm", form, norm_kernel.load):
        target = specplug.Target.from_pretrained(tiny_dirs["target"])
        assert target.lean is not None and (target.lean.layers[0].norm_in.kernel is not None) == (form == "kernel")
        assert_batched_greedy_rows_equal_target_only(target, specplug.get_proposer("ngram"))
