"""The most any proposer could win here: an oracle drafter that knows target-only's greedy output.

    python benchmarks/oracle_ceiling.py [--target zoo:pycode] [--batch-sizes 1,16] [--requests 16] [--tokens 96]
                                        [--gammas 2,4,6] [--alphas 1,0.8,0.6] [--repeats 3] [-p suffix:6 ...]

First decodes ``--requests`` held-out HumanEval prompts target-only (greedy), then decodes them again through the
real engine and verifier with an oracle proposer (:class:`specplug.bench.oracle.OracleProposer`): at each step it
drafts the next γ tokens of that output as a point mass, at no drafting cost. With ``--alphas`` below 1 each
drafted token is replaced by a wrong one with probability 1 − α (seeded), so a draft's tokens are kept as by a
drafter of i.i.d. acceptance α. Each oracle run follows a target-only run of its own; printed are the median
goodput and the median of each variant's ratio to the target-only run beside it.

The oracle row at α = 1 is the bound for any proposer on this machine, model and workload (``specplug compare
--ceiling`` puts it in the load bench's table); the α rows say what acceptance a proposer needs to reach a
given speed-up; ``-p NAME:γ`` puts a real proposer beside them. Every run's output is checked against
target-only's (greedy exactness holds for any q).
"""
from __future__ import annotations

import argparse
import statistics
import time

import specplug
from specplug.bench.oracle import OracleProposer, greedy_outputs
from specplug.bench.workloads import humaneval_prompts
from specplug.engine import prompt_ids


def decode(target, proposer, prompts: list[str], batch_size: int, tokens: int, gamma: int):
    """One run: (results, seconds)."""
    t0 = time.perf_counter()
    results = specplug.generate_batch(target, proposer, prompts, max_new_tokens=tokens, sampling=specplug.GREEDY,
                                      num_speculative_tokens=gamma, max_batch_size=batch_size)
    return results, time.perf_counter() - t0


def real_variant(spec: str) -> tuple[str, int]:
    """``NAME:γ`` -> (NAME, γ)."""
    name, _, gamma = spec.rpartition(":")
    if not (name and gamma.isdigit()):
        raise argparse.ArgumentTypeError(f"expected NAME:γ (e.g. suffix:6), got {spec!r}")
    return name, int(gamma)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:pycode")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--gammas", default="2,4,6")
    parser.add_argument("--alphas", default="1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-p", "--proposer", dest="real", action="append", default=[], type=real_variant,
                        help="NAME:γ, a registered proposer run beside the oracle, paired alike (repeatable)")
    args = parser.parse_args()
    target = specplug.Target.from_pretrained(args.target)
    prompts = humaneval_prompts(args.requests)
    outputs = greedy_outputs(target, prompts, args.tokens)
    expected = [outputs[tuple(prompt_ids(target, p))] for p in prompts]
    made = sum(map(len, expected))
    vocab = target.vocab_size
    gammas = [int(g) for g in args.gammas.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    print(f"{args.target}, {args.requests} requests x {args.tokens} tokens, greedy, oracle drafts (no drafting "
          f"cost), medians of {args.repeats}: tok/s (x target-only, paired run by run)")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        runs: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            variants = [(f"oracle α={a:g} γ={g}", lambda a=a: OracleProposer(outputs, vocab, a, seed=repeat), g)
                        for a in alphas for g in gammas]
            variants += [(f"{name} γ={g}", lambda name=name: specplug.get_proposer(name, target=target), g)
                         for name, g in args.real]
            for label, make, gamma in variants:
                _, base = decode(target, None, prompts, b, args.tokens, 0)  # paired: the pace drifts
                results, wall = decode(target, make(), prompts, b, args.tokens, gamma)
                if [r.tokens for r in results] != expected:
                    raise SystemExit(f"B = {b}, {label}: output parted from target-only")
                runs.setdefault("target-only", []).append(base)
                runs.setdefault(label, []).append(wall)
                ratios.setdefault(label, []).append(base / wall)
        print(f"B = {b}:")
        for label, walls in runs.items():
            ratio = statistics.median(ratios.get(label, [1.0]))
            print(f"  {label:22} {made / statistics.median(walls):8.1f} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
