"""Render a compare report: a rich terminal table and a self-contained HTML page with matplotlib plots."""
from __future__ import annotations

import base64
import html
import io
import json

PEER_TITLES = {"hf": "Hugging Face transformers' assisted generation on the same target, draft and prompts",
               "vllm": "vLLM on the same target, drafts and prompts (τ from vLLM's own counters)"}
PLOTS = ("speedup_vs_gamma", "per_position_acceptance", "latency_distribution", "measured_vs_predicted")


def _fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def tables(report: dict) -> list:
    """Rich tables: every cell (one line per proposer x workload x T x γ), then the peer if it ran."""
    from rich.table import Table

    repeated = any(len(c["speedup_by_sample"]) > 1 for c in report["cells"])

    t = Table(title=f"specplug compare — target {report['target']['name']}, "
                    f"{report['settings']['max_new_tokens']} new tokens")
    columns = ["proposer", "workload", "T", "γ", "α", "tok/call", "c", "v", "tok/s", "speed-up", "predicted",
               "meas/pred", "meas/pred·v", "meas/acc", "p50 ms", "p99 ms", "greedy ="] + (["by sample"] if repeated else [])
    for col in columns:
        t.add_column(col, justify="left" if col in ("proposer", "workload") else "right", no_wrap=True)
    rows = []
    for b in report["baseline"]:
        rows.append(["target-only", b["workload"], _fmt(b["temperature"], "g"), "0", "-", "1.00", "-", "1.00",
                     _fmt(b["tokens_per_second"], ".1f"), "1.00", "-", "-", "-", "-", _fmt(b["token_latency_p50_s"] * 1e3, ".1f"),
                     _fmt(b["token_latency_p99_s"] * 1e3, ".1f"), "-", "-"])
    for c in sorted(report["cells"], key=lambda c: (c["workload"], c["temperature"], c["proposer"], c["gamma"])):
        equal = {None: "-", True: "yes", False: "NO"}[c["greedy_equal_to_target_only"]]
        by_sample = " ".join(_fmt(v) for v in c["speedup_by_sample"]) if len(c["speedup_by_sample"]) > 1 else "-"
        rows.append([c["proposer"], c["workload"], _fmt(c["temperature"], "g"), str(c["gamma"]),
                     _fmt(c["acceptance_rate"]), _fmt(c["mean_acceptance_length"]), _fmt(c["draft_cost_ratio"], ".3f"),
                     _fmt(c["verify_cost"]), _fmt(c["tokens_per_second"], ".1f"), _fmt(c["speedup"]),
                     _fmt(c["predicted_speedup"]), _fmt(c["measured_over_predicted"]),
                     _fmt(c["measured_over_predicted_with_verify_cost"]), _fmt(c["measured_over_accounted"]),
                     _fmt(c["token_latency_p50_s"] * 1e3, ".1f"),
                     _fmt(c["token_latency_p99_s"] * 1e3, ".1f"), equal, by_sample])
    for row in rows:
        t.add_row(*row[: len(columns)])
    if not report["peer"]:
        return [t]
    peer = Table(title=PEER_TITLES.get(report["settings"].get("peer"), "peer"))
    for col in ("peer", "workload", "T", "γ", "tok/s", "speed-up", "τ", "ours vs peer", "greedy = ours"):
        peer.add_column(col, justify="left" if col in ("peer", "workload") else "right", no_wrap=True)
    for p in report["peer"]:
        equal = {None: "-", True: "yes", False: "NO"}[p["greedy_equal_to_ours"]]
        peer.add_row(p["peer"], p["workload"], _fmt(p["temperature"], "g"), str(p["gamma"]),
                     _fmt(p["tokens_per_second"], ".1f"), _fmt(p["speedup"]), _fmt(p.get("mean_acceptance_length")),
                     f"{_fmt(p['ours_over_peer'])}x {p['ours']}", equal)
    return [t, peer]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def figures(report: dict) -> dict[str, str]:
    """The four plots as base64 PNGs, keyed by PLOTS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    series: dict[tuple, list] = {}
    for c in cells:
        series.setdefault((c["proposer"], c["workload"], c["temperature"]), []).append(c)
    out = {}

    fig, ax = plt.subplots(figsize=(7, 4))
    for (prop, wl, t), cs in sorted(series.items()):
        cs = sorted(cs, key=lambda c: c["gamma"])
        ax.plot([c["gamma"] for c in cs], [c["speedup"] or 0 for c in cs], marker="o", label=f"{prop} · {wl} · T={t:g}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="γ (draft tokens per step)", ylabel="speed-up over target-only (median)", title="Speed-up vs γ")
    ax.legend(fontsize=7)
    out["speedup_vs_gamma"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in sorted(cells, key=lambda c: (c["proposer"], c["temperature"], c["gamma"])):
        if c["gamma"] == max(x["gamma"] for x in cells) and c["per_position_acceptance"]:
            ax.plot(range(1, len(c["per_position_acceptance"]) + 1), c["per_position_acceptance"], marker="o",
                    label=f"{c['proposer']} · {c['workload']} · T={c['temperature']:g} · γ={c['gamma']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="Per-position acceptance")
    ax.legend(fontsize=7)
    out["per_position_acceptance"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, p50, p99 = [], [], []
    for b in report["baseline"]:
        labels.append(f"target-only · T={b['temperature']:g}")
        p50.append(b["token_latency_p50_s"] * 1e3)
        p99.append(b["token_latency_p99_s"] * 1e3)
    for c in sorted(cells, key=lambda c: (c["proposer"], c["temperature"], c["gamma"])):
        labels.append(f"{c['proposer']} · T={c['temperature']:g} · γ={c['gamma']}")
        p50.append(c["token_latency_p50_s"] * 1e3)
        p99.append(c["token_latency_p99_s"] * 1e3)
    y = range(len(labels))
    ax.barh([i + 0.2 for i in y], p99, height=0.4, label="p99")
    ax.barh([i - 0.2 for i in y], p50, height=0.4, label="p50")
    ax.set_yticks(list(y), labels, fontsize=6)
    ax.set(xlabel="per-token latency (ms)", title="Latency distribution")
    ax.legend()
    out["latency_distribution"] = _png(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    pts = [(c["predicted_speedup"], c["predicted_speedup_with_verify_cost"], c["speedup"], c["proposer"])
           for c in cells if c["predicted_speedup"] is not None and c["speedup"] is not None]
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
           xlim=(0, hi), ylim=(0, hi),
           title="Measured vs predicted speed-up")
    ax.legend(fontsize=7)
    out["measured_vs_predicted"] = _png(fig)
    return out


def write_html(report: dict, path) -> None:
    """A self-contained page: settings, the table, the four plots, and the raw JSON."""
    from rich.console import Console

    console = Console(record=True, width=200, file=io.StringIO())
    for t in tables(report):
        console.print(t)
    skipped = "".join(f"<li><b>{html.escape(s['proposer'])}</b>: {html.escape(s['reason'])}</li>"
                      for s in report["skipped"]) or "<li>none</li>"
    images = "".join(f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,{data}"></figure>'
                     for name, data in figures(report).items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>specplug compare</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}} pre{{font-size:11px;overflow-x:auto}}
figure{{display:inline-block;margin:0.5em}} img{{max-width:560px}}</style></head><body>
<h1>specplug compare — {html.escape(report['target']['name'])}</h1>
<p>Speed-ups are medians of paired runs against target-only decoding in the same run (interleaved).
c = drafting time per drafted token / target step time; predicted = (1 − α<sup>γ+1</sup>) / ((1 − α)(γc + 1)) (Leviathan et al.).
v = the target's scoring pass over γ + 1 tokens in target-only steps, measured in the same cell; the formula
assumes v = 1, and meas/pred·v uses (γc + v) instead. Both also assume every position is accepted
independently with one α; meas/acc compares with tok/call / (γc + v) from the cell's own tokens per call, so it
shows only what the decode loop itself loses.</p>
<h2>Settings</h2><pre>{html.escape(json.dumps({k: report[k] for k in ('settings', 'machine', 'target')}, indent=1))}</pre>
<h2>Skipped proposers</h2><ul>{skipped}</ul>
<h2>Results</h2><pre>{html.escape(console.export_text())}</pre>
<h2>Plots</h2>{images}
<h2>Raw report</h2><pre>{html.escape(json.dumps(report, indent=1))}</pre></body></html>"""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
