"""specplug compare: on tiny models, JSON that matches the documented schema, an HTML page that opens on
the summary and every plot, proposers that cannot attach skipped, not fatal; on synthetic runs, intervals
that say how sure a speed-up is and flags on the cells a busy machine explains better than the decoder."""
import io
import json
from importlib import resources

import jsonschema
import pytest
import numpy as np
from click.testing import CliRunner
from rich.console import Console

from specplug.bench import confidence
from specplug.bench.compare import Run, summarise
from specplug.bench.report import PLOTS, WIDTH, notes, tables
from specplug.cli import main
from specplug.metrics import GenerationStats


def test_tiny_compare_run_yields_schema_json_and_html_with_every_plot(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\n"}\n')
    html = tmp_path / "report.html"
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", f"draft-model:model={tiny_dirs['draft']}",
        "-p", "ngram", "-p", "draft-model:model=/nowhere",
        "-w", str(prompts), "--gammas", "1,3", "--temperatures", "0,1", "--max-new-tokens", "12",
        "--json", "--html", str(html)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    schema = json.loads((resources.files("specplug") / "bench" / "compare.schema.json").read_text())
    jsonschema.validate(report, schema)
    assert {s["proposer"] for s in report["skipped"]} == {"draft-model:model=/nowhere"}
    cells = {(c["proposer"].split(":")[0], c["temperature"], c["gamma"]) for c in report["cells"]}
    assert cells == {(p, t, g) for p in ("draft-model", "ngram") for t in (0.0, 1.0) for g in (1, 3)}
    assert all(c["runs"] == 2 * 2 for c in report["cells"])  # 2 prompts, 2 repeats by default
    assert all(c["speedup_interval"][0] <= c["speedup"] <= c["speedup_interval"][1] for c in report["cells"])
    greedy = [c for c in report["cells"] if c["temperature"] == 0]
    assert all(c["greedy_equal_to_target_only"] is True for c in greedy)
    page = html.read_text()
    for plot in PLOTS:
        assert f'id="{plot}"' in page
    assert page.count("data:image/png;base64,") == len(PLOTS)
    # the first screen: the summary, then the plots; settings and raw JSON folded away at the end
    assert page.index("best proposer") < page.index('id="speedup_vs_gamma"') < page.index("<details>")
    assert page.index("<details><summary>Settings") < page.index("<details><summary>Raw report")


def test_hf_peer_runs_on_the_same_prompts_and_its_greedy_tokens_equal_ours(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", f"draft-model:model={tiny_dirs['draft']}",
        "-p", "ngram", "-w", str(prompts), "--gammas", "2", "--temperatures", "0", "--max-new-tokens", "16",
        "--peer", "hf", "--json", "--html", str(tmp_path / "report.html")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    peer = {p["peer"]: p for p in json.loads(result.stdout)["peer"]}
    assert set(peer) == {"hf-target-only", "hf-assisted", "hf-prompt-lookup"}
    assert peer["hf-target-only"]["ours"] == "target-only" and peer["hf-target-only"]["gamma"] == 0
    assert all(p["greedy_equal_to_ours"] is True and p["greedy_agreement"] == "equal" and p["ours_over_peer"] > 0
               for p in peer.values())


def test_compare_rejects_an_unknown_workload(tiny_dirs, tmp_path):
    result = CliRunner().invoke(main, ["compare", "--target", str(tiny_dirs["target"]), "-w", "nonsense",
                                       "--html", str(tmp_path / "report.html")])
    assert result.exit_code != 0 and "unknown workload 'nonsense'" in result.output


def test_compare_rejects_an_unknown_peer_naming_the_known_ones(tiny_dirs, tmp_path):
    result = CliRunner().invoke(main, ["compare", "--target", str(tiny_dirs["target"]), "--peer", "nope",
                                       "--html", str(tmp_path / "report.html")])
    assert result.exit_code != 0 and "unknown peer 'nope'; known: hf" in result.output


def test_default_table_fits_120_columns_and_explains_its_ratio(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    args = ["compare", "--target", str(tiny_dirs["target"]), "-p", f"draft-model:model={tiny_dirs['draft']}",
            "-p", "ngram", "-w", str(prompts), "--gammas", "2", "--max-new-tokens", "8",
            "--html", str(tmp_path / "report.html")]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert any(line.startswith("meas/pred:") for line in lines)
    header = next(line for line in lines if "speed-up" in line)
    assert "meas/pred" in header and "p99" not in header
    wide = CliRunner().invoke(main, args + ["--wide"], catch_exceptions=False)
    assert "p99 ms" in wide.stdout and "meas/pred(v=1)" in wide.stdout


def test_load_bench_reports_goodput_per_batch_size_with_policies(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\n"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", "ngram", "-w", str(prompts), "--gammas", "2",
        "--max-new-tokens", "8", "--batch-sizes", "1,2", "--repeats", "1", "--requests", "3", "--json",
        "--html", str(tmp_path / "report.html")],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["settings"]["requests"] == 3
    text = json.dumps(report)
    for label in ("heuristic", "cost-model", "cost-model warm"):
        assert label in text
    page = (tmp_path / "report.html").read_text()
    assert "goodput, tokens/s" in page and "cost-model warm" in page and "Raw report (JSON)" in page
    assert '<figure id="goodput_vs_batch_size"><img alt="goodput vs batch size" src="data:image/png;base64,' in page


def _one_request_load_bench(tiny_dirs, tmp_path) -> dict:
    """The JSON report of `specplug compare --batch-sizes 1` over one greedy request (ngram, γ = 2)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", "ngram", "-w", str(prompts), "--gammas", "2",
        "--temperatures", "0", "--max-new-tokens", "6", "--batch-sizes", "1", "--repeats", "1", "--requests", "1",
        "--json", "--html", ""], catch_exceptions=False)
    return json.loads(result.stdout)


def _rendered(report: dict) -> str:
    from specplug.bench import load

    console = Console(width=400, file=io.StringIO(), record=True)
    load.render(report, console)
    return console.export_text()


def test_load_bench_table_marks_a_cell_whose_greedy_rows_part_from_target_only(tiny_dirs, tmp_path):
    report = _one_request_load_bench(tiny_dirs, tmp_path)
    assert "≠" not in _rendered(report)  # greedy speculative rows equal target-only's
    next(c for c in report["cells"] if c["variant"] == "ngram γ=2")["greedy_equal_to_target_only"] = False
    assert "≠: greedy tokens differ" in _rendered(report)


def test_load_bench_takes_one_prompt_per_request_unless_told(tiny_dirs, tmp_path):
    def prompts_used(*extra):
        result = CliRunner().invoke(main, [
            "compare", "--target", str(tiny_dirs["target"]), "-p", "ngram", "--gammas", "2", "--max-new-tokens", "4",
            "--batch-sizes", "2", "--repeats", "1", "--requests", "5", "--json",
            "--html", str(tmp_path / "report.html"), *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["settings"]["prompts"]

    # copies of a prompt would decode alike and move in step, a burstier load than distinct requests
    assert prompts_used() == 5
    assert prompts_used("-n", "2") == 2


def test_the_ceiling_rows_draft_target_onlys_output_and_never_count_as_the_best(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\n"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", "ngram", "-w", str(prompts), "--gammas", "2",
        "--temperatures", "0", "--max-new-tokens", "8", "--batch-sizes", "1,2", "--repeats", "1", "--requests", "2",
        "--ceiling", "3", "--json", "--html", ""], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    oracle = [c for c in report["cells"] if c["variant"] == "oracle γ=3"]
    assert [c["batch_size"] for c in oracle] == [1, 2] and report["settings"]["ceiling"] == [3]
    for cell in oracle:  # every drafted token is target-only's own: all kept, and the rows are target-only's
        assert cell["ceiling"] and cell["acceptance_rate"] == 1.0 and cell["greedy_equal_to_target_only"] is True
    assert all(best["variant"] != "oracle γ=3" and best["best_static"] != "oracle γ=3"
               for best in report["best"].values())
    assert "the most any proposer could reach" in _rendered(report)


def test_the_speedup_plot_draws_each_proposers_best_gamma_its_policies_and_the_ceiling():
    from specplug.bench.load import speedup_curves

    def cell(variant, proposer, B, x, policy=None, ceiling=False):
        return {"variant": variant, "proposer": proposer, "policy": policy, "batch_size": B,
                "speedup_vs_target_only": x, "ceiling": ceiling}

    report = {"settings": {"batch_sizes": [1, 4]}, "cells": [
        cell("target-only", None, 1, 1.0), cell("target-only", None, 4, 1.0),
        cell("ngram γ=2", "ngram", 1, 1.3), cell("ngram γ=4", "ngram", 1, 1.6), cell("ngram γ=2", "ngram", 4, 1.1),
        cell("ngram γ=4", "ngram", 4, 0.9), cell("ngram cost-model", "ngram", 1, 1.5, policy="cost-model"),
        cell("ngram cost-model", "ngram", 4, None, policy="cost-model"),
        cell("oracle γ=2", "oracle", 1, 2.0, ceiling=True), cell("oracle γ=4", "oracle", 1, 2.6, ceiling=True),
        cell("oracle γ=2", "oracle", 4, 1.4, ceiling=True), cell("oracle γ=4", "oracle", 4, 1.3, ceiling=True)]}
    assert speedup_curves(report) == {"ngram best γ": [1.6, 1.1], "ngram cost-model": [1.5, None],
                                      "oracle best γ (ceiling)": [2.6, 1.4]}


@pytest.mark.parametrize("extra, message", [(["--temperatures", "1", "--batch-sizes", "1"], "must be 0, got 1"),
                                            (["--temperatures", "0"], "give --batch-sizes too")])
def test_a_ceiling_without_a_greedy_load_bench_is_refused_before_loading(extra, message):
    result = CliRunner().invoke(main, ["compare", "--target", "no/such/model", "--ceiling", "2", *extra])
    assert result.exit_code == 2 and "--ceiling" in result.output and message in result.output


# --- synthetic runs: figures whose truth is known -------------------------------------------------------

STEP = 0.006  # a target-only step, seconds


def _run(tokens: int, gamma: int, accepted: int, c: float, v: float, slow: float = 1.0) -> Run:
    """A run of ``tokens`` tokens: steps drafting γ and keeping ``accepted``; drafting c and scoring v in
    target-only steps; everything ``slow`` times slower (another process on the cores)."""
    stats = GenerationStats(prompt_tokens=20)
    emitted = accepted + 1
    for _ in range(tokens // emitted):
        draft, score = gamma * c * STEP * slow, (v if gamma else 1.0) * STEP * slow
        stats.record_step(gamma, gamma, accepted, emitted, draft + score)
        stats.draft_time += draft
        stats.target_time += score
    stats.wall_time = sum(stats.step_times)
    return Run(stats, list(range(stats.new_tokens)))


def _report(repeats=2, prompts=5, base_slow=lambda rep, pi: 1.0, cell_slow=lambda label, rep, pi: 1.0,
            cells=(("draft-model", 4, 2, 0.05, 1.1), ("ngram", 4, 0, 0.01, 1.1))):
    """One greedy workload; prompt i's work is a little longer or shorter, as real prompts are."""
    runs = {}
    for rep in range(repeats):
        for pi in range(prompts):
            pair, length = ("w", pi, 0, rep, 0.0), 1 + 0.05 * (pi % 3)
            baseline = _run(60, 0, 0, 0, 1, length * base_slow(rep, pi))
            runs.setdefault(("baseline", "w", 0.0), []).append((pair, baseline))
            for label, g, acc, c, v in cells:
                runs.setdefault((label, "w", 0.0, g), []).append(
                    (pair, _run(60, g, acc, c, v, length * cell_slow(label, rep, pi))))
    settings = {"max_new_tokens": 60, "repeats": repeats, "gammas": [4], "temperatures": [0.0], "peer": None,
                "workloads": [{"name": "w", "prompts": prompts, "samples": 1}]}
    report = summarise(runs, target={"name": "synthetic", "parameters": 0, "device": "cpu", "dtype": "float32"},
                       settings=settings)
    return report, {c["proposer"]: c for c in report["cells"]}


def test_a_clean_run_is_not_flagged_and_its_speedup_is_what_tau_c_and_v_allow():
    report, cells = _report()
    assert all(c["flags"] == [] for c in cells.values())
    assert abs(cells["draft-model"]["measured_over_accounted"] - 1) < 0.01
    assert not any(line.startswith("busy!") for line in notes(report))
    schema = json.loads((resources.files("specplug") / "bench" / "compare.schema.json").read_text())
    jsonschema.validate(report, schema)


def test_a_slow_spell_in_one_cell_flags_that_cell_only():
    _, cells = _report(cell_slow=lambda label, rep, pi: 1.8 if label == "ngram" and rep == 1 else 1.0)
    assert cells["draft-model"]["flags"] == []
    assert cells["ngram"]["slow_runs"] == 5
    assert cells["ngram"]["flags"] == ["5 of 10 runs took ≥30% longer than a repeat"]


def test_one_slow_run_among_many_is_not_a_busy_cell():
    _, cells = _report(cell_slow=lambda label, rep, pi: 1.8 if (label, rep, pi) == ("ngram", 1, 2) else 1.0)
    assert cells["ngram"]["slow_runs"] == 1 and cells["ngram"]["flags"] == []


def test_a_slow_baseline_flags_the_speedups_it_inflated():
    # no repeats to compare with, but a speed-up of 1.3x from 1 token a call cannot be the decoder's
    report, cells = _report(repeats=1, base_slow=lambda rep, pi: 1.5)
    assert cells["ngram"]["speedup"] > 1.3
    assert cells["ngram"]["flags"] and "its τ, c and v allow" in cells["ngram"]["flags"][0]
    assert cells["draft-model"]["flags"]  # 3 tokens a call allow 2.3x, not 3.5x
    lines = notes(report)
    assert f"busy!: {confidence.BUSY}" in lines and any(line.startswith("  ngram T=0 γ=4: speed-up") for line in lines)
    console = Console(width=WIDTH, file=io.StringIO(), record=True)
    console.print(tables(report)[0])
    assert console.export_text().count("busy!") == 2


def test_the_interval_covers_the_median_and_is_narrow_when_repeats_agree():
    rng = np.random.default_rng(1)
    for _ in range(20):
        groups = rng.lognormal(0.5, 0.3, size=(rng.integers(1, 8), rng.integers(1, 4))).tolist()
        low, high = confidence.speedup_interval(groups)
        assert low <= float(np.median(groups)) <= high
    assert confidence.speedup_interval([[2.0, 2.0], [2.0, 2.0]]) == (2.0, 2.0)
    agree = confidence.speedup_interval([[2.0, 2.01], [1.99, 2.0], [2.0, 2.02]])
    disagree = confidence.speedup_interval([[1.5, 2.5], [1.2, 2.8], [2.0, 3.1]])
    assert agree[1] - agree[0] < 0.05 < disagree[1] - disagree[0]


def test_the_interval_is_reproducible_and_handles_prompts_with_unequal_repeats():
    groups = [[1.9, 2.1, 2.0], [2.4], [1.7, 1.8]]
    assert confidence.speedup_interval(groups) == confidence.speedup_interval(groups)
    low, high = confidence.speedup_interval(groups)
    assert 1.7 <= low <= 2.0 <= high <= 2.4


def test_every_synthetic_cell_carries_its_interval_in_the_json():
    _, cells = _report()
    for c in cells.values():
        low, high = c["speedup_interval"]
        assert low <= c["speedup"] <= high


def test_compare_reports_the_speed_choices_this_machine_made(tiny_dirs, tmp_path):
    from specplug import machine

    machine.forget()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", f"draft-model:model={tiny_dirs['draft']}",
        "-w", str(prompts), "--gammas", "2", "--temperatures", "0", "--max-new-tokens", "6", "--repeats", "1",
        "--json", "--html", str(tmp_path / "report.html")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    taken = {(c["name"], c["value"], c["source"]) for c in report["machine"]["choices"]}
    assert taken == {(c.name, c.value, c.source) for c in machine.machine_choices()}
    assert taken, "loading a target and a drafter decides at least the kernel facts they rely on"
    assert any(line.startswith("machine choice ") for line in notes(report))


def test_load_bench_reports_the_machines_choices_and_whether_its_verify_passes_are_bit_identical(tiny_dirs, tmp_path):
    from specplug import machine

    machine.forget()
    report = _one_request_load_bench(tiny_dirs, tmp_path)
    taken = {(c["name"], c["value"], c["source"]) for c in report["machine"]["choices"]}
    assert taken and taken == {(c.name, c.value, c.source) for c in machine.machine_choices()}
    text = _rendered(report)
    assert f"{report['target']['matmul_dtype']} products" in text
    made = {(c["name"], c["value"]) for c in report["machine"]["choices"]}
    assert sum(line.startswith("machine choice ") for line in text.splitlines()) == len(made)  # one per form
    # whichever path this machine's probe found, the table says so
    assert ("not bit-identical" in text) == (report["target"]["verify_bit_identical"] is False)
    report["target"]["verify_bit_identical"] = False
    assert "not bit-identical to its one-token steps on this machine" in _rendered(report)


def test_decoder_options_of_a_spec_go_to_the_decoder_and_the_rest_to_the_proposer():
    from specplug.bench.compare import ProposerSpec

    spec = ProposerSpec.parse("draft-model:verification=block,model=/m")
    assert (spec.name, spec.options, spec.decode) == ("draft-model", {"model": "/m"}, {"verification": "block"})
    assert spec.label == "draft-model:verification=block,model=/m"


def test_compare_no_lean_scores_on_hf_forward_and_says_so(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", "ngram", "--no-lean", "-w", str(prompts),
        "--gammas", "2", "--temperatures", "0", "--max-new-tokens", "6", "--repeats", "1", "--json",
        "--html", ""], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    target = json.loads(result.stdout)["target"]
    assert target["lean"] is False and target["lean_note"].startswith("lean=False")


def test_tree_cells_stand_beside_chain_cells_with_their_nodes_and_scoring_cost():
    # a tree of 16 nodes scores 17 positions a call at 1.7 target steps; the chain of 4 scores 5 at 1.1
    report, cells = _report(cells=(("eagle", 4, 3, 0.05, 1.1), ("eagle:tree=16", 4, 4, 0.05, 1.7),
                                   ("eagle:verification=block", 4, 3, 0.05, 1.1)))
    tree, chain, block = cells["eagle:tree=16"], cells["eagle"], cells["eagle:verification=block"]
    assert (tree["tree"], chain["tree"]) == (16, None)
    assert (block["verification"], chain["verification"]) == ("block", "token")
    assert tree["verify_cost"] == pytest.approx(1.7, rel=0.05) and chain["verify_cost"] == pytest.approx(1.1, rel=0.05)
    table = tables(report)[0]
    assert {"nodes", "v"} <= {col.header for col in table.columns}
    console = Console(width=WIDTH, file=io.StringIO(), record=True)
    console.print(table)
    assert max(len(line) for line in console.export_text().splitlines()) <= WIDTH
