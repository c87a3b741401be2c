"""Where a wave's time goes when every request starts together: prefill, the full batch, and its draining tail.

    python benchmarks/batch_tail.py [--target zoo:pycode] [--batch-size 16] [--tokens 128] [--repeats 3]
                                    [-p ngram:2 -p draft-model:4 -p draft-model:cost-model ...]

Decodes ``--batch-size`` held-out HumanEval prompts at once (one wave: every row joins at the first step), greedy,
target-only and each ``-p NAME:γ`` (or ``NAME:POLICY``, a registered γ policy; proposer and policy fresh each
run) interleaved per repeat, and prints medians: goodput and its ratio to target-only, the prefill, the steps
taken with every row live and their time, the steps after the first row finished (the tail) and theirs, and each
row's step count (min / median / max). Speculation shortens rows by different amounts, so the wave lasts as long
as its slowest row; the tail's steps run fewer rows than the machine could take at the same cost. ``if no tail``
prices the wave as if the tail's steps were free, an upper bound on what any rule could win back there.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import specplug
from specplug.bench.workloads import humaneval_prompts
from specplug.plugins import get_policy, list_policies


@dataclass
class Wave:
    """One wave's split: seconds, and step counts."""

    tokens: int
    wall: float
    prefill: float
    full_steps: int
    full_time: float
    tail_steps: int
    tail_time: float
    row_steps: list[int]

    @property
    def goodput(self) -> float:
        return self.tokens / self.wall

    @property
    def goodput_without_tail(self) -> float:
        return self.tokens / (self.wall - self.tail_time)


def split(results: list[specplug.GenerationResult], wall: float) -> Wave:
    """The wave's split from its per-row stats: the longest row was in every step, so its step times are the
    steps'; a step ran every row while all rows still had steps to take."""
    row_steps = [r.stats.target_calls for r in results]
    longest = max(results, key=lambda r: r.stats.target_calls).stats.step_times
    full = min(row_steps)
    return Wave(tokens=sum(len(r.tokens) for r in results), wall=wall,
                prefill=max(r.stats.prefill_time for r in results), full_steps=full, full_time=sum(longest[:full]),
                tail_steps=len(longest) - full, tail_time=sum(longest[full:]), row_steps=sorted(row_steps))


def run_wave(target, proposer, prompts: list[str], gamma: int | str, tokens: int) -> Wave:
    """One wave; ``gamma`` a fixed γ or a registered policy's name (a fresh policy)."""
    policy = gamma if isinstance(gamma, int) else get_policy(gamma)
    t0 = time.perf_counter()
    results = specplug.generate_batch(target, proposer, prompts, max_new_tokens=tokens, sampling=specplug.GREEDY,
                                      num_speculative_tokens=policy)
    return split(results, time.perf_counter() - t0)


def parse_variant(spec: str) -> tuple[str, int | str]:
    """``NAME:γ`` -> (NAME, γ); ``NAME:POLICY`` -> (NAME, POLICY) for a registered γ policy."""
    name, _, gamma = spec.rpartition(":")
    if name and gamma.isdigit():
        return name, int(gamma)
    if name and gamma in list_policies():
        return name, gamma
    raise argparse.ArgumentTypeError(f"expected NAME:γ or NAME:POLICY (e.g. ngram:2, ngram:cost-model), got {spec!r}")


def median_wave(waves: list[Wave]) -> Wave:
    """The repeat with the median wall time (its parts belong together)."""
    return sorted(waves, key=lambda w: w.wall)[len(waves) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:pycode")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-p", "--proposer", dest="variants", action="append", type=parse_variant,
                        help="NAME:γ or NAME:POLICY (repeatable); default ngram:2 and draft-model:4")
    args = parser.parse_args()
    variants = args.variants or [("ngram", 2), ("draft-model", 4)]
    target = specplug.Target.from_pretrained(args.target)
    prompts = humaneval_prompts(args.batch_size)
    runs: dict[str, list[Wave]] = {}
    for _ in range(args.repeats):
        runs.setdefault("target-only", []).append(run_wave(target, None, prompts, 0, args.tokens))
        for name, gamma in variants:
            # a fresh proposer per run, as compare builds them: suffix's cache would otherwise hold these very
            # prompts' outputs from the run before
            proposer = specplug.get_proposer(name, target=target)
            runs.setdefault(f"{name} {gamma if isinstance(gamma, str) else f'γ{gamma}'}", []).append(
                run_wave(target, proposer, prompts, gamma, args.tokens))
    base = median_wave(runs["target-only"]).goodput
    print(f"{args.target}, one wave of {args.batch_size} requests x {args.tokens} tokens, greedy, "
          f"medians of {args.repeats}")
    print(f"{'':18} {'tok/s':>7} {'x':>5} {'prefill':>8} {'full batch':>16} {'tail':>16} "
          f"{'row steps':>14} {'if no tail':>10}")
    for label, waves in runs.items():
        w = median_wave(waves)
        steps = w.row_steps
        print(f"{label:18} {w.goodput:7.1f} {w.goodput / base:5.2f} {w.prefill:7.3f}s "
              f"{w.full_steps:5d} {w.full_time:8.3f}s  {w.tail_steps:5d} {w.tail_time:8.3f}s  "
              f"{steps[0]:4d}/{statistics.median(steps):4.0f}/{steps[-1]:4d} {w.goodput_without_tail / base:9.2f}x")


if __name__ == "__main__":
    main()
