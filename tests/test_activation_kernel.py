"""The lean forward's gated activation kernel: close to torch's silu(gate) · up, each row computed as it would be
alone, one form on every path of a layer, and torch's form (named, with the reason) where the kernel cannot run
or is pinned off."""
import pytest
import torch

from greedy_rows import assert_batched_greedy_rows_equal_target_only, kernel_form_pinned
from specplug import activation_kernel, machine


def _kernel(inter: int) -> activation_kernel.SiluMul:
    lib, reason = activation_kernel.load()
    if lib is None:
        pytest.skip(reason)  # no C compiler here: the fallback is tested below
    return activation_kernel.SiluMul(lib, inter)


@pytest.mark.parametrize("inter", [1536, 64, 40, 7])
def test_activation_kernel_agrees_with_torchs_silu_times_up(inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(9, 2 * inter, generator=g) * 6
    x[0, :4] = torch.tensor([-120.0, -0.0, 0.0, 120.0])[:min(4, inter)]  # beyond the exp's clamped range, and ±0
    want = activation_kernel.by_torch(x.double(), inter).float()
    torch.testing.assert_close(_kernel(inter)(x), want, atol=1e-6, rtol=2e-6)


def test_activation_kernel_computes_each_row_as_it_would_alone():
    """A verify pass or a batched step (many rows, one call) gives every row the bits of its one-row call, as a
    one-token step makes it: what keeps speculative greedy output equal to target-only output."""
    g = torch.Generator().manual_seed(1)
    kernel = _kernel(200)
    x = torch.randn(300, 400, generator=g) * 3  # enough elements for the kernel's threads
    together = kernel(x)
    for i in range(0, x.shape[0], 7):
        assert torch.equal(together[i], kernel(x[i:i + 1])[0]), f"row {i} differs when it shares the call"
    strided = torch.randn(5, 2, 400, generator=g)[:, 0]
    assert torch.equal(kernel(strided), kernel(strided.contiguous()))


def test_every_path_of_a_lean_layer_takes_its_one_activation_form(tiny_dirs):
    """Steps, verify passes, prefills and tree nodes all reach LeanLayer.activated: one form per layer, as the
    listed choice says."""
    from specplug import Target
    target = Target.from_pretrained(tiny_dirs["target"])
    layer = target.lean.layers[0]
    w = layer.norm_in.weight
    # other models this process loaded earlier have their own sizes' choices: take this layer's
    key = f"{layer.inter} {str(w.dtype).removeprefix('torch.')} {w.device.type}"
    choices = [c for c in machine.machine_choices() if c.name == activation_kernel.CHOICE and c.key == key]
    assert choices, "the activation form a lean layer runs is listed among the machine's choices"
    assert (layer.act_kernel is not None) == (choices[-1].value == activation_kernel.KERNEL)
    gate_up = torch.randn(3, 2 * layer.inter)
    want = layer.act_kernel(gate_up) if layer.act_kernel is not None else activation_kernel.by_torch(gate_up, layer.inter)
    assert torch.equal(layer.activated(gate_up), want)
    fused = layer.fused
    if fused is not None:  # the C layer activates in the same call where the kernel serves the layer
        assert bool(fused.plan.act) == (layer.act_kernel is not None)


def test_pinning_torchs_activation_runs_it_and_pinning_the_kernel_where_it_cannot_run_is_refused(monkeypatch):
    machine.forget()
    try:
        monkeypatch.setenv(machine.OVERRIDE_ENV, "activation=torch")
        assert activation_kernel.choose(64, torch.float32, "cpu") is None
        [choice] = [c for c in machine.machine_choices() if c.name == activation_kernel.CHOICE]
        assert choice.value == activation_kernel.TORCH and choice.source == "override"
        monkeypatch.setenv(machine.OVERRIDE_ENV, "activation=kernel")
        with pytest.raises(ValueError, match="activation=kernel is pinned, but .*bfloat16"):
            activation_kernel.choose(64, torch.bfloat16, "cpu")
    finally:
        machine.forget()


def test_an_activation_off_by_more_than_float32_rounding_is_refused(monkeypatch):
    """The probe has power: a kernel whose results sit 1e-5 off torch's is not used."""
    if activation_kernel.load()[0] is None:
        pytest.skip(activation_kernel.load()[1])  # the probe runs only where the kernel could

    class Off:
        def __init__(self, inter):
            self.inter = inter

        def __call__(self, gate_up):
            return activation_kernel.by_torch(gate_up, self.inter) * (1 + 1e-5)

    machine.forget()
    try:
        monkeypatch.setattr(activation_kernel, "SiluMul", lambda lib, inter: Off(inter))
        assert activation_kernel.choose(64, torch.float32, "cpu") is None
        [choice] = [c for c in machine.machine_choices() if c.name == activation_kernel.CHOICE]
        assert "differs from torch's silu" in choice.why
    finally:
        machine.forget()


def test_without_a_compiler_the_activation_runs_torchs_form_and_names_the_reason(without_a_compiler):
    assert activation_kernel.choose(64, torch.float32, "cpu") is None
    [choice] = [c for c in machine.machine_choices() if c.name == activation_kernel.CHOICE]
    assert choice.value == activation_kernel.TORCH and without_a_compiler in choice.why


@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_either_activation_form_keeps_batched_speculative_greedy_rows_equal_to_target_only(form, tiny_dirs,
                                                                                           monkeypatch):
    import specplug

    with kernel_form_pinned(monkeypatch, "activation", form, activation_kernel.load):
        target = specplug.Target.from_pretrained(tiny_dirs["target"])
        assert target.lean is not None and (target.lean.layers[0].act_kernel is not None) == (form == "kernel")
        assert_batched_greedy_rows_equal_target_only(target, specplug.get_proposer("ngram"))
