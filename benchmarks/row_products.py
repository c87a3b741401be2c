"""What a float32 product over a step's or a verify pass's rows costs through the rows kernel, against torch's
product in few_rows' pieces and, optionally, against another version of the kernel's source.

    python benchmarks/row_products.py [--rows 1,2,3,5,16,32,80] [--repeats 60]
    python benchmarks/row_products.py --against-source <(git show bd52cd1:specplug/kernels/rows_f32.c)

Shapes are the zoo target's (hidden 512: fused gate/up, q/k/v, down, the 8,192-row LM head). Forms are timed
interleaved, call by call, so a busy machine slows them alike; prints the median per call in µs and checks
that every form gives the kernel's bits where it should (another kernel source: the same bits).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specplug import few_rows, native, row_products

SHAPES = {"gate_up": (3072, 512), "qkv": (1536, 512), "down": (512, 1536), "lm_head": (8192, 512)}


def other_kernel(source: str, workdir: Path) -> ctypes.CDLL:
    """``source`` compiled with the flags specplug's own kernels get, loaded."""
    text = Path(source).read_text(encoding="utf-8")
    src, lib = workdir / "other_rows_f32.c", workdir / "other_rows_f32.so"
    src.write_text(text, encoding="utf-8")
    subprocess.run(["cc", *native.FLAGS, str(src), "-o", str(lib), "-lm"], check=True)
    loaded = ctypes.CDLL(str(lib))
    loaded.specplug_rows_f32.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
    return loaded


def median_us(times: list[float]) -> float:
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,3,5,16,32,80")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--against-source", help="another rows_f32.c to time beside this one")
    args = parser.parse_args()
    lib, reason = row_products.load()
    if lib is None:
        raise SystemExit(f"the rows kernel is not available here: {reason}")
    with tempfile.TemporaryDirectory() as tmp:
        other = other_kernel(args.against_source, Path(tmp)) if args.against_source else None
        names = ["kernel"] + (["other source"] if other else []) + ["torch, few_rows"]
        print(f"{'product':8s} {'rows':>5s} " + " ".join(f"{n:>16s}" for n in names)
              + f"   (µs, median of {args.repeats}, {torch.get_num_threads()} threads)")
        g = torch.Generator().manual_seed(0)
        for name, (out, inp) in SHAPES.items():
            weight = torch.randn(out, inp, generator=g) * 0.02
            forms = [row_products.RowProduct(lib, weight)] + ([row_products.RowProduct(other, weight)] if other else [])
            forms.append(lambda x, w=weight: few_rows.linear(x, w))
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, inp, generator=g)
                outputs = [form(x) for form in forms]
                if other and not torch.equal(outputs[0], outputs[1]):
                    raise SystemExit(f"{name}, {rows} rows: the other source gives other bits")
                times = [[] for _ in forms]
                for _ in range(args.repeats):
                    for form, spent in zip(forms, times):
                        start = time.perf_counter()
                        form(x)
                        spent.append(time.perf_counter() - start)
                print(f"{name:8s} {rows:5d} " + " ".join(f"{median_us(t):16.0f}" for t in times))


if __name__ == "__main__":
    main()
