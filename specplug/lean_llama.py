"""A lean single-sequence forward for Llama-family models (drafters and targets), on HF's own weights.

Why: a drafter runs one token per call, and for a 1-layer model HF's per-call machinery (mask building,
cache objects, output dataclasses, hooks) costs several times the arithmetic (measured: 1.4 ms per call for
the zoo draft, of which 0.3 ms is matmuls). This path does the same arithmetic with a dozen tensor ops per
layer and a preallocated KV cache whose rollback is a length reset.

For a drafter it never touches exactness: whatever logits it produces, the drafter samples its token from the
q it reports, and the verifier corrects for q. For a target it is the forward that defines p, for target-only
and speculative decoding alike (HF's forward of a 6-layer target spends a fifth of a step outside arithmetic).
Either way :func:`lean_or_reason` refuses the fast path unless it reproduces HF's logits on a probe, so the
model users loaded is the model that runs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
import transformers.activations

from . import (activation_kernel, attention_kernel, bf16_products, few_rows, fused_layers, int8_products, machine,
               norm_kernel, row_products)
from .int8_products import Int8Product

# Architectures that differ from Llama only in what LeanLayer handles (q/k/v biases, per-head q/k norms) or what
# lean_or_reason refuses (a sliding window a sequence can outgrow); each is still checked against HF's logits.
FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Rotary variants whose cos/sin depend only on the position (a "dynamic" one rescales with sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
# Up to this many new positions (a step, a verify pass of k + 1) attention runs one query at a time;
# longer runs (prefills) through torch's fused attention.
SMALL_ATTENTION = 16
VALUES = "value_cache"  # the machine choice naming the dtype cached values are kept in (LeanLayer.value_dtype)
_UNDECIDED = object()  # a layer's C form before its first run (LeanLayer.fused)


class RopeTable:
    """cos and signed sin per position, computed once by the HF rotary module itself and grown by doubling.

    ``signed_sin`` is sin with its first half negated: HF rotates x·cos + cat(−x₂, x₁)·sin, which equals
    x·cos + roll(x)·signed_sin bit for bit (a sign moves from one factor to the other) in one op instead of
    four (8 → 5 µs a layer and step)."""

    def __init__(self, rotary: torch.nn.Module, device, dtype):
        self.rotary, self.device, self.dtype = rotary, device, dtype
        self.cos = self.signed_sin = torch.empty(0, device=device, dtype=dtype)

    def get(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) of positions start..start + n - 1."""
        if start + n > self.cos.shape[0]:
            size = max(64, 2 * (start + n))
            pos = torch.arange(size, device=self.device)[None]
            probe = torch.empty(0, device=self.device, dtype=self.dtype)
            with torch.inference_mode():
                cos, sin = self.rotary(probe, pos)
            half = sin.shape[-1] // 2
            self.cos, self.signed_sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return self.cos[start:start + n], self.signed_sin[start:start + n]

    def rows(self, starts: Sequence[int], counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) of positions starts[r]..starts[r] + counts[r] - 1 for each row r, rows in order."""
        self.get(max(s + n for s, n in zip(starts, counts)) - 1, 1)
        at = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)]).to(self.cos.device)
        return self.cos[at], self.signed_sin[at]


class LayerCache:
    """Keys and values of one layer, [kv_heads, capacity, head_dim]; ``length`` entries are valid. Values may be
    kept in another dtype than keys (``value_dtype``, see :attr:`LeanLayer.value_dtype`)."""

    def __init__(self, kv_heads: int, head_dim: int, device, dtype, capacity: int = 256,
                 value_dtype: torch.dtype | None = None):
        self.k = torch.empty(kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.empty(kv_heads, capacity, head_dim, device=device, dtype=value_dtype or dtype)
        self.length = 0

    def reserve(self, n: int) -> None:
        """Room for ``n`` more entries (grown by doubling: appends stay amortised O(1))."""
        end = self.length + n
        if end > self.k.shape[1]:
            grow = max(end, 2 * self.k.shape[1]) - self.k.shape[1]
            self.k = torch.cat([self.k, self.k.new_empty(self.k.shape[0], grow, self.k.shape[2])], dim=1)
            self.v = torch.cat([self.v, self.v.new_empty(self.v.shape[0], grow, self.v.shape[2])], dim=1)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[1]
        self.reserve(k.shape[1])
        self.k[:, self.length:end] = k
        self.v[:, self.length:end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep(self, start: int, indices: torch.Tensor) -> None:
        """Move entries ``indices`` (absolute, ascending, >= start) to start, start + 1, ...; drop the rest."""
        end = start + indices.numel()
        with torch.inference_mode():  # a cache grown inside inference mode holds inference tensors
            self.k[:, start:end] = self.k.index_select(1, indices)  # index_select copies: overlaps are safe
            self.v[:, start:end] = self.v.index_select(1, indices)
        self.length = end


class Norm:
    """HF's LlamaRMSNorm (normalise in float32, cast back, scale), in one call where x is float32: the norm
    kernel's where the machine chose it (:mod:`specplug.norm_kernel`), else torch's fused op."""

    __slots__ = ("weight", "shape", "eps", "kernel")

    def __init__(self, norm: torch.nn.Module):
        self.weight, self.shape = norm.weight, tuple(norm.weight.shape)
        self.eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
        self.kernel = norm_kernel.choose(norm.weight, self.eps)  # the weight's dtype is the rows' (new_cache)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if self.kernel is not None:
                return self.kernel(x)
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)


# modules whose forward is F.silu: called as the function, a step saves ~0.13 ms of module dispatch (6 calls)
_SILU_MODULES = tuple(c for c in (torch.nn.SiLU, getattr(transformers.activations, "SiLUActivation", None)) if c)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding, x·cos + rotate_half(x)·sin, with sin signed as :class:`RopeTable` keeps it."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _fuse(first: torch.nn.Linear, *rest: torch.nn.Linear, share: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input, so a step makes one product.

    With ``share``, the modules' weights become views into it: nothing is duplicated, and HF's own forward
    still works (without it the result is a temporary, e.g. to quantize)."""
    layers = (first, *rest)
    weight = torch.cat([m.weight.detach() for m in layers])
    bias = None if first.bias is None else torch.cat([m.bias.detach() for m in layers])
    if not share:
        return weight, bias
    at = 0
    for m in layers:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[at:at + n], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[at:at + n], requires_grad=False)
        at += n
    return weight, bias


COPY = "column-major copy"


class Product:
    """One linear map of a lean forward: ``x @ weight.T + bias`` through :func:`few_rows.linear`, or, where a
    one-row copy is kept, one-row inputs through a column-major copy of the weight.

    Why the copy: for a drafter's small float32 matrices a one-row product through a column-major weight can
    take a fraction of the time of few_rows' two-row padding; products over several rows (batched drafting)
    stay row-major. Whether it does is timed per shape on the machine at hand (:func:`specplug.machine.faster`,
    choice ``one_row_copies``): ``one_row_copy=True`` keeps a copy only where it is the faster form. A
    drafter's arithmetic never touches exactness (the verifier uses the q it reports), so the two forms need
    not round alike.

    ``int8`` (drafters only): the product keeps an int8 copy of the weight (see :mod:`specplug.int8_products`) and
    ``weight`` is None; where int8 products of many rows are the slower form on this machine
    (:func:`specplug.int8_products.rows_through_int8`), also a ``wide`` one (bf16 where native) that takes products
    of more rows than ``int8_rows``. A bf16 CPU weight may instead be multiplied by the bf16 kernel
    (:mod:`specplug.bf16_products`, AMX or AVX-512: every row count one product, each row its one-row product) or
    keep a oneDNN-packed copy (:func:`few_rows.packed_copy`: the same bits as unpacked, faster); a float32 CPU
    weight without a one-row copy, through the rows kernel (:mod:`specplug.row_products`, the same property)."""

    __slots__ = ("weight", "bias", "one_row", "int8", "packed", "tiles", "wide", "int8_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, one_row_copy: bool = False,
                 int8: bool = False):
        self.int8 = Int8Product(weight, bias) if int8 else None
        self.wide, self.int8_rows = _wide_form(self.int8, weight, bias) if int8 else (None, None)
        self.weight, self.bias = (None, None) if int8 else (weight, bias)
        self.one_row = _one_row_copy(weight, bias) if one_row_copy and not int8 else None
        self.packed = None if int8 else few_rows.packed_copy(weight, bias)
        if int8:
            self.tiles = None
        elif weight.dtype == torch.bfloat16:
            self.tiles = bf16_products.choose(weight, bias, self.packed)
        else:  # a drafter's one-row copy is its fast form; a target's products must keep one order at any row count
            self.tiles = None if one_row_copy or weight.dtype != torch.float32 else row_products.choose(weight, bias)
        if self.tiles is not None:
            self.packed = None  # every row count runs on the tiles

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            if self.wide is not None and x.numel() > self.int8_rows * x.shape[-1]:
                return self.wide(x)
            return self.int8(x)
        if self.tiles is not None:
            y = self.tiles(x)
            return y if x.dtype == y.dtype else y.to(x.dtype)
        if self.one_row is not None and x.shape[0] == 1:
            return F.linear(x, self.one_row, self.bias)
        return few_rows.linear(x, self.weight, self.bias, self.packed)

    @property
    def rounds_to_bf16(self) -> bool:
        """Whether every output is a bf16 value (a bf16 weight's product, on any of its forms, rounds its sums to
        bf16 before handing them back in the input's dtype)."""
        return self.int8 is None and self.weight is not None and self.weight.dtype == torch.bfloat16

    def nbytes(self) -> int:
        """Bytes of the one-row, int8 or packed copy (the weight itself belongs to the model)."""
        if self.int8 is not None:
            return self.int8.nbytes() + (0 if self.wide is None else self.wide.nbytes()
                                         + self.wide.weight.numel() * self.wide.weight.element_size())
        copies = [t for t in (self.one_row, self.packed) if t is not None]
        tiles = 0 if self.tiles is None else self.tiles.nbytes()
        return sum(t.numel() * t.element_size() for t in copies) + tiles


def _wide_form(narrow: Int8Product, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Product | None, int | None]:
    """An int8 product's form for many rows and the rows up to which the int8 copy runs (None, None: int8 at
    every row count). The wide copy and the probe's rows are made only where the choice needs them."""
    dtype = int8_products.wide_dtype(weight.device)
    wide_bias = None if bias is None else bias.detach().to(dtype)
    wide = functools.cache(lambda: Product(weight.detach().to(dtype), wide_bias))
    probe = functools.cache(lambda: torch.randn(max(int8_products.PROBED_ROWS), weight.shape[1],
                                                generator=torch.Generator().manual_seed(0)).to(weight.device, dtype))
    key = f"{str(dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]} {weight.device}"
    nbytes = weight.numel() * 4  # the float32 weight the drafter would otherwise read
    upto = int8_products.rows_through_int8(key, nbytes, lambda n: narrow(probe()[:n]),
                                           lambda n: wide()(probe()[:n]))
    return (None, None) if upto is None else (wide(), upto)


def _one_row_copy(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A column-major copy of ``weight`` where one-row products through it are the faster form here, else None."""
    copy = weight.t().contiguous().t()
    x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    forms = {COPY: lambda: F.linear(x, copy, bias), "few_rows": lambda: few_rows.linear(x, weight, bias)}
    key = f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')} {weight.device}"
    chosen = machine.faster("one_row_copies", key, forms, COPY, weight.numel() * weight.element_size())
    return copy if chosen == COPY else None


class LeanLayer:
    """An HF decoder layer of the Llama family (:data:`FAMILY`) run for one sequence: q/k/v (with their biases,
    Qwen2) and gate/up each as one product, q and k normed per head where the layer does so (Qwen3).

    ``one_row_copies`` (drafters, CPU float32) and ``int8`` (drafters: int8 copies of the products, the
    layer's own linear weights left untouched and unused): see :class:`Product`."""

    def __init__(self, layer: torch.nn.Module, one_row_copies: bool = False, int8: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        # Qwen3: an RMSNorm over each head's q and k before rotary (None elsewhere)
        self.q_norm, self.k_norm = (Norm(attn.q_norm), Norm(attn.k_norm)) if hasattr(attn, "q_norm") else (None, None)
        self.layer, self.head_dim, self.scaling = layer, attn.head_dim, attn.scaling
        self.heads = attn.q_proj.weight.shape[0] // attn.head_dim
        self.kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
        self.inter = mlp.gate_proj.weight.shape[0]
        copy = one_row_copies and attn.q_proj.weight.dtype == torch.float32
        share = not int8  # int8 products quantize a temporary fused weight
        self.qkv = Product(*_fuse(attn.q_proj, attn.k_proj, attn.v_proj, share=share), one_row_copy=copy, int8=int8)
        self.gate_up = Product(*_fuse(mlp.gate_proj, mlp.up_proj, share=share), one_row_copy=copy, int8=int8)
        # the modules' own weights, called directly: the same arithmetic as their (few_rows) forward
        self.o = Product(attn.o_proj.weight, attn.o_proj.bias, one_row_copy=copy, int8=int8)
        self.down = Product(mlp.down_proj.weight, mlp.down_proj.bias, one_row_copy=copy, int8=int8)
        self.act = F.silu if type(mlp.act_fn) in _SILU_MODULES else mlp.act_fn
        self.norm_in, self.norm_post = Norm(layer.input_layernorm), Norm(layer.post_attention_layernorm)
        w = layer.input_layernorm.weight  # the caches' dtype (see new_cache)
        # silu(gate) · up in C where the machine chose it: then on every path of this layer, as for attention
        self.act_kernel = (activation_kernel.choose(self.inter, w.dtype, w.device) if self.act is F.silu
                           else None)
        # one form for every path of this layer (steps, verify passes, rows, tree nodes): they must round alike
        self.kernel = attention_kernel.choose(self.heads, self.kv_heads, self.head_dim, w.dtype, w.device,
                                              self._attend_by_torch)
        self._fused = _UNDECIDED  # decided at the first run (see fused): the products may still be replaced
        self._values: tuple[Product | None, torch.dtype] = (None, w.dtype)  # (for which qkv, value_dtype)

    @property
    def fused(self) -> "fused_layers.FusedLayer | None":
        """This layer's chain rows in C (:mod:`specplug.fused_layers`: the same bits as :meth:`rows_by_torch`),
        or None where torch's form runs."""
        if self._fused is _UNDECIDED:
            self._fused = fused_layers.choose(self)
        return self._fused

    def products(self) -> tuple[Product, ...]:
        return self.qkv, self.gate_up, self.o, self.down

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype this layer's caches keep values in: bf16 where the attention kernel reads them and the value
        projection already rounds to bf16 (the same values in half the bytes, and a many-row step's attention
        waits on reading them); else the activations' dtype. Keys stay as computed: rotary leaves them float32.
        Listed by :func:`specplug.machine.machine_choices` (``value_cache``); ``SPECPLUG_CHOICES=value_cache=float32``
        keeps float32 values."""
        if self._values[0] is not self.qkv:  # decided again where the products were replaced (to_int8)
            self._values = (self.qkv, self._decide_values())
        return self._values[1]

    def _decide_values(self) -> torch.dtype:
        w = self.layer.input_layernorm.weight  # the activations' dtype (the norms'), which bf16 weights do not share
        if self.kernel is None or w.dtype != torch.float32:
            return w.dtype
        key, pinned = f"{self.kv_heads}x{self.head_dim} {w.device.type}", machine.overrides().get(VALUES)
        if pinned not in (None, "float32", "bf16"):
            raise ValueError(f"{machine.OVERRIDE_ENV}: {VALUES}={pinned} is not a form (float32 or bf16)")
        if not self.qkv.rounds_to_bf16:
            if pinned == "bf16":
                raise ValueError(f"{machine.OVERRIDE_ENV}: {VALUES}=bf16 is pinned, but the value projection's "
                                 "outputs are not bf16 values (bf16 values would change the model's arithmetic)")
            return w.dtype
        if pinned == "float32":
            machine.record(VALUES, key, "float32", machine.OVERRIDE_ENV, "override")
            return w.dtype
        machine.record(VALUES, key, "bf16", "the value projection rounds to bf16: the same values in half the bytes",
                       "default")
        return torch.bfloat16

    def new_cache(self) -> LayerCache:
        w = self.layer.input_layernorm.weight
        return LayerCache(self.kv_heads, self.head_dim, w.device, w.dtype, value_dtype=self.value_dtype)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q, k and v of rows x [N, h]: each [N, heads, head_dim] (rotary on q and k at once)."""
        H, G = self.heads, self.kv_heads
        qkv = self.qkv(self.norm_in(x)).view(x.shape[0], H + 2 * G, -1)
        qk = qkv[:, : H + G]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        qk = _rotate(qk, cos[:, None], sin[:, None])
        return qk[:, :H], qk[:, H:], qkv[:, H + G:]

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection and residual, then the MLP block: attended [N, heads·head_dim] -> [N, h]."""
        x = x + self.o(attended)
        return x + self.down(self.activated(self.gate_up(self.norm_post(x))))

    def activated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's activation of gate_up rows [N, 2·inter]: act(gate) · up [N, inter], by this layer's form."""
        if self.act_kernel is not None:
            return self.act_kernel(gate_up)
        gate, up = gate_up.split(self.inter, -1)
        return self.act(gate) * up

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                 keep: int = 0, visible: Visibility | torch.Tensor | None = None) -> torch.Tensor:
        """x [T, h]: T new positions after ``cache.length`` cached ones; cos/sin [T, head_dim] of their positions
        (sin signed as :class:`RopeTable` keeps it).
        Returns the outputs [T, h], or only the last ``keep`` rows' (0: all).

        Why ``keep``: every row's keys and values go into the cache, but a row's attention and MLP only feed
        its own output; a last layer whose caller reads one row (a drafter catching up on accepted tokens, a
        prefill) skips them for the others.

        ``visible`` (with ``keep=0``): a [T, cache.length + T] bool mask or its :class:`Visibility` (planned once
        for all layers): query i attends over exactly the keys its row marks, in cache order, instead of the
        causal prefix (a tree: the prefix and the node's ancestors)."""
        T, start = x.shape[0], cache.length
        if visible is None and T <= SMALL_ATTENTION and self.fused is not None:
            # a short chain as one row of the rows form: the same bits (no row's output depends on another's)
            out = self.fused.rows(x, cos, sin, [cache], [T])
            return out[-keep:] if 0 < keep < T else out
        q, k, v = self._qkv(x, cos, sin)
        keys, values = cache.append(k.transpose(0, 1), v.transpose(0, 1))
        if visible is not None:
            plan = visible if isinstance(visible, Visibility) else Visibility.of(visible.bool())
            return self._finish(x, self._attend_visible(q * self.scaling, keys, values, plan).reshape(T, -1))
        if 0 < keep < T:
            x, q, start, T = x[-keep:], q[-keep:], start + T - keep, keep
        if T <= SMALL_ATTENTION:
            # Query i makes the very call a one-token step at start + i makes, on the same keys, so a verified
            # position's logits are bit-identical to target-only decoding's wherever the products are
            # row-invariant (see few_rows). One call for all T queries would sum in another order, and with
            # bf16 products such last-bit differences grow until a greedy near-tie flips.
            out = self._attend_spans(q * self.scaling, [(cache.k, cache.v, start, T)])
        else:
            out = self._attend_prefill(q, keys, values, start)
        return self._finish(x, out.reshape(T, -1))

    def _attend_prefill(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """Many queries q [T, heads, d] at positions start.. over keys/values [kv_heads, start + T, d], causally,
        in one fused call. Batched (4-D) inputs reach torch's flash kernel on the CPU, where 3-D ones fall back to
        masked matrix products at about twice the time; from an empty cache no mask is needed at all."""
        T, values = q.shape[0], values.to(q.dtype)  # bf16 values widen exactly
        mask = None if start == 0 else (torch.arange(keys.shape[1], device=q.device)[None]
                                        <= torch.arange(start, start + T, device=q.device)[:, None])
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                             is_causal=mask is None, scale=self.scaling,
                                             enable_gqa=self.heads != self.kv_heads)
        return out[0].transpose(0, 1)

    def _attend_spans(self, q: torch.Tensor, spans: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> torch.Tensor:
        """Scaled queries q [N, heads, d] (scaled once for all rows, not each query's scores) attend one by one:
        ``spans`` (keys, values, first, count) are runs of ``count`` consecutive queries over one cache's
        keys/values [kv_heads, capacity, d], the i-th seeing its first ``first + i + 1`` entries -> [N, heads, d]."""
        if self.kernel is not None:
            return self.kernel(q, spans)
        out, at = [], 0
        for keys, values, first, count in spans:
            out += [self._attend_by_torch(q[at + i], keys[:, :first + i + 1], values[:, :first + i + 1])
                    for i in range(count)]
            at += count
        return torch.stack(out)

    def _attend_visible(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        visible: "Visibility", fused: bool = True) -> torch.Tensor:
        """Scaled queries q [T, heads, d] over the cache's keys/values [kv_heads, L, d], query i over the keys
        ``visible`` marks for it -> [T, heads, d]. A few queries (or any number with ``fused=False``: a target's
        tree, whose path must score as its chain would) each make the one-token step's call on a view of the
        cache: its visible entries after the leading visible run are written, in order, just after that run,
        so the view holds what a chain holding the node's path would (the overwritten entries are put back
        afterwards). More queries run through torch's fused attention, masked (4-D, as in a prefill)."""
        if fused and q.shape[0] > SMALL_ATTENTION:
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values.to(q.dtype)[None],
                                                  attn_mask=visible.mask, scale=1.0,
                                                  enable_gqa=self.heads != self.kv_heads)[0].transpose(0, 1)
        lo = min(visible.runs, default=keys.shape[1])
        saved_k, saved_v = keys[:, lo:].clone(), values[:, lo:].clone()
        out = []
        for i, (run, rest) in enumerate(zip(visible.runs, visible.rest)):
            end = run + rest.numel()
            if rest.numel():
                keys[:, run:end] = saved_k.index_select(1, rest - lo)
                values[:, run:end] = saved_v.index_select(1, rest - lo)
            out.append(self._attend_one(q[i], keys[:, :end], values[:, :end]))
            if rest.numel():  # put back what the next query may see in its leading run
                keys[:, run:end], values[:, run:end] = saved_k[:, run - lo:end - lo], saved_v[:, run - lo:end - lo]
        return torch.stack(out)

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of one scaled query q [heads, d] over keys/values [kv_heads, L, d] (views of a cache's first
        L entries) -> [heads, d], by this layer's form."""
        if self.kernel is not None:
            return self.kernel(q[None], [(keys, values, keys.shape[1] - 1, 1)])[0]
        return self._attend_by_torch(q, keys, values)

    def _attend_by_torch(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """torch's form of :meth:`_attend_one`: two small products and a softmax, about half the time of torch's
        fused attention on one query (CPU)."""
        values = values.to(keys.dtype)  # bf16 values widen exactly
        grouped = q.reshape(self.kv_heads, -1, q.shape[-1])  # the heads that share a kv head, as HF pairs them
        scores = torch.bmm(grouped, keys.transpose(1, 2))
        if scores.dtype == torch.float32:
            weights = torch.softmax(scores, -1)
        else:  # HF's eager attention: softmax in float32
            weights = torch.softmax(scores, -1, dtype=torch.float32).to(values.dtype)
        return torch.bmm(weights, values).reshape(q.shape)

    def rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[LayerCache],
             counts: list[int], visible: Sequence[Visibility | None] | None = None) -> torch.Tensor:
        """A few new positions in each of B sequences: x [N, h] holds ``counts[b]`` rows for sequence b in
        order, cos/sin [N, head_dim] their positions (sin signed, see :class:`RopeTable`), one cache per sequence.
        ``visible[b]`` (None: causal): row b's [counts[b], length after] mask, as in ``__call__``.

        The products run once for all N rows (the weights are read once); attention runs per query over its
        own sequence's cache, as a one-token step would (see ``__call__``). Chains run in C where the machine
        chose it (:attr:`fused`), trees in torch's form: the same bits either way."""
        if (visible is None or all(v is None for v in visible)) and self.fused is not None:
            return self.fused.rows(x, cos, sin, caches, counts)
        return self.rows_by_torch(x, cos, sin, caches, counts, visible)

    def rows_by_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[LayerCache],
                      counts: list[int], visible: Sequence[Visibility | None] | None = None) -> torch.Tensor:
        """:meth:`rows` in torch's form (with the products', norms' and attention's kernels)."""
        q, k, v = self._qkv(x, cos, sin)
        return self._finish(x, self._attend_rows(q, k, v, caches, counts, visible).reshape(x.shape[0], -1))

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[LayerCache],
                     counts: list[int], visible: Sequence[Visibility | None] | None = None) -> torch.Tensor:
        """Append ``counts[b]`` new keys and values k, v [N, kv_heads, d] to cache b, in order, and attend the
        queries q [N, heads, d] (unscaled) as :meth:`rows` does -> [N, heads, d]."""
        q = q * self.scaling  # once for all rows: an elementwise product rounds alike row by row or all at once
        if self.kernel is not None and visible is None:  # chains only: every row's new entries in one call
            for cache, n in zip(caches, counts):
                cache.reserve(n)
            self.kernel.append(k, v, caches, counts)
            spans = []
            for cache, n in zip(caches, counts):
                spans.append((cache.k, cache.v, cache.length, n))
                cache.length += n
            return self._attend_spans(q, spans)
        chains, trees, at = [], [], 0
        for b, (cache, n) in enumerate(zip(caches, counts)):
            start = cache.length
            keys, values = cache.append(k[at:at + n].transpose(0, 1), v[at:at + n].transpose(0, 1))
            mask = None if visible is None else visible[b]
            if mask is None:
                chains.append((at, (cache.k, cache.v, start, n)))
            else:
                trees.append((at, n, keys, values, mask))
            at += n
        if not trees:
            return self._attend_spans(q, [span for _, span in chains])
        out = torch.empty_like(q)  # the chains' queries in one call; each tree node over its own path
        if chains:
            picked = torch.cat([torch.arange(a, a + span[3], device=q.device) for a, span in chains])
            out[picked] = self._attend_spans(q[picked], [span for _, span in chains])
        for a, n, keys, values, mask in trees:
            out[a:a + n] = self._attend_visible(q[a:a + n], keys, values, mask, fused=False)
        return out


class LeanCache:
    """A whole model's cache: one :class:`LayerCache` per layer. ``crop`` is the rollback."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)

    def keep_entries(self, start: int, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep entries ``start..`` only at the absolute ``indices`` (ascending, each >= start), moved to
        start, start + 1, ...: the K/V compaction of a tree's accepted path. The length becomes start + len(indices)."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.layers[0].k.device).reshape(-1)
        if idx.numel() and (int(idx[0]) < start or bool((idx[1:] <= idx[:-1]).any()) or int(idx[-1]) >= self.length):
            raise ValueError(f"keep_entries({start}, {idx.tolist()}): indices must ascend within {start}..{self.length - 1}")
        for layer in self.layers:
            layer.keep(start, idx)

    def get_seq_length(self) -> int:  # HF's cache API, for code that checks either kind
        return self.length


class LeanLlama:
    """The forward of an HF causal LM of the Llama family (:data:`FAMILY`) for one sequence, sharing its
    weights (only a drafter's one-row copies, ``one_row_copies=True``, add memory: see :class:`Product`)."""

    def __init__(self, model: torch.nn.Module, one_row_copies: bool = False):
        self.model, self.one_row_copies = model, one_row_copies
        param = model.get_input_embeddings().weight  # the activations' dtype, whatever the linear weights keep
        self.device, self.dtype = param.device, param.dtype
        self.embedding = param
        self.rope = RopeTable(model.model.rotary_emb, self.device, self.dtype)
        self.layers = [LeanLayer(layer, one_row_copies) for layer in model.model.layers]
        self.norm = Norm(model.model.norm)
        head = model.get_output_embeddings()
        self.set_head(head.weight, head.bias)

    def set_head(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Replace the LM head's product, e.g. by a drafter's rows for a subset of the vocabulary."""
        self.head = Product(weight, bias, one_row_copy=self.one_row_copies and weight.dtype == torch.float32)

    def to_int8(self, head: bool = True) -> None:
        """Multiply by int8 copies of every product, the head's too unless ``head=False`` (drafters only: see
        :mod:`specplug.int8_products`). Called after the probe that checked this path against HF's forward."""
        for layer in self.layers:
            for name in ("qkv", "gate_up", "o", "down"):
                product = getattr(layer, name)
                setattr(layer, name, Product(product.weight, product.bias, int8=True))
            layer._fused = _UNDECIDED
        if head:
            self.head = Product(self.head.weight, self.head.bias, int8=True)

    def extra_bytes(self) -> int:
        """Memory beyond the model's own parameters: the one-row or int8 copies, and a replaced head's rows."""
        products = [p for layer in self.layers for p in layer.products()] + [self.head]
        own = self.model.get_output_embeddings().weight
        weight = self.head.weight
        head = 0 if weight is None or weight is own else weight.numel() * weight.element_size()
        return sum(p.nbytes() for p in products) + head

    def new_cache(self) -> LeanCache:
        return LeanCache([layer.new_cache() for layer in self.layers])

    def forward(self, cache: LeanCache, tokens: list[int] | torch.Tensor, last_only: bool = True,
                head=None) -> torch.Tensor:
        """Logits of the last token [V] (or of all, [T, V]) after running ``tokens`` past the cached ones;
        ``head``: another product in place of the LM head (e.g. a drafter's rows for a subset)."""
        logits, _ = self.run(cache, tokens, keep=1 if last_only else 0, head=head)
        return logits[-1] if last_only else logits

    @torch.inference_mode()
    def run(self, cache: LeanCache, tokens: list[int] | torch.Tensor, keep: int = 0,
            hidden: tuple[int, ...] = (), head=None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [keep or T, V] of the last ``keep`` tokens (all when 0) and the hidden states [T, h] numbered
        as HF's ``hidden_states``: 0 is the embeddings, i the output of layer i, the last one final-normed."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        cos, sin = self.rope.get(cache.length, ids.shape[0])
        top = len(self.layers)
        # the last layer runs attention and MLP for the kept rows only, unless the final state is wanted
        last_keep = 0 if top in hidden else keep
        x, states = self._stack(ids, hidden, lambda i, layer, x: layer(
            x, cos, sin, cache.layers[i], keep=last_keep if i == top - 1 else 0))
        return (head or self.head)(x[-keep:] if keep else x), states

    @torch.inference_mode()
    def run_masked(self, cache: LeanCache, tokens: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor,
                   visible: torch.Tensor, hidden: tuple[int, ...] = (),
                   head=None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Append ``tokens`` [T] at rotary ``positions`` [T], query i attending over exactly the cache entries
        ``visible[i]`` marks (bool [T, cache.length + T]: the prefix and everything appended, earlier provisional
        tree nodes included). Returns logits [T, V] and hidden states as :meth:`run`.

        A few queries attend one by one over their gathered keys by the call a one-token step makes, so a tree's
        accepted path scores bit-identically to the chain wherever the products are row-invariant."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        mask = _checked_visible(visible, ids.shape[0], cache.length, self.device)
        cos, sin = self._rope_at(positions, ids.shape[0])
        x, states = self._stack(ids, hidden, lambda i, layer, x: layer(x, cos, sin, cache.layers[i], visible=mask))
        return (head or self.head)(x), states

    def _rope_at(self, positions: Sequence[int] | torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [n, head_dim] at arbitrary positions."""
        at = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        if at.numel() != n:
            raise ValueError(f"{at.numel()} positions for {n} tokens")
        self.rope.get(int(at.max()) if n else 0, 1)  # make sure the table reaches the furthest position
        return self.rope.cos[at], self.rope.signed_sin[at]

    def _stack(self, ids: torch.Tensor, hidden: tuple[int, ...], step) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Embed ``ids``, run ``step(i, layer, x)`` for every layer, final-norm; the states numbered as :meth:`run`."""
        states: dict[int, torch.Tensor] = {}
        top = len(self.layers)
        x = F.embedding(ids, self.embedding)
        for i, layer in enumerate(self.layers):
            if i in hidden:
                states[i] = x
            x = step(i, layer, x)
        x = self.norm(x)
        if top in hidden:
            states[top] = x
        return x, states

    def forward_rows(self, caches: list[LeanCache], tokens: Sequence[int | Sequence[int]], head=None) -> torch.Tensor:
        """A token (or a few: a list) after each of B sequences' cached ones, in one pass: logits [B, V] after
        each sequence's last token (``head`` as for :meth:`forward`)."""
        return self.run_rows(caches, tokens, last_only=True, head=head)[0]

    @torch.inference_mode()
    def run_rows(self, caches: list[LeanCache], tokens: Sequence[int | Sequence[int]], hidden: tuple[int, ...] = (),
                 last_only: bool = False, head=None, positions: Sequence[Sequence[int] | None] | None = None,
                 visible: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A few new tokens after each of B sequences' cached ones (ragged: each row its own count, positions
        and cache), in one pass whose products read the weights once.

        Returns logits [N, V] for all N new positions, row after row (``last_only``: [B, V], each row's last),
        and the hidden states [N, h] numbered as in :meth:`run`. Each query attends over its own row's cache
        only, by the very call a one-token step makes (see :meth:`LeanLayer.rows`).

        A tree row: ``positions[b]`` its tokens' rotary positions and ``visible[b]`` its mask, as for
        :meth:`run_masked`; None (or the argument absent) for a chain row: consecutive positions, causal."""
        per_row = [[int(t)] if isinstance(t, int) else [int(x) for x in t] for t in tokens]
        counts = [len(r) for r in per_row]
        ids = torch.as_tensor([t for r in per_row for t in r], dtype=torch.long, device=self.device)
        masks = None if visible is None else [
            None if m is None else _checked_visible(m, n, cache.length, self.device)
            for m, n, cache in zip(visible, counts, caches)]
        at = [list(range(cache.length, cache.length + n)) if positions is None or positions[b] is None
              else [int(p) for p in positions[b]] for b, (cache, n) in enumerate(zip(caches, counts))]
        cos, sin = self._rope_at([p for row in at for p in row], ids.shape[0])
        in_c = fused_layers.stack(self.layers) if masks is None else None
        if in_c is None:
            x, states = self._stack(ids, hidden, lambda i, layer, x: layer.rows(
                x, cos, sin, [cache.layers[i] for cache in caches], counts, masks))
        else:  # chains through every layer in C, one table and one set of buffers for the pass
            step = fused_layers.Pass(in_c[0], ids.shape[0], self.dtype,
                                     [[cache.layers[i] for cache in caches] for i in range(len(in_c))], counts)
            x, states = self._stack(ids, hidden, lambda i, layer, x: in_c[i].run(step, i, x, cos, sin))
            step.done()
        if last_only:
            x = x[torch.tensor(counts, device=self.device).cumsum(0) - 1]
        return (head or self.head)(x), states


@dataclass
class Visibility:
    """A masked run's attention mask, read once for every layer: ``mask`` [T, L] bool; for query i, ``runs[i]``
    its leading run of visible entries (0..runs[i] - 1) and ``rest[i]`` the indices of the visible entries after
    it, ascending."""

    mask: torch.Tensor
    runs: list[int]
    rest: list[torch.Tensor]

    @classmethod
    def of(cls, mask: torch.Tensor) -> "Visibility":
        rows = mask.cpu()
        hidden = ~rows
        # the first entry a query does not see (its row's length where it sees them all)
        runs = torch.where(hidden.any(1), hidden.int().argmax(1), rows.shape[1]).tolist()
        rest = [(rows[i, run:].nonzero().squeeze(-1) + run).to(mask.device) for i, run in enumerate(runs)]
        return cls(mask, runs, rest)


def _checked_visible(visible: torch.Tensor, n: int, cached: int, device) -> Visibility:
    """``visible`` planned (:class:`Visibility`) on ``device``, if it has the shape [n, cached + n] a masked run
    needs."""
    mask = torch.as_tensor(visible, device=device).bool()
    if mask.shape != (n, cached + n):
        raise ValueError(f"visible must be [T, cache length + T] = [{n}, {cached + n}], got {tuple(mask.shape)}")
    return Visibility.of(mask)


def lean_or_reason(model: torch.nn.Module, one_row_copies: bool = False) -> tuple[LeanLlama | None, str]:
    """A :class:`LeanLlama` for ``model`` if it is of the Llama family (:data:`FAMILY`) and the lean path
    reproduces its logits on a probe, else None and the reason."""
    name, config = type(model).__name__, model.config
    if name not in FAMILY:
        return None, f"lean path covers {', '.join(FAMILY)}, not {name}"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE_TYPES:
        return None, f"rope type {rope!r} depends on the sequence length"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return None, "pretraining_tp > 1"
    window = _sliding_window(model)
    if window is not None:
        return None, (f"{name} with sliding_window={window} below max_position_embeddings="
                      f"{getattr(config, 'max_position_embeddings', None)}: the lean path attends to every cached key")
    lean = LeanLlama(model, one_row_copies)
    return (lean, "") if _agrees(model, lean) else (None, f"lean logits differ from HF's on the probe ({name})")


def _sliding_window(model: torch.nn.Module) -> int | None:
    """The smallest attention window of any layer that a sequence within the model's positions can exceed."""
    longest = getattr(model.config, "max_position_embeddings", None)
    default = getattr(model.config, "sliding_window", None)  # Mistral's layers all use the config's window
    windows = [getattr(layer.self_attn, "sliding_window", default) for layer in model.model.layers]
    windows = [w for w in windows if w is not None and (longest is None or w < longest)]
    return min(windows, default=None)


def _agrees(model: torch.nn.Module, lean: LeanLlama) -> bool:
    """Run a probe (a prefill of 7 tokens, then 1, then 2) both ways and compare the logits."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(0)).to(lean.device)
    with torch.inference_mode():
        want = model(input_ids=ids).logits[0].float()
    cache = lean.new_cache()
    got = torch.cat([lean.forward(cache, ids[0, :7], last_only=False), lean.forward(cache, ids[0, 7:8], last_only=False),
                     lean.forward(cache, ids[0, 8:], last_only=False)]).float()
    narrow = lean.dtype != torch.float32 or lean.layers[0].qkv.weight.dtype != torch.float32
    tol = 5e-2 if narrow else 1e-3  # bf16 products: HF's separate q/k/v round differently from the fused one
    return bool(torch.allclose(got, want, atol=tol * max(1.0, float(want.abs().max())), rtol=0))
