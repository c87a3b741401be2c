"""What a verify pass costs against a plain step, at a batch size: the number speculation has to beat.

    python benchmarks/pass_cost.py [--target zoo:pycode] [--batch-size 16] [--tokens 1,2,3,5,7] [--repeats 9]
                                   [--probe-rows 64] [--products]

Each of ``--batch-size`` rows holds one held-out HumanEval prompt in the target's lean cache; a pass feeds
every row n tokens (a γ = n − 1 verify pass; n = 1 is a plain step) through ``LeanLlama.run_rows``, and each
row's cache is cut back afterwards. Prints the median time per pass and its ratio to the plain step, n
interleaved per repeat. With τ tokens emitted per pass, speculation at this batch size can reach at most
τ / ratio(γ + 1) (drafting free, prefill left out). ``--probe-rows N`` checks products for row-invariance only up
to N rows (``few_rows.PROBE_ROWS``), so longer ones run in pieces of N, each reading the weight again: the
products as a shallower probe left them (64 before session 30). ``--products`` also times the pass's rows through
every product of the target alone (each layer's four and the LM head, on random rows, after the passes): what a
position beyond the first costs in products and in the rest (attention, norms, the loop).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specplug
from specplug import few_rows
from specplug.bench.workloads import humaneval_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:pycode")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens", default="1,2,3,5,7", help="tokens per row in a pass (1: a plain step)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--probe-rows", type=int, default=None, help="check row-invariance up to this many rows")
    parser.add_argument("--products", action="store_true", help="also time the rows through the products alone")
    args = parser.parse_args()
    if args.probe_rows is not None:
        few_rows.PROBE_ROWS = args.probe_rows  # read when the Target's products are first probed, below
    counts = [int(n) for n in args.tokens.split(",")]
    target = specplug.Target.from_pretrained(args.target)
    if target.lean is None:
        raise SystemExit(f"{args.target} has no lean forward here: {target.lean_note}")
    lean, tokenizer = target.lean, target.tokenizer
    caches = []
    for prompt in humaneval_prompts(args.batch_size):
        cache = lean.new_cache()
        lean.run(cache, tokenizer(prompt)["input_ids"], keep=1)
        caches.append(cache)
    lengths = [c.length for c in caches]

    def one_pass(n: int) -> float:
        t0 = time.perf_counter()
        lean.run_rows(caches, [[0] * n for _ in caches])
        seconds = time.perf_counter() - t0
        for cache, length in zip(caches, lengths):
            cache.crop(length)
        return seconds

    for n in counts:  # warm up every shape once
        one_pass(n)
    times = _interleaved(one_pass, counts, args.repeats)
    # afterwards, not between the passes: its inputs and weights would leave the caches colder for the next pass
    products_only = products_timer(lean, len(caches), counts) if args.products else None
    alone = _interleaved(products_only, counts, args.repeats) if products_only else {}
    plain = statistics.median(times[1]) if 1 in times else None
    print(f"{args.target}, {args.batch_size} rows, prompts of {min(lengths)}-{max(lengths)} tokens, "
          f"median of {args.repeats}; {product_form(lean)}:")
    for n in counts:
        t = statistics.median(times[n])
        ratio = f"  {t / plain:.2f}× a plain step" if plain else ""
        split = f"; products alone {1e3 * statistics.median(alone[n]):.2f} ms" if products_only else ""
        print(f"  {n} token(s) a row: {1e3 * t:7.2f} ms{ratio}{split}")
    if products_only and len(counts) > 1:
        first, last = counts[0], counts[-1]
        extra = (last - first) * len(caches)
        per = (statistics.median(times[last]) - statistics.median(times[first])) / extra
        prod = (statistics.median(alone[last]) - statistics.median(alone[first])) / extra
        print(f"  a position beyond {first} a row: {1e6 * per:.0f} µs, of which products {1e6 * prod:.0f} µs, "
              f"the rest {1e6 * (per - prod):.0f} µs")


def _interleaved(timed, counts: list[int], repeats: int) -> dict[int, list[float]]:
    """``repeats`` timings of ``timed(n)`` for each n, the order of the ns rotated each repeat."""
    times: dict[int, list[float]] = {n: [] for n in counts}
    for rep in range(repeats):
        for n in counts[rep % len(counts):] + counts[: rep % len(counts)]:
            times[n].append(timed(n))
    return times


def products_timer(lean, rows: int, counts: list[int]):
    """Seconds for ``rows`` × n random rows through every product of the target (each layer's four, the LM head)."""
    hidden = lean.layers[0].norm_in.shape[0]
    products = [(p, width) for layer in lean.layers
                for p, width in zip(layer.products(), (hidden, hidden, layer.heads * layer.head_dim, layer.inter))]
    products.append((lean.head, hidden))
    g = torch.Generator().manual_seed(0)
    inputs = {n: {w: torch.randn(rows * n, w, generator=g) for w in {w for _, w in products}} for n in counts}

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        for product, width in products:
            product(inputs[n][width])
        return time.perf_counter() - t0
    return timed


def product_form(lean) -> str:
    """How the layers' products run: whole on a kernel that keeps one-row bits (rows kernel, AMX tiles), or in
    pieces of as many rows as the probe found bit-identical."""
    products = [p for layer in lean.layers for p in layer.products()]
    whole = sum(1 for p in products if p.tiles is not None)
    if whole == len(products):
        return f"products whole ({type(products[0].tiles).__name__})"
    pieces = min((p.rows for p in few_rows.probes()), default=None)
    return f"{whole} of {len(products)} products whole, the rest in pieces of up to {pieces} rows"


if __name__ == "__main__":
    main()
