"""Is acceptance a coin with one α? Acceptance by the previous step's outcome and by drafted position.

    python benchmarks/acceptance_streaks.py [--proposer ngram] [--gamma 4] [--batch-size 4] [--requests 16]

Decodes HumanEval requests greedily at a fixed γ through the batched decoder and reports, per regime (the
request's previous step: all drafts accepted, or not), the steps, α (accepted / tried positions, a step trying
positions up to its first rejection), the share of fully accepted steps, the acceptance at each drafted
position given that the ones before it were accepted, and how long the proposals were; then the drafts
accepted per step by the proposal's length (a proposer may draft fewer than γ: ngram stops where its
match's continuation ends). The cost-model
policy's expected tokens assume one α per request at every position (geometric); these figures show how far
a proposer departs from that.
"""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import specplug
from specplug.batch import generate_batch
from specplug.bench.workloads import humaneval_prompts
from specplug.policies import FixedPolicy


class RecordingPolicy(FixedPolicy):
    """A fixed γ that records each request's (proposed, accepted) per step."""

    def __init__(self, gamma: int):
        super().__init__(gamma)
        self.steps: dict[int, list[tuple[int, int]]] = defaultdict(list)

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        self.steps[id(seq)].append((proposed, accepted))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode")
    ap.add_argument("--proposer", default="ngram")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    target = specplug.Target.from_pretrained(args.target)
    prompts = humaneval_prompts(args.requests)
    sampling = [specplug.SamplingParams(temperature=0, seed=i) for i in range(len(prompts))]
    policy = RecordingPolicy(args.gamma)
    generate_batch(target, specplug.get_proposer(args.proposer, target=target), prompts,
                   max_new_tokens=args.max_new_tokens, sampling=sampling, num_speculative_tokens=policy,
                   max_batch_size=args.batch_size)

    by_length: dict[int, list[int]] = defaultdict(list)  # proposal length -> drafts accepted, per step
    for steps in policy.steps.values():
        for proposed, accepted in steps:
            if proposed:
                by_length[proposed].append(accepted)
    regimes = {name: {"steps": 0, "full": 0, "reached": Counter(), "kept": Counter(), "lengths": Counter()}
               for name in ("after a fully accepted step", "after any other step")}
    for steps in policy.steps.values():
        full_before = False
        for proposed, accepted in steps:
            if proposed == 0:  # nothing drafted: no streak to go on
                full_before = False
                continue
            r = regimes["after a fully accepted step" if full_before else "after any other step"]
            r["steps"] += 1
            r["full"] += accepted == proposed
            r["lengths"][proposed] += 1
            for position in range(1, min(accepted + 1, proposed) + 1):  # tried up to the first rejection
                r["reached"][position] += 1
                r["kept"][position] += position <= accepted
            full_before = accepted == proposed
    print(f"{args.proposer}, γ = {args.gamma}, B = {args.batch_size}, {args.requests} requests × "
          f"{args.max_new_tokens} tokens, greedy")
    for name, r in regimes.items():
        if not r["steps"]:
            continue
        tried, kept = sum(r["reached"].values()), sum(r["kept"].values())
        by_position = "  ".join(f"{r['kept'][j] / r['reached'][j]:.2f} ({r['reached'][j]})"
                                for j in sorted(r["reached"]))
        print(f"{name}: {r['steps']} steps, α {kept / tried:.2f}, fully accepted {r['full'] / r['steps']:.2f}")
        print(f"    by position (tried): {by_position}")
        print(f"    proposal lengths: {dict(sorted(r['lengths'].items()))}")
    print("drafts accepted by proposal length (steps): " + "  ".join(
        f"{n}: {sum(a) / len(a):.2f} ({len(a)})" for n, a in sorted(by_length.items())))


if __name__ == "__main__":
    main()
