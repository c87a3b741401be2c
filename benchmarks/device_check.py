"""Exactness, greedy equality and a short compare on one device, in one table.

    python benchmarks/device_check.py                 # CUDA when there is one (< 8 minutes), else the CPU
    python benchmarks/device_check.py --device cpu --quick

Rows: the statistical exactness harness (chi-square against the enumerated distribution of a tiny target
built on the fly, single-sequence and one batch with mixed settings per row), greedy equality with
target-only output on the zoo (alone and in a batch), the zoo target's bit-identity probe, and a short
``compare`` (draft-model and ngram, γ = 4, greedy). Every tensor is on the chosen device: the models, the
proposals, q, the verifier's uniforms and the features. It exits non-zero if a check fails.

A lent accelerator is held for minutes, so the script is sized to its time: ``--exactness-seconds`` bounds
the harness (each row draws as many samples as its share allows, timed on its first draws, never fewer than
``--min-samples``); each row is printed as it finishes, and a section that raises becomes a FAIL row with its
error, so one broken part still leaves the others' evidence.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table

import specplug
from specplug.bench.compare import ProposerSpec, run_compare
from specplug.bench.workloads import Workload, humaneval_prompts
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution, tiny_llama

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
SETTINGS = {"T=1": specplug.SamplingParams(temperature=1.0),
            "top-k=3": specplug.SamplingParams(temperature=1.0, top_k=3),
            "T=0.7 top-p=0.8": specplug.SamplingParams(temperature=0.7, top_p=0.8)}

Row = tuple[str, str, bool, float]  # check, evidence, passed, seconds
Report = Callable[[Row], None]


def sized(draw: Callable[[int, int], Counter], most: int, least: int, seconds: float) -> Counter:
    """``draw(n, first)`` counts n samples numbered from ``first``; draw ``most`` of them, or as many as
    ``seconds`` allows at the pace of the first few (never fewer than ``least``). Only time decides the count,
    never the outcomes drawn, so the test keeps its level."""
    first = min(most, max(1, least // 10))
    t0 = time.perf_counter()
    counts = draw(first, 0)
    pace = (time.perf_counter() - t0) / first
    total = max(least, min(most, int(seconds / max(pace, 1e-9))))
    if total > first:
        counts.update(draw(total - first, first))
    return counts


def exactness_rows(device: str, samples: int, least: int, seconds: float, workdir: Path, report: Report) -> None:
    """Report a row for each proposer and setting, single and batched."""
    tiny_llama(workdir / "target", 6, hidden=32, layers=2, seed=0, init=0.3)
    tiny_llama(workdir / "draft", 6, hidden=16, layers=1, seed=7, init=0.2)
    target = specplug.Target.from_pretrained(workdir / "target", device=device)
    share = seconds / (3 * len(SETTINGS) + 2)  # single rows for three proposers, batched rows for two
    for name in ("draft-model", "ngram", None):
        prop = (specplug.get_proposer(name, target=target, **({"model": workdir / "draft"} if name == "draft-model"
                                                                else {})) if name else None)
        for label, sampling in SETTINGS.items():
            t0 = time.perf_counter()
            counts = sized(lambda n, first: sampled_distribution(target, prop, PROMPT, 3, sampling, n, seed=first),
                           samples, least, share)
            p = chi_square_pvalue(counts, exact_distribution(target, PROMPT, 3, sampling))
            report((f"exactness {name or 'target-only'} {label}", f"p = {p:.3g} ({sum(counts.values())} samples)",
                    p > EXACTNESS_ALPHA, time.perf_counter() - t0))
        if name is not None:
            report(batched_exactness(target, prop, name, samples, least, share))


def batched_exactness(target, prop, name: str, samples: int, least: int, seconds: float) -> Row:
    """One batch call per round, its rows taking the settings in turn (and one greedy row)."""
    t0 = time.perf_counter()
    names, rows_per_call = list(SETTINGS), 48

    def draw(n: int, first: int) -> Counter:
        counts = Counter()
        for call in range(first, first + n):
            params = [specplug.SamplingParams(**{**SETTINGS[names[r % 3]].to_dict(), "seed": 10_000 * call + r})
                      for r in range(rows_per_call)] + [specplug.GREEDY]
            out = specplug.generate_batch(target, prop, [PROMPT] * len(params), max_new_tokens=3, sampling=params,
                                          num_speculative_tokens=2, strict=True)
            counts.update((names[r % 3], tuple(result.tokens)) for r, result in enumerate(out[:rows_per_call]))
        return counts

    per_call = rows_per_call // len(names)  # samples of each setting per call
    drawn = sized(draw, max(1, samples // per_call), max(1, least // per_call), seconds)
    pvalues = {n: chi_square_pvalue(Counter({t: c for (m, t), c in drawn.items() if m == n}),
                                    exact_distribution(target, PROMPT, 3, SETTINGS[n])) for n in names}
    worst = min(pvalues.values())
    return (f"exactness {name} batched, mixed settings",
            f"min p = {worst:.3g} over {len(names)} settings ({sum(drawn.values()) // len(names)} samples each)",
            worst > EXACTNESS_ALPHA, time.perf_counter() - t0)


def greedy_rows(device: str, prompts: int, tokens: int, report: Report) -> specplug.Target:
    target = specplug.Target.from_pretrained("zoo:pycode", device=device)
    texts = humaneval_prompts(prompts)
    t0 = time.perf_counter()
    want = [specplug.generate(target, None, p, max_new_tokens=tokens, sampling=specplug.GREEDY).tokens for p in texts]
    report(("bit-identity probe", f"{target.bit_identity}; {target.lean_note or 'lean path, no note'}; "
            f"products {target.matmul_dtype or target.dtype}", True, time.perf_counter() - t0))
    for name in ("draft-model", "eagle", "ngram"):
        prop = specplug.get_proposer(name, target=target)
        t0 = time.perf_counter()
        alone = [specplug.generate(target, prop, p, max_new_tokens=tokens, sampling=specplug.GREEDY).tokens
                 for p in texts]
        batch = [r.tokens for r in specplug.generate_batch(target, prop, texts, max_new_tokens=tokens,
                                                           sampling=specplug.GREEDY)]
        same = sum(a == w for a, w in zip(alone, want)), sum(b == w for b, w in zip(batch, want))
        # where the probe found no bit-identical path, a near-tie may flip a token: reported, not a failure
        ok = same == (len(texts), len(texts)) or not target.verify_bit_identical
        report((f"greedy == target-only, {name}", f"alone {same[0]}/{len(texts)}, batch of {len(texts)} "
                f"{same[1]}/{len(texts)}", ok, time.perf_counter() - t0))
    return target


def compare_rows(target, prompts: int, tokens: int, report: Report) -> None:
    t0 = time.perf_counter()
    result = run_compare(target, [ProposerSpec.parse("draft-model"), ProposerSpec.parse("ngram")],
                         [Workload("humaneval", tuple(humaneval_prompts(prompts)))], gammas=(4,),
                         temperatures=(0.0,), max_new_tokens=tokens)
    base = result["baseline"][0]["tokens_per_second"]
    report(("compare target-only", f"{base:.1f} tok/s", True, time.perf_counter() - t0))
    for cell in result["cells"]:
        report((f"compare {cell['proposer']} γ={cell['gamma']}",
                f"{cell['tokens_per_second']:.1f} tok/s, {cell['speedup']:.2f}x, α {cell['acceptance_rate']:.2f}",
                cell["greedy_equal_to_target_only"] is not False, 0.0))


class Rows:
    """The table's rows, each printed as it comes (a run cut short by its time limit keeps what it found)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def __call__(self, row: Row) -> None:
        self.rows.append(row)
        print(f"{'pass' if row[2] else 'FAIL'}  {row[0]}: {row[1]} ({row[3]:.1f} s)", flush=True)

    def section(self, name: str, run: Callable[[], object]) -> object:
        """Run one part; if it raises, its error is a FAIL row and the next part still runs."""
        t0 = time.perf_counter()
        try:
            return run()
        except Exception as exc:  # report it, traceback included, and go on: each part is separate evidence
            traceback.print_exc()
            self((f"{name} raised", f"{type(exc).__name__}: {exc}"[:300], False, time.perf_counter() - t0))
            return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer samples and prompts (the CPU default)")
    ap.add_argument("--exactness-seconds", type=float, default=150.0,
                    help="time for the whole exactness harness; rows draw fewer samples to fit it")
    ap.add_argument("--min-samples", type=int, default=400, help="samples a row draws however long they take")
    args = ap.parse_args()
    quick = args.quick or not args.device.startswith("cuda")
    samples, prompts, tokens = (150, 2, 24) if quick else (1500, 8, 96)
    least = min(samples, args.min_samples)
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"specplug {specplug.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.device} ({name})", flush=True)
    console = Console(width=None if sys.stdout.isatty() else 160)  # a log keeps each row on one line
    start = time.perf_counter()
    rows = Rows()
    with tempfile.TemporaryDirectory(prefix="specplug-device-") as tmp:
        rows.section("exactness", lambda: exactness_rows(args.device, samples, least, args.exactness_seconds,
                                                         Path(tmp), rows))
    target = rows.section("greedy", lambda: greedy_rows(args.device, prompts, tokens, rows))
    if target is not None:
        rows.section("compare", lambda: compare_rows(target, prompts, tokens, rows))
    table = Table(title=f"specplug device check on {args.device} ({name}), {time.perf_counter() - start:.0f} s")
    for column in ("check", "evidence", "result", "seconds"):
        table.add_column(column)
    for check, evidence, ok, seconds in rows.rows:
        table.add_row(check, evidence, "pass" if ok else "FAIL", f"{seconds:.1f}")
    console.print(table)
    sys.exit(0 if rows.rows and all(ok for _, _, ok, _ in rows.rows) else 1)


if __name__ == "__main__":
    main()
