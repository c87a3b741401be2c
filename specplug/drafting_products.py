"""Which form a drafter's products take on the machine at hand: int8 copies or the float weights.

A drafter multiplies one row at a time (16 when it drafts a batch's rows together), so its products are bound by
reading weights: int8 copies (:mod:`specplug.int8_products`) read a quarter of float32's bytes, but on some
machines, for small weights held in cache, or where bf16 products run on specplug's kernel
(:mod:`specplug.bf16_products`), float products (with one-row column-major copies, see
:class:`specplug.lean_llama.Product`) are as fast or faster. :func:`drafting_weights` times both once per
machine and drafter shape, over 1 and 16 rows (:mod:`specplug.machine`, choice ``int8_drafting``); each int8
product then takes only the row counts at which int8 is not the slower form, and more rows through a bf16 (or
float32) copy (choice ``int8_rows``, :func:`specplug.int8_products.rows_through_int8`). A drafter's
arithmetic never touches exactness: it samples from the q it reports, and the verifier corrects for q.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import int8_products, machine
from .lean_llama import LeanLlama, Product


def linear_shapes(module: torch.nn.Module) -> list[tuple[int, int]]:
    """The weight shapes of a module's linear layers (what a drafter multiplies by, for :func:`drafting_weights`)."""
    return [tuple(m.weight.shape) for m in module.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel()]


def drafting_weights(shapes: Sequence[tuple[int, int]], device, dtype: torch.dtype, alternative: str,
                     recommended: str | None = None, one_row_copies: bool = False) -> str:
    """A drafter's default ``weights``: ``"int8"`` where torch's int8 kernel runs on ``device`` and int8 one-row
    products by weights of ``shapes`` are not slower than ``dtype`` ones (:func:`int8_drafting_pays`), else
    ``alternative``. ``recommended`` (a head's config, measured on some machine) is where the probe starts."""
    if not int8_products.available(str(device)):
        return alternative
    prefer = recommended in (None, "int8")
    return "int8" if int8_drafting_pays(shapes, device, dtype, one_row_copies=one_row_copies, prefer=prefer) \
        else alternative


def int8_drafting_pays(shapes: Sequence[tuple[int, int]], device, dtype: torch.dtype, *, one_row_copies: bool = False,
                       prefer: bool = True) -> bool:
    """Whether a drafter's one-row products by weights of ``shapes`` run faster through int8 copies (see
    :mod:`specplug.int8_products`) than in ``dtype`` (with one-row copies where those pay) on ``device``: timed
    once per machine (choice ``int8_drafting``), ``prefer`` (int8) standing unless the other is faster by more
    than the margin. The caller checks that the int8 kernel runs on the device."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=gen).to(device) for shape in shapes]
    rows = [torch.randn(16, shape[1], generator=gen).to(device) for shape in shapes]
    plain = [Product(w.to(dtype), one_row_copy=one_row_copies) for w in weights]
    narrow = [Product(w, int8=True) for w in weights]
    forms = {form: lambda products=products: [p(x[:m]) for p, x in zip(products, rows) for m in (1, 16)]
             for form, products in (("int8", narrow), ("float", plain))}
    key = (f"{str(dtype).removeprefix('torch.')}{' one-row copies' if one_row_copies else ''} {device} "
           + " ".join(f"{n}x{k}" for n, k in shapes) + " over 1 and 16 rows")
    nbytes = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
    return machine.faster("int8_drafting", key, forms, "int8" if prefer else "float", nbytes) == "int8"


def head_weights(shapes: Sequence[tuple[int, int]], target, advice: str | None) -> str:
    """A feature head's default ``weights`` for ``target``: ``"int8"`` where int8 products by weights of ``shapes``
    draft faster on this machine (:func:`drafting_weights`), else the head's ``advice`` where that is ``"target"`` or
    ``"float32"`` (a head's config, measured on some machine), else ``"target"``."""
    alternative = advice if advice in ("target", "float32") else "target"
    dtype = torch.float32 if alternative == "float32" else getattr(target, "matmul_dtype", None) or target.dtype
    return drafting_weights(shapes, target.device, dtype, alternative, advice)


def faster_drafting_form(forms: dict[str, tuple[LeanLlama, Product]], default: str, key: str, nbytes: int) -> str:
    """Which of a drafter's lean forms (each a lean forward and its head) drafts one token faster after a short
    context on this machine: timed whole, since a form's gain may lie outside its products (bf16 products let
    every layer run in C, :mod:`specplug.fused_layers`), once per machine and ``key`` (choice ``draft_products``);
    the ``default`` stands unless another is faster by more than the margin, or where the weights (``nbytes``) are
    too small to matter."""
    timed = {}
    for name, (lean, head) in forms.items():
        cache = lean.new_cache()
        vocab = lean.embedding.shape[0]
        lean.forward(cache, [i % vocab for i in range(1, 33)], head=head)

        def draft_four(lean=lean, head=head, cache=cache):
            start = cache.length
            for token in (1, 2, 3, 4):
                lean.forward(cache, [token % vocab], head=head)
            cache.crop(start)

        timed[name] = draft_four
    return machine.faster("draft_products", key, timed, default, nbytes)
