"""The cost-model policy against static γ at one batch size, alternating in one process: is a gap real or noise?

    python benchmarks/policy_ab.py [--batch-size 4] [--proposer draft-model] [--gammas 6,8] [--repeats 6]
                                   [--tokens 64] [--without-reach-relaxation] [--policy old.py:CostModelPolicy]
                                   [--save-steps steps.json]

The load bench runs each cell once per repeat minutes apart, so a slow spell of the shared machine can sit in
one cell's runs; here every repeat runs each static γ, a fresh policy and one kept across repeats back to back
(order rotated per repeat) on the same 16 HumanEval requests × 64 tokens, greedy; with
``--without-reach-relaxation`` also a fresh policy whose unasked depths keep their reach (REACH_RELAX = 1, the
rule before the relaxation); with ``--policy`` a fresh and a kept one of each class given (e.g. ``git show
HEAD:specplug/policies.py`` saved with its relative imports made absolute: the rule before a change). With
``--save-steps`` it writes every run's steps, the cost table benchmarks/policy_replay.py prices runs by. Prints
each variant's median
goodput (tokens/s) and the median over repeats of its goodput over the best static γ's in that repeat, the best
being the static γ with the highest median (a per-repeat maximum over several γ would be biased up by the noise).

At B = 1 it also prices every run by one line fitted to all of them, seconds = a·steps + b·drafted tokens, and
prints that goodput too: the choices' quality without the machine's noise (a run's step count and drafted
tokens depend only on the choices, greedy), though not what choosing costs (the policy's own time).

At every B it also prices the target's passes by a table: each step's pass (rule included) at the median over all
runs of every pass with the same rows and positions scored, the rest of each run (drafting, catching up, choosing,
updating, prefill) as measured. The target's passes are most of a step and the part slow spells stretch most, so
this takes most of the noise out while keeping every cost a policy's choices cause.

Each variant's own calls (``choose``/``choose_batch`` and ``update``) are timed too: milliseconds a step and the
share of its run. A static γ spends next to nothing there, so for the cost-model policy that share is part of
its gap to the best static γ whatever it chooses.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import numpy as np

import specplug
from specplug.batch import generate_batch
from specplug.engine import as_policy
from specplug.bench.workloads import humaneval_prompts
from specplug import policies
from specplug.policies import CostModelPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode")
    ap.add_argument("--proposer", default="draft-model")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--gammas", default="6,8", help="static γ values, comma-separated")
    ap.add_argument("--max-gamma", type=int, default=8, help="the policy's largest γ")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--without-reach-relaxation", action="store_true", help="also the policy without it")
    ap.add_argument("--policy", action="append", default=[], metavar="PATH.py:CLASS",
                    help="a variant of the policy (e.g. a scratch copy of policies.py before a change) run fresh "
                         "and kept beside it, built with max_gamma=--max-gamma")
    ap.add_argument("--save-steps", metavar="FILE", help="write every run's steps (costs, rows) as JSON, e.g. for "
                                                          "benchmarks/policy_replay.py's cost table")
    args = ap.parse_args()
    target = specplug.Target.from_pretrained(args.target)
    prompts = humaneval_prompts(args.requests)
    sampling = [specplug.SamplingParams(temperature=0, seed=i) for i in range(len(prompts))]
    kept = CostModelPolicy(max_gamma=args.max_gamma)
    variants = {f"γ={g}": int(g) for g in args.gammas.split(",")}
    variants.update({"cost-model fresh": None, "cost-model kept": kept})
    if args.without_reach_relaxation:
        variants["no reach relaxation"] = "no-relax"
    for spec in args.policy:  # each variant fresh, and one kept across repeats as the landed policy is
        variant, label = load_policy(spec), spec.rpartition("/")[2]
        variants.update({f"{label} fresh": variant, f"{label} kept": variant(max_gamma=args.max_gamma)})
    relax = policies.REACH_RELAX

    runs: list[tuple[str, float, int, int, int]] = []  # (variant, seconds, tokens, steps, drafted tokens)
    passes: list[list[tuple[int, int, float]]] = []  # per run, its steps' (rows, positions scored, seconds)
    saved: list[dict] = []  # per run, what --save-steps writes
    own: dict[str, list[tuple[float, float]]] = {}  # per variant and run: the policy's own seconds a step, share

    def run(name: str) -> float:
        gamma = variants[name]
        proposer = specplug.get_proposer(args.proposer, target=target)
        if gamma in (None, "no-relax"):
            policy = CostModelPolicy(max_gamma=args.max_gamma)
        elif isinstance(gamma, type):
            policy = gamma(max_gamma=args.max_gamma)
        else:
            policy = gamma
        policy = StepRecorder(as_policy(policy))
        policies.REACH_RELAX = 1.0 if gamma == "no-relax" else relax  # read at each count
        start = time.perf_counter()
        results = generate_batch(target, proposer, prompts, max_new_tokens=args.tokens, sampling=sampling,
                                 num_speculative_tokens=policy, max_batch_size=args.batch_size)
        seconds, tokens = time.perf_counter() - start, sum(len(r.tokens) for r in results)
        runs.append((name, seconds, tokens, sum(r.stats.target_calls for r in results),
                     sum(r.stats.draft_tokens for r in results)))
        passes.append(policy.passes)
        own.setdefault(name, []).append((policy.policy_time / max(len(policy.passes), 1), policy.policy_time / seconds))
        saved.append({"variant": name, "seconds": seconds, "tokens": tokens, "steps": policy.steps,
                      "policy_time": policy.policy_time})
        return tokens / seconds

    for name in variants:  # warm-up: every shape once, and the kept policy's first run
        run(name)
    del runs[:], passes[:], saved[:]
    own.clear()
    names = list(variants)
    goodput: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            goodput[name].append(run(name))
    static = [name for name in names if name.startswith("γ")]
    best = goodput[max(static, key=lambda name: statistics.median(goodput[name]))]
    print(f"{args.proposer}, B = {args.batch_size}, {args.requests} requests, {args.repeats} repeats")
    for name in names:
        paired = statistics.median(g / b for g, b in zip(goodput[name], best))
        print(f"{name:18s} {statistics.median(goodput[name]):7.0f} tokens/s   {100 * (paired - 1):+5.1f}% against the "
              f"best static γ, paired by repeat")
    print("the policy's own calls (choosing and updating), median over repeats:")
    for name in names:
        print(f"{name:18s} {1e3 * statistics.median(t for t, _ in own[name]):6.3f} ms a step, "
              f"{100 * statistics.median(share for _, share in own[name]):4.1f}% of a run")
    if args.batch_size == 1:
        print_priced_by_one_line(runs, static)
    print_priced_by_pass_table(runs, passes, static)
    if args.save_steps:
        with open(args.save_steps, "w") as f:
            json.dump({"target": args.target, "proposer": args.proposer, "batch_size": args.batch_size,
                       "requests": args.requests, "tokens": args.tokens, "runs": saved}, f)


def load_policy(spec: str) -> type:
    """``path.py:Name`` -> that class, from a file outside the package (a scratch variant of a policy, run or
    replayed beside the landed one)."""
    path, _, attr = spec.rpartition(":")
    name = f"variant_{abs(hash(path))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(module_spec)  # dataclasses look it up
    module_spec.loader.exec_module(module)
    return getattr(module, attr)


class StepRecorder:
    """``policy`` as it is (choices, updates, ``choose_batch`` where it has one), recording what each step's
    target pass scored and cost: ``passes``, (rows, positions, seconds) per step; and in a batch each step's
    whole :class:`~specplug.types.BatchStep` (``steps``); and the seconds the policy's own calls took
    (``policy_time``: choosing and updating, which a static γ hardly spends)."""

    def __init__(self, policy):
        self.policy, self.passes, self.steps, self._last = policy, [], [], None
        self.policy_time = 0.0

    def __getattr__(self, name):
        found = getattr(self.policy, name)
        if name not in ("choose", "choose_batch"):
            return found

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return found(*args)
            finally:
                self.policy_time += time.perf_counter() - t0
        return timed

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        step = seq.scratch.get("batch_step")
        if step is None:  # one row: its own step
            self.passes.append((1, proposed + 1, verify_time))
        elif step is not self._last:  # a batch: every row reports the same step
            self._last = step
            self.passes.append((step["batch_size"], step["tokens"], step["verify_time"]))
            self.steps.append(dict(step))
        update = getattr(self.policy, "update", None)
        if update is not None:
            t0 = time.perf_counter()
            update(seq, proposed, accepted, draft_time, verify_time, batch_size)
            self.policy_time += time.perf_counter() - t0


def print_priced_by_pass_table(runs: list[tuple[str, float, int, int, int]], passes: list[list[tuple[int, int, float]]],
                               static: list[str]) -> None:
    """Each variant's goodput with its target passes priced by the median of all runs' passes of the same shape
    (rows, positions) and the rest of its time as measured (its median, and against the best static γ's)."""
    shapes: dict[tuple[int, int], list[float]] = {}
    for steps in passes:
        for rows, positions, seconds in steps:
            shapes.setdefault((rows, positions), []).append(seconds)
    table = {shape: statistics.median(times) for shape, times in shapes.items()}
    priced: dict[str, list[float]] = {}
    shares = []
    for (name, seconds, tokens, *_), steps in zip(runs, passes):
        measured = sum(s for *_, s in steps)
        shares.append(measured / seconds)
        priced.setdefault(name, []).append(tokens / (seconds - measured + sum(table[r, n] for r, n, _ in steps)))
    best = statistics.median(max((priced[name] for name in static), key=statistics.median))
    print(f"target passes priced by the median of {len(table)} pass shapes over all runs (the passes were "
          f"{100 * statistics.median(shares):.0f}% of a run's time, median):")
    for name, values in priced.items():
        print(f"{name:18s} {statistics.median(values):7.1f} tokens/s   {100 * (statistics.median(values) / best - 1):+5.1f}%"
              f" against the best static γ (spread {min(values):.1f}–{max(values):.1f})")


def print_priced_by_one_line(runs: list[tuple[str, float, int, int, int]], static: list[str]) -> None:
    """Each variant's goodput with every run priced by one least-squares line seconds = a·steps + b·drafted
    tokens through all runs (its median, and against the best static γ's)."""
    design = np.array([[steps, drafted] for _, _, _, steps, drafted in runs], dtype=float)
    wall = np.array([seconds for _, seconds, *_ in runs])
    (a, b), *_ = np.linalg.lstsq(design, wall, rcond=None)
    if b < 0:  # steps and drafted tokens moved together (few static γ): no share for drafting to find
        print("the line's drafting part came out negative: priced by steps alone (add γ = 0 to --gammas)")
        a, b = float(design[:, 0] @ wall / (design[:, 0] @ design[:, 0])), 0.0
    priced: dict[str, list[float]] = {}
    for name, _, tokens, steps, drafted in runs:
        priced.setdefault(name, []).append(tokens / (a * steps + b * drafted))
    best = statistics.median(max((priced[name] for name in static), key=statistics.median))
    print(f"priced by one line: {1e3 * a:.2f} ms a step + {1e3 * b:.2f} ms a drafted token")
    for name, values in priced.items():
        print(f"{name:18s} {statistics.median(values):7.1f} tokens/s   {100 * (statistics.median(values) / best - 1):+5.1f}%"
              f" against the best static γ (spread {min(values):.1f}–{max(values):.1f})")


if __name__ == "__main__":
    main()
