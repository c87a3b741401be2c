"""Weight-only int8 products for drafters: each output row of a weight scaled into int8, inputs multiplied in bf16.

Why: a drafter runs one row per call, and that product is bound by reading the weight: an int8 weight is a
quarter of float32's bytes. Whether that makes it faster depends on the machine (on the AMD machine the zoo
EAGLE head's drafting products went from 0.30 to 0.11 ms a token; ``python benchmarks/drafting_products.py``),
and for small weights held in cache a float32 column-major product can win. So drafters take int8 by default
only where a short probe on the machine at hand finds it faster
(:mod:`specplug.drafting_products`, cached by :mod:`specplug.machine`).

Only drafters use it. A drafter's arithmetic never touches exactness — it samples its token from the q it
reports, and the verifier corrects for q — so rounding its weights can only change how often drafts are
accepted. A target's weights define p and are never rounded here.

Scheme: symmetric, one scale per output row (``scale = max |w_row| / 127``), the kernel
``torch._weight_int8pack_mm`` (CPU and MPS in torch 2.13; :func:`available` probes a device once).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import machine

ACTIVATIONS = torch.bfloat16  # the kernel's input dtype on CPU (float32 inputs take a slow path: 20× slower)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (int8 weight [N, K], scales [N]), weight ≈ int8 · scale to half a step. The scales
    are rounded to the kernel's dtype first (float32 holding bf16 values), so the rounding is to the very
    steps the kernel multiplies by."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-30).to(ACTIVATIONS).float()
    return torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous(), scales


@functools.lru_cache(maxsize=None)
def available(device: str) -> bool:
    """Whether the int8 kernel runs on ``device`` (a ``torch.device`` string) with this torch build."""
    try:
        w, scales = quantize(torch.ones(8, 32))
        x = torch.ones(1, 32, dtype=ACTIVATIONS, device=device)
        y = torch._weight_int8pack_mm(x, w.to(device), scales.to(device=device, dtype=ACTIVATIONS))
        return bool(torch.allclose(y.float().cpu(), torch.full((1, 8), 32.0), rtol=0.02))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def checked_weights(value, forms: tuple[str, ...], device, who: str, fallback: str) -> str:
    """A drafter's ``weights=`` setting, checked: one of ``forms``, and ``"int8"`` only where the kernel runs on
    ``device`` (else the error names ``who`` and suggests ``fallback``)."""
    if value not in forms:
        raise ValueError(f"{who}: weights must be one of {', '.join(map(repr, forms))}, got {value!r}")
    if value == "int8" and not available(str(device)):
        raise ValueError(f"{who}: weights='int8' needs torch's int8 kernel (torch._weight_int8pack_mm), which "
                         f"this torch build does not run on {device}; pass weights={fallback!r}")
    return value


ROWS_CHOICE = "int8_rows"
ALL = "all"
PROBED_ROWS = (1, 2, 4, 8, 16, 32, 64)


def wide_dtype(device) -> torch.dtype:
    """The dtype of a product's form for many rows: bf16 on a CPU with native bf16 products (the int8 kernel's
    inputs are bf16 already), else float32."""
    if torch.device(device).type == "cpu":
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return torch.bfloat16
        except (AttributeError, RuntimeError):
            pass
    return torch.float32


def rows_through_int8(key: str, nbytes: int, int8_form: Callable[[int], object],
                      wide_form: Callable[[int], object], margin: float = 0.1) -> int | None:
    """Up to how many rows a product runs through its int8 copy rather than its wide form (:func:`wide_dtype`),
    None for every row count: timed at :data:`PROBED_ROWS` rows once per machine and shape (choice
    ``int8_rows``), int8 standing at a row count unless the wide form is faster by more than ``margin``.

    Why: ``torch._weight_int8pack_mm`` runs each row as its own pass over the weight, so its time grows with the
    rows, while a bf16 product of many rows reads the weight once (on one AVX-512 machine int8 was faster at one
    row and 2-3× slower at 16). A drafter runs one row per drafting step but many in a batch or a catch-up.
    Weights under :data:`specplug.machine.MIN_BYTES` stay int8 at every row count, unprobed;
    ``SPECPLUG_CHOICES=int8_rows=N`` (or ``all``) pins it."""
    pinned = machine.overrides().get(ROWS_CHOICE)
    if pinned is not None:
        if pinned != ALL and not pinned.isdigit():
            raise ValueError(f"{machine.OVERRIDE_ENV}: {ROWS_CHOICE}={pinned!r} is not a row count or {ALL!r}")
        machine.record(ROWS_CHOICE, key, pinned, machine.OVERRIDE_ENV, "override")
        return None if pinned == ALL else int(pinned)
    if nbytes < machine.MIN_BYTES:
        machine.record(ROWS_CHOICE, key, ALL, f"weights of {nbytes} bytes: too small to matter, not probed", "default")
        return None

    def measure() -> str:
        last = 0
        for rows in PROBED_ROWS:
            took = machine.seconds({"int8": lambda: int8_form(rows), "wide": lambda: wide_form(rows)}, repeats=5)
            if took["int8"] > took["wide"] * (1 + margin):
                return str(last)
            last = rows
        return ALL

    value = machine.remembered(ROWS_CHOICE, key, measure, lambda v: "int8 at every row count probed" if v == ALL
                               else f"int8 up to {v} row(s), the wide form beyond")
    return None if value == ALL else int(value)


class Int8Product:
    """``x @ weight.T + bias`` with the weight kept as int8 and per-row scales; returns x's dtype."""

    __slots__ = ("weight", "scales", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        q, scales = quantize(weight)
        self.weight = q.to(weight.device)
        self.scales = scales.to(device=weight.device, dtype=ACTIVATIONS)
        self.bias = None if bias is None else bias.detach().float().to(weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(ACTIVATIONS)
        y = torch._weight_int8pack_mm(flat, self.weight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.weight.shape[0])

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this product multiplies by (for tests and checks)."""
        return self.weight.float() * self.scales.float()[:, None]

    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() + self.scales.numel() * self.scales.element_size() + extra
