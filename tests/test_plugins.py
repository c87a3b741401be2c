"""Entry points for real: an installed distribution (a dist-info on the path) adds a proposer through the
``specplug`` group; a broken plugin is reported and skipped while the others load."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

PLUGIN = '''
import specplug
from specplug.types import Proposal, Proposer


class Repeat(Proposer):
    """Proposes the last token again, as a point mass."""

    def __init__(self, target=None):
        pass

    def propose(self, seq, k):
        return Proposal.point_mass([seq.ids[-1]] * k)


@specplug.hookimpl
def register_proposers(register):
    register("repeat-last", Repeat, "Proposes the last token again.")
'''


@pytest.fixture
def site(tmp_path):
    """Two installed distributions: a working plugin and one whose module fails to import."""
    (tmp_path / "repeat_plugin.py").write_text(PLUGIN)
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('missing dependency frobnicate')\n")
    for dist, module in (("specplug-repeat", "repeat_plugin"), ("specplug-broken", "broken_plugin")):
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[specplug]\n{module} = {module}\n")
    return tmp_path


def run(site, *code_or_args, cli=False):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "specplug.cli", *code_or_args] if cli else [sys.executable, "-c", *code_or_args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_registry_sees_an_installed_entry_point_and_reports_a_broken_one(site):
    code = textwrap.dedent("""
        import warnings, json
        warnings.simplefilter("ignore")
        import specplug
        from specplug.plugins import failures
        found = specplug.list_proposers()
        print(json.dumps({"found": {n: i.source for n, i in found.items()},
                          "failures": [[f.plugin, f.source, f.error] for f in failures]}))
    """)
    out = run(site, code)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["found"]["repeat-last"] == "specplug-repeat"
    assert data["found"]["draft-model"] == data["found"]["ngram"] == "specplug"
    assert data["failures"] == [["broken_plugin", "specplug-broken", "ImportError: missing dependency frobnicate"]]


def test_cli_lists_plugin_proposers_with_their_distribution(site):
    out = run(site, "proposers", "--json", cli=True)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = {p["name"]: p for p in data["proposers"]}
    assert rows["repeat-last"]["source"] == "specplug-repeat"
    assert rows["repeat-last"]["description"] == "Proposes the last token again."
    assert data["failed_plugins"][0]["plugin"] == "broken_plugin"
    assert "broken_plugin" in out.stderr  # warned, not fatal


def test_plugin_proposer_decodes_exactly_like_target_only(site, tiny_dirs):
    code = textwrap.dedent(f"""
        import warnings; warnings.simplefilter("ignore")
        import specplug
        t = specplug.Target.from_pretrained({str(tiny_dirs["target"])!r})
        p = specplug.get_proposer("repeat-last", target=t)
        a = specplug.generate(t, p, "def f(x):", max_new_tokens=50, sampling=specplug.GREEDY)
        b = specplug.generate(t, None, "def f(x):", max_new_tokens=50, sampling=specplug.GREEDY)
        print(a.tokens == b.tokens, a.stats.draft_tokens > 0)
    """)
    out = run(site, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
