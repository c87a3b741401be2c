"""specplug compare on tiny models: JSON that matches the documented schema, an HTML page with every plot,
and proposers that cannot attach are skipped, not fatal."""
import json
from importlib import resources

import jsonschema
from click.testing import CliRunner

from specplug.bench.report import PLOTS
from specplug.cli import main


def test_tiny_compare_run_yields_schema_json_and_html_with_every_plot(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\n"}\n')
    html = tmp_path / "report.html"
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", f"draft-model:model={tiny_dirs['draft']}",
        "-p", "ngram", "-p", "no-such-proposer", "-p", "draft-model:model=/nowhere",
        "-w", str(prompts), "--gammas", "1,3", "--temperatures", "0,1", "--max-new-tokens", "12",
        "--json", "--html", str(html)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    schema = json.loads((resources.files("specplug") / "bench" / "compare.schema.json").read_text())
    jsonschema.validate(report, schema)
    assert {s["proposer"] for s in report["skipped"]} == {"no-such-proposer", "draft-model:model=/nowhere"}
    cells = {(c["proposer"].split(":")[0], c["temperature"], c["gamma"]) for c in report["cells"]}
    assert cells == {(p, t, g) for p in ("draft-model", "ngram") for t in (0.0, 1.0) for g in (1, 3)}
    assert all(c["runs"] == 2 for c in report["cells"])
    greedy = [c for c in report["cells"] if c["temperature"] == 0]
    assert all(c["greedy_equal_to_target_only"] is True for c in greedy)
    page = html.read_text()
    for plot in PLOTS:
        assert f'id="{plot}"' in page
    assert page.count("data:image/png;base64,") == len(PLOTS)


def test_hf_peer_runs_on_the_same_prompts_and_its_greedy_tokens_equal_ours(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", f"draft-model:model={tiny_dirs['draft']}",
        "-p", "ngram", "-w", str(prompts), "--gammas", "2", "--temperatures", "0", "--max-new-tokens", "16",
        "--peer", "hf", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    peer = {p["peer"]: p for p in json.loads(result.stdout)["peer"]}
    assert set(peer) == {"hf-target-only", "hf-assisted", "hf-prompt-lookup"}
    assert peer["hf-target-only"]["ours"] == "target-only" and peer["hf-target-only"]["gamma"] == 0
    assert all(p["greedy_equal_to_ours"] is True and p["ours_over_peer"] > 0 for p in peer.values())


def test_compare_rejects_an_unknown_workload(tiny_dirs):
    result = CliRunner().invoke(main, ["compare", "--target", str(tiny_dirs["target"]), "-w", "nonsense"])
    assert result.exit_code != 0 and "unknown workload 'nonsense'" in result.output


def test_load_bench_reports_goodput_per_batch_size_with_policies(tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\n"}\n')
    result = CliRunner().invoke(main, [
        "compare", "--target", str(tiny_dirs["target"]), "-p", "ngram", "-w", str(prompts), "--gammas", "2",
        "--max-new-tokens", "8", "--batch-sizes", "1,2", "--repeats", "1", "--requests", "3", "--json"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["settings"]["requests"] == 3
    text = json.dumps(report)
    for label in ("heuristic", "cost-model", "cost-model warm"):
        assert label in text


def test_load_bench_takes_one_prompt_per_request_unless_told(tiny_dirs):
    def prompts_used(*extra):
        result = CliRunner().invoke(main, [
            "compare", "--target", str(tiny_dirs["target"]), "-p", "ngram", "--gammas", "2", "--max-new-tokens", "4",
            "--batch-sizes", "2", "--repeats", "1", "--requests", "5", "--json", *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["settings"]["prompts"]

    # copies of a prompt would decode alike and move in step, a burstier load than distinct requests
    assert prompts_used() == 5
    assert prompts_used("-n", "2") == 2
