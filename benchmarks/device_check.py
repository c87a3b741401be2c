"""Exactness, greedy equality and a short compare on one device, in one table.

    python benchmarks/device_check.py                 # CUDA when there is one (< 8 minutes), else the CPU
    python benchmarks/device_check.py --device cpu --quick

Rows: the statistical exactness harness (chi-square against the enumerated distribution of a tiny target
built on the fly, single-sequence and one batch with mixed settings per row), greedy equality with
target-only output on the zoo (alone and in a batch), the zoo target's bit-identity probe, and a short
``compare`` (draft-model and ngram, γ = 4, greedy). Every tensor is on the chosen device: the models, the
proposals, q, the verifier's uniforms and the features. It exits non-zero if a check fails.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
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


def exactness_rows(device: str, samples: int, workdir: Path) -> list[tuple[str, str, bool, float]]:
    """(check, evidence, passed, seconds) for each proposer and setting, single and batched."""
    tiny_llama(workdir / "target", 6, hidden=32, layers=2, seed=0, init=0.3)
    tiny_llama(workdir / "draft", 6, hidden=16, layers=1, seed=7, init=0.2)
    target = specplug.Target.from_pretrained(workdir / "target", device=device)
    rows = []
    for name in ("draft-model", "ngram", None):
        prop = (specplug.get_proposer(name, target=target, **({"model": workdir / "draft"} if name == "draft-model"
                                                                else {})) if name else None)
        for label, sampling in SETTINGS.items():
            t0 = time.perf_counter()
            p = chi_square_pvalue(sampled_distribution(target, prop, PROMPT, 3, sampling, samples),
                                  exact_distribution(target, PROMPT, 3, sampling))
            rows.append((f"exactness {name or 'target-only'} {label}", f"p = {p:.3g} ({samples} samples)",
                         p > EXACTNESS_ALPHA, time.perf_counter() - t0))
        if name is not None:
            rows += batched_exactness(target, prop, name, samples)
    return rows


def batched_exactness(target, prop, name: str, samples: int) -> list[tuple[str, str, bool, float]]:
    """One batch call per round, its rows taking the settings in turn (and one greedy row)."""
    t0 = time.perf_counter()
    names, counts = list(SETTINGS), {n: Counter() for n in SETTINGS}
    rows_per_call = 48
    for call in range(max(1, samples // (rows_per_call // 3))):
        params = [specplug.SamplingParams(**{**SETTINGS[names[r % 3]].to_dict(), "seed": 10_000 * call + r})
                  for r in range(rows_per_call)] + [specplug.GREEDY]
        out = specplug.generate_batch(target, prop, [PROMPT] * len(params), max_new_tokens=3, sampling=params,
                                      num_speculative_tokens=2, strict=True)
        for r, result in enumerate(out[:rows_per_call]):
            counts[names[r % 3]][tuple(result.tokens)] += 1
    pvalues = {n: chi_square_pvalue(counts[n], exact_distribution(target, PROMPT, 3, SETTINGS[n])) for n in names}
    worst = min(pvalues.values())
    return [(f"exactness {name} batched, mixed settings", f"min p = {worst:.3g} over {len(names)} settings",
             worst > EXACTNESS_ALPHA, time.perf_counter() - t0)]


def greedy_rows(device: str, prompts: int, tokens: int) -> tuple[list, specplug.Target]:
    target = specplug.Target.from_pretrained("zoo:pycode", device=device)
    texts = humaneval_prompts(prompts)
    t0 = time.perf_counter()
    want = [specplug.generate(target, None, p, max_new_tokens=tokens, sampling=specplug.GREEDY).tokens for p in texts]
    rows = [("bit-identity probe", f"{target.bit_identity}; {target.lean_note or 'lean path, no note'}",
             True, time.perf_counter() - t0)]
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
        rows.append((f"greedy == target-only, {name}", f"alone {same[0]}/{len(texts)}, batch of {len(texts)} "
                     f"{same[1]}/{len(texts)}", ok, time.perf_counter() - t0))
    return rows, target


def compare_rows(target, prompts: int, tokens: int) -> list[tuple[str, str, bool, float]]:
    t0 = time.perf_counter()
    report = run_compare(target, [ProposerSpec.parse("draft-model"), ProposerSpec.parse("ngram")],
                         [Workload("humaneval", tuple(humaneval_prompts(prompts)))], gammas=(4,),
                         temperatures=(0.0,), max_new_tokens=tokens)
    seconds = time.perf_counter() - t0
    base = report["baseline"][0]["tokens_per_second"]
    rows = [("compare target-only", f"{base:.1f} tok/s", True, seconds)]
    for cell in report["cells"]:
        rows.append((f"compare {cell['proposer']} γ={cell['gamma']}",
                     f"{cell['tokens_per_second']:.1f} tok/s, {cell['speedup']:.2f}x, "
                     f"α {cell['acceptance_rate']:.2f}", cell["greedy_equal_to_target_only"] is not False, 0.0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer samples and prompts (the CPU default)")
    args = ap.parse_args()
    quick = args.quick or not args.device.startswith("cuda")
    samples, prompts, tokens = (150, 2, 24) if quick else (1500, 8, 96)
    console = Console(width=None if sys.stdout.isatty() else 160)  # a log keeps each row on one line
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specplug-device-") as tmp:
        rows = exactness_rows(args.device, samples, Path(tmp))
    greedy, target = greedy_rows(args.device, prompts, tokens)
    rows += greedy + compare_rows(target, prompts, tokens)
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    table = Table(title=f"specplug device check on {args.device} ({name}), {time.perf_counter() - start:.0f} s")
    for column in ("check", "evidence", "result", "seconds"):
        table.add_column(column)
    for check, evidence, ok, seconds in rows:
        table.add_row(check, evidence, "pass" if ok else "FAIL", f"{seconds:.1f}")
    console.print(table)
    sys.exit(0 if all(ok for _, _, ok, _ in rows) else 1)


if __name__ == "__main__":
    main()
