"""The lean forward's CPU attention kernel: each query scores as it would alone, close to torch's attention, and a
machine without a compiler runs torch's form and says why."""
import pytest
import torch

from greedy_rows import assert_batched_greedy_rows_equal_target_only, pinned_forms
from specplug import attention_kernel, machine, native


def _caches(rows: int, kv_heads: int, head_dim: int, capacity: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(kv_heads, capacity, head_dim, generator=g), torch.randn(kv_heads, capacity, head_dim, generator=g))
            for _ in range(rows)]


def _kernel(heads: int, kv_heads: int, head_dim: int) -> attention_kernel.Attention:
    lib, reason = attention_kernel.load()
    if lib is None:
        pytest.skip(reason)  # no C compiler here: the fallback is tested below
    return attention_kernel.Attention(lib, heads, kv_heads, head_dim)


def _each_query(spans):
    """(index, keys, values, visible length) of every query the spans describe, in order."""
    at = 0
    for keys, values, first, count in spans:
        for i in range(count):
            yield at, keys, values, first + i + 1
            at += 1


def _by_torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Reference attention of one query [heads, d] over [kv_heads, L, d], in float64."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(heads // kv_heads, 0)
    v = values.double().repeat_interleave(heads // kv_heads, 0)
    weights = torch.softmax(torch.einsum("hd,hld->hl", q.double(), k), -1)
    return torch.einsum("hl,hld->hd", weights, v).float()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 128), (4, 2, 8), (2, 1, 40)])
def test_attention_kernel_agrees_with_softmax_attention(heads, kv_heads, head_dim):
    kernel = _kernel(heads, kv_heads, head_dim)
    caches = _caches(3, kv_heads, head_dim, capacity=300)
    # lengths below, at and across the kernel's 16-key blocks
    spans = [(caches[0][0], caches[0][1], 0, 3), (caches[1][0], caches[1][1], 14, 4), (caches[2][0], caches[2][1], 250, 2)]
    n = sum(count for *_, count in spans)
    q = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(1)) * 3 * head_dim ** -0.5
    got = kernel(q, spans)
    for at, keys, values, length in _each_query(spans):
        torch.testing.assert_close(got[at], _by_torch(q[at], keys[:, :length], values[:, :length]), atol=2e-5, rtol=1e-4)


def test_attention_kernel_scores_each_query_as_it_would_alone():
    """A verify pass (several queries per row, many rows, one call) gives every query the bits of its own
    one-query call: the property that keeps speculative greedy output equal to target-only output."""
    heads, kv_heads, head_dim = 8, 4, 64
    kernel = _kernel(heads, kv_heads, head_dim)
    caches = _caches(5, kv_heads, head_dim, capacity=400, seed=2)
    spans = [(k, v, first, count) for (k, v), first, count in zip(caches, (7, 100, 31, 250, 0), (5, 1, 3, 9, 2))]
    n = sum(count for *_, count in spans)
    q = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(3)) * 4 * head_dim ** -0.5
    together = kernel(q, spans)
    for at, keys, values, length in _each_query(spans):
        alone = kernel(q[at:at + 1], [(keys, values, length - 1, 1)])
        assert torch.equal(together[at], alone[0]), f"query {at} differs when it shares the call"


def test_lean_layers_run_the_kernel_or_say_why_not(tiny_dirs):
    from specplug import Target
    target = Target.from_pretrained(tiny_dirs["target"])
    layer = target.lean.layers[0]
    # other models this process loaded earlier have their own shapes' choices: take this layer's
    w = layer.norm_in.weight
    key = f"{layer.heads}x{layer.kv_heads}x{layer.head_dim} {w.dtype} {w.device.type}"
    choices = [c for c in machine.machine_choices() if c.name == attention_kernel.CHOICE and c.key == key]
    assert choices, "the attention form a lean layer runs is listed among the machine's choices"
    lib, reason = attention_kernel.load()
    uses_kernel = layer.kernel is not None
    assert uses_kernel == (lib is not None and choices[-1].value == attention_kernel.KERNEL)


def test_without_a_compiler_attention_runs_torch_form_and_names_the_reason(without_a_compiler, monkeypatch):
    chosen = attention_kernel.choose(8, 8, 64, torch.float32, "cpu", _by_torch)
    assert chosen is None
    [choice] = [c for c in machine.machine_choices() if c.name == attention_kernel.CHOICE]
    assert choice.value == attention_kernel.TORCH and without_a_compiler in choice.why
    monkeypatch.setenv(machine.OVERRIDE_ENV, "attention=kernel")
    with pytest.raises(ValueError, match="attention=kernel is pinned"):
        attention_kernel.choose(8, 8, 64, torch.float32, "cpu", _by_torch)


def test_attention_kernel_is_not_used_where_it_does_not_apply():
    assert "float32" in attention_kernel.supports(torch.bfloat16, "cpu", 8, 8, 64)
    assert "head_dim" in attention_kernel.supports(torch.float32, "cpu", 8, 8, 256)
    assert "CPU" in attention_kernel.supports(torch.float32, "meta", 8, 8, 64)


@pytest.mark.parametrize("name", ["ngram", "draft-model"])
def test_torchs_attention_form_keeps_batched_speculative_greedy_rows_equal_to_target_only(name, tiny_dirs,
                                                                                           monkeypatch):
    """Where the kernel does not run (no compiler, another device, bf16 caches) torch's form serves every path of
    the lean forward; a machine with a compiler checks that form here."""
    import specplug

    with pinned_forms(monkeypatch, "attention=torch"):
        target = specplug.Target.from_pretrained(tiny_dirs["target"])
        assert target.lean is not None and target.lean.layers[0].kernel is None
        options = {"target": target, "model": str(tiny_dirs["draft"])} if name == "draft-model" else {}
        assert_batched_greedy_rows_equal_target_only(target, specplug.get_proposer(name, **options))


def test_a_source_the_compiler_refuses_is_not_compiled_again_but_a_timeout_is_retried(tmp_path, monkeypatch):
    (tmp_path / "broken.c").write_text("this is not C\n")
    monkeypatch.setattr(native, "KERNELS", tmp_path)
    real_run, compiles = native.subprocess.run, []

    def counting(cmd, **kwargs):
        if "-shared" in cmd:
            compiles.append(cmd)
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting)
    if native.build("broken.c")[0] is None and not compiles:
        pytest.skip("no C compiler here")
    try:
        for _ in range(2):
            native.build.cache_clear()  # as a new process would
            lib, reason = native.build("broken.c")
            assert lib is None and "could not build broken.c" in reason
        assert len(compiles) == 1

        (tmp_path / "slow.c").write_text("int f(void) { return 1; }\n")

        def timing_out(cmd, **kwargs):
            if "-shared" in cmd:
                compiles.append(cmd)
                raise native.subprocess.TimeoutExpired(cmd, 300)
            return real_run(cmd, **kwargs)

        monkeypatch.setattr(native.subprocess, "run", timing_out)
        for _ in range(2):
            native.build.cache_clear()
            assert "timed out" in native.build("slow.c")[1]
        assert len(compiles) == 3
    finally:
        native.build.cache_clear()


@pytest.mark.parametrize("head_dim", [64, 40])
def test_values_kept_in_bf16_are_read_as_the_float32_values_they_hold(head_dim):
    """bf16 values widen exactly: attention over a bf16 value cache has the bits of attention over the same
    values held in float32 (every lane and, for head_dim 40, the tail past the last 16 lanes)."""
    kernel = _kernel(4, 2, head_dim)
    caches = [(k, v.bfloat16()) for k, v in _caches(3, 2, head_dim, capacity=200, seed=4)]
    spans16 = [(k, v, first, count) for (k, v), first, count in zip(caches, (0, 17, 150), (3, 1, 6))]
    spans32 = [(k, v.float(), first, count) for k, v, first, count in spans16]
    q = torch.randn(10, 4, head_dim, generator=torch.Generator().manual_seed(5)) * head_dim ** -0.5
    assert torch.equal(kernel(q, spans16), kernel(q, spans32))


def test_appending_values_into_a_bf16_cache_rounds_them_as_torchs_copy_does():
    from specplug.lean_llama import LayerCache
    kernel = _kernel(4, 2, 64)
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(7, 2, 64, generator=g), torch.randn(7, 2, 64, generator=g)  # not bf16 values: they round
    by_kernel = [LayerCache(2, 64, "cpu", torch.float32, value_dtype=torch.bfloat16) for _ in range(2)]
    by_torch = [LayerCache(2, 64, "cpu", torch.float32, value_dtype=torch.bfloat16) for _ in range(2)]
    for kc, tc, length in zip(by_kernel, by_torch, (3, 0)):
        kc.length = tc.length = length
    kernel.append(k, v, by_kernel, [4, 3])
    by_torch[0].append(k[:4].transpose(0, 1), v[:4].transpose(0, 1))
    by_torch[1].append(k[4:].transpose(0, 1), v[4:].transpose(0, 1))
    for kc, tc, start, end in zip(by_kernel, by_torch, (3, 0), (7, 3)):
        assert torch.equal(kc.k[:, start:end], tc.k[:, start:end])
        assert torch.equal(kc.v[:, start:end], tc.v[:, start:end])


def _scores_of_steps_passes_and_rows(target):
    """Logits of a prefill's last position, single steps, a 6-token verify pass and three ragged rows of one pass."""
    ids = torch.randint(0, target.vocab_size, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    state = target.prefill(ids[:8])
    out = [target.forward(state, [t]).logits for t in ids[8:11]]
    out.append(target.forward(state, ids[11:17], logits_to_keep=0).logits)
    rows = target.new_rows()
    rows.add([ids[:5], ids[:9], ids[:3]])
    out.append(rows.score([ids[5:9], ids[9:10], ids[3:8]]).logits)
    return out


@pytest.mark.parametrize("matmul_dtype", ["bfloat16", None])
def test_values_are_kept_in_bf16_only_where_that_leaves_every_logit_as_it_was(matmul_dtype, tiny_dirs, monkeypatch):
    """A bf16 value projection hands back bf16 values, so caching them in bf16 halves what attention reads and
    changes no bit; float32 products' values would round, so they stay float32."""
    import specplug

    if attention_kernel.load()[0] is None:
        pytest.skip(attention_kernel.load()[1])
    with pinned_forms(monkeypatch, "attention=kernel"):
        target = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype=matmul_dtype)
        values = target.lean.layers[0].value_dtype
        default = _scores_of_steps_passes_and_rows(target)
    assert values == (torch.bfloat16 if matmul_dtype else torch.float32)
    with pinned_forms(monkeypatch, "attention=kernel,value_cache=float32"):
        target = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype=matmul_dtype)
        assert target.lean.layers[0].value_dtype == torch.float32
        float32_values = _scores_of_steps_passes_and_rows(target)
    assert all(torch.equal(a, b) for a, b in zip(default, float32_values))


def test_bf16_values_pinned_where_they_would_round_are_refused_by_name(tiny_dirs, monkeypatch):
    import specplug

    if attention_kernel.load()[0] is None:
        pytest.skip(attention_kernel.load()[1])
    with pinned_forms(monkeypatch, "attention=kernel,value_cache=bf16"):
        with pytest.raises(ValueError, match="value_cache=bf16 is pinned, but the value projection"):
            specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype=None)
