"""A model drafter's weight forms side by side, interleaved in one process: goodput and what a drafted token costs.

    python benchmarks/draft_weights.py [-p draft-model] [--weights int8,bf16] [--batch-sizes 1,16] [--gamma 4]
                                       [--prompts 16] [--tokens 128] [--repeats 3]

One proposer per form (its ``weights=``: ``draft-model`` int8 / bf16 / loaded, ``eagle``, ``eagle3`` and ``mtp``
int8 / target / float32 or loaded) over the same target; every repeat runs each (batch size × form) cell back to
back over held-out HumanEval prompts, greedy (B = 1 decodes the first 4 prompts one at a time). Prints tokens/s
and drafting milliseconds a drafted token (a row's share where rows draft together), medians of the repeats, and
whether every form's greedy rows equal target-only's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import specplug
from specplug.bench.workloads import humaneval_prompts


def cell(target, proposer, prompts, batch: int, gamma: int, tokens: int) -> tuple[float, float, list]:
    """(tokens/s, drafting ms a drafted token, each row's tokens) of one decode of ``prompts``."""
    start = time.perf_counter()
    out = specplug.generate_batch(target, proposer, prompts, max_new_tokens=tokens, sampling=specplug.GREEDY,
                                  num_speculative_tokens=gamma, max_batch_size=batch)
    seconds = time.perf_counter() - start
    drafted = sum(sum(r.stats.step_gammas) for r in out)
    return (sum(len(r.tokens) for r in out) / seconds, 1e3 * sum(r.stats.draft_time for r in out) / max(drafted, 1),
            [r.tokens for r in out])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode")
    ap.add_argument("-p", "--proposer", default="draft-model")
    ap.add_argument("--weights", default="int8,bf16", help="forms to compare (the proposer's weights=)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    target = specplug.Target.from_pretrained(args.target)
    forms = {w: specplug.get_proposer(args.proposer, target=target, weights=w) for w in args.weights.split(",")}
    prompts = humaneval_prompts(args.prompts)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = {b: prompts if b > 1 else prompts[:4] for b in sizes}
    plain = {b: cell(target, None, rows[b], b, 0, args.tokens)[2] for b in sizes}
    for b in sizes:  # warm-up: every form's shapes once
        for proposer in forms.values():
            cell(target, proposer, rows[b], b, args.gamma, 16)
    runs: dict[tuple[int, str], list] = {}
    for _ in range(args.repeats):
        for b in sizes:
            for name, proposer in forms.items():
                runs.setdefault((b, name), []).append(cell(target, proposer, rows[b], b, args.gamma, args.tokens))
    for (b, name), results in runs.items():
        print(f"B = {b:2d}  {name:6s} {statistics.median(r[0] for r in results):8.1f} tok/s   "
              f"drafting {statistics.median(r[1] for r in results):.3f} ms a drafted token   "
              f"greedy rows = target-only's: {all(r[2] == plain[b] for r in results)}")


if __name__ == "__main__":
    main()
