"""Real CLI runs through click's runner."""
import json

from click.testing import CliRunner

from specplug.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_generate_json_prints_tokens_text_and_stats(tiny_dirs):
    result = invoke("generate", "--target", tiny_dirs["target"], "--proposer", "draft-model",
                    "-o", f"model={tiny_dirs['draft']}", "-n", 24, "-k", 3, "--json", "def add(a, b):")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["tokens"]) == 24 and isinstance(data["text"], str)
    assert data["stats"]["new_tokens"] == 24 and data["stats"]["finish_reason"] == "length"
    assert data["sampling"]["temperature"] == 0.0


def test_generate_target_only_streams_text(tiny_dirs):
    result = invoke("generate", "--target", tiny_dirs["target"], "--proposer", "none", "-n", 10, "import os")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("import os") and "10 tokens" in result.stderr


def test_generate_options_reach_the_proposer(tiny_dirs):
    result = invoke("generate", "--target", tiny_dirs["target"], "-p", "ngram", "-o", "prompt_lookup_max=5",
                    "-n", 8, "--json", "for i in range(10):")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["stats"]["new_tokens"] == 8


def test_unknown_proposer_is_a_clear_cli_error(tiny_dirs):
    result = invoke("generate", "--target", tiny_dirs["target"], "-p", "nope", "x")
    assert result.exit_code != 0 and "--proposer nope: unknown proposer 'nope'; available:" in result.output


def test_generate_refuses_a_proposer_option_typo_before_loading_the_target(tmp_path):
    result = invoke("generate", "--target", tmp_path / "nowhere", "-p", "ngram", "-o", "prompt_lookup_max=abc", "x")
    assert result.exit_code != 0 and "--target" not in result.output
    assert "--proposer ngram: proposer 'ngram': option prompt_lookup_max takes an int, got 'abc'" in result.output


def test_missing_target_is_a_clear_cli_error(tmp_path):
    result = invoke("generate", "--target", tmp_path / "nowhere", "x")
    assert result.exit_code != 0 and "--target" in result.output


def test_generate_with_a_policy_records_its_choices(tiny_dirs):
    result = invoke("generate", "--target", tiny_dirs["target"], "-p", "ngram", "--policy", "heuristic", "-k", 2,
                    "-n", 30, "--json", "for i in range(10):")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["stats"]["new_tokens"] == 30


def test_unknown_policy_is_a_clear_cli_error(tiny_dirs):
    result = invoke("generate", "--target", tiny_dirs["target"], "-p", "ngram", "--policy", "nope", "x")
    assert result.exit_code != 0 and "--policy nope: unknown policy 'nope'" in result.output


def test_compare_refuses_an_unknown_proposer_or_option_before_loading_the_target(tmp_path):
    # the target does not exist: the proposer's name is checked first
    result = invoke("compare", "--target", tmp_path / "nowhere", "-p", "ngram", "-p", "nope", "--html", "")
    assert result.exit_code != 0 and "unknown proposer 'nope'; available:" in result.output
    result = invoke("compare", "--target", tmp_path / "nowhere", "-p", "ngram:colour=1", "--html", "")
    assert result.exit_code != 0 and "--proposer ngram:colour=1" in result.output
    assert "bad options ['colour']; it takes" in result.output


def test_compare_refuses_bad_number_lists_by_option_before_loading_the_target(tmp_path):
    for option, value, message in (("--batch-sizes", "0,4", "each value must be >= 1, got 0"),
                                   ("--gammas", "2,-1", "each value must be >= 0, got -1"),
                                   ("--temperatures", "-1", "each value must be >= 0, got -1.0"),
                                   ("--gammas", "2.5", "not a comma-separated list of ints"),
                                   ("--batch-sizes", ",", "lists no value")):
        result = invoke("compare", "--target", tmp_path / "nowhere", "-p", "ngram", option, value, "--html", "")
        assert result.exit_code != 0 and option in result.output and message in result.output, result.output
