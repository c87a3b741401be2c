"""How much of a decode is the loop's own work, and how fast is the batched verifier?

    python benchmarks/loop_overhead.py [--target zoo:pycode] [--draft zoo:pycode-draft] [--tokens 256]
    python benchmarks/loop_overhead.py --batch-sizes 1,4,16 [--prompts 16] [--tokens 96]

With ``--batch-sizes``: target-only tokens/s of ``generate_batch`` on the target's lean (ragged) rows and on
HF's padded forward (``Target(lean=False)``), interleaved, median of --repeats, over held-out HumanEval prompts,
and single-sequence ``generate`` for reference.

Loop overhead = wall time outside the model forwards (target and draft) as a share of wall time, for a
greedy run, target-only and with draft-model; median of --repeats runs. Verifier: median time of
verify_batch for B=64, K=8, V=32,000 (random p and q).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specplug


class ForwardTimer:
    """Accumulates time spent inside a module's forward (hooks, so nothing in the loop changes)."""

    def __init__(self, *modules):
        self.total, self._start = 0.0, 0.0
        for m in modules:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.total += time.perf_counter() - self._start

    def wrap(self, obj, name: str) -> None:
        """Time a plain method too (the lean drafter's forward is not a module call)."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        setattr(obj, name, timed)


def loop_overhead(target, proposer, tokens, repeats, timer):
    shares, walls = [], []
    prompt = "def parse_args(argv):\n    "
    for _ in range(repeats):
        timer.total = 0.0
        t0 = time.perf_counter()
        specplug.generate(target, proposer, prompt, max_new_tokens=tokens, sampling=specplug.GREEDY,
                          num_speculative_tokens=4)
        wall = time.perf_counter() - t0
        shares.append(1 - timer.total / wall)
        walls.append(wall)
    return statistics.median(shares), statistics.median(walls)


def verifier_time(B=64, K=8, V=32_000, repeats=20):
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    times = []
    for validate in (True, False):
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            specplug.verify_batch(p, drafts, q, generator=g, validate=validate)
            runs.append(time.perf_counter() - t0)
        times.append(statistics.median(runs))
    return times


def batch_throughput(args) -> None:
    from specplug.bench.workloads import humaneval_prompts

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = humaneval_prompts(args.prompts)
    targets = {"lean rows": specplug.Target.from_pretrained(args.target),
               "HF padded": specplug.Target.from_pretrained(args.target, lean=False)}
    for target in targets.values():  # warm-up: every shape's kernels once
        specplug.generate_batch(target, None, prompts[:max(sizes)], max_new_tokens=8, sampling=specplug.GREEDY)
    runs: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for label, target in targets.items():
            t0 = time.perf_counter()
            out = [specplug.generate(target, None, p, max_new_tokens=args.tokens, sampling=specplug.GREEDY)
                   for p in prompts]
            runs.setdefault((label, "generate"), []).append(sum(len(r.tokens) for r in out) / (time.perf_counter() - t0))
            for B in sizes:
                t0 = time.perf_counter()
                out = specplug.generate_batch(target, None, prompts, max_new_tokens=args.tokens,
                                              sampling=specplug.GREEDY, max_batch_size=B)
                runs.setdefault((label, f"B={B}"), []).append(sum(len(r.tokens) for r in out)
                                                              / (time.perf_counter() - t0))
    for (label, what), rates in runs.items():
        print(f"{label:10s} {what:9s} target-only {statistics.median(rates):7.1f} tok/s "
              f"(median of {len(rates)}, {len(prompts)} prompts x {args.tokens} tokens)")
    for label, target in targets.items():
        print(f"{label}: bit identity {target.bit_identity} {target.lean_note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default=None, help="e.g. 1,4,16: batched target-only throughput instead")
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    if args.batch_sizes:
        return batch_throughput(args)
    target = specplug.Target.from_pretrained(args.target)
    draft = specplug.get_proposer("draft-model", target=target, **({"model": args.draft} if args.draft else {}))
    timer = ForwardTimer(target.model, draft.draft.model)
    if draft.lean is not None:  # the draft runs through specplug.lean_llama, not the HF module's forward
        timer.wrap(draft.lean, "forward")
        timer.wrap(draft.lean, "forward_rows")
    if target.lean is not None:  # so does the target: prefills through run, steps through run_rows
        timer.wrap(target.lean, "run")
        timer.wrap(target.lean, "run_rows")
    for name, proposer in (("target-only", None), ("draft-model", draft)):
        loop_overhead(target, proposer, 16, 1, timer)  # warm-up
        share, wall = loop_overhead(target, proposer, args.tokens, args.repeats, timer)
        print(f"{name:12s} {args.tokens} greedy tokens: wall {wall:.3f} s (median of {args.repeats}), "
              f"outside model forwards {100 * share:.1f}%")
    checked, unchecked = verifier_time()
    print(f"verify_batch B=64 K=8 V=32000: {1000 * checked:.1f} ms with input validation, "
          f"{1000 * unchecked:.1f} ms without (median of 20)")


if __name__ == "__main__":
    main()
