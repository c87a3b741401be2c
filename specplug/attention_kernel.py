"""The lean forward's CPU attention kernel (``kernels/attend.c``): compiled on first use, cached, loaded by ctypes.

Why: at batch 16 attention is half a target step, and it is bound by reading each row's cache. torch's
form makes two small products and a softmax per query, and every query of a verify pass reads its row's cache
from memory again; the kernel runs every query head of a layer in one call on all cores, the next query of a row
reading the row's cache from the core's cache. A query's result depends on its own inputs only (see the source),
so a verified position still scores exactly as a one-token step does. Keys are float32; values float32 or, where
the value projection already rounds to bf16, bf16 (:attr:`specplug.lean_llama.LeanLayer.value_dtype`): the same
values in half the bytes.

The kernel is compiled for this CPU by :mod:`specplug.native`; without a C compiler, on
another device or dtype, or where it is not faster (a probe, :mod:`specplug.machine`), torch's form runs, and
:func:`specplug.machine.machine_choices` says which ran and why. ``SPECPLUG_CHOICES=attention=torch`` pins torch's.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable, Sequence

import torch

from . import machine, native

SOURCE = "attend.c"
CHOICE = "attention"
KERNEL, TORCH = "kernel", "torch"


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel, or None and why it is not available."""
    i64, ptr = native.I64, native.PTR
    attend = ([i64] * 4 + [ptr] * 7 + [i64], ctypes.c_int64)
    append = ([i64] * 3 + [ptr] * 2 + [i64] * 2 + [ptr] * 5, None)
    return native.bind(SOURCE, {"specplug_attend": attend, "specplug_attend_v16": attend,
                                "specplug_append": append, "specplug_append_v16": append})


class Attention:
    """The kernel for one layer shape (``heads`` query heads over ``kv_heads`` cached ones, ``head_dim`` each)."""

    def __init__(self, lib: ctypes.CDLL, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        # by the dtype of the cached values: float32, or bf16 (see LeanLayer.value_dtype)
        self.attend_fns = {torch.float32: lib.specplug_attend, torch.bfloat16: lib.specplug_attend_v16}
        self.append_fns = {torch.float32: lib.specplug_append, torch.bfloat16: lib.specplug_append_v16}

    def append(self, k: torch.Tensor, v: torch.Tensor, caches: Sequence, counts: Sequence[int]) -> None:
        """Write new keys and values k, v [N, kv_heads, d] (float32, each position's heads contiguous), ``counts[r]``
        positions for cache r in order, into each cache after its ``length`` entries, in one call (values rounded
        to the caches' dtype, as torch's copy rounds). The caches (:class:`specplug.lean_llama.LayerCache`, alike)
        must have room; their lengths are the caller's to advance."""
        if k.stride()[1:] != (self.head_dim, 1) or v.stride()[1:] != (self.head_dim, 1):
            k, v = k.contiguous(), v.contiguous()
        table = torch.tensor([[c.k.data_ptr() for c in caches], [c.v.data_ptr() for c in caches],
                              [c.k.stride(0) for c in caches], [c.length for c in caches], list(counts)],
                             dtype=torch.int64)
        self.append_fns[caches[0].v.dtype](len(caches), self.kv_heads, self.head_dim, k.data_ptr(), v.data_ptr(),
                                           k.stride(0), v.stride(0), *_row_addresses(table))

    def __call__(self, q: torch.Tensor, spans: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]]) -> torch.Tensor:
        """Scaled queries q [N, heads, d], float32; ``spans``: (keys, values, first, count) for consecutive runs of
        queries, ``count`` queries over the cache tensors keys/values [kv_heads, capacity, d] (a layer cache's own;
        keys float32, values float32 or bf16, alike in every span), the i-th seeing its first ``first + i + 1``
        entries. Returns [N, heads, d]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        # per span: keys' and values' address, kv-head stride, entries before its first query, query count
        table = torch.tensor([[k.data_ptr() for k, _, _, _ in spans], [v.data_ptr() for _, v, _, _ in spans],
                              [k.stride(0) for k, _, _, _ in spans], [first for _, _, first, _ in spans],
                              [count for _, _, _, count in spans]], dtype=torch.int64)
        longest = max((first + count for _, _, first, count in spans), default=0)
        attend = self.attend_fns[spans[0][1].dtype] if spans else self.attend_fns[torch.float32]
        status = attend(len(spans), self.heads, self.kv_heads, self.head_dim, q.data_ptr(), out.data_ptr(),
                         *_row_addresses(table), longest)
        if status:
            raise RuntimeError(f"attention kernel failed (status {status}) for head_dim={self.head_dim}")
        return out


def _row_addresses(table: torch.Tensor) -> list[int]:
    """The address of each row of a contiguous table, by arithmetic: iterating the tensor makes a view per row,
    ~8 µs a table, twice a layer every step."""
    base, step = table.data_ptr(), table.stride(0) * table.element_size()
    return [base + i * step for i in range(table.shape[0])]


def supports(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str:
    """"" where the kernel can run these shapes, else why not."""
    if torch.device(device).type != "cpu":
        return f"the attention kernel runs on the CPU, not {torch.device(device).type}"
    if dtype != torch.float32:
        return f"the attention kernel reads float32 caches, not {dtype}"
    if head_dim > 128 or heads % kv_heads:
        return f"the attention kernel takes head_dim up to 128 and whole groups of heads, not {heads}x{kv_heads}x{head_dim}"
    return ""


def choose(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
           torch_form: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Attention | None:
    """The kernel for a layer of these shapes, or None for torch's form (``torch_form(q, keys, values)``: one
    query [heads, d] over keys/values [kv_heads, L, d]). Decided once per shape and machine, and listed by
    :func:`specplug.machine.machine_choices` with the reason."""
    key = f"{heads}x{kv_heads}x{head_dim} {dtype} {torch.device(device).type}"
    pinned = machine.overrides().get(CHOICE)
    lib, reason = load()
    reason = reason or supports(dtype, device, heads, kv_heads, head_dim)
    if reason:
        if pinned == KERNEL:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={KERNEL} is pinned, but {reason}")
        machine.record(CHOICE, key, TORCH, reason, "default")
        return None
    kernel = Attention(lib, heads, kv_heads, head_dim)
    rows, length = 4, 256
    q, caches = _probe_inputs(heads, kv_heads, head_dim, rows, length)
    spans = [(k, v, length - 2, 2) for k, v in caches]

    def by_torch():
        return [torch_form(q[2 * r + i], k[:, :length - 1 + i], v[:, :length - 1 + i])
                for r, (k, v) in enumerate(caches) for i in range(2)]

    with torch.inference_mode():
        got, want = kernel(q, spans), torch.stack(by_torch())
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
        machine.record(CHOICE, key, TORCH, f"the kernel differs from torch's form by "
                       f"{float((got - want).abs().max()):.2g} on a probe", "kernel")
        return None
    forms = {KERNEL: lambda: kernel(q, spans), TORCH: by_torch}
    nbytes = 2 * rows * kv_heads * length * head_dim * 4
    return kernel if machine.faster(CHOICE, key, forms, KERNEL, nbytes) == KERNEL else None


@functools.lru_cache(maxsize=8)
def _probe_inputs(heads: int, kv_heads: int, head_dim: int, rows: int, length: int):
    """Seeded probe queries [2·rows, heads, d] and ``rows`` caches of ``length`` entries, made once per shape (every
    layer of a model asks for the same)."""
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(kv_heads, length, head_dim, generator=g), torch.randn(kv_heads, length, head_dim, generator=g))
              for _ in range(rows)]
    return torch.randn(2 * rows, heads, head_dim, generator=g) * head_dim ** -0.5, caches
