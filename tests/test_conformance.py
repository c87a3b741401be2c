"""The conformance kit: every built-in proposer passes `specplug check`; the example plugin passes; its
deliberately dishonest sibling fails, with the failed properties named."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from specplug.cli import main
from specplug.plugins import list_proposers
from specplug.testing import assert_proposer_conforms

BUILTINS = [name for name, info in list_proposers().items() if info.source == "specplug"]
SAMPLES = "400"  # the dishonest example lands below 1e-9 at 300 samples; honest proposers well above 1e-3


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_proposer_passes_specplug_check(name):
    result = CliRunner().invoke(main, ["check", name, "--samples", SAMPLES, "--json"], catch_exceptions=False)
    rows = json.loads(result.stdout)
    assert result.exit_code == 0, rows
    assert {r["check"] for r in rows} >= {"q-honesty[T=1]", "exactness[temperature-1]", "exactness[top-k-3]",
                                         "exactness[top-p-0.8]", "greedy-equality", "determinism", "rollback-residue"}


def check_installed(site, name):
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, "-m", "specplug.cli", "check", name, "--samples", SAMPLES], env=env,
                          capture_output=True, text=True, timeout=600)


def test_example_plugin_passes_the_check(example_site):
    out = check_installed(example_site, "bigram")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "conforms" in out.stderr


def test_dishonest_example_fails_the_check_naming_the_property(example_site):
    out = check_installed(example_site, "bigram-dishonest")
    assert out.returncode == 1
    assert "FAILED: q-honesty[T=1]" in out.stderr and "exactness[temperature-1]" in out.stderr
    assert "FAIL  q-honesty[T=1]" in out.stdout and "p = " in out.stdout


def test_pytest_helper_accepts_honest_and_rejects_dishonest(example_module):
    assert_proposer_conforms(lambda target, draft_dir: example_module.BigramProposer(), samples=600)
    with pytest.raises(AssertionError, match="q-honesty"):
        assert_proposer_conforms(lambda target, draft_dir: example_module.DishonestBigram(), samples=600)
