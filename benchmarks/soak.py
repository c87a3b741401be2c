"""Soak: many short requests through one target and one proposer instance; nothing may grow.

    python benchmarks/soak.py [--target zoo:pycode] [--proposer draft-model] [--requests 1000] [--tokens 16]

Prints resident memory (VmRSS), live Python objects and the proposer's reported memory every 10% of the
run; a leak shows as a steady climb after the first few hundred requests (allocator warm-up aside).
"""
from __future__ import annotations

import argparse
import gc
import json

import specplug


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode")
    ap.add_argument("--proposer", default="draft-model")
    ap.add_argument("--option", "-o", action="append", default=[], help="KEY=VALUE proposer option (JSON values)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    options = {}
    for pair in args.option:
        key, _, value = pair.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    target = specplug.Target.from_pretrained(args.target)
    proposer = specplug.get_proposer(args.proposer, target=target, **options)
    prompts = ["def f(x):\n    return", "import os\n", "class A:\n    def __init__(self):\n", "for i in range(3):"]
    rows = []
    for i in range(args.requests + 1):
        if i % max(1, args.requests // 10) == 0:
            gc.collect()
            rows.append({"requests": i, "rss_mib": round(rss_mib(), 1), "objects": len(gc.get_objects()),
                         "proposer_bytes": int(proposer.memory_bytes())})
            print(json.dumps(rows[-1]), flush=True)
        if i == args.requests:
            break
        sampling = specplug.SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i)
        specplug.generate(target, proposer, prompts[i % len(prompts)], max_new_tokens=args.tokens,
                          sampling=sampling, num_speculative_tokens=4)
    settled = rows[min(3, len(rows) - 1)]
    print(f"RSS {rows[0]['rss_mib']} MiB at start, {settled['rss_mib']} MiB after {settled['requests']} requests, "
          f"{rows[-1]['rss_mib']} MiB after {rows[-1]['requests']}; live objects {settled['objects']} -> "
          f"{rows[-1]['objects']}; proposer memory {rows[0]['proposer_bytes']} -> {rows[-1]['proposer_bytes']} bytes")


if __name__ == "__main__":
    main()
