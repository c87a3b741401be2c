"""Does batched greedy decoding emit, row by row, exactly what single-sequence target-only decoding emits?

    python benchmarks/greedy_equality.py [--prompts 16] [--tokens 128] [--batch-sizes 1,2,4,8,16]
                                         [--proposers target-only,draft-model,eagle] [--policy cost-model]
                                         [--no-lean]

The reference is ``generate(target, None, prompt)`` per prompt; each variant (target-only, or a proposer under
``--policy``) decodes all prompts with ``generate_batch(max_batch_size=B)``. Prints one line per variant and B:
rows equal, and for a row that parts, the first token index where it does. Exit status 1 if any row parts.
Not a timing: it may run on a busy machine.
"""
from __future__ import annotations

import argparse
import sys

import specplug
from specplug.bench.workloads import humaneval_prompts
from specplug.plugins.registry import get_policy


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (or where the shorter ends), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--proposers", default="target-only,draft-model,eagle")
    ap.add_argument("--policy", default="cost-model", help="γ policy of the speculative variants (or an int γ)")
    ap.add_argument("--no-lean", action="store_true", help="HF's padded forward instead of the lean rows")
    args = ap.parse_args()
    target = specplug.Target.from_pretrained(args.target, lean=not args.no_lean)
    print(f"target {target.name}: bit identity {target.bit_identity}; {target.lean_note}")
    prompts = humaneval_prompts(args.prompts)
    want = [specplug.generate(target, None, p, max_new_tokens=args.tokens, sampling=specplug.GREEDY).tokens
            for p in prompts]
    parted = 0
    for name in args.proposers.split(","):
        proposer = None if name == "target-only" else specplug.get_proposer(name, target=target)
        for B in [int(b) for b in args.batch_sizes.split(",")]:
            gamma = 0 if proposer is None else (int(args.policy) if args.policy.isdigit() else get_policy(args.policy))
            got = specplug.generate_batch(target, proposer, prompts, max_new_tokens=args.tokens,
                                          sampling=specplug.GREEDY, num_speculative_tokens=gamma, max_batch_size=B)
            diffs = {i: first_difference(r.tokens, w) for i, (r, w) in enumerate(zip(got, want))}
            bad = {i: d for i, d in diffs.items() if d is not None}
            parted += len(bad)
            detail = "; ".join(f"row {i} parts at token {d}" for i, d in bad.items())
            print(f"{name:12s} B={B:<3d} {len(prompts) - len(bad)}/{len(prompts)} rows equal"
                  + (f" ({detail})" if detail else ""), flush=True)
    print(f"{args.prompts} HumanEval prompts x {args.tokens} tokens, greedy: "
          + ("every row equal to target-only" if not parted else f"{parted} row(s) part from target-only"))
    return 1 if parted else 0


if __name__ == "__main__":
    sys.exit(main())
