"""Goodput of the machine's own speed choices against pinned alternatives, side by side in one process.

    python benchmarks/forms_ab.py --against attention=torch [--against packed_bf16=F.linear,attention=torch]
        [--batch-sizes 1,16] [-p draft-model -p ngram] [--gamma 4] [--prompts 16] [--tokens 128] [--repeats 3]

Each ``--against`` is a SPECPLUG_CHOICES setting (see specplug.machine); "default" is what the machine chose.
One Target is loaded per setting, and every cell (batch size × proposer, target-only first) runs once per
setting per repeat, interleaved, over held-out HumanEval prompts, greedy (B = 1 decodes the first 4 prompts
one at a time). Prints tokens/s (median of the repeats), each setting over the default, and whether every
setting's greedy rows equal its own target-only rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import specplug
from specplug import machine
from specplug.bench.workloads import humaneval_prompts


def load(setting: str, target: str) -> specplug.Target:
    """The target loaded with SPECPLUG_CHOICES=setting ("default": as the machine chooses)."""
    saved = os.environ.pop(machine.OVERRIDE_ENV, None)
    if setting != "default":
        os.environ[machine.OVERRIDE_ENV] = setting
    machine.forget()
    try:
        return specplug.Target.from_pretrained(target)
    finally:
        os.environ.pop(machine.OVERRIDE_ENV, None)
        if saved is not None:
            os.environ[machine.OVERRIDE_ENV] = saved


def run(target, batch: int, proposer: str | None, prompts, gamma: int, tokens: int) -> tuple[float, list]:
    drafter = proposer and specplug.get_proposer(proposer, **({"target": target} if proposer == "draft-model" else {}))
    rows = prompts if batch > 1 else prompts[:4]
    start = time.perf_counter()
    results = specplug.generate_batch(target, drafter, rows, max_new_tokens=tokens, sampling=specplug.GREEDY,
                                      max_batch_size=batch, num_speculative_tokens=gamma)
    seconds = time.perf_counter() - start
    out = [list(r.tokens) for r in results]
    return sum(map(len, out)) / seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", action="append", required=True, help="a SPECPLUG_CHOICES setting")
    parser.add_argument("--target", default="zoo:pycode")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("-p", "--proposer", action="append", default=[])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = ["default", *args.against]
    targets = {s: load(s, args.target) for s in settings}
    prompts = humaneval_prompts(args.prompts)
    cells = [(int(b), p) for b in args.batch_sizes.split(",") for p in [None, *args.proposer]]
    speed: dict = {}
    reference: dict = {}  # (batch, setting) -> target-only rows
    greedy_equal = {s: True for s in settings}
    for t in targets.values():
        run(t, max(b for b, _ in cells), None, prompts, args.gamma, 4)  # warm-up: first calls allocate
    for _ in range(args.repeats):
        for batch, proposer in cells:
            for s, t in targets.items():
                rate, out = run(t, batch, proposer, prompts, args.gamma, args.tokens)
                speed.setdefault((batch, proposer, s), []).append(rate)
                greedy_equal[s] &= out == reference.setdefault((batch, s), out)
    width = max(28, *(len(s) + 2 for s in settings))
    print(f"{'B':>3} {'proposer':<12}" + "".join(f"{s:>{width}}" for s in settings))
    for batch, proposer in cells:
        base = statistics.median(speed[(batch, proposer, 'default')])
        line = f"{batch:>3} {proposer or 'target-only':<12}"
        for s in settings:
            rate = statistics.median(speed[(batch, proposer, s)])
            line += f"{rate:>{width - 9}.0f} tok/s" + (f" {rate / base:4.2f}x" if s != "default" else " " * 6)
        print(line)
    print("greedy rows equal target-only's:", ", ".join(f"{s}: {'yes' if ok else 'NO'}" for s, ok in greedy_equal.items()))


if __name__ == "__main__":
    main()
