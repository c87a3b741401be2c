"""The load bench: goodput and per-token latency against batch size, for target-only decoding, fixed γ and γ
policies per proposer, all through the batched decoder (:func:`specplug.batch.generate_batch`).

Every run serves the same load: ``requests`` requests (default: the largest batch size; prompts cycled if
fewer, seeds per request), ``max_new_tokens`` each, with at most B decoded together; as a request finishes the next one
joins (continuous batching, ``generate_batch(..., max_batch_size=B)``). So every batch size does the same
work, and goodput = tokens emitted by all requests / wall seconds of the run (prefills included). Per-token latency is
each step's wall time shared among the tokens it emitted for that row (what a user of the row sees), pooled
over the run's rows; a cell reports the median over repeats of each run's goodput, p50 and p99. Runs are
interleaved (repeat → batch size → variant, variant order rotated each repeat) so machine drift hits all
cells alike. Every cell gets its own fresh proposer per run, and whatever policy object its factory returns
(a fresh one per run, or one kept across runs as a server would keep it: the CLI shows both). A policy's
cell also reports paired ratios, the median over repeats of its goodput over the best static γ's (and
target-only's) in the same repeat: they cancel a slow spell that hits one repeat, which a ratio of medians
does not. Every cell carries its goodput by repeat (``goodput_by_repeat``), so they can be checked.

Variants: ``target-only`` (γ = 0, the baseline), then for each proposer spec one variant per entry of
``gammas`` (an int γ) and one per entry of ``policies`` (label → factory returning a fresh policy object with
``choose(seq, max_k)`` / ``update(...)``, see :mod:`specplug.batch`). With ``ceiling`` (greedy only), one
``oracle γ=k`` variant per entry: :class:`specplug.bench.oracle.OracleProposer` drafting target-only's own output
at no cost, the most any proposer could reach at that B; its cells never count as the best.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from specplug.batch import generate_batch
from specplug.machine import machine_choices
from specplug.plugins import get_proposer
from specplug.sampling import SamplingParams
from specplug.target import Target

from .compare import BIT_IDENTITY, ProposerSpec, attachable, target_info
from .oracle import OracleProposer, greedy_outputs
from .report import NOT_BIT_IDENTICAL, choice_lines

SCHEMA = "specplug.load/1"

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(args):\n    \"\"\"Parse command line arguments.\"\"\"\n",
    "for i in range(10):\n",
    "def read_file(path):\n    with open(path) as fh:\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "def merge_sort(items):\n",
)


@dataclass(frozen=True)
class Variant:
    """One line of the table: a proposer spec (None: target-only) with an int γ or a policy factory."""

    label: str
    spec: ProposerSpec | None
    gamma: int | None = 0
    policy: Callable[[], object] | None = None
    policy_label: str | None = None
    oracle: bool = False  # drafts target-only's greedy output (the ceiling), not a proposer's

    def make(self, target: Target, outputs: Mapping[tuple[int, ...], Sequence[int]] | None = None):
        """(a fresh proposer, its γ or policy); ``outputs``: target-only's, for an oracle variant."""
        if self.oracle:
            return OracleProposer(outputs, target.vocab_size), self.gamma
        proposer = None if self.spec is None else get_proposer(self.spec.name, target=target, **self.spec.options)
        return proposer, (self.policy() if self.policy is not None else self.gamma)


def variants(specs: Sequence[ProposerSpec], gammas: Sequence[int],
             policies: Mapping[str, Callable[[], object]] | None = None, ceiling: Sequence[int] = ()) -> list[Variant]:
    out = [Variant("target-only", None, 0)]
    for spec in specs:
        out += [Variant(f"{spec.label} γ={g}", spec, int(g)) for g in gammas]
        out += [Variant(f"{spec.label} {name}", spec, None, factory, name) for name, factory in (policies or {}).items()]
    return out + [Variant(f"oracle γ={g}", None, int(g), oracle=True) for g in ceiling]


def _run(target, variant: Variant, prompts: Sequence[str], B: int, max_new_tokens: int, temperature: float,
         seed: int, requests: int, outputs: Mapping | None = None) -> dict:
    proposer, gamma = variant.make(target, outputs)
    rows = [prompts[i % len(prompts)] for i in range(requests)]
    sampling = [SamplingParams(temperature=temperature, seed=seed + i) for i in range(requests)]
    t0 = time.perf_counter()
    results = generate_batch(target, proposer, rows, max_new_tokens=max_new_tokens, sampling=sampling,
                             num_speculative_tokens=gamma, max_batch_size=B,
                             **(variant.spec.decode if variant.spec is not None else {}))
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in results)
    lat = np.concatenate([r.stats.token_latencies() for r in results]) if results else np.zeros(0)
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    return {
        "wall_s": wall, "tokens": tokens, "goodput": tokens / wall if wall else None,
        "p50": float(np.percentile(lat, 50)) if lat.size else None,
        "p99": float(np.percentile(lat, 99)) if lat.size else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_gamma": drafted / sum(r.stats.target_calls for r in results),
        "finish_p90": float(np.percentile([r.stats.wall_time for r in results], 90)),
        "fallback_steps": sum(r.stats.fallback_steps for r in results),
        "tokens_by_row": [r.tokens for r in results],
    }


def run_load(target: Target, proposer_specs: Sequence[ProposerSpec | str], *,
             batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), gammas: Sequence[int] = (2, 4),
             policies: Mapping[str, Callable[[], object]] | None = None, max_new_tokens: int = 64,
             prompts: Sequence[str] | None = None, requests: int | None = None, temperature: float = 0.0,
             repeats: int = 3, warmup: bool = True, progress: Callable[[int, str], None] | None = None,
             peer=None, ceiling: Sequence[int] = ()) -> dict:
    """Measure goodput and per-token latency per (variant, batch size); return a JSON-able report
    (schema ``specplug.load/1``). ``proposer_specs`` are ProposerSpec or ``name:key=value`` strings.
    ``peer`` (a :class:`specplug.bench.peer_vllm.VLLMPeer`) runs the same requests after all of ours, one engine
    alive at a time (an idle vLLM engine slows the other cells); its rows go to ``report["peer"]``.
    ``ceiling``: γ values for oracle variants (temperature 0 only: the oracle drafts target-only's greedy output).
    """
    if ceiling and temperature != 0:
        raise ValueError(f"ceiling: the oracle drafts target-only's greedy output, so it needs temperature 0, "
                         f"got {temperature}")
    specs = [s if isinstance(s, ProposerSpec) else ProposerSpec.parse(s) for s in proposer_specs]
    specs, skipped = attachable(target, specs)
    prompts = list(prompts or DEFAULT_PROMPTS)
    cells = variants(specs, gammas, policies, ceiling)
    requests = requests or max(batch_sizes)
    outputs = greedy_outputs(target, prompts, max_new_tokens) if ceiling else None
    runs: dict[tuple[str, int], list[dict]] = {}
    peer_runs: dict[tuple[str, int, int], list[dict]] = {}
    if warmup:
        for v in cells:
            _run(target, v, prompts, 2, 4, temperature, 0, 2, outputs)
    for rep in range(repeats):
        for B in batch_sizes:
            order = cells[rep % len(cells):] + cells[: rep % len(cells)]
            for v in order:
                runs.setdefault((v.label, B), []).append(
                    _run(target, v, prompts, B, max_new_tokens, temperature, 1000 * rep, requests, outputs))
                if progress is not None:
                    progress(1, f"B={B} {v.label}")
    if peer is not None:  # the same requests and seeds as _run's, in the same order, after all of ours
        rows = [prompts[i % len(prompts)] for i in range(requests)]
        work = [(B, rows, [SamplingParams(temperature=temperature, seed=1000 * rep + i) for i in range(requests)])
                for rep in range(repeats) for B in batch_sizes]
        for label, g, B, r in peer.load_runs(work, max_new_tokens):
            peer_runs.setdefault((label, g, B), []).append(r)
    report = _report(target, cells, runs, skipped, batch_sizes, gammas, policies, max_new_tokens, len(prompts),
                     requests, temperature, repeats)
    report["settings"]["ceiling"] = list(ceiling)
    if peer is not None:
        report["peer"] = peer.load_rows(peer_runs, runs, temperature)
        report["skipped"] += peer.skipped
    return report


def count_runs(specs, batch_sizes, gammas, policies, repeats, ceiling: Sequence[int] = ()) -> int:
    """Runs run_load will make (for a progress bar): repeats × batch sizes × variants."""
    return repeats * len(batch_sizes) * (1 + len(specs) * (len(gammas) + len(policies or {})) + len(ceiling))


def _median(values):
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _report(target, cells, runs, skipped, batch_sizes, gammas, policies, max_new_tokens, n_prompts, requests,
            temperature, repeats) -> dict:
    report = {
        "schema": SCHEMA,
        "target": target_info(target),
        "settings": {"batch_sizes": list(batch_sizes), "gammas": list(gammas), "policies": list(policies or {}),
                     "max_new_tokens": max_new_tokens, "prompts": n_prompts, "requests": requests,
                     "temperature": temperature,
                     "repeats": repeats},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "platform": platform.platform(),
                    "choices": [c.as_dict() for c in machine_choices()]},
        "skipped": skipped, "cells": [], "best": {},
    }
    base = {B: _median([r["goodput"] for r in runs[("target-only", B)]]) for B in batch_sizes}
    for v in cells:
        for B in batch_sizes:
            entries = runs[(v.label, B)]
            goodput = _median([r["goodput"] for r in entries])
            greedy_equal = None
            if temperature == 0 and (v.spec is not None or v.oracle):
                greedy_equal = all(r["tokens_by_row"] == b["tokens_by_row"]
                                   for r, b in zip(entries, runs[("target-only", B)]))
            report["cells"].append({
                "variant": v.label, "proposer": v.spec.label if v.spec else ("oracle" if v.oracle else None),
                "ceiling": v.oracle,
                "gamma": v.gamma if v.policy is None else None, "policy": v.policy_label,
                "batch_size": B, "runs": len(entries), "goodput_tokens_per_s": goodput,
                # by repeat, in run order: what the paired ratios are medians of, for a reader to check them
                "goodput_by_repeat": [r["goodput"] for r in entries],
                "speedup_vs_target_only": goodput / base[B] if goodput and base[B] else None,
                "token_latency_p50_s": _median([r["p50"] for r in entries]),
                "token_latency_p99_s": _median([r["p99"] for r in entries]),
                "acceptance_rate": _median([r["acceptance_rate"] for r in entries]),
                "mean_gamma": _median([r["mean_gamma"] for r in entries]),
                "wall_s": _median([r["wall_s"] for r in entries]),
                "time_to_finish_p90_s": _median([r["finish_p90"] for r in entries]),
                "fallback_steps": sum(r["fallback_steps"] for r in entries),
                "greedy_equal_to_target_only": greedy_equal,
            })
    for B in batch_sizes:
        # the oracle's cells are the ceiling, not a contender: never the best, nor a policy's best static γ
        at_b = [c for c in report["cells"] if c["batch_size"] == B and c["goodput_tokens_per_s"] and not c["ceiling"]]
        best = max(at_b, key=lambda c: c["goodput_tokens_per_s"], default=None)
        static = [c for c in at_b if c["policy"] is None]
        best_static = max(static, key=lambda c: c["goodput_tokens_per_s"], default=None)
        report["best"][str(B)] = {"variant": best and best["variant"],
                                  "best_static": best_static and best_static["variant"],
                                  "speculation_pays": bool(best and best["variant"] != "target-only")}
        for c in at_b:
            if c["policy"] is not None:  # the same repeat's runs of the two cells, side by side
                # against its own proposer's static γ (γ = 0 being target-only): the policy chooses γ, not the proposer
                own = max((s for s in static if s["proposer"] in (c["proposer"], None)),
                          key=lambda s: s["goodput_tokens_per_s"], default=None)
                c["best_static"] = own and own["variant"]
                for key, other in (("paired_vs_best_static", own), ("paired_vs_target_only", _by_label(at_b, "target-only"))):
                    c[key] = other and _paired(runs[(c["variant"], B)], runs[(other["variant"], B)])
    return report


def _by_label(cells: list[dict], label: str) -> dict | None:
    return next((c for c in cells if c["variant"] == label), None)


def _paired(runs: list[dict], others: list[dict]) -> float | None:
    """Median over repeats of goodput / the other cell's goodput in the same repeat."""
    return _median([r["goodput"] / o["goodput"] for r, o in zip(runs, others) if r["goodput"] and o["goodput"]])


def render(report: dict, console=None) -> None:
    """Rich tables: goodput (× target-only), the policies paired against static γ, p50/p99 per-token latency and
    acceptance, variants × batch sizes; then the target's forward and the machine's choices."""
    from rich.console import Console

    console = console or Console()
    sizes = report["settings"]["batch_sizes"]
    by = {(c["variant"], c["batch_size"]): c for c in report["cells"]}
    labels = list(dict.fromkeys(c["variant"] for c in report["cells"]))
    s = report["settings"]
    title = (f"goodput, tokens/s over all rows (× target-only) — {report['target']['name']}, {s['requests']} "
             f"requests × {s['max_new_tokens']} tokens, at most B at once, T={s['temperature']}, "
             f"median of {s['repeats']}")
    table = _grid(title, sizes, [(label, [_fmt_goodput(report, by[(label, B)]) for B in sizes]) for label in labels])
    if any(c.get("greedy_equal_to_target_only") is False for c in report["cells"]):
        table.caption = "≠: greedy tokens differ from target-only's in some row"
    console.print(table)
    if report["settings"].get("ceiling"):
        console.print("oracle γ=k: drafts target-only's own output at no cost, the most any proposer could reach "
                      "at that B (never counted as the best)", highlight=False, markup=False)
    target = report["target"]
    console.print(f"target {target['name']}: {target['matmul_dtype']} products"
                  + (f", HF's forward ({target['lean_note']})" if not target.get("lean") else ", lean forward")
                  + ("; " + NOT_BIT_IDENTICAL if target.get(BIT_IDENTITY) is False else ""), highlight=False, markup=False)
    for line in choice_lines(report):
        console.print(line, highlight=False, markup=False)
    policies = [label for label in labels if by[(label, sizes[0])]["policy"] is not None]
    if policies:
        console.print(_grid("policies against their proposer's best static γ at each B (γ = 0: target-only) / "
                            "against target-only, paired: median over repeats of the ratio within a repeat", sizes,
                            [(label, [_fmt_paired(by[(label, B)]) for B in sizes]) for label in policies]))
    console.print(_grid("per-token latency p50 / p99 (ms)", sizes,
                        [(label, [_fmt_latency(by[(label, B)]) for B in sizes]) for label in labels]))
    if labels[1:]:
        console.print(_grid("acceptance rate α / mean γ drafted per step", sizes,
                            [(label, [_fmt_alpha(by[(label, B)]) for B in sizes]) for label in labels[1:]]))


def _grid(title: str, sizes: list[int], rows: list[tuple[str, list[str]]]):
    """A rich table of variants (rows) by batch sizes (columns)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("variant")
    for B in sizes:
        table.add_column(f"B={B}", justify="right")
    for label, cells in rows:
        table.add_row(label, *cells)
    return table


def _fmt_goodput(report: dict, c: dict) -> str:
    """Goodput, its ratio to target-only, ≠ where greedy rows parted from target-only's, bold for the best at B."""
    text = f"{c['goodput_tokens_per_s']:.1f}"
    if c["speedup_vs_target_only"] is not None and c["variant"] != "target-only":
        text += f" ({c['speedup_vs_target_only']:.2f}×)"
    if c.get("greedy_equal_to_target_only") is False:
        text += " ≠"
    return f"[bold]{text}[/bold]" if report["best"][str(c["batch_size"])]["variant"] == c["variant"] else text


def _fmt_latency(c: dict) -> str:
    return f"{1e3 * c['token_latency_p50_s']:.1f} / {1e3 * c['token_latency_p99_s']:.1f}"


def _fmt_paired(c) -> str:
    pct = lambda r: "–" if r is None else f"{100 * (r - 1):+.1f}%"  # noqa: E731
    return f"{pct(c.get('paired_vs_best_static'))} / {pct(c.get('paired_vs_target_only'))}"


def _fmt_alpha(c) -> str:
    a = c["acceptance_rate"]
    return ("–" if a is None else f"{a:.2f}") + f" / {c['mean_gamma']:.1f}"


def write_html(report: dict, path) -> None:
    """The load bench's tables (and the vLLM peer's, if any) as a self-contained page, with the raw report."""
    import html
    import io

    from rich.console import Console

    from .report import WIDE_WIDTH, html_page

    console = Console(record=True, width=WIDE_WIDTH, file=io.StringIO())
    render(report, console)
    if report.get("peer"):
        from .peer_vllm import render_load

        render_load(report["peer"], console)
    body = (f"<p>Goodput and per-token latency per batch size; cells are medians over repeats of runs "
            f"interleaved in one process.</p>\n<figure id=\"goodput_vs_batch_size\"><img alt=\"goodput vs batch size\" "
            f"src=\"data:image/png;base64,{goodput_figure(report)}\"></figure>\n"
            f"<pre>{html.escape(console.export_text())}</pre>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(html_page("specplug load bench", body, report))


def speedup_curves(report: dict) -> dict[str, list[float | None]]:
    """× target-only at each batch size: each proposer's best static γ, each policy, and the oracle's best γ (the
    ceiling), keyed by the legend's label."""
    sizes = report["settings"]["batch_sizes"]
    curves: dict[str, list[float | None]] = {}
    for c in report["cells"]:
        if c["proposer"] is None:
            continue
        if c["ceiling"]:
            label = "oracle best γ (ceiling)"
        else:
            label = c["variant"] if c["policy"] is not None else f"{c['proposer']} best γ"
        curve = curves.setdefault(label, [None] * len(sizes))
        i, x = sizes.index(c["batch_size"]), c["speedup_vs_target_only"]
        if x is not None and (curve[i] is None or x > curve[i]):
            curve[i] = x
    return curves


def goodput_figure(report: dict) -> str:
    """Speed-up over target-only against batch size (:func:`speedup_curves`), as a base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import png

    sizes = report["settings"]["batch_sizes"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, ys in speedup_curves(report).items():
        ceiling = label.startswith("oracle")
        ax.plot(sizes, ys, marker="o", ls="--" if ceiling else "-", color="black" if ceiling else None, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="target-only")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set(xlabel="batch size B (rows decoded together)", ylabel="goodput × target-only (median)",
           title="Speed-up against batch size")
    ax.legend(fontsize=7)
    return png(fig)
