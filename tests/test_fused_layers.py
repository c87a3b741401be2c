"""A lean layer's chain rows in C (specplug.fused_layers): the same bits as the layer's torch form, chosen by the
machine and said so, and torch's form wherever a part of the layer is not on a kernel."""
import pytest
import torch

import specplug
from greedy_rows import assert_batched_greedy_rows_equal_target_only, pinned_forms
from specplug import fused_layers, int8_products, machine


@pytest.fixture(autouse=True)
def _fresh_choices():
    """Each test decides its forms afresh, so the choices it reads are its own (the refusal test below counts them).
    Choices an earlier file left in the process once kept the tiny target's layers off the C path: see that test."""
    machine.forget()
    yield
    machine.forget()


def _fused_layer(target):
    layer = target.lean.layers[0] if target.lean is not None else None
    if layer is None or layer.fused is None:
        reasons = [c.why for c in machine.machine_choices() if c.name == fused_layers.CHOICE]
        pytest.skip(f"no lean layer runs in C here: {reasons}")
    return layer


def _prefilled(target, prompts):
    rows = target.new_rows()
    rows.add([target.tokenizer(p)["input_ids"] for p in prompts])
    return rows


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"], ids=["float32-values", "bf16-values"])
@pytest.mark.parametrize("counts", [(1,), (9,), (1, 1, 1, 1), (3, 1, 16, 2)], ids=["step", "pass", "batch", "ragged"])
def test_c_layer_rows_are_the_torch_forms_bits(counts, matmul_dtype, tiny_dirs):
    """Every output row and every appended key and value, over caches of a real prefill (bf16 products: values
    cached in bf16)."""
    target = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype=matmul_dtype)
    layer = _fused_layer(target)
    prompts = ["def add(a, b):\n    return a + b\n" * (1 + i) for i in range(len(counts))]
    forms = {}
    for name, rows_of in (("C", layer.rows), ("torch", layer.rows_by_torch)):
        caches = [cache.layers[0] for cache in _prefilled(target, prompts).caches]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(sum(counts), layer.norm_in.shape[0], generator=g) * 3
        at = [p for cache, n in zip(caches, counts) for p in range(cache.length, cache.length + n)]
        cos, sin = target.lean._rope_at(at, len(at))
        starts = [c.length for c in caches]
        with torch.inference_mode():
            out = rows_of(x, cos, sin, caches, list(counts))
        forms[name] = [out] + [t[:, s:c.length] for c, s in zip(caches, starts) for t in (c.k, c.v)]
    assert all(torch.equal(a, b) for a, b in zip(forms["C"], forms["torch"]))


def test_c_layers_refuse_caches_holding_values_of_another_dtype(tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="bfloat16")
    layer = _fused_layer(target)
    assert layer.value_dtype == torch.bfloat16
    cache = target.lean.new_cache().layers[0]
    cache.v = cache.v.float()  # as a cache made for another layer would hold them
    x = torch.randn(1, layer.norm_in.shape[0])
    cos, sin = target.lean._rope_at([0], 1)
    with pytest.raises(ValueError, match="a cache of torch.float32 values passed to C layers built for torch.bfloat16"):
        layer.rows(x, cos, sin, [cache], [1])


@pytest.mark.parametrize("target_name", ["tiny", "zoo:pycode"])
def test_verify_pass_logits_are_the_same_with_c_layers_and_without(target_name, tiny_dirs, monkeypatch):
    """The whole forward: a batch of ragged verify passes scores every position with the same bits whether the
    layers run in C or in torch's form (the zoo target: bf16 products on AMX tiles where the CPU has them)."""
    path = tiny_dirs["target"] if target_name == "tiny" else target_name
    prompts = ["def add(a, b):", "for i in range(10):\n    print(i)", "x"]
    fed = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14]]
    target = specplug.Target.from_pretrained(path)
    _fused_layer(target)
    top = len(target.lean.layers)
    hidden = (0, top // 2, top)  # the states feature heads read come out of the same pass

    def scored(t):
        logits, states = t.lean.run_rows(_prefilled(t, prompts).caches, fed, hidden=hidden)
        return [logits] + [states[i] for i in hidden]

    assert fused_layers.stack(target.lean.layers) is not None
    with_c = scored(target)
    with pinned_forms(monkeypatch, f"{fused_layers.CHOICE}={fused_layers.TORCH}"):
        plain = specplug.Target.from_pretrained(path)
        assert all(layer.fused is None for layer in plain.lean.layers)
        without = scored(plain)
    assert all(torch.equal(a, b) for a, b in zip(with_c, without))


@pytest.mark.parametrize("name", ["ngram", "draft-model"])
def test_c_layers_keep_batched_speculative_greedy_rows_equal_to_target_only(name, tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    _fused_layer(target)
    options = {"target": target, "model": str(tiny_dirs["draft"])} if name == "draft-model" else {}
    assert_batched_greedy_rows_equal_target_only(target, specplug.get_proposer(name, **options))


def test_the_choice_is_listed_and_a_pin_that_cannot_hold_names_why(tiny_dirs, monkeypatch):
    with pinned_forms(monkeypatch, "attention=torch"):
        target = specplug.Target.from_pretrained(tiny_dirs["target"])
        assert target.lean.layers[0].fused is None
        [choice] = {c.key: c for c in machine.machine_choices() if c.name == fused_layers.CHOICE}.values()
        assert choice.value == fused_layers.TORCH and "attention" in choice.why
    with pinned_forms(monkeypatch, f"attention=torch,{fused_layers.CHOICE}={fused_layers.FUSED}"):
        with pytest.raises(ValueError, match=f"{fused_layers.CHOICE}={fused_layers.FUSED} is pinned, but attention"):
            specplug.Target.from_pretrained(tiny_dirs["target"], probe=False)  # the lean path's first run decides


def test_without_a_compiler_layers_run_torchs_form_and_say_why(without_a_compiler, tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    assert all(layer.fused is None for layer in target.lean.layers)
    choices = [c for c in machine.machine_choices() if c.name == fused_layers.CHOICE]
    assert choices and all(c.value == fused_layers.TORCH for c in choices)


@pytest.mark.skipif(not int8_products.available("cpu"), reason="no int8 kernel in this torch build")
def test_a_drafters_int8_layers_are_not_fused(tiny_dirs):
    """int8 products (drafters) have no C form here: the reason is the product, named."""
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    lean = target.lean
    layer = lean.layers[0]
    lean.to_int8()
    plan, reason = fused_layers.plan_or_reason(layer)
    assert plan is None and "qkv" in reason
    assert layer.fused is None


def test_a_c_form_that_rounds_otherwise_is_refused_by_the_probe(tiny_dirs, monkeypatch):
    """The probe has power: a C layer one rounding away from torch's form (its norm's eps nudged) is not used."""
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    layer = _fused_layer(target)
    real = fused_layers.plan_or_reason

    def nudged(layer):
        plan, reason = real(layer)
        plan.eps_post *= 1.5
        return plan, reason

    monkeypatch.setattr(fused_layers, "plan_or_reason", nudged)
    machine.forget()
    try:
        assert fused_layers.choose(layer) is None
        [choice] = [c for c in machine.machine_choices() if c.name == fused_layers.CHOICE]
        assert choice.value == fused_layers.TORCH and "differ" in choice.why
    finally:
        machine.forget()  # the refusal belongs to the nudged form, not to later targets of this shape


@pytest.mark.parametrize("count,keep", [(1, 0), (3, 1), (16, 0), (5, 2)])
def test_a_single_sequences_short_run_takes_the_c_form_with_the_torch_forms_bits(count, keep, tiny_dirs):
    """``LeanLayer.__call__`` (drafters' steps, short prefills) runs a chain of up to SMALL_ATTENTION positions
    as one row of the C form: the kept rows and the cache entries are the torch form's."""
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    layer = _fused_layer(target)
    forms = {}
    for name, fused in (("C", layer.fused), ("torch", None)):
        cache = _prefilled(target, ["def add(a, b):\n    return a + b\n"]).caches[0].layers[0]
        start = cache.length
        x = torch.randn(count, layer.norm_in.shape[0], generator=torch.Generator().manual_seed(2)) * 3
        cos, sin = target.lean.rope.get(start, count)
        chosen, layer._fused = layer._fused, fused
        try:
            with torch.inference_mode():
                out = layer(x, cos, sin, cache, keep=keep)
        finally:
            layer._fused = chosen
        forms[name] = [out, cache.k[:, start:cache.length], cache.v[:, start:cache.length]]
    assert forms["C"][0].shape[0] == (keep or count)
    assert all(torch.equal(a, b) for a, b in zip(forms["C"], forms["torch"]))


def test_a_refusal_for_bf16_rows_leaves_float32_rows_of_the_same_shapes_their_own_choice(tiny_dirs):
    """A choice is kept per key for the process: keyed by shapes alone, a bf16 model's refusal ("attention runs in
    torch's form") kept a later float32-rows model of the same shapes off the C path (the order dependence this
    file's fixture once hid)."""
    whole_bf16 = specplug.Target.from_pretrained(tiny_dirs["target"], dtype=torch.bfloat16)
    assert whole_bf16.lean.layers[0].fused is None  # C layers take float32 rows
    (refusal,) = [c for c in machine.machine_choices() if c.name == fused_layers.CHOICE]
    float32_rows = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="bfloat16")
    float32_rows.lean.layers[0].fused  # the first access decides the layer's form and records the choice
    (own,) = [c for c in machine.machine_choices() if c.name == fused_layers.CHOICE and c is not refusal]
    assert "torch.bfloat16 rows" in refusal.key and "torch.float32 rows" in own.key
    assert own.why != refusal.why
