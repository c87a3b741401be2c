"""What a product over a step's or a verify pass's rows costs through one of specplug's product kernels, against
torch's product and, optionally, against another version of the kernel's source.

    python benchmarks/row_products.py [--rows 1,2,3,5,16,32,80] [--repeats 60]
    python benchmarks/row_products.py --against-source <(git show bd52cd1:specplug/kernels/rows_f32.c)
    python benchmarks/row_products.py --kernel bf16 --rows 1,5,16,48,112 \\
        [--against-source <(git show 9ed0de3~1:specplug/kernels/product.c)]

``--kernel rows`` (default): float32 rows through ``kernels/rows_f32.c`` against torch's product in few_rows'
pieces. ``--kernel bf16``: a bf16 weight through ``kernels/product.c`` in the form this machine runs (AMX or
AVX-512 BF16) against oneDNN's bf16 product; 48 and 112 rows are 16 rows' verify passes at γ = 2 and 6.
Shapes are the zoo target's (hidden 512: fused gate/up, q/k/v, down, the 8,192-row LM head). Forms are timed
interleaved, call by call, so a busy machine slows them alike; prints the median per call in µs and its
GFLOP/s, and checks that another kernel source gives the kernel's bits.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from specplug import bf16_products, few_rows, machine, native, row_products

SHAPES = {"gate_up": (3072, 512), "qkv": (1536, 512), "down": (512, 1536), "lm_head": (8192, 512)}
Form = Callable[[torch.Tensor], torch.Tensor]


def compiled(source: str, workdir: Path) -> ctypes.CDLL:
    """``source`` compiled with the flags specplug's own kernels get, loaded."""
    src, lib = workdir / "other.c", workdir / "other.so"
    src.write_text(Path(source).read_text(encoding="utf-8"), encoding="utf-8")
    subprocess.run(["cc", *native.FLAGS, str(src), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def rows_forms(source: str | None, workdir: Path) -> Callable[[torch.Tensor], tuple[list[str], list[Form]]]:
    """The float32 rows kernel (and ``source``'s), then torch's product in few_rows' pieces, for a weight."""
    lib, reason = row_products.load()
    if lib is None:
        raise SystemExit(f"the rows kernel is not available here: {reason}")
    other = compiled(source, workdir) if source else None
    if other is not None:
        other.specplug_rows_f32.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4

    def forms(weight: torch.Tensor) -> tuple[list[str], list[Form]]:
        kernels = [k for k in (lib, other) if k is not None]
        return (["kernel"] + ["other source"] * bool(other) + ["torch, few_rows"],
                [row_products.RowProduct(k, weight) for k in kernels] + [lambda x: few_rows.linear(x, weight)])
    return forms


def bf16_forms(source: str | None, workdir: Path) -> Callable[[torch.Tensor], tuple[list[str], list[Form]]]:
    """The bf16 product kernel in this machine's form (and ``source``'s), then oneDNN's bf16 product."""
    kernel, reason = bf16_products.load()
    if kernel is None:
        raise SystemExit(f"the bf16 product kernel is not available here: {reason}")
    other = None
    if source:
        lib = compiled(source, workdir)
        fn = lib.specplug_product if kernel.form == bf16_products.AMX else lib.specplug_product_dot
        fn.argtypes, fn.restype = [native.I64] * 3 + [native.PTR] * 5, None
        lib.specplug_product_pack.argtypes = [native.I64] * 2 + [native.PTR] * 2
        lib.specplug_product_pack.restype = None
        other = bf16_products.Compiled(kernel.form, fn, lib.specplug_product_pack)

    def forms(weight: torch.Tensor) -> tuple[list[str], list[Form]]:
        w = weight.to(torch.bfloat16)
        kernels = [k for k in (kernel, other) if k is not None]
        return ([kernel.form] + ["other source"] * bool(other) + ["oneDNN"],
                [bf16_products.Bf16Product(k, w) for k in kernels]
                + [lambda x: torch.nn.functional.linear(x.to(torch.bfloat16), w)])
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=("rows", "bf16"), default="rows")
    parser.add_argument("--rows", default="1,2,3,5,16,32,80")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--against-source", help="another version of the kernel's C source to time beside it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        forms_for = (rows_forms if args.kernel == "rows" else bf16_forms)(args.against_source, Path(tmp))
        g = torch.Generator().manual_seed(0)
        header = True
        for name, (out, inp) in SHAPES.items():
            names, forms = forms_for(torch.randn(out, inp, generator=g) * 0.02)
            if header:
                print(f"{'product':8s} {'rows':>5s} " + " ".join(f"{n:>22s}" for n in names)
                      + f"   (µs and GFLOP/s, median of {args.repeats}, {torch.get_num_threads()} threads)")
                header = False
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, inp, generator=g)
                if args.against_source and not torch.equal(forms[0](x), forms[1](x)):
                    raise SystemExit(f"{name}, {rows} rows: the other source gives other bits")
                # interleaved, the order turned each repeat (a call right after oneDNN's runs slower)
                timed = machine.seconds({i: lambda f=f: f(x) for i, f in enumerate(forms)}, args.repeats,
                                        statistics.median)
                cells = [f"{1e6 * t:8.0f} µs {2 * rows * out * inp / t / 1e9:5.0f} GF/s" for t in timed.values()]
                print(f"{name:8s} {rows:5d} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
