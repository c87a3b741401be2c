"""Replay a γ policy over recorded acceptance and a fixed cost table: its choices' quality without the machine.

    python benchmarks/policy_replay.py record --proposer ngram --out ngram.json [--tokens 128] [--requests 16]
                                              [--ask deepest]
    python benchmarks/policy_ab.py --proposer ngram --batch-size 4 --gammas 0,1,2,3,4,6,8 --tokens 128 \\
        --repeats 2 --save-steps steps.json
    python benchmarks/policy_replay.py replay --trace ngram.json --steps steps.json [--noise 0.1] [--seeds 20] \\
        [--policy scratch.py:MyPolicy] [--first 16] [--smooth] [--losses] [--by-rows]

On a shared 2-core machine one A/B's repeats move a cell by ±5 points; pricing the passes afterwards
(policy_ab.py) takes the noise out of the clock, not out of the policy, which reacts to the noisy costs it
measures. The replay takes both out, so a rule can be judged in seconds and A/B'd on the machine afterwards:

- ``record``: the target's greedy output for each request, then the proposer rolled along it, asked for
  k = 1..``--depth`` tokens at every position (each step's drafts rejected, so every position is visited): how
  many it drafted and how many of them the target's output matches (``--ask deepest`` for a model drafter:
  asked once for ``--depth``, whose greedy chain's first k are its k-token draft). Greedy, that is all a step asking k at
  position t needs, so any policy's run follows from the trace. Rows of a batch each draft as if alone (a
  drafter shared across requests, ``suffix``, sees the earlier requests whole).
- ``replay``: the engine's batch loop in miniature (rows join as others finish, k capped by the budget, one
  ``choose_batch`` and every row's ``update`` per step, as :class:`specplug.engine.Engine` calls them) over a
  cost table fitted to the steps policy_ab.py saved on this machine: the target's pass by (rows, positions
  scored), medians, interpolated along positions; drafting and choosing by a least-squares line over clean
  steps, plus a cost per row catching up; the rest of a step per row. Every static γ and the cost-model policy
  (fresh, and kept over three runs) are priced on that table alone, so two rules compare exactly; ``--noise``
  makes the policy *see* each cost times a log-normal factor (the run stays priced by the table), over
  ``--seeds`` seeds: what reacting to noise costs it. Each static γ's table price is printed beside its
  measured goodput in the steps file: how far the table is from the machine. ``--first`` replays other
  requests of a longer trace (its batch size and count from the steps); ``--smooth`` prices passes on a
  plane (a rare shape's median can hold a pause the policy then steers around or into); ``--losses`` shows
  where the policy loses against the best static γ, step by step: each step's time beyond what its tokens
  would have cost at the rate of every row drafting that γ from the same positions, by the step's longest
  draft (off, 1-2, 3-4, 5+); ``--by-rows`` the steps and table time by the rows in a step (once no request
  waits, a batch drains: its slowest row sets how long the last steps run with fewer rows);
  ``--spell FIRST:LAST:FACTOR`` also replays a policy kept over ``--kept-runs`` runs that sees every cost
  ``FACTOR`` times dearer in its steps FIRST to LAST - 1, counted over those runs (a slow spell of a shared
  machine, which a kept pass table remembers), and prints each run against the best static γ. Each policy
  also gets its own calls' time a step over its fresh, kept and noisy runs (warm, unlike a decode's, whose
  calls find their data out of cache after each pass) and a digest of every step's ks: a rewrite for speed
  alone must leave the digest as it was.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import specplug
from specplug.batch import generate_batch
from specplug.engine import prompt_ids
from specplug.policies import CostModelPolicy, FixedPolicy, interpolated, non_decreasing
from specplug.types import SequenceState
from specplug.verifier import Verdict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_ab import load_policy  # noqa: E402  (a sibling script)


def record(target, proposer_name: str, prompts: list[str], tokens: int, depth: int, every_k: bool = True) -> list[dict]:
    """Per request, the target's greedy output and at each position, for k = 1..``depth``, how many tokens the
    proposer drafts when asked for k and how many of them match the output; asked for each k in turn, or with
    ``every_k=False`` once for ``depth``, a k-token draft being its first k (a greedy chain drafted token by
    token: a model drafter, which also expects new tokens between two asks)."""
    greedy = [specplug.SamplingParams(temperature=0) for _ in prompts]
    outputs = [r.tokens for r in generate_batch(target, None, prompts, max_new_tokens=tokens, sampling=greedy,
                                                   max_batch_size=len(prompts))]
    proposer = specplug.get_proposer(proposer_name, target=target)
    trace = []
    for prompt, out in zip(prompts, outputs):
        ids = prompt_ids(target, prompt)
        seq = SequenceState(ids=list(ids), num_prompt=len(ids), sampling=greedy[0],
                            rng=greedy[0].generator(target.device), target=target)
        seq.scratch["proposer"] = proposer_name
        proposer.begin(seq)
        positions = []
        for t, token in enumerate(out):
            # asked for each k in turn: a k-token draft need not be the first k of a longer one (suffix
            # weighs a continuation by its length)
            by_k = []
            for k in range(1, depth + 1) if every_k else [depth]:
                drafted = proposer.propose(seq, k).tokens.tolist()
                match = next((i for i, (d, o) in enumerate(zip(drafted, out[t:])) if d != o),
                             min(len(drafted), len(out) - t))
                by_k.append((len(drafted), match))
            if not every_k:
                (reach, match), = by_k
                by_k = [(min(k, reach), min(k, match)) for k in range(1, depth + 1)]
            positions.append(by_k)
            seq.ids.append(token)
            proposer.observe(seq, Verdict(accepted=0, proposed=by_k[-1][0], tokens=[token]))
        proposer.end(seq)
        trace.append({"output": out, "positions": positions})
    return trace


class CostTable:
    """Seconds of each part of a step, fitted to the steps policy_ab.py saved (see the module docstring); with
    ``smooth`` the target's pass from a plane in (positions, rows) instead of per-shape medians."""

    def __init__(self, saved: dict, smooth: bool = False):
        steps = [s for run in saved["runs"] for s in run["steps"]]
        passes: dict[tuple[int, int], list[float]] = {}
        for s in steps:
            passes.setdefault((s["batch_size"], s["tokens"]), []).append(s["verify_time"])
        self.passes = {shape: statistics.median(v) for shape, v in passes.items()}
        # a + b·positions + c·rows through the shapes seen 3 times or more: a rare shape's median may hold a
        # pause (one 15-row pass at 2.5× its neighbours), and a policy steers towards an underpriced shape
        seen = [(b, n, self.passes[(b, n)]) for (b, n), v in passes.items() if len(v) >= 3]
        self.plane = None
        if smooth and len(seen) >= 3:
            self.plane, *_ = np.linalg.lstsq(np.array([[1.0, n, b] for b, n, _ in seen]),
                                             np.array([t for *_, t in seen]), rcond=None)
        # the spread of a pass around its shape's median: the noise a policy sees (log scale, robust)
        logs = [math.log(t / self.passes[shape]) for shape, v in passes.items() if len(v) >= 5 for t in v]
        self.spread = 1.4826 * statistics.median(abs(x) for x in logs) if logs else 0.0
        clean = [s for s in steps if s["backlog_rows"] == 0]
        design = np.array([self._features(s["batch_size"], s["draft_rows"], s["scored"] - 1 if s["drafted"] else 0)
                           for s in clean])
        self.draft_coef, *_ = np.linalg.lstsq(design, np.array([s["draft_time"] for s in clean]), rcond=None)
        catching = [(s["draft_time"] - self._drafting(s["batch_size"], s["draft_rows"], s["scored"] - 1)) / s["backlog_rows"]
                    for s in steps if s["backlog_rows"] and s["drafted"]]
        self.catch_up = max(0.0, statistics.median(catching)) if catching else 0.0
        # what the steps do not hold (prefill, admitting; settling each row: update, emit, observe): a line in
        # the row-steps through every run, neither part below 0
        rest = np.array([run["seconds"] - sum(s["draft_time"] + s["verify_time"] for s in run["steps"])
                         for run in saved["runs"]])
        row_steps = np.array([sum(s["batch_size"] for s in run["steps"]) for run in saved["runs"]], dtype=float)
        (self.per_run, self.per_row_step), *_ = np.linalg.lstsq(np.stack([np.ones_like(row_steps), row_steps], 1),
                                                                rest, rcond=None)
        if self.per_row_step < 0 or self.per_run < 0:
            self.per_run, self.per_row_step = max(0.0, float(np.median(rest))), 0.0

    @staticmethod
    def _features(batch_size: int, rows: int, passes: int) -> list[float]:
        # choosing (by rows in the step) and, where anything is drafted, a fixed part and a part per pass
        drafting = 1.0 if rows and passes else 0.0
        return [1.0, batch_size, drafting, rows * drafting, passes, rows * passes]

    def _drafting(self, batch_size: int, rows: int, passes: int) -> float:
        return max(0.0, float(np.dot(self.draft_coef, self._features(batch_size, rows, passes))))

    def step(self, batch_size: int, drafted: list[int], backlog_rows: int) -> tuple[float, float]:
        """(choosing and drafting, the target's pass) seconds of a step whose rows drafted ``drafted`` tokens."""
        rows, passes = sum(1 for d in drafted if d), max(drafted, default=0)
        draft = self._drafting(batch_size, rows, passes) + self.catch_up * backlog_rows
        return draft, self.pass_time(batch_size, sum(d + 1 for d in drafted))

    def pass_time(self, batch_size: int, tokens: int) -> float:
        """On the plane where smooth; else along positions at this batch size (the nearest measured one if none):
        the measured medians made non-decreasing (a shape seen once or twice may hold a pause), interpolated
        between them, below them the fewest's, beyond them on the line through the two longest."""
        if self.plane is not None:
            return max(float(self.plane @ np.array([1.0, tokens, batch_size])), 1e-6)
        sizes = {b for b, _ in self.passes}
        here = min(sizes, key=lambda b: (abs(b - batch_size), -b))
        points = non_decreasing(sorted((n, t) for (b, n), t in self.passes.items() if b == here))
        if tokens <= points[0][0]:
            return points[0][1]
        inside = interpolated(points, tokens)
        if inside is not None:
            return inside
        if len(points) < 2:
            return points[-1][1] * tokens / points[-1][0]
        (n0, t0), (n1, t1) = points[-2:]
        return max(t1, t0 + (t1 - t0) * (tokens - n0) / (n1 - n0))


class SlowSpell:
    """A spell in which the machine runs ``factor`` times slower, from the policy's ``first`` step to before its
    ``last`` one, counted over every run it is passed to: what a policy kept across runs (a server's) sees of a
    shared machine's slow spell. Only what the policy sees is scaled; the replay's clock stays the table's."""

    def __init__(self, first: int, last: int, factor: float):
        self.first, self.last, self.factor, self.steps = first, last, factor, 0

    def tick(self) -> float:
        """This step's factor; counts the step."""
        self.steps += 1
        return self.factor if self.first <= self.steps - 1 < self.last else 1.0


def replay(policy, trace: list[dict], table: CostTable, batch_size: int, tokens: int, name: str,
           noise: float = 0.0, seed: int = 0, losses: tuple[int, dict[str, float]] | None = None,
           spell: SlowSpell | None = None, by_rows: dict[int, list[float]] | None = None,
           own: dict | None = None) -> float:
    """Goodput (tokens per table second) of ``policy`` decoding every traced request ``tokens`` tokens long,
    ``batch_size`` rows at a time, the policy seeing each cost times exp(noise · N(0, 1)), and times the
    ``spell``'s factor in its steps. With ``losses`` (γ, totals), each step's seconds beyond what its tokens
    would have cost at the rate every row drafting γ would have had at the same positions, added to totals by
    the step's longest draft (:func:`_phase`). With ``by_rows``, [steps, table seconds] added up by the rows in a
    step: a batch draining (no request waits) runs its last steps with fewer rows. With ``own``, the policy's
    own calls: their seconds (``seconds``), the steps (``steps``) and a digest of every step's ks (``choices``),
    which two versions of a rule share exactly where they choose alike."""
    rng = random.Random(seed)
    jitter = (lambda s: s * math.exp(noise * rng.gauss(0.0, 1.0))) if noise else (lambda s: s)
    waiting = [SimpleNamespace(seq=SimpleNamespace(scratch={"proposer": name, "max_node_budget": 0}),
                               trace=req["positions"], done=0, drafted_last=False) for req in trace]
    live, clock, emitted_all = [], table.per_run, 0
    while waiting or live:
        while waiting and len(live) < batch_size:  # rows join as others finish
            row = waiting.pop(0)
            live.append(row)
            if hasattr(policy, "begin"):
                policy.begin(row.seq)
        B = len(live)
        for row in live:
            row.seq.scratch["batch_size"] = B
        k_maxes = [max(0, tokens - row.done - 1) for row in live]
        started = time.perf_counter()
        if len(trace) > 1 and hasattr(policy, "choose_batch"):
            ks = [max(0, min(int(k), m)) for k, m in zip(policy.choose_batch([r.seq for r in live], k_maxes), k_maxes)]
        else:
            ks = [m and max(0, min(int(policy.choose(r.seq, m)), m)) for r, m in zip(live, k_maxes)]
        choosing = time.perf_counter() - started
        # (drafted, accepted) per row: what the proposer drafted asked for k there, and how much of it matched
        drafted, accepted = zip(*(row.trace[row.done][k - 1] if k else (0, 0) for k, row in zip(ks, live)))
        backlog = sum(1 for k, row in zip(ks, live) if k > 0 and not row.drafted_last)
        draft_time, pass_time = table.step(B, drafted, backlog)
        seconds = draft_time + pass_time + table.per_row_step * B
        clock += seconds
        if by_rows is not None:
            tally = by_rows.setdefault(B, [0, 0.0])
            tally[0], tally[1] = tally[0] + 1, tally[1] + seconds
        slow = spell.tick() if spell is not None else 1.0
        seen = lambda seconds: jitter(seconds * slow)  # noqa: E731
        if losses is not None:
            _count_loss(losses, live, k_maxes, table, B, max(ks), draft_time + pass_time,
                        sum(min(a + 1, tokens - row.done) for a, row in zip(accepted, live)), tokens)
        step = {"scored": max(drafted) + 1, "tokens": sum(d + 1 for d in drafted), "drafted": sum(drafted),
                "draft_rows": sum(1 for d in drafted if d), "asked_rows": sum(1 for k in ks if k),
                "backlog_rows": backlog,
                "draft_time": seen(draft_time), "verify_time": seen(pass_time), "batch_size": B, "tree_rows": 0,
                "padded": False}
        share = step["draft_time"] / max(1, step["asked_rows"])
        started = time.perf_counter()
        for row, k, d, a in zip(live, ks, drafted, accepted):
            row.drafted_last = k > 0
            row.seq.scratch["batch_step"], row.seq.scratch["drafted_tree"] = step, None
            if hasattr(policy, "update"):
                policy.update(row.seq, d, a, share if k else 0.0, step["verify_time"], B)
        if own is not None:
            own["seconds"] = own.get("seconds", 0.0) + choosing + time.perf_counter() - started
            own["steps"] = own.get("steps", 0) + 1
            own.setdefault("choices", hashlib.sha256()).update(repr(ks).encode())
        for row, a in zip(live, accepted):
            emitted = min(a + 1, tokens - row.done)
            row.done += emitted
            emitted_all += emitted
        live = [row for row in live if row.done < tokens]
    return emitted_all / clock


def _phase(k: int) -> str:
    return "off" if k == 0 else "k 1-2" if k <= 2 else "k 3-4" if k <= 4 else "k 5+"


def _count_loss(losses: tuple[int, dict[str, float]], live: list, k_maxes: list[int], table: CostTable, B: int,
                k: int, seconds: float, emitted: int, tokens: int) -> None:
    """One step's loss against every row drafting γ from the same positions (no backlog), by phase."""
    gamma, totals = losses
    ref = [row.trace[row.done][min(gamma, m) - 1] if min(gamma, m) else (0, 0) for row, m in zip(live, k_maxes)]
    ref_draft, ref_pass = table.step(B, [d for d, _ in ref], 0)
    ref_emitted = sum(min(a + 1, tokens - row.done) for (_, a), row in zip(ref, live))
    ref_seconds = ref_draft + ref_pass + table.per_row_step * B
    lost = seconds + table.per_row_step * B - emitted * ref_seconds / ref_emitted
    totals[_phase(k)] = totals.get(_phase(k), 0.0) + lost


def _print_by_rows(label: str, policy, trace: list[dict], table: CostTable, B: int, tokens: int, name: str) -> None:
    """One line: ``policy``'s steps and table seconds by the rows in a step, for one run without noise."""
    by_rows: dict[int, list[float]] = {}
    replay(policy, trace, table, B, tokens, name, by_rows=by_rows)
    print(f"{label:18s} by rows in a step: " + ", ".join(f"{rows}: {int(n)} steps {seconds:.2f} s"
                                                       for rows, (n, seconds) in sorted(by_rows.items(), reverse=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="the target's greedy output and the proposer's drafts along it")
    rec.add_argument("--target", default="zoo:pycode")
    rec.add_argument("--proposer", required=True)
    rec.add_argument("--requests", type=int, default=16)
    rec.add_argument("--tokens", type=int, default=128)
    rec.add_argument("--depth", type=int, default=8, help="the longest draft asked (the policy's max_gamma)")
    rec.add_argument("--out", required=True)
    rec.add_argument("--ask", choices=("every-k", "deepest"), default="every-k",
                     help="ask for each k in turn (lookup drafters), or once for --depth, taking its first k as the "
                          "k-token draft (greedy chains: draft-model, eagle, mtp)")
    rep = sub.add_parser("replay", help="every static γ and the cost-model policy over a trace and a cost table")
    rep.add_argument("--trace", required=True, help="what `record` wrote")
    rep.add_argument("--steps", required=True, help="what policy_ab.py --save-steps wrote (its batch size is used)")
    rep.add_argument("--gammas", default="0,1,2,3,4,6,8")
    rep.add_argument("--noise", type=float, default=None, help="log-normal σ of the costs the policy sees "
                                                               "(default: the steps' own spread)")
    rep.add_argument("--seeds", type=int, default=20)
    rep.add_argument("--policy", action="append", default=[], help="path.py:Class, a variant replayed beside "
                                                                   "cost-model (built with max_gamma=--depth)")
    rep.add_argument("--depth", type=int, default=8)
    rep.add_argument("--first", type=int, default=0, help="the first traced request replayed (a trace recorded with "
                                                          "more requests than the steps' run holds several loads)")
    rep.add_argument("--smooth", action="store_true", help="price passes on a plane in (positions, rows) through "
                                                           "the shapes seen 3+ times, not per-shape medians")
    rep.add_argument("--losses", action="store_true", help="also where each policy loses against the best static γ, "
                                                           "step by step, by the step's longest draft")
    rep.add_argument("--spell", default=None, metavar="FIRST:LAST:FACTOR",
                     help="also a kept policy seeing costs FACTOR times dearer in its steps FIRST..LAST-1")
    rep.add_argument("--kept-runs", type=int, default=5, help="runs of the kept policy through --spell")
    rep.add_argument("--by-rows", action="store_true", help="also each fresh policy's and the best static γ's steps "
                     "and table seconds by the rows in a step (where a draining batch's tail goes)")
    args = ap.parse_args()
    if args.command == "record":
        from specplug.bench.workloads import humaneval_prompts
        target = specplug.Target.from_pretrained(args.target)
        trace = record(target, args.proposer, humaneval_prompts(args.requests), args.tokens, args.depth,
                       args.ask == "every-k")
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "proposer": args.proposer, "depth": args.depth, "requests": trace}, f)
        return
    with open(args.trace) as f:
        traced = json.load(f)
    with open(args.steps) as f:
        saved = json.load(f)
    table, B, tokens, name = CostTable(saved, args.smooth), saved["batch_size"], saved["tokens"], traced["proposer"]
    trace = traced["requests"][args.first: args.first + saved["requests"]]
    noise = table.spread if args.noise is None else args.noise
    print(f"{name}, B = {B}, {len(trace)} requests × {tokens} tokens; the policy sees costs × exp({noise:.3f}·N(0,1)) "
          f"in the noisy columns; drafting {1e3 * table.catch_up:.2f} ms a row catching up, "
          f"{1e3 * table.per_row_step:.2f} ms a row-step and {table.per_run:.2f} s a run besides")
    measured: dict[str, list[float]] = {}
    for run in saved["runs"]:
        measured.setdefault(run["variant"], []).append(run["tokens"] / run["seconds"])
    static = {g: replay(FixedPolicy(g), trace, table, B, tokens, name) for g in map(int, args.gammas.split(","))}
    best = max(static.values())
    best_gamma = max(static, key=static.get)
    for g, rate in static.items():
        mine = measured.get(f"γ={g}") if args.first == 0 else None  # the steps' run decoded the first requests
        print(f"γ={g:<16d} {rate:7.1f} tokens/s on the table" + (f"   (measured {statistics.median(mine):.1f})" if mine else ""))
    if args.by_rows:
        _print_by_rows(f"γ={best_gamma}", FixedPolicy(best_gamma), trace, table, B, tokens, name)
    variants = {"cost-model": CostModelPolicy}
    variants.update({spec: load_policy(spec) for spec in args.policy})
    for label, cls in variants.items():
        own: dict = {}
        fresh = replay(cls(max_gamma=args.depth), trace, table, B, tokens, name, own=own)
        kept_policy = cls(max_gamma=args.depth)
        kept = [replay(kept_policy, trace, table, B, tokens, name, own=own) for _ in range(3)][-1]
        totals: dict[str, float] = {}
        noisy = [replay(cls(max_gamma=args.depth), trace, table, B, tokens, name, noise, seed,
                        (best_gamma, totals) if args.losses else None, own=own) for seed in range(args.seeds)]
        print(f"{label:18s} fresh {100 * (fresh / best - 1):+5.1f}%  kept {100 * (kept / best - 1):+5.1f}%  "
              f"noisy fresh median {100 * (statistics.median(noisy) / best - 1):+5.1f}% "
              f"(spread {100 * (min(noisy) / best - 1):+.1f} to {100 * (max(noisy) / best - 1):+.1f}) against the best static γ")
        print(f"{'':18s} own calls {1e6 * own['seconds'] / own['steps']:.0f} µs a step over {own['steps']} steps; "
              f"choices {own['choices'].hexdigest()[:12]} (equal digests: the same ks at every step)")
        if args.losses:  # as a share of the noisy runs' table time
            seconds = sum(tokens * len(trace) / rate for rate in noisy)
            shares = [f"{phase} {100 * totals[phase] / seconds:+.1f}%"
                      for phase in ("off", "k 1-2", "k 3-4", "k 5+") if phase in totals]
            print(f"{'':18s} lost against γ={best_gamma} step by step, noisy fresh runs: " + ", ".join(shares))
        if args.by_rows:
            _print_by_rows(label, cls(max_gamma=args.depth), trace, table, B, tokens, name)
        if args.spell:
            first, last, factor = args.spell.split(":")
            spell, spelled = SlowSpell(int(first), int(last), float(factor)), cls(max_gamma=args.depth)
            runs = [replay(spelled, trace, table, B, tokens, name, spell=spell) for _ in range(args.kept_runs)]
            print(f"{'':18s} kept through the spell, run by run: "
                  + " ".join(f"{100 * (rate / best - 1):+.1f}%" for rate in runs))


if __name__ == "__main__":
    main()
