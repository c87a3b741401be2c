"""What one drafted row costs through each product form: float32 (few_rows), bf16 and weight-only int8.

    python benchmarks/drafting_products.py [--repeats 500]

Shapes are the zoo EAGLE head's (hidden 512: fused q/k/v, fused gate/up, o, down, fc) and a 2,048-row
LM-head subset; one input row each, weights in cache (each product is timed back to back). Prints the median
per call in ms. The figures quoted in specplug/int8_products.py come from this script.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specplug import few_rows
from specplug.int8_products import Int8Product

SHAPES = {"qkv": (1536, 512), "gate_up": (3072, 512), "o": (512, 512), "down": (512, 1536), "fc": (512, 1024),
          "lm rows": (2048, 512)}


def median_ms(fn, repeats: int) -> float:
    for _ in range(30):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"{'product':10s} {'shape':>12s} {'float32':>9s} {'bf16':>9s} {'int8':>9s}   (ms, one row, "
          f"{torch.get_num_threads()} threads)")
    totals = [0.0, 0.0, 0.0]
    for name, (out, inp) in SHAPES.items():
        weight = torch.randn(out, inp, generator=g) * 0.02
        x = torch.randn(1, inp, generator=g)
        narrow, int8 = weight.bfloat16(), Int8Product(weight)
        row = [median_ms(lambda: few_rows.linear(x, weight), args.repeats),
               median_ms(lambda: few_rows.linear(x, narrow), args.repeats),
               median_ms(lambda: int8(x), args.repeats)]
        totals = [t + r for t, r in zip(totals, row)]
        print(f"{name:10s} {f'{out} x {inp}':>12s} " + " ".join(f"{r:9.3f}" for r in row))
    print(f"{'all':10s} {'':>12s} " + " ".join(f"{t:9.3f}" for t in totals))


if __name__ == "__main__":
    main()
