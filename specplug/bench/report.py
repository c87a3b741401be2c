"""Render a compare report: a terminal table that fits 120 columns (every column with ``wide``), and a
self-contained HTML page that opens with the best proposer per temperature and the plots."""
from __future__ import annotations

import base64
import html
import io
import json

from .agreement import DIFFER, EQUAL, TIES
from .confidence import BUSY

PEER_TITLES = {"hf": "Hugging Face transformers' assisted generation on the same target, draft and prompts",
               "vllm": "vLLM on the same target, drafts and prompts (τ from vLLM's own counters)"}
PLOTS = ("speedup_vs_gamma", "per_position_acceptance", "latency_distribution", "measured_vs_predicted",
         "verify_cost_vs_nodes")
GREEDY_MARKS = {None: "-", EQUAL: "yes", TIES: "ties", DIFFER: "NO"}  # "ties": parted only at rounding ties
WIDTH = 120
WIDE_WIDTH = 200
RATIO_NOTE = ("meas/pred: speed-up ÷ τ/(γc + v), what this cell's τ, c and scoring cost v (in target-only steps) "
              "allow; ≈1 is healthy.")


def _fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def _speedup(cell) -> str:
    interval = cell.get("speedup_interval")
    if cell["speedup"] is None:
        return "-"
    if not interval:
        return f"{cell['speedup']:.2f}x"
    return f"{cell['speedup']:.2f}x [{interval[0]:.2f}–{interval[1]:.2f}]"


def _greedy(cell, bit_identical) -> str:
    text = {None: "-", True: "yes", False: "NO"}[cell["greedy_equal_to_target_only"]]
    return text + "*" if bit_identical is False and text != "-" else text


def _sorted_cells(report):
    return sorted(report["cells"], key=lambda c: (c["workload"], c["temperature"], c["proposer"], c["gamma"]))


def summary(report: dict) -> list[dict]:
    """The best cell per workload and temperature (by median speed-up)."""
    best: dict[tuple, dict] = {}
    for c in report["cells"]:
        key = (c["workload"], c["temperature"])
        if c["speedup"] is not None and (key not in best or c["speedup"] > best[key]["speedup"]):
            best[key] = c
    return [best[k] for k in sorted(best)]


NOT_BIT_IDENTICAL = ("this target's verify passes are not bit-identical to its one-token steps on this machine, so "
                     "greedy output may part from target-only's where two tokens nearly tie.")


def choice_lines(report: dict) -> list[str]:
    """One line per speed or kernel choice this machine made (:mod:`specplug.machine`), for any report; a form
    chosen alike for several shapes (its key) is one line, with the first shape's reason."""
    made: dict[tuple[str, str], list[dict]] = {}
    for c in report["machine"].get("choices", []):
        made.setdefault((c["name"], c["value"]), []).append(c)
    lines = []
    for (name, value), alike in made.items():
        sources = "/".join(dict.fromkeys(c["source"] for c in alike))
        shapes = f"{len(alike)} shapes, e.g. " if len(alike) > 1 else ""
        lines.append(f"machine choice {name}: {value} ({sources}: {shapes}{alike[0]['why']})")
    return lines


def notes(report: dict, wide: bool = False) -> list[str]:
    """The lines printed under the table: what the ratio means, the flagged cells and why, the best cells."""
    lines = [] if wide else [RATIO_NOTE]
    if report["target"].get("verify_bit_identical") is False:
        lines.append("*: " + NOT_BIT_IDENTICAL)
    for b in report["baseline"]:
        lines.append(f"target-only {b['workload']} T={b['temperature']:g}: "
                     f"{_fmt(b['target_step_time_s'] * 1e3, '.2f')} ms a step, "
                     f"{_fmt(b['tokens_per_second'], '.0f')} tok/s")
    flagged = [c for c in _sorted_cells(report) if c.get("flags")]
    if flagged:
        lines.append(f"busy!: {BUSY}")
    for c in flagged:
        lines.append(f"  {c['proposer']} T={c['temperature']:g} γ={c['gamma']}: {'; '.join(c['flags'])}")
    if report["machine"].get("wall_time_s"):
        machine = report["machine"]
        lines.append(f"measured in {machine['wall_time_s']:.0f} s on {machine['threads']} thread(s)")
    lines += choice_lines(report)
    for c in summary(report):
        lines.append(f"best at T={c['temperature']:g} on {c['workload']}: {c['proposer']} γ={c['gamma']}, {_speedup(c)}"
                     + (" (flagged)" if c.get("flags") else ""))
    return lines


def _columns(report, wide: bool) -> list[str]:
    several = len({c["workload"] for c in report["cells"]} | {b["workload"] for b in report["baseline"]}) > 1
    trees = any(c.get("tree") for c in report["cells"])  # nodes and v say what a tree's extra nodes cost
    if not wide:
        return ["proposer"] + (["workload"] if several else []) + ["T", "γ"] + (["nodes", "v"] if trees else []) \
            + ["α", "τ", "c", "speed-up [95%]", "meas/pred", "greedy =", "flag"]
    repeated = any(len(c["speedup_by_sample"]) > 1 for c in report["cells"])
    return ["proposer", "workload", "T", "γ", "nodes", "α", "τ", "c", "v", "tok/s", "speed-up [95%]", "predicted",
            "meas/pred(v=1)", "meas/pred(v)", "meas/pred", "p50 ms", "p99 ms", "greedy =", "flag"] \
        + (["by sample"] if repeated else [])


def _values(c, bit_identical) -> dict:
    return {
        "proposer": c["proposer"], "workload": c["workload"], "T": _fmt(c["temperature"], "g"), "γ": str(c["gamma"]),
        "nodes": _fmt(c.get("nodes_scored_per_step"), ".1f"),
        "α": _fmt(c["acceptance_rate"]), "τ": _fmt(c["mean_acceptance_length"]),
        "c": _fmt(c["draft_cost_ratio"], ".3f"),
        "v": _fmt(c["verify_cost"]), "tok/s": _fmt(c["tokens_per_second"], ".1f"), "speed-up [95%]": _speedup(c),
        "predicted": _fmt(c["predicted_speedup"]), "meas/pred(v=1)": _fmt(c["measured_over_predicted"]),
        "meas/pred(v)": _fmt(c["measured_over_predicted_with_verify_cost"]),
        "meas/pred": _fmt(c["measured_over_accounted"]), "p50 ms": _fmt(c["token_latency_p50_s"] * 1e3, ".1f"),
        "p99 ms": _fmt(c["token_latency_p99_s"] * 1e3, ".1f"), "greedy =": _greedy(c, bit_identical),
        "flag": "busy!" if c.get("flags") else "",
        "by sample": " ".join(_fmt(v) for v in c["speedup_by_sample"]) if len(c["speedup_by_sample"]) > 1 else "-",
    }


def _baseline_values(b) -> dict:
    return {"proposer": "target-only", "workload": b["workload"], "T": _fmt(b["temperature"], "g"), "γ": "0",
            "nodes": "1.0", "τ": "1.00", "v": "1.00", "tok/s": _fmt(b["tokens_per_second"], ".1f"), "speed-up [95%]": "1.00x",
            "p50 ms": _fmt(b["token_latency_p50_s"] * 1e3, ".1f"), "p99 ms": _fmt(b["token_latency_p99_s"] * 1e3, ".1f"),
            "flag": ""}


def tables(report: dict, wide: bool = False) -> list:
    """Rich tables: one line per proposer x workload x T x γ (the default's columns fit 120 characters;
    ``wide``: every column), then the peer's if it ran."""
    from rich.table import Table

    columns = _columns(report, wide)
    workloads = sorted({b["workload"] for b in report["baseline"]})
    s = report["settings"]
    t = Table(title=f"specplug compare — {report['target']['name']}, {', '.join(workloads)}, "
                    f"{s['max_new_tokens']} new tokens, {s['repeats']} repeat(s)")
    for col in columns:
        left = col in ("proposer", "workload", "flag")
        t.add_column(col, justify="left" if left else "right", no_wrap=col != "proposer",
                     max_width=28 if col == "proposer" else None, overflow="fold")
    bit_identical = report["target"].get("verify_bit_identical")
    rows = [_baseline_values(b) for b in sorted(report["baseline"], key=lambda b: (b["workload"], b["temperature"]))]
    rows += [_values(c, bit_identical) for c in _sorted_cells(report)]
    for row in rows:
        t.add_row(*[row.get(col, "-") for col in columns])
    if not report["peer"]:
        return [t]
    peer = Table(title=PEER_TITLES.get(report["settings"].get("peer"), "peer"))
    for col in ("peer", "workload", "T", "γ", "tok/s", "speed-up", "τ", "ours vs peer", "greedy = ours"):
        peer.add_column(col, justify="left" if col in ("peer", "workload") else "right", no_wrap=True)
    for p in report["peer"]:
        equal = GREEDY_MARKS[_peer_agreement(p)]
        peer.add_row(p["peer"], p["workload"], _fmt(p["temperature"], "g"), str(p["gamma"]),
                     _fmt(p["tokens_per_second"], ".1f"), _fmt(p["speedup"]), _fmt(p.get("mean_acceptance_length")),
                     f"{_fmt(p['ours_over_peer'])}x {p['ours']}", equal)
    if any(_peer_agreement(p) == TIES for p in report["peer"]):
        peer.caption = ("ties: the outputs part only where our target rates both tokens within rounding "
                        "(the engines sum their products in other orders)")
    return [t, peer]


def _peer_agreement(p: dict) -> str | None:
    """A peer row's greedy agreement (reports written before it was recorded: from equality alone)."""
    if "greedy_agreement" in p:
        return p["greedy_agreement"]
    return {None: None, True: EQUAL, False: DIFFER}[p["greedy_equal_to_ours"]]


def print_report(report: dict, console, wide: bool = False) -> None:
    """The tables, then the notes under them."""
    for t in tables(report, wide):
        console.print(t)
    for line in notes(report, wide):
        console.print(line, highlight=False, markup=False, soft_wrap=False)


def png(fig) -> str:
    """A matplotlib figure as a base64 PNG (the figure closed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def figures(report: dict) -> dict[str, str]:
    """The plots as base64 PNGs, keyed by PLOTS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    for name in PLOTS:
        figsize, draw = _PLOTTERS[name]
        fig, ax = plt.subplots(figsize=figsize)
        draw(ax, report)
        out[name] = png(fig)
    return out


def _by_cell(c: dict) -> tuple:
    return c["proposer"], c["temperature"], c["gamma"]


def _plot_speedup_vs_gamma(ax, report: dict) -> None:
    series: dict[tuple, list] = {}
    for c in report["cells"]:
        series.setdefault((c["proposer"], c["workload"], c["temperature"]), []).append(c)
    for (prop, wl, t), cs in sorted(series.items()):
        cs = sorted(cs, key=lambda c: c["gamma"])
        ys = [c["speedup"] or 0 for c in cs]
        spans = [c.get("speedup_interval") or (y, y) for c, y in zip(cs, ys)]
        ax.errorbar([c["gamma"] for c in cs], ys, yerr=[[y - lo for y, (lo, _) in zip(ys, spans)],
                                                       [hi - y for y, (_, hi) in zip(ys, spans)]],
                    marker="o", capsize=3, label=f"{prop} · {wl} · T={t:g}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="γ (draft tokens per step)", ylabel="speed-up over target-only (median, 95% interval)",
           title="Speed-up vs γ")
    ax.legend(fontsize=7)


def _plot_per_position_acceptance(ax, report: dict) -> None:
    cells = report["cells"]
    deepest = max((c["gamma"] for c in cells), default=None)
    for c in sorted(cells, key=_by_cell):
        if c["gamma"] == deepest and c["per_position_acceptance"]:
            ax.plot(range(1, len(c["per_position_acceptance"]) + 1), c["per_position_acceptance"], marker="o",
                    label=f"{c['proposer']} · {c['workload']} · T={c['temperature']:g} · γ={c['gamma']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="Per-position acceptance")
    ax.legend(fontsize=7)


def _plot_latency_distribution(ax, report: dict) -> None:
    runs = [(f"target-only · T={b['temperature']:g}", b) for b in report["baseline"]]
    runs += [(f"{c['proposer']} · T={c['temperature']:g} · γ={c['gamma']}", c)
             for c in sorted(report["cells"], key=_by_cell)]
    y = range(len(runs))
    ax.barh([i + 0.2 for i in y], [r["token_latency_p99_s"] * 1e3 for _, r in runs], height=0.4, label="p99")
    ax.barh([i - 0.2 for i in y], [r["token_latency_p50_s"] * 1e3 for _, r in runs], height=0.4, label="p50")
    ax.set_yticks(list(y), [label for label, _ in runs], fontsize=6)
    ax.set(xlabel="per-token latency (ms)", title="Latency distribution")
    ax.legend()


def _plot_measured_vs_predicted(ax, report: dict) -> None:
    pts = [(c["predicted_speedup"], c["predicted_speedup_with_verify_cost"], c["speedup"], c["proposer"])
           for c in report["cells"] if c["predicted_speedup"] is not None and c["speedup"] is not None]
    for i, prop in enumerate(sorted({p for *_, p in pts})):
        mine = [pt for pt in pts if pt[3] == prop]
        color = f"C{i % 10}"
        ax.scatter([x for x, _, _, _ in mine], [y for _, _, y, _ in mine], color=color, label=f"{prop} (v = 1)")
        with_v = [(x, y) for _, x, y, _ in mine if x is not None]
        ax.scatter([x for x, _ in with_v], [y for _, y in with_v], color=color, marker="x",
                   label=f"{prop} (measured v)")
    hi = max([1.0] + [max(x, y) for x, _, y, _ in pts]) * 1.1
    ax.plot([0, hi], [0, hi], color="grey", lw=0.8, ls="--")
    ax.set(xlabel="predicted (Leviathan, measured α and c; v = verify cost)", ylabel="measured speed-up",
           xlim=(0, hi), ylim=(0, hi), title="Measured vs predicted speed-up")
    ax.legend(fontsize=7)


def _plot_verify_cost_vs_nodes(ax, report: dict) -> None:
    for i, kind in enumerate(("chain", "tree")):
        pts = [(c["nodes_scored_per_step"], c["verify_cost"]) for c in report["cells"]
               if bool(c.get("tree")) == (kind == "tree") and c.get("nodes_scored_per_step") and c["verify_cost"]]
        ax.scatter([x for x, _ in pts], [y for _, y in pts], color=f"C{i}", label=f"{kind} cells")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="positions scored per target call (nodes + 1)", ylabel="v: a call's cost in target-only steps",
           title="Scoring cost by positions scored")
    ax.legend(fontsize=7)


_PLOTTERS = {  # name: (figure size, what draws it)
    "speedup_vs_gamma": ((7, 4), _plot_speedup_vs_gamma),
    "per_position_acceptance": ((7, 4), _plot_per_position_acceptance),
    "latency_distribution": ((7, 4), _plot_latency_distribution),
    "measured_vs_predicted": ((5, 5), _plot_measured_vs_predicted),
    "verify_cost_vs_nodes": ((6, 4), _plot_verify_cost_vs_nodes),
}


def _summary_html(report: dict) -> str:
    rows = "".join(
        f"<tr><td>T = {c['temperature']:g}</td><td>{html.escape(c['workload'])}</td><td><b>{html.escape(c['proposer'])}"
        f"</b></td><td>{c['gamma']}</td><td><b>{html.escape(_speedup(c))}</b></td>"
        f"<td>{html.escape('; '.join(c.get('flags') or [])) or 'consistent'}</td></tr>" for c in summary(report))
    flagged = [c for c in _sorted_cells(report) if c.get("flags")]
    warn = ""
    if flagged:
        items = "".join(f"<li>{html.escape(c['proposer'])} T={c['temperature']:g} γ={c['gamma']}: {BUSY} "
                        f"({html.escape('; '.join(c['flags']))})</li>" for c in flagged)
        warn = f'<div class="warn"><b>{len(flagged)} cell(s) flagged</b><ul>{items}</ul></div>'
    return (f"<table class=summary><tr><th>temperature</th><th>workload</th><th>best proposer</th><th>γ</th>"
            f"<th>speed-up [95% interval]</th><th>figures</th></tr>{rows}</table>{warn}")


def write_html(report: dict, path) -> None:
    """A self-contained page: the best proposer per temperature, the plots, the full table, then the
    settings and the raw JSON folded away."""
    from rich.console import Console

    console = Console(record=True, width=WIDE_WIDTH, file=io.StringIO())
    print_report(report, console, wide=True)
    skipped = "".join(f"<li><b>{html.escape(s['proposer'])}</b>: {html.escape(s['reason'])}</li>"
                      for s in report["skipped"]) or "<li>none</li>"
    images = "".join(f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,{data}"></figure>'
                     for name, data in figures(report).items())
    s = report["settings"]
    body = f"""<p>Speed-up over target-only decoding in the same, interleaved run: the median over paired runs, with a 95%
bootstrap interval over prompts and repeats ({s['repeats']} repeat(s), {s['max_new_tokens']} new tokens).</p>
{_summary_html(report)}
<h2>Plots</h2>{images}
<h2>Every cell</h2>
<p>α: accepted / drafted tokens; τ: tokens per target call; c: drafting time per drafted token in target-only
steps; v: the scoring pass over γ + 1 tokens in target-only steps. predicted = (1 − α<sup>γ+1</sup>) / ((1 − α)(γc + 1))
(Leviathan et al., v = 1); meas/pred(v) puts (γc + v) in its denominator; meas/pred compares with τ / (γc + v), the
speed-up the cell's own figures allow, so it shows only what the decode loop itself loses.</p>
<pre>{html.escape(console.export_text())}</pre>
<h2>Skipped proposers</h2><ul>{skipped}</ul>"""
    page = html_page("specplug compare", body, report)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)


def html_page(title: str, body: str, report: dict) -> str:
    """A self-contained page: ``title`` with the target's name, ``body``, then the settings, machine and target and
    the raw report (JSON), folded away."""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}} pre{{font-size:11px;overflow-x:auto}}
figure{{display:inline-block;margin:0.5em}} img{{max-width:560px}} td,th{{padding:0.2em 0.8em;text-align:left}}
.warn{{background:#fff3cd;padding:0.5em 1em;margin:1em 0}}</style></head><body>
<h1>{html.escape(title)} — {html.escape(report['target']['name'])}</h1>
{body}
<details><summary>Settings, machine and target</summary>
<pre>{html.escape(json.dumps({k: report[k] for k in ('settings', 'machine', 'target')}, indent=1))}</pre></details>
<details><summary>Raw report (JSON)</summary><pre>{html.escape(json.dumps(report, indent=1))}</pre></details>
</body></html>"""
