"""specplug and vLLM on the bundled zoo target, with a real vLLM engine (no mock): vLLM's output equals ours,
specplug's proposers run inside vLLM through the custom_class adapter, an EAGLE-3 head in the speculators
format is served, and ``compare --peer vllm`` reports its rows.

Without vLLM these tests skip with the install hint — except under CI=true, where a missing vLLM fails them
(CI installs the extra, so a skip there would hide a broken install)."""
import json
import os
from importlib import resources

import pytest
import torch

import specplug
from specplug.integrations.vllm import INSTALL_HINT, check_model_free, engine_kwargs, require_vllm
from specplug.types import Proposer

PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n")
NEW_TOKENS = 64
GREEDY = specplug.SamplingParams(temperature=0.0)


def _vllm_or_skip():
    try:
        return require_vllm()
    except ImportError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the vLLM tests: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def vllm_env():
    """vLLM importable; engines run inside this process (no engine/worker processes to spawn: ~15 s a start
    instead of ~45 s here) with a 1 GiB KV cache and no compilation."""
    _vllm_or_skip()
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE",
                                            "SPECPLUG_VLLM_EAGER")}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", SPECPLUG_VLLM_EAGER="1")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def zoo_target():
    # float32 products on both sides, so greedy tokens can be compared one for one
    return specplug.Target.from_pretrained("zoo:pycode", dtype="float32", matmul_dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(zoo_target):
    return [zoo_target.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def ours(zoo_target, prompt_ids):
    """specplug's target-only greedy output: what every vLLM configuration must reproduce."""
    return [specplug.generate(zoo_target, None, ids, max_new_tokens=NEW_TOKENS, sampling=GREEDY).tokens
            for ids in prompt_ids]


@pytest.fixture
def engine(vllm_env, zoo_target):
    """start(**speculative options) -> a vLLM engine on the zoo target, shut down after the test."""
    from specplug.bench.peer_vllm import model_dir, shutdown, start_engine

    started = []

    def start(**options):
        llm = start_engine(model_dir(zoo_target), dtype="float32", max_num_seqs=4, max_model_len=1024,
                           enforce_eager=True, **options)
        started.append(llm)
        return llm

    yield start
    for llm in started:
        shutdown(llm)


def _greedy(llm, prompt_ids):
    from specplug.bench.peer_vllm import run_requests, sampling_params

    tokens, _, counters = run_requests(llm, prompt_ids, sampling_params(GREEDY, NEW_TOKENS))
    return tokens, counters


def test_vllm_target_only_greedy_output_equals_specplugs(engine, prompt_ids, ours):
    tokens, _ = _greedy(engine(), prompt_ids)
    assert tokens == ours


def test_specplug_suffix_inside_vllm_keeps_greedy_output_and_learns_across_requests(engine, prompt_ids, ours):
    llm = engine(**engine_kwargs("suffix", num_speculative_tokens=4))
    first, cold = _greedy(llm, prompt_ids)
    second, warm = _greedy(llm, prompt_ids)  # the same prompts again: the global cache holds their outputs
    assert first == ours and second == ours
    assert cold["drafts"] > 0 and warm["drafts"] > 0
    tau_cold = 1 + cold["accepted"] / cold["drafts"]
    tau_warm = 1 + warm["accepted"] / warm["drafts"]
    assert tau_warm > tau_cold and tau_warm > 3.5, (cold, warm)


def test_ngram_counts_inside_vllm_keeps_greedy_output(engine, prompt_ids, ours):
    tokens, counters = _greedy(engine(**engine_kwargs("ngram", num_speculative_tokens=3, q="counts")), prompt_ids)
    assert tokens == ours and counters["accepted"] > 0


def _random_eagle3_head(out, target_dir, draft_vocab=2048):
    """An EAGLE-3 head for the zoo target written by the speculators library itself: one layer, features of
    target layers 1, 3 and 4, a drafting vocabulary of the first ``draft_vocab`` ids, random weights."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    d2t = torch.zeros(draft_vocab, dtype=torch.long)  # draft id i is target id i + d2t[i]
    head = Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab, norm_before_residual=True, ttt_steps=3,
        verifier_name_or_path=str(target_dir), target_layer_ids=[1, 3, 4], draft_attn_impl="sdpa")
    head.save_pretrained(out)
    return out


def test_eagle3_head_in_the_speculators_format_is_served_with_greedy_output_equal_to_target_only(
        engine, zoo_target, prompt_ids, ours, tmp_path):
    pytest.importorskip("speculators", reason=f"the speculators library comes with {INSTALL_HINT}")
    head = _random_eagle3_head(tmp_path / "eagle3", zoo_target.path)
    llm = engine(speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    tokens, counters = _greedy(llm, prompt_ids)
    assert tokens == ours
    assert counters["drafts"] > 0  # it did draft (random weights: little is accepted)


def _random_specplug_eagle3_head(target, out):
    from specplug import heads
    from specplug.proposers.eagle3 import Eagle3Head

    head = Eagle3Head.for_target(target, seed=4, std=0.15)
    heads.save_head(out, "eagle3", head.state_dict(), head.config, target)
    return out


def test_exported_eagle3_zoo_head_is_served_with_greedy_output_equal_and_tau_within_10_percent_of_ours(
        engine, zoo_target, prompt_ids, ours, tmp_path):
    """The head specplug trains, exported with ``specplug export --format speculators``, behaves in vLLM as in
    specplug: same greedy output, and vLLM's mean acceptance length within 10% of ours at the same γ."""
    pytest.importorskip("speculators", reason=f"the speculators library comes with {INSTALL_HINT}")
    formats = pytest.importorskip("specplug.speculators_format", reason="needs the eagle3 head and its export")
    from specplug import zoo
    from specplug.proposers.eagle3 import DEFAULT_HEADS

    head = zoo.PREFIX + DEFAULT_HEADS["pycode"]
    if not (zoo.models_dir() / DEFAULT_HEADS["pycode"] / "model.safetensors").is_file():
        head = _random_specplug_eagle3_head(zoo_target, tmp_path / "head")  # a checkout without the trained one
    gamma = 3
    exported = formats.export_eagle3(head, tmp_path / "eagle3", target=zoo_target)
    mine = [specplug.generate(zoo_target, specplug.get_proposer("eagle3", target=zoo_target, head=head), ids,
                              max_new_tokens=NEW_TOKENS, sampling=GREEDY, num_speculative_tokens=gamma, strict=True)
            for ids in prompt_ids]
    assert [r.tokens for r in mine] == ours
    tau_ours = sum(r.stats.new_tokens for r in mine) / sum(r.stats.target_calls for r in mine)
    llm = engine(speculative_config={"method": "eagle3", "model": str(exported), "num_speculative_tokens": gamma})
    tokens, counters = _greedy(llm, prompt_ids)
    assert tokens == ours
    tau_vllm = 1 + counters["accepted"] / counters["drafts"]
    assert abs(tau_vllm - tau_ours) <= 0.1 * tau_ours, (tau_vllm, tau_ours)


def test_compare_peer_vllm_reports_schema_valid_rows_with_greedy_tokens_equal_to_ours(vllm_env, tmp_path):
    import jsonschema
    from click.testing import CliRunner

    from specplug.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    html = tmp_path / "report.html"
    result = CliRunner().invoke(main, [
        "compare", "--target", "zoo:pycode", "--matmul-dtype", "float32", "-p", "ngram:q=counts", "-p", "suffix", "-w",
        str(prompts),
        "--gammas", "3", "--temperatures", "0", "--max-new-tokens", "24", "--peer", "vllm", "--json",
        "--html", str(html)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    jsonschema.validate(report, json.loads((resources.files("specplug") / "bench" / "compare.schema.json").read_text()))
    peer = {p["peer"]: p for p in report["peer"]}
    assert set(peer) == {"vllm-target-only", "vllm-specplug-ngram:q=counts", "vllm-specplug-suffix"}
    assert peer["vllm-target-only"]["ours"] == "target-only" and peer["vllm-specplug-suffix"]["ours"] == "suffix"
    assert all(p["greedy_equal_to_ours"] is True and p["ours_over_peer"] > 0 for p in peer.values())
    # every engine's own τ, though three were alive (vLLM's metrics registry keeps only the newest engine's)
    assert peer["vllm-specplug-ngram:q=counts"]["mean_acceptance_length"] > 1
    assert peer["vllm-specplug-suffix"]["mean_acceptance_length"] >= 1
    assert "vllm-specplug-suffix" in html.read_text()


def test_load_bench_peer_vllm_reports_tau_and_greedy_equality_for_every_engine_and_batch_size(vllm_env, tmp_path):
    """vLLM's own ngram, started last: in-process (as here), vLLM 0.32 cannot start an engine after one that
    imported numba (its kernel rebinding scan trips over llvmlite's objects); the CLI's engines run in their
    own processes."""
    from click.testing import CliRunner

    from specplug.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    result = CliRunner().invoke(main, [
        "compare", "--target", "zoo:pycode", "--matmul-dtype", "float32", "-p", "ngram", "-w", str(prompts),
        "--batch-sizes", "1,2", "--requests", "2", "--gammas", "3", "--temperatures", "0", "--max-new-tokens", "24",
        "--repeats", "1", "--peer", "vllm", "--json", "--html", str(tmp_path / "load.html")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "vLLM on the same requests" in (tmp_path / "load.html").read_text()
    rows = {(r["peer"], r["batch_size"]): r for r in json.loads(result.stdout)["peer"]}
    assert set(rows) == {(p, B) for p in ("vllm-target-only", "vllm-ngram") for B in (1, 2)}
    assert all(r["greedy_equal_to_ours"] is True and r["greedy_agreement"] == "equal" and r["goodput_tokens_per_s"] > 0
               for r in rows.values())
    assert all(rows[("vllm-ngram", B)]["mean_acceptance_length"] > 1 for B in (1, 2))


# --- without an engine ---------------------------------------------------------------------------------

def test_without_vllm_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError, match=r"specplug\[vllm\]"):
        require_vllm()


def test_adapter_refuses_a_proposer_that_needs_target_features():
    class Featured(Proposer):
        name = "featured"
        needs_features = ("last",)

    with pytest.raises(ValueError, match="'featured' needs target features"):
        check_model_free(Featured())


def test_adapter_rejects_an_unknown_proposer_before_vllm_starts():
    with pytest.raises(ValueError, match="unknown proposer 'no-such'"):
        engine_kwargs("no-such", num_speculative_tokens=2)
