"""Linear layers whose rows come out the same whether a product has one row or many, fast on few rows.

A speculative step scores k + 1 positions where target-only decoding scores one. For a verified position to get
the very logits a one-token step gives, each row of a many-row product must equal the one-row product bit for
bit. Whether it does is a property of the kernels at hand, not of the arithmetic: on one CPU oneDNN's bf16
products were row-invariant for every row count, on another only up to a few dozen rows. So :func:`linear`
probes, once per weight shape, dtype, device and thread count, the largest row count whose rows all equal
one-row products (:func:`identical_rows`), and computes larger products in pieces of that many rows. A one-row
product is padded to two rows: BLAS's matrix-vector kernel sums in another order than its matrix kernel.

On CPU in float32, products of up to MAX_ROWS rows may run as ``weight @ xᵀ``: with torch 2.13's CPU BLAS on
one machine ``F.linear`` over 2-4 rows of a large weight cost several one-row products (a verify pass costing
more than a step is exactly what Leviathan's formula assumes away), on another ``weight @ xᵀ`` was the slower
form. Which form a kind of weight takes is timed once per machine (:func:`specplug.machine.faster`, choice
``few_rows_float32``), before any of its products is used, and kept for every row count.

``install(model, weight_dtype=torch.bfloat16)`` instead keeps the linear weights in bfloat16 and multiplies in it
(inputs cast down, products cast back), while everything else — embeddings, norms, attention, the residual
stream, the KV cache — stays float32: the arithmetic of bf16-autocast training, without autocast's per-call
weight casts. Where the CPU has native bf16 products it halves the bytes a step reads. A bf16 CPU weight may
also be packed once for oneDNN (:func:`packed_copy`), which torch's ``F.linear`` otherwise does at every call;
it is used only where its products give the very bits of unpacked ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import machine

MAX_ROWS = 16  # float32 CPU products up to this many rows may run as weight @ xᵀ (see transposed)
# The most rows the probe checks: longer products run in pieces it has checked, each reading the weight again.
# A verify pass at B = 16 feeds 16 · (γ + 1) rows, so up to γ = 9 it is one product.
PROBE_ROWS = 160


@dataclass(frozen=True)
class RowProbe:
    """What the probe found for one kind of product: rows of products over up to ``rows`` rows equal one-row
    products bit for bit (``rows`` = 1: not even two rows do, and products are not split)."""

    out_features: int
    in_features: int
    dtype: str
    device: str
    bias: bool
    threads: int
    rows: int

    def describe(self) -> str:
        tail = "" if self.rows > 1 else " (none: products are not split)"
        return (f"{self.dtype} {self.out_features}x{self.in_features}{' +bias' if self.bias else ''} on "
                f"{self.device}, {self.threads} thread(s): rows bit-identical to one-row products up to "
                f"{self.rows}{'+' if self.rows >= PROBE_ROWS else ''}{tail}")


_probed: dict[tuple, RowProbe] = {}


def _key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return tuple(weight.shape), weight.dtype, weight.device, bias is not None, torch.get_num_threads()


TRANSPOSED = "weight @ x.T"
_transposed: dict[tuple, bool] = {}


def transposed(weight: torch.Tensor) -> bool:
    """Whether float32 CPU products by ``weight`` of up to MAX_ROWS rows run as ``weight @ xᵀ`` rather than
    ``F.linear``: the faster over 1, 2, 4 and 8 rows on this machine (timed once per shape and thread count)."""
    key = tuple(weight.shape), torch.get_num_threads()
    found = _transposed.get(key)
    if found is None:
        x = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0))  # not the global rng
        pieces = [torch.cat([x[:1], torch.zeros_like(x[:1])]), x[:2], x[:4], x]
        forms = {TRANSPOSED: lambda: [torch.mm(weight, piece.T).T.contiguous() for piece in pieces],
                 "F.linear": lambda: [F.linear(piece, weight) for piece in pieces]}
        name = machine.faster("few_rows_float32", f"{weight.shape[0]}x{weight.shape[1]} cpu", forms, TRANSPOSED,
                              weight.numel() * weight.element_size())
        found = _transposed[key] = name == TRANSPOSED
    return found


def product(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """One unsplit product of rows ``flat`` [N, in] (already in the weight's dtype): one row padded to two,
    through ``packed`` (the weight packed by :func:`packed_copy`) where given, and float32 CPU products of up to
    MAX_ROWS rows in the form :func:`transposed` chose."""
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, torch.zeros_like(flat)])
    if packed is not None:
        return _packed_product(flat, packed, bias)[:rows]
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and flat.shape[0] <= MAX_ROWS \
            and transposed(weight):
        y = torch.mm(weight, flat.T).T[:rows].contiguous()
        return y if bias is None else y + bias
    return F.linear(flat, weight, bias)[:rows]


PACKED = "oneDNN packed"


def _packed_product(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=1)
def _pack_refusal() -> str:
    """"" where oneDNN packs bf16 weights here, else why not: tried at run time, since it needs instructions
    (avx512bw or avx_ne_convert) that some CPUs lack."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN weight packing"
    try:
        with torch.inference_mode():
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16))
    except RuntimeError as error:
        return f"oneDNN cannot pack bf16 weights on this CPU ({str(error).splitlines()[0]})"
    return ""


def _same_bits_packed(out_features: int, in_features: int, bias: bool) -> bool:
    """Whether products through the packed weight give the unpacked product's bits, on 1..PROBE_ROWS rows of
    inputs that expose any change of summation order."""
    w, x, b = sensitive_inputs(out_features, in_features, torch.bfloat16, "cpu", bias)
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        return all(torch.equal(product(x[:m], w, b, packed), product(x[:m], w, b)) for m in range(1, PROBE_ROWS + 1))


def packed_copy(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """A copy of a bf16 CPU ``weight`` in oneDNN's packed layout, for :func:`linear`'s ``packed``, where products
    through it give the very bits of products through ``weight`` (checked once per shape and machine) and run
    faster (choice ``packed_bf16``); else None.

    Why: torch's bf16 ``F.linear`` on the CPU reorders the weight for oneDNN at every call, which for a step's
    few rows costs about as much as the product itself."""
    if weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    out_features, in_features = weight.shape
    where = f"bfloat16 {out_features}x{in_features}{' +bias' if bias is not None else ''} cpu"
    if _pack_refusal():
        machine.record("packed_bf16", where, "F.linear", _pack_refusal(), "probe")
        return None
    same = machine.remembered("packed_same_bits", f"{where}, probed to {PROBE_ROWS} rows",
                              lambda: "yes" if _same_bits_packed(out_features, in_features, bias is not None) else "no",
                              lambda v: "packed products give the unpacked bits" if v == "yes"
                              else "packed products round differently: not used")
    if same != "yes":
        return None
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    forms = {PACKED: lambda: product(x, weight, bias, packed), "F.linear": lambda: product(x, weight, bias)}
    chosen = machine.faster("packed_bf16", where, forms, PACKED, weight.numel() * weight.element_size())
    return packed if chosen == PACKED else None


def sensitive_inputs(out_features: int, in_features: int, dtype, device, bias: bool):
    """Random weight, rows and bias whose products change their last bits with any change of summation order:
    a large term enters at the first input and leaves at the last, so every partial sum in between is
    rounded at about the output's own precision (plain random rows show a different order in a few outputs
    out of 10⁵, these in most)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen) * 2.0 ** -5
    x = torch.randn(PROBE_ROWS, in_features, generator=gen) * 2.0 ** -5
    if in_features >= 2:
        w[:, 0], w[:, -1], x[:, 0], x[:, -1] = 2.0 ** 12, -(2.0 ** 12), 1.0, 1.0
    b = torch.randn(out_features, generator=gen) if bias else None
    move = dict(device=device, dtype=dtype)
    return w.to(**move), x.to(**move), None if b is None else b.to(**move)


def _probe(out_features: int, in_features: int, dtype, device, bias: bool) -> int:
    """The largest m <= PROBE_ROWS such that every product over 2..m rows gives each row's one-row product."""
    w, x, b = sensitive_inputs(out_features, in_features, dtype, device, bias)
    one: list[torch.Tensor] = []
    with torch.inference_mode():
        for m in range(2, PROBE_ROWS + 1):
            one += [product(x[i:i + 1], w, b) for i in range(len(one), m)]
            if not torch.equal(product(x[:m], w, b), torch.cat(one)):
                return m - 1
    return PROBE_ROWS


def identical_rows(weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """How many rows a product by ``weight`` may have and still give each row's one-row product bit for bit:
    probed on synthetic data of the weight's shape, dtype and device once per thread count, and remembered per
    machine (:func:`specplug.machine.remembered`). 1 means not even two rows do."""
    key = _key(weight, bias)
    found = _probed.get(key)
    if found is None:
        shape, dtype, device, has_bias, threads = key
        probe = RowProbe(shape[0], shape[1], str(dtype).removeprefix("torch."), str(device), has_bias, threads, 0)
        where = (f"{probe.dtype} {shape[0]}x{shape[1]}{' +bias' if has_bias else ''} {probe.device}, "
                 f"probed to {PROBE_ROWS} rows")  # a shallower probe's finding says nothing of the rows beyond it
        rows = machine.remembered("identical_rows", where, lambda: str(_probe(shape[0], shape[1], dtype, device,
                                                                              has_bias)),
                                  lambda value: replace(probe, rows=int(value)).describe())
        found = _probed[key] = replace(probe, rows=int(rows))
    return found.rows


def probes() -> list[RowProbe]:
    """Everything the probe has found in this process (for reports: ``specplug compare``, a Target's note)."""
    return list(_probed.values())


def forget_probes() -> None:
    """Drop what the probes found (the next product probes again), e.g. after swapping kernels in a test."""
    _probed.clear()
    _transposed.clear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the weight's dtype (x cast to it and back, where the weights are kept
    narrower, see :func:`install`), each output row bit-identical to that row's one-row product wherever the
    probe finds a row count > 1 that keeps it so (longer products run in pieces of that many rows). ``packed``:
    the weight as :func:`packed_copy` packed it (the same bits, faster)."""
    flat = x.reshape(-1, x.shape[-1])
    if weight.dtype != x.dtype:
        flat = flat.to(weight.dtype)
    rows = flat.shape[0]
    if rows == 0:
        y = F.linear(flat, weight, bias)
    else:
        n = identical_rows(weight, bias) if rows > 1 else rows
        if rows <= n or n < 2:
            y = product(flat, weight, bias, packed)
        else:
            y = torch.cat([product(piece, weight, bias, packed) for piece in flat.split(n)])
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def install(model: torch.nn.Module, weight_dtype: torch.dtype | None = None) -> int:
    """Give every float32 ``nn.Linear`` of ``model`` the path of :func:`linear`; return how many got it.

    With ``weight_dtype``, the layers' weights and biases are first converted to it in place (a tied LM head
    gets its own copy, the embedding stays float32) and every product runs in it."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype != torch.float32:
            continue
        if weight_dtype is not None and weight_dtype != torch.float32:
            module.weight = torch.nn.Parameter(module.weight.detach().to(weight_dtype), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.detach().to(weight_dtype), requires_grad=False)
        module.forward = _forward.__get__(module)
        count += 1
    return count


def warm(model: torch.nn.Module) -> int:
    """Probe every linear layer's kind of product now (at load, not inside the first timed step); returns the
    fewest identical rows found (PROBE_ROWS if there are no linear layers)."""
    found = [identical_rows(m.weight, m.bias) for m in model.modules()
             if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2 and m.weight.numel()]
    return min(found, default=PROBE_ROWS)
