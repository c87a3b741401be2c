"""A lean layer's step rows in one or two C calls (``kernels/layer.c``) in place of its torch form's thirty-odd
calls.

Why: on a step's few rows a layer's arithmetic is a fraction of its dispatch. On the Intel Xeon with AMX a
one-row step of the zoo target spent ~1.3 of its ~3 ms in Python, allocation and small torch ops around the
products and attention; a batch of 16 rows ~1.5 of ~5 ms.

The C form calls the very kernels the torch form calls (the products' bf16 (AMX or AVX-512) or rows kernels, the
RMSNorm and the attention kernels, passed by address) and does the rotary embedding, the scaling and the residual
sums with one rounding per operation, as torch's ops round. The activation is the layer's own form: on the
activation kernel (:mod:`specplug.activation_kernel`) inside the one call, else torch's function between two. So a
layer's rows come out bit for bit as :meth:`specplug.lean_llama.LeanLayer.rows` computes them in torch's form,
which tree rows (masked attention) and long prefills still use: a verified position, drafted as a chain or a tree,
scores exactly as a one-token step does. A single sequence's short runs (``LeanLayer.__call__``, up to
``SMALL_ATTENTION`` positions) run as one row of it.

Used per layer shape where every part of the layer runs on those kernels, the two forms agree bit for bit on a
probe over ragged rows, and the C form is not slower (choice ``fused_layers``, listed by
:func:`specplug.machine.machine_choices`; ``SPECPLUG_CHOICES=fused_layers=torch`` pins torch's form).
"""
from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Sequence

import torch

from . import bf16_products, machine, native, row_products

if TYPE_CHECKING:
    from .lean_llama import LayerCache, LeanLayer, Product

SOURCE = "layer.c"
CHOICE = "fused_layers"
FUSED, TORCH = "C", "torch"
TILES, ROWS, ROWS_FROM_16 = 0, 1, 2  # the product kinds layer.c knows
PROBE_COUNTS = (1, 5, 1, 3, 2)  # ragged rows: a step, a verify pass, and rows between


class _Product(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("out", ctypes.c_int64), ("in_", ctypes.c_int64), ("flag", ctypes.c_int64),
                ("fn", ctypes.c_void_p), ("w", ctypes.c_void_p), ("b", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("h", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("d", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("scaling", ctypes.c_double), ("eps_in", ctypes.c_double),
                ("eps_post", ctypes.c_double), ("w_in", ctypes.c_void_p), ("w_post", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("append", ctypes.c_void_p), ("attend", ctypes.c_void_p),
                ("act", ctypes.c_void_p),
                ("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product)]


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled library, or None and why it is not available."""
    i64, ptr = native.I64, native.PTR
    return native.bind(SOURCE, {"specplug_layer_first": ([ptr, i64] + [ptr] * 3 + [i64, ptr, i64] + [ptr] * 4, i64),
                                "specplug_layer_last": ([ptr, i64] + [ptr] * 5, None),
                                "specplug_layer": ([ptr, i64] + [ptr] * 3 + [i64, ptr, i64] + [ptr] * 6, i64)})


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _product(product: "Product") -> _Product | str:
    """The C description of a lean product, or why it has none (it must run on one of layer.c's kernels)."""
    kernel = product.tiles
    if product.int8 is not None or kernel is None:
        return "a product not on the bf16 or rows kernel"
    bias = 0 if getattr(kernel, "bias", None) is None else kernel.bias.data_ptr()
    if isinstance(kernel, bf16_products.Bf16Product):
        return _Product(TILES, kernel.out_features, kernel.in_features, 0, _address(kernel.kernel.fn),
                        kernel.packed.data_ptr(), bias)
    if isinstance(kernel, row_products.RowProduct):
        if kernel.narrow is None:
            return _Product(ROWS, kernel.out_features, kernel.in_features, 0, _address(kernel.lib.specplug_rows_f32),
                            kernel.weight.data_ptr(), bias)
        return _Product(ROWS_FROM_16, kernel.out_features, kernel.in_features, int(kernel.narrow.dtype == torch.bfloat16),
                        _address(kernel.lib.specplug_rows_f32_from16), kernel.narrow.data_ptr(), bias)
    return f"a product on {type(kernel).__name__}"


class Pass:
    """One pass of chain rows through fused layers of one shape: each layer's caches' addresses and lengths in one
    table, and scratch every layer reuses, made once for the pass rather than once a layer (~0.1 ms a layer of
    Python at 16 rows). ``caches[i]`` are layer i's caches, ``counts[b]`` new positions for row b."""

    def __init__(self, first: "FusedLayer", N: int, dtype: torch.dtype, caches: Sequence[Sequence["LayerCache"]],
                 counts: Sequence[int]):
        layer, h = first.layer, first.plan.h
        self.caches, self.counts, self.rows = caches, list(counts), len(counts)
        if caches and caches[0] and caches[0][0].v.dtype != first.values:  # caches come from LeanLayer.new_cache
            raise ValueError(f"a cache of {caches[0][0].v.dtype} values passed to C layers built for {first.values}")
        for layer_caches in caches:
            for cache, n in zip(layer_caches, counts):
                cache.reserve(n)
        self.table = torch.tensor([[[c.k.data_ptr() for c in layer_caches], [c.v.data_ptr() for c in layer_caches],
                                    [c.k.stride(0) for c in layer_caches], [c.length for c in layer_caches],
                                    self.counts] for layer_caches in caches], dtype=torch.int64)
        self.longest = max(c.length + n for c, n in zip(caches[0], counts))
        self.x_mid, self.gate_up = torch.empty(N, h, dtype=dtype), torch.empty(N, 2 * layer.inter, dtype=dtype)
        self.act = torch.empty(N, layer.inter, dtype=dtype) if first.plan.act else None
        self.work = torch.empty(N * (2 * h + first.width + 2 * layer.heads * layer.head_dim), dtype=dtype)
        self.scratch = torch.empty((N + 15) // 16 * 16 * first.in_max, dtype=torch.bfloat16)
        self._step = self.table.stride(0) * self.table.element_size()

    def table_of(self, i: int) -> int:
        """The address of layer i's part of the table."""
        return self.table.data_ptr() + i * self._step

    def done(self) -> None:
        """Advance every cache past the rows it took."""
        for layer_caches in self.caches:
            for cache, n in zip(layer_caches, self.counts):
                cache.length += n


class FusedLayer:
    """:meth:`LeanLayer.rows` for chains (no mask) of one layer, by layer.c."""

    def __init__(self, lib: ctypes.CDLL, layer: "LeanLayer", plan: _Layer):
        self.lib, self.layer, self.plan = lib, layer, plan
        self.values = layer.value_dtype  # the dtype of the values its plan's kernels read and write
        self.ref = ctypes.byref(plan)
        self.in_max = max(layer.qkv.tiles.in_features, layer.o.tiles.in_features, layer.down.tiles.in_features)
        self.width = (layer.heads + 2 * layer.kv_heads) * layer.head_dim

    def rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: Sequence["LayerCache"],
             counts: Sequence[int]) -> torch.Tensor:
        """As :meth:`LeanLayer.rows` without ``visible``: x [N, h] float32, ``counts[b]`` rows for cache b."""
        x = x.contiguous()
        step = Pass(self, x.shape[0], x.dtype, [caches], counts)
        out = self.run(step, 0, x, cos.contiguous(), sin.contiguous())
        step.done()
        return out

    def run(self, step: Pass, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """This layer as layer ``i`` of ``step`` (x, cos and sin contiguous); its caches advance at ``step.done``."""
        N = x.shape[0]
        out = torch.empty_like(x)
        if self.plan.act:  # the activation in C too: one call
            status = self.lib.specplug_layer(self.ref, N, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), step.rows,
                                             step.table_of(i), step.longest, step.x_mid.data_ptr(),
                                             step.gate_up.data_ptr(), step.act.data_ptr(), out.data_ptr(),
                                             step.work.data_ptr(), step.scratch.data_ptr())
            if status:
                raise RuntimeError(f"fused layer failed (attention kernel status {status})")
            return out
        status = self.lib.specplug_layer_first(self.ref, N, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), step.rows,
                                               step.table_of(i), step.longest, step.x_mid.data_ptr(),
                                               step.gate_up.data_ptr(), step.work.data_ptr(), step.scratch.data_ptr())
        if status:
            raise RuntimeError(f"fused layer failed (attention kernel status {status})")
        act = self.layer.activated(step.gate_up).contiguous()  # the torch form's
        self.lib.specplug_layer_last(self.ref, N, step.x_mid.data_ptr(), act.data_ptr(), out.data_ptr(),
                                     step.work.data_ptr(), step.scratch.data_ptr())
        return out


def stack(layers: Sequence["LeanLayer"]) -> list[FusedLayer] | None:
    """Every layer's C form, where each has one and all share a shape (one :class:`Pass` serves them), else None."""
    fused = [layer.fused for layer in layers]
    if not fused or any(f is None for f in fused):
        return None
    shapes = {(f.plan.h, f.plan.heads, f.plan.kv_heads, f.plan.d, f.plan.inter, f.in_max, bool(f.plan.act),
               f.values) for f in fused}
    return fused if len(shapes) == 1 else None


def plan_or_reason(layer: "LeanLayer") -> tuple[_Layer | None, str]:
    """The C description of a layer, or why it cannot run in C."""
    lib, reason = load()
    if reason:
        return None, reason
    if layer.q_norm is not None:
        return None, "per-head q/k norms (Qwen3) run in torch's form"
    if layer.kernel is None:
        return None, "attention runs in torch's form"
    if layer.norm_in.kernel is None or layer.norm_post.kernel is None:
        return None, "RMSNorm runs in torch's form"
    w = layer.layer.input_layernorm.weight
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return None, f"rows of {w.dtype} on {w.device.type}: the C layer takes float32 rows on the CPU"
    products = {}
    for name in ("qkv", "o", "gate_up", "down"):
        found = _product(getattr(layer, name))
        if isinstance(found, str):
            return None, f"{name}: {found}"
        products[name] = found
    norm_in, norm_post = layer.norm_in.kernel, layer.norm_post.kernel
    act = 0 if layer.act_kernel is None else _address(layer.act_kernel.fn)
    values = layer.value_dtype  # the caches this layer makes: the kernels that read and write their values
    return _Layer(norm_in.size, layer.heads, layer.kv_heads, layer.head_dim, layer.inter, float(layer.scaling),
                  float(norm_in.eps), float(norm_post.eps), norm_in.weight.data_ptr(), norm_post.weight.data_ptr(),
                  _address(norm_in.fn), _address(layer.kernel.append_fns[values]),
                  _address(layer.kernel.attend_fns[values]), act, **products), ""


def choose(layer: "LeanLayer") -> FusedLayer | None:
    """The C form of this layer's step rows, or None for torch's: decided once per layer shape and machine (the
    probe's bit-equality check on every layer), and listed by :func:`specplug.machine.machine_choices`."""
    products = layer.products()
    kinds = "/".join(sorted({type(p.tiles).__name__ for p in products}))
    # the rows' and the cached values' dtypes too: a refusal for bf16 rows must not keep float32 rows of the
    # same shapes off the C path (a choice is kept per key for the process)
    rows = layer.layer.input_layernorm.weight.dtype
    key = (f"{layer.norm_in.shape[0]}x{layer.heads}x{layer.kv_heads}x{layer.head_dim}x{layer.inter} "
           f"{kinds or 'torch products'} {rows} rows, {layer.value_dtype} values")
    pinned = machine.overrides().get(CHOICE)
    plan, reason = plan_or_reason(layer)
    if plan is None:
        if pinned == FUSED:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={FUSED} is pinned, but {reason}")
        machine.record(CHOICE, key, TORCH, reason, "default")
        return None
    fused = FusedLayer(load()[0], layer, plan)
    x, cos, sin, caches = _probe_inputs(layer)
    got, want = _run(fused.rows, x, cos, sin, caches), _run(layer.rows_by_torch, x, cos, sin, caches)
    if not all(torch.equal(a, b) for a, b in zip(got, want)):
        if pinned == FUSED:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={FUSED} is pinned, but the C layer's rows differ "
                             "from torch's form on this machine")
        machine.record(CHOICE, key, TORCH, "the C layer's rows differ from torch's form on a probe", "probe")
        return None
    forms = {FUSED: lambda: _run(fused.rows, x, cos, sin, caches),
             TORCH: lambda: _run(layer.rows_by_torch, x, cos, sin, caches)}
    nbytes = sum(p.nbytes() for p in products)
    return fused if machine.faster(CHOICE, key, forms, FUSED, nbytes) == FUSED else None


def _probe_inputs(layer: "LeanLayer", cached: int = 40):
    """Seeded rows for the probe: len(PROBE_COUNTS) caches of ``cached`` random entries each, and their new rows."""
    g = torch.Generator().manual_seed(0)
    h, d, N = layer.norm_in.shape[0], layer.head_dim, sum(PROBE_COUNTS)
    caches = []
    for _ in PROBE_COUNTS:
        cache = layer.new_cache()
        cache.reserve(cached)
        cache.k[:, :cached] = torch.randn(cache.k.shape[0], cached, d, generator=g)
        cache.v[:, :cached] = torch.randn(cache.v.shape[0], cached, d, generator=g)
        cache.length = cached
        caches.append(cache)
    angles = torch.rand(N, d // 2, generator=g) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    return torch.randn(N, h, generator=g), cos, sin, caches


def _run(rows, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list["LayerCache"]) -> list[torch.Tensor]:
    """One form's output and the entries it appended (each cache cut back after)."""
    lengths = [c.length for c in caches]
    with torch.inference_mode():
        out = rows(x, cos, sin, caches, list(PROBE_COUNTS))
    appended = [t[:, n:c.length].clone() for c, n in zip(caches, lengths) for t in (c.k, c.v)]
    for cache, n in zip(caches, lengths):
        cache.crop(n)
    return [out, *appended]
