"""Batched decoding: exact per row, equal to each row decoded alone, rows independent of each other.

The strongest check is reproducibility: with per-row seeds, every row of a batch emits exactly the tokens the
single-sequence loop emits for that seed (greedy and sampled), whatever else is in the batch, whatever the
acceptance pattern (holes, compaction), and when rows finish or join mid-way. Since the single loop is exact
(tests/test_exactness.py), so is each row. The statistical harness also runs directly on batches (B > 1).
"""
from collections import Counter

import pytest
import torch

import specplug
from specplug.batch import BatchCacheView, generate_batch
from specplug.decode import SpeculationError
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution
from specplug.types import Proposal, Proposer

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self", "for i in range(10):\n", "import os\n", "x"]


def proposer(name, dirs, target):
    if name is None:
        return None
    if name == "noisy-oracle":
        return NoisyOracle(target)
    options = {"draft-model": {"model": dirs["draft"]}, "eagle": {"head": "random"},
               "eagle3": {"head": "random"}}.get(name, {})
    return specplug.get_proposer(name, target=target, **options)


class NoisyOracle(Proposer):
    """Drafts the target's own greedy continuation but corrupts a position now and then, so rows of a batch
    accept different numbers of tokens at every step (holes in the shared cache, compaction)."""

    name = "noisy-oracle"

    def __init__(self, target):
        self.target = target

    def propose(self, seq, k):
        ids, out = list(seq.ids), []
        with torch.inference_mode():
            for i in range(k):
                token = int(self.target.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                if (len(seq.ids) * 7 + i * 3) % 5 == 0:
                    token = (token + 1) % self.target.vocab_size
                out.append(token)
                ids.append(token)
        return Proposal.point_mass(out)


@pytest.fixture(scope="module")
def tiny_hf_target(tiny_dirs):
    """The tiny target on HF's own forward (the padded fallback), not the lean one."""
    target = specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)
    assert target.lean is None and target.lean_note.startswith("lean=False")
    return target


def alone(target, prop, prompt, budget, sampling, gamma=4):
    return specplug.generate(target, prop, prompt, max_new_tokens=budget, sampling=sampling,
                             num_speculative_tokens=gamma, strict=True)


# --- greedy: each row equals the row decoded alone ------------------------------------------------------
@pytest.mark.parametrize("name", [None, "ngram", "draft-model", "noisy-oracle", "eagle", "eagle3"])
def test_greedy_batch_equals_each_row_alone(name, tiny_dirs, tiny_target):
    prop = proposer(name, tiny_dirs, tiny_target)
    batch = generate_batch(tiny_target, prop, PROMPTS, max_new_tokens=100, sampling=specplug.GREEDY,
                           num_speculative_tokens=4, strict=True)
    for prompt, got in zip(PROMPTS, batch):
        want = alone(tiny_target, prop, prompt, 100, specplug.GREEDY)
        assert len(got.tokens) == 100 and got.finish_reason == "length"
        assert got.tokens == want.tokens
        assert got.stats.step_accepted == want.stats.step_accepted  # same steps, not just the same text
        assert got.prompt_ids == want.prompt_ids and got.text == want.text


# --- sampled: per-row seeds make each row reproduce the single loop, independent of the batch --------------
@pytest.mark.parametrize("name", ["noisy-oracle", "draft-model", "ngram", "eagle", "eagle3"])
def test_sampled_rows_reproduce_the_single_loop_with_their_seeds(name, tiny_dirs, tiny_target):
    prop = proposer(name, tiny_dirs, tiny_target)
    budgets = [60, 23, 75, 5, 40]
    settings = [specplug.SamplingParams(temperature=1.0, seed=10 + i) if i % 2 else
                specplug.SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=10 + i) for i in range(5)]
    for cap in (None, 2) if name != "ngram" else (2,):  # all at once; two at a time, the others joining later
        batch = generate_batch(tiny_target, prop, PROMPTS, max_new_tokens=budgets, sampling=settings,
                               num_speculative_tokens=3, strict=True, max_batch_size=cap)
        for i, got in enumerate(batch):
            want = alone(tiny_target, prop, PROMPTS[i], budgets[i], settings[i], gamma=3)
            assert got.tokens == want.tokens, (cap, i)
            assert got.stats.step_accepted == want.stats.step_accepted


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_feature_heads_draft_every_row_in_one_pass_as_each_row_would_alone(name, tiny_target, monkeypatch):
    """A feature head's propose_batch feeds and drafts all rows in one head pass a step, and gives each row the
    very proposal propose gives it alone (tokens and q, bit for bit), so every sampled row of the batch
    reproduces the single loop token for token."""
    from specplug import feature_heads

    drafts: dict[str, dict] = {"batch": {}, "alone": {}}
    record = {"to": "batch"}
    real_rows, real_one = feature_heads.FeatureHeadProposer._draft_rows, feature_heads.FeatureHeadProposer.propose

    def rows(self, seqs, ks, states):
        keys = [tuple(seq.ids) for seq in seqs]
        out = real_rows(self, seqs, ks, states)
        drafts["batch"].update(zip(keys, out))
        return out

    def one(self, seq, k):
        key, out = tuple(seq.ids), real_one(self, seq, k)
        drafts[record["to"]][key] = out
        return out

    monkeypatch.setattr(feature_heads.FeatureHeadProposer, "_draft_rows", rows)
    monkeypatch.setattr(feature_heads.FeatureHeadProposer, "propose", one)
    prop = specplug.get_proposer(name, target=tiny_target, head="random", init_std=0.5)
    settings = [specplug.SamplingParams(temperature=1.0, seed=20 + i) for i in range(len(PROMPTS))]
    batch = generate_batch(tiny_target, prop, PROMPTS, max_new_tokens=40, sampling=settings, num_speculative_tokens=4,
                           strict=True)
    record["to"] = "alone"
    for i, got in enumerate(batch):
        want = alone(tiny_target, prop, PROMPTS[i], 40, settings[i])
        assert got.tokens == want.tokens, i
        assert got.stats.step_accepted == want.stats.step_accepted
    shared = drafts["batch"].keys() & drafts["alone"].keys()
    assert len(shared) >= 20  # many batched steps, each met again by the single loop
    for key in shared:
        got, want = drafts["batch"][key], drafts["alone"][key]
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.q, want.q)


def test_a_rows_output_does_not_depend_on_its_neighbours(tiny_dirs, tiny_target):
    prop = NoisyOracle(tiny_target)
    mine = specplug.SamplingParams(temperature=1.0, seed=5)
    solo = generate_batch(tiny_target, prop, [PROMPTS[0]], max_new_tokens=50, sampling=mine)[0]
    crowd = generate_batch(tiny_target, prop, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], max_new_tokens=[7, 50, 90],
                           sampling=[specplug.SamplingParams(temperature=1.0, seed=99), mine,
                                     specplug.SamplingParams(temperature=0.5, seed=98)])[1]
    assert crowd.tokens == solo.tokens


# --- the statistical harness on batches (B > 1) ---------------------------------------------------------
SMALL_PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
OTHER_PROMPT = [3, 3, 1]
N_TOKENS = 3
ROWS, CALLS = 50, 30  # 1500 samples, batches of 50 rows plus 4 distractor rows with other prompts/budgets


@pytest.mark.parametrize("setting", ["temperature-1", "top-k-3"])
@pytest.mark.parametrize("name", ["draft-model", "ngram"])
def test_batched_sampling_matches_target_distribution(name, setting, small_vocab_dirs, small_target):
    sampling = {"temperature-1": specplug.SamplingParams(temperature=1.0),
                "top-k-3": specplug.SamplingParams(temperature=1.0, top_k=3)}[setting]
    assert batched_pvalue(small_target, proposer(name, small_vocab_dirs, small_target), sampling) > EXACTNESS_ALPHA


def test_batched_sampling_with_bf16_products_matches_target_distribution(small_vocab_dirs):
    target = specplug.Target.from_pretrained(small_vocab_dirs["target"], matmul_dtype="bfloat16")
    sampling = specplug.SamplingParams(temperature=1.0)
    assert batched_pvalue(target, proposer("draft-model", small_vocab_dirs, target), sampling) > EXACTNESS_ALPHA


def batched_pvalue(small_target, prop, sampling):
    """Chi-square p-value of ROWS × CALLS batched samples of SMALL_PROMPT against the exact distribution."""
    expected = exact_distribution(small_target, SMALL_PROMPT, N_TOKENS, sampling)
    counts = Counter()
    for call in range(CALLS):
        seeds = [call * 100 + r for r in range(ROWS + 4)]
        params = [specplug.SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=s) for s in seeds]
        prompts = [SMALL_PROMPT] * ROWS + [OTHER_PROMPT] * 4
        budgets = [N_TOKENS] * ROWS + [2, 5, 6, 8]
        out = generate_batch(small_target, prop, prompts, max_new_tokens=budgets, sampling=params,
                             num_speculative_tokens=2, strict=True)
        for result in out[:ROWS]:
            counts[tuple(result.tokens)] += 1
    # pooled over rows; that no row is special is shown exactly by the reproduction tests above
    return chi_square_pvalue(counts, expected)


MIXED = {"temperature-1": specplug.SamplingParams(temperature=1.0),
         "top-k-3": specplug.SamplingParams(temperature=1.0, top_k=3),
         "top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_p=0.8)}


def mixed_pvalues(target, prop, calls=20, rows=60):
    """One chi-square p-value per setting of MIXED, from batches whose rows take the settings in turn (plus a
    greedy row, which must not disturb the others), each row against its own setting's exact distribution."""
    names = list(MIXED)
    counts = {name: Counter() for name in names}
    for call in range(calls):
        params = [specplug.SamplingParams(**{**MIXED[names[r % 3]].to_dict(), "seed": call * 1000 + r})
                  for r in range(rows)] + [specplug.GREEDY]
        out = generate_batch(target, prop, [SMALL_PROMPT] * (rows + 1), max_new_tokens=N_TOKENS, sampling=params,
                             num_speculative_tokens=2, strict=True)
        for r, result in enumerate(out[:rows]):
            counts[names[r % 3]][tuple(result.tokens)] += 1
    return {name: chi_square_pvalue(counts[name], exact_distribution(target, SMALL_PROMPT, N_TOKENS, MIXED[name]))
            for name in names}


@pytest.mark.parametrize("name, lean", [("draft-model", True), ("ngram", True), ("draft-model", False)],
                         ids=["draft-model", "ngram", "draft-model-hf-padded"])
def test_each_row_of_a_batch_with_mixed_settings_matches_its_own_target_distribution(name, lean, small_vocab_dirs,
                                                                                      small_target):
    target = small_target if lean else specplug.Target.from_pretrained(small_vocab_dirs["target"], lean=False)
    pvalues = mixed_pvalues(target, proposer(name, small_vocab_dirs, target))
    assert min(pvalues.values()) > EXACTNESS_ALPHA, pvalues


def test_mixed_settings_harness_has_power(small_vocab_dirs, small_target, monkeypatch):
    """p and q swapped in the rule: caught in every setting of the mixed batch."""
    import specplug.verifier.rule as rule

    monkeypatch.setattr(rule, "acceptance_probability", lambda p_x, q_x: torch.clamp(q_x / p_x, max=1.0))
    pvalues = mixed_pvalues(small_target, proposer("draft-model", small_vocab_dirs, small_target), calls=10)
    assert max(pvalues.values()) < EXACTNESS_ALPHA, pvalues


def test_harness_on_batches_has_power(small_vocab_dirs, small_target, monkeypatch):
    """A mutant verifier (residual replaced by p) is caught by the same batched harness."""
    import specplug.verifier.rule as rule

    monkeypatch.setattr(rule, "residual_distribution", lambda p, q: p)
    sampling = specplug.SamplingParams(temperature=1.0)
    prop = proposer("draft-model", small_vocab_dirs, small_target)
    counts = Counter()
    for call in range(20):
        params = [specplug.SamplingParams(1.0, seed=call * 100 + r) for r in range(50)]
        for result in generate_batch(small_target, prop, [SMALL_PROMPT] * 50, max_new_tokens=N_TOKENS,
                                     sampling=params, num_speculative_tokens=2):
            counts[tuple(result.tokens)] += 1
    assert chi_square_pvalue(counts, exact_distribution(small_target, SMALL_PROMPT, N_TOKENS, sampling)) < EXACTNESS_ALPHA


# --- rows finishing at different times ------------------------------------------------------------------
def test_rows_finishing_at_eos_or_budget_do_not_disturb_the_others(tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    free = specplug.generate(target, None, PROMPTS[0], max_new_tokens=30, sampling=specplug.GREEDY)
    eos = free.tokens[5]
    target.tokenizer.eos_token = None
    target.model.generation_config.eos_token_id = eos
    prop = NoisyOracle(target)
    budgets = [30, 3, 80, 1, 45]
    batch = generate_batch(target, prop, PROMPTS, max_new_tokens=budgets, sampling=specplug.GREEDY,
                           num_speculative_tokens=4, strict=True)
    assert batch[0].finish_reason == "eos" and batch[0].tokens == free.tokens[: free.tokens.index(eos) + 1]
    for i, got in enumerate(batch):
        want = alone(target, prop, PROMPTS[i], budgets[i], specplug.GREEDY)
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
        if got.finish_reason == "length":
            assert len(got.tokens) == budgets[i]


def test_stop_strings_per_row(tiny_dirs, tiny_target):
    frees = [specplug.generate(tiny_target, None, p, max_new_tokens=40, sampling=specplug.GREEDY) for p in PROMPTS[:3]]
    stop = frees[1].text[10:13]
    prop = proposer("ngram", tiny_dirs, tiny_target)
    batch = generate_batch(tiny_target, prop, PROMPTS[:3], max_new_tokens=40, sampling=specplug.GREEDY, stop=[stop])
    for prompt, got in zip(PROMPTS[:3], batch):
        want = specplug.generate(tiny_target, prop, prompt, max_new_tokens=40, sampling=specplug.GREEDY, stop=[stop])
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
    assert batch[1].finish_reason == "stop"


# --- cache hygiene --------------------------------------------------------------------------------------
class CacheChecker(NoisyOracle):
    """After every step: the row's count of cached target tokens and the sequence agree (on the padded HF
    fallback, its valid slots too)."""

    def observe(self, seq, verdict):
        view = seq.target_cache
        assert view.length == len(seq.ids) - 1
        if isinstance(view, BatchCacheView):
            assert view.length == int(view.batch.valid[view.row].sum())
            assert view.batch.cache.get_seq_length() == view.batch.slots
            self.max_slots = max(getattr(self, "max_slots", 0), view.batch.slots)
            self.compactions = view.batch.compactions
        else:  # the lean path: a cache of its own, every layer as long as the row
            assert {layer.length for layer in view.layers} == {view.length}
            self.caches = getattr(self, "caches", {})
            self.caches.setdefault(seq.request_id, view)
            assert self.caches[seq.request_id] is view  # joins and leaves never move a row's cache


def test_lean_rows_keep_a_cache_each_that_follows_the_accepted_sequence(tiny_target):
    assert tiny_target.lean is not None
    checker = CacheChecker(tiny_target)
    generate_batch(tiny_target, checker, PROMPTS, max_new_tokens=[60, 20, 60, 60, 60], sampling=specplug.GREEDY,
                   num_speculative_tokens=5, strict=True, max_batch_size=3)
    assert len(checker.caches) == len(PROMPTS)


def test_padded_fallback_cache_bookkeeping_and_compaction(tiny_hf_target):
    checker = CacheChecker(tiny_hf_target)
    out = generate_batch(tiny_hf_target, checker, PROMPTS, max_new_tokens=[120, 40, 120, 120, 120],
                         sampling=specplug.GREEDY, num_speculative_tokens=5, strict=True)
    longest = max(len(r.prompt_ids) + len(r.tokens) for r in out)
    # holes are compacted away: the shared cache never grows far past the longest row
    assert checker.max_slots <= longest + 5 + 1 + 40
    assert checker.compactions > 0


# --- failures ---------------------------------------------------------------------------------------------
class FailsOnRow(NoisyOracle):
    name = "flaky"

    def propose(self, seq, k):
        if seq.num_prompt == 5 and len(seq.output_ids) >= 3:
            raise RuntimeError("boom")
        return super().propose(seq, k)


def test_a_raising_proposer_falls_back_on_its_row_only(tiny_target):
    flaky = FailsOnRow(tiny_target)
    with pytest.warns(UserWarning, match="flaky"):
        batch = generate_batch(tiny_target, flaky, PROMPTS, max_new_tokens=30, sampling=specplug.GREEDY)
    lengths = [len(r.prompt_ids) for r in batch]
    for prompt, got, n in zip(PROMPTS, batch, lengths):
        base = specplug.generate(tiny_target, None, prompt, max_new_tokens=30, sampling=specplug.GREEDY)
        assert got.tokens == base.tokens
        assert (got.stats.fallback_steps > 0) == (n == 5)


def test_strict_mode_names_the_proposer_and_keeps_partials(tiny_target):
    with pytest.raises(SpeculationError, match="flaky") as info:
        generate_batch(tiny_target, FailsOnRow(tiny_target), PROMPTS, max_new_tokens=30, sampling=specplug.GREEDY,
                       strict=True)
    err = info.value
    assert len(err.partial.prompt_ids) == 5 and len(err.partial.tokens) >= 3
    assert len(err.partials) == len(PROMPTS)


class OutOfRange(Proposer):
    name = "out-of-range"

    def propose(self, seq, k):
        return Proposal.point_mass([10 ** 6] * k)


def test_bad_proposal_is_an_error_naming_the_proposer(tiny_target):
    with pytest.raises(SpeculationError, match="out-of-range"):
        generate_batch(tiny_target, OutOfRange(), PROMPTS[:2], max_new_tokens=5)


# --- γ per row: ints, policy objects ----------------------------------------------------------------------
class Recorder:
    name = "recorder"

    def __init__(self, k):
        self.k, self.seen = k, []

    def choose(self, seq, max_k):
        return self.k

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        self.seen.append((seq.num_prompt, proposed, accepted, batch_size))


def test_gamma_may_be_an_int_or_a_policy_per_row(tiny_target):
    prop = NoisyOracle(tiny_target)
    policy = Recorder(2)
    out = generate_batch(tiny_target, prop, PROMPTS[:3], max_new_tokens=20, sampling=specplug.GREEDY,
                         num_speculative_tokens=[0, policy, 5])
    assert max(out[0].stats.step_proposed) == 0 and max(out[1].stats.step_proposed) == 2
    assert max(out[2].stats.step_proposed) == 5
    assert {s[0] for s in policy.seen} == {len(out[1].prompt_ids)} and policy.seen[0][3] == 3


class Crashes(Recorder):
    def choose(self, seq, max_k):
        raise ZeroDivisionError("no estimate")


def test_a_policy_crash_is_a_clear_error(tiny_target):
    with pytest.raises(SpeculationError, match="policy 'recorder'.*choose"):
        generate_batch(tiny_target, NoisyOracle(tiny_target), PROMPTS[:2], max_new_tokens=5,
                       num_speculative_tokens=Crashes(1))


# --- the load bench -----------------------------------------------------------------------------------------
def test_load_bench_reports_goodput_and_latency_per_batch_size(tiny_dirs, tiny_target):
    import json

    from specplug.bench.load import render, run_load

    policies = {"recorder": lambda: Recorder(1)}
    report = run_load(tiny_target, ["ngram", f"draft-model:model={tiny_dirs['draft']}", "no-such-proposer"],
                      batch_sizes=(1, 3), gammas=(2,), policies=policies, max_new_tokens=6,
                      prompts=PROMPTS[:2], requests=4, repeats=1, warmup=False)
    json.dumps(report)
    assert report["schema"] == "specplug.load/1"
    assert [s["proposer"] for s in report["skipped"]] == ["no-such-proposer"]
    labels = {c["variant"] for c in report["cells"]}
    assert "target-only" in labels and "ngram γ=2" in labels and "ngram recorder" in labels
    assert len(report["cells"]) == 2 * 5
    for cell in report["cells"]:
        assert cell["goodput_tokens_per_s"] > 0 and cell["token_latency_p99_s"] >= cell["token_latency_p50_s"] > 0
        assert cell["goodput_by_repeat"] == [cell["goodput_tokens_per_s"]]  # one repeat
        if cell["proposer"]:
            assert cell["greedy_equal_to_target_only"] is True
    recorded = [c for c in report["cells"] if c["policy"] == "recorder"]
    assert all(c["mean_gamma"] <= 1 for c in recorded)
    assert set(report["best"]) == {"1", "3"} and report["settings"]["requests"] == 4
    assert all(c["paired_vs_best_static"] > 0 and c["paired_vs_target_only"] > 0 for c in recorded)
    by = {(c["variant"], c["batch_size"]): c for c in report["cells"]}
    for c in recorded:  # the paired ratio follows from the goodputs by repeat the report carries
        base = by[("target-only", c["batch_size"])]["goodput_by_repeat"]
        assert c["paired_vs_target_only"] == pytest.approx(c["goodput_by_repeat"][0] / base[0])
    for c in recorded:  # a policy chooses γ for its proposer: it is measured against that proposer's static γ
        own = [o for o in report["cells"] if o["batch_size"] == c["batch_size"] and o["policy"] is None
               and o["proposer"] in (c["proposer"], None)]
        assert c["best_static"] == max(own, key=lambda o: o["goodput_tokens_per_s"])["variant"]
    from rich.console import Console

    console = Console(record=True, width=160)
    render(report, console)
    text = console.export_text()
    assert "B=3" in text and "paired" in text


def test_paired_ratio_compares_runs_of_the_same_repeat():
    from specplug.bench.load import _paired

    policy = [{"goodput": 90.0}, {"goodput": 40.0}, {"goodput": 100.0}]
    static = [{"goodput": 100.0}, {"goodput": 50.0}, {"goodput": 80.0}]
    # within-repeat ratios 0.9, 0.8, 1.25: median 0.9 (a ratio of the medians would say 90 / 80 = 1.125)
    assert _paired(policy, static) == 0.9


class BatchedOracle(NoisyOracle):
    """A proposer with propose_batch (here just the per-row proposals, counted)."""

    calls = 0

    def propose_batch(self, seqs, ks):
        self.calls += 1
        return [self.propose(seq, k) for seq, k in zip(seqs, ks)]


class BrokenBatch(NoisyOracle):
    name = "broken-batch"

    def propose_batch(self, seqs, ks):
        raise RuntimeError("no batch today")


def test_propose_batch_is_used_when_a_proposer_has_it(tiny_target):
    batched = BatchedOracle(tiny_target)
    settings = [specplug.SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    got = generate_batch(tiny_target, batched, PROMPTS[:3], max_new_tokens=25, sampling=settings)
    want = generate_batch(tiny_target, NoisyOracle(tiny_target), PROMPTS[:3], max_new_tokens=25, sampling=settings)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert 0 < batched.calls <= max(r.stats.target_calls for r in got)
    with pytest.warns(UserWarning, match="broken-batch"):
        fell = generate_batch(tiny_target, BrokenBatch(tiny_target), PROMPTS[:3], max_new_tokens=10,
                              sampling=specplug.GREEDY)
    assert all(r.stats.fallback_steps == 9 for r in fell)
    with pytest.raises(SpeculationError, match="broken-batch"):
        generate_batch(tiny_target, BrokenBatch(tiny_target), PROMPTS[:3], max_new_tokens=10, strict=True)


class WholeBatch(Recorder):
    """Chooses every row's k at once: γ for the row with the given prompt length, 0 for the others."""

    name = "whole-batch"

    def __init__(self, k, prompt_length):
        super().__init__(k)
        self.prompt_length = prompt_length

    def choose_batch(self, seqs, max_ks):
        assert all(seq.scratch["batch_size"] == len(seqs) for seq in seqs)
        return [self.k if seq.num_prompt == self.prompt_length else 0 for seq in seqs]


def test_a_shared_policy_may_choose_for_the_whole_batch(tiny_target):
    policy = WholeBatch(3, len(tiny_target.encode(PROMPTS[0])))
    out = generate_batch(tiny_target, NoisyOracle(tiny_target), PROMPTS[:3], max_new_tokens=15,
                         sampling=specplug.GREEDY, num_speculative_tokens=policy)
    assert max(out[0].stats.step_proposed) == 3 and max(out[1].stats.step_proposed + out[2].stats.step_proposed) == 0
    assert len(policy.seen) > 0  # update() still reaches it per row


class FeatureChecker(NoisyOracle):
    """Asks for the target's last hidden state: in greedy decoding lm_head(feature_i) picks verdict token i."""

    needs_features = ("last", "layer:1")

    def observe(self, seq, verdict):
        last = verdict.features["last"]
        assert last.shape == (verdict.accepted + 1, self.target.hidden_size)
        assert verdict.features["layer:1"].shape == last.shape
        with torch.inference_mode():
            assert self.target.lm_head(last).argmax(-1).tolist() == verdict.tokens
        self.checked = getattr(self, "checked", 0) + 1


def test_proposers_get_their_rows_target_features(tiny_target):
    checker = FeatureChecker(tiny_target)
    out = generate_batch(tiny_target, checker, PROMPTS, max_new_tokens=20, sampling=specplug.GREEDY, strict=True)
    assert checker.checked == sum(r.stats.target_calls for r in out)


class StepRecorder(Recorder):
    """Drafts 2 tokens in every row, except none in every third step; records each step's shared costs."""

    name = "step-recorder"

    def __init__(self):
        super().__init__(2)
        self.steps, self.calls = [], 0

    def choose_batch(self, seqs, max_ks):
        self.calls += 1
        return [0 if self.calls % 3 == 0 else 2 for _ in seqs]

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        step = seq.scratch["batch_step"]
        if not self.steps or self.steps[-1] is not step:
            self.steps.append(step)


def test_steps_report_the_positions_the_pass_scored_over_all_rows(tiny_target):
    policy = StepRecorder()
    generate_batch(tiny_target, NoisyOracle(tiny_target), PROMPTS[:3], max_new_tokens=12, sampling=specplug.GREEDY,
                   num_speculative_tokens=policy, max_batch_size=2)
    assert tiny_target.new_rows().padded is False  # the tiny Llama runs on the lean, ragged rows
    assert [s["tokens"] for s in policy.steps[:3]] == [6, 6, 2]  # 3 positions in each of two rows, then 1
    assert not any(s["padded"] for s in policy.steps)


def test_steps_report_the_rows_whose_drafter_had_a_backlog(tiny_target):
    # a drafter that did not run last step (a row that just joined, or k was 0) catches up first, so that
    # step's drafting time is no measure of drafting: the step says how many such rows drafted
    policy = StepRecorder()
    generate_batch(tiny_target, NoisyOracle(tiny_target), PROMPTS[:3], max_new_tokens=12, sampling=specplug.GREEDY,
                   num_speculative_tokens=policy, max_batch_size=2)
    rows = [(s["draft_rows"], s["backlog_rows"]) for s in policy.steps]
    assert rows[0] == (2, 2)  # both rows start with their prompts
    assert rows[1] == (2, 0) and rows[2] == (0, 0) and rows[3] == (2, 2)  # after a plain step every drafter lags
    # the third prompt joins when a row finishes: its first drafting step has one backlog row at least
    assert any(backlog == 1 for _, backlog in rows[3:])
