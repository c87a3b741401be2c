"""The one decode engine: the same rules for one request and for a batch, and the bugs found reading the two
loops it replaced (each test here failed on them)."""
import types

import pytest
import torch

import specplug
from benchmark_scripts import BENCHMARKS, load_benchmark
from specplug.batch import generate_batch
from specplug.detokenize import IncrementalDetokenizer
from specplug.policies import GammaPolicy
from specplug.proposers.draft_model import DraftModelProposer
from specplug.types import Proposal, Proposer, SequenceState

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self", "for i in range(10):\n", "import os\n", "x",
           "while True:\n", "print(", "if __name__"]


class Repeat(Proposer):
    """Drafts the last token again (a point mass): often rejected, sometimes accepted."""

    name = "repeat"

    def propose(self, seq, k):
        return Proposal.point_mass([seq.ids[-1]] * k)


# --- one engine for every batch size ---------------------------------------------------------------------
@pytest.mark.parametrize("lean", [True, False], ids=["lean-rows", "hf-padded"])
@pytest.mark.parametrize("name", [None, "ngram", "draft-model"])
def test_greedy_batched_output_equals_target_only_row_by_row_with_rows_joining_and_leaving(
        name, lean, tiny_dirs, tiny_target):
    target = tiny_target if lean else specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)
    options = {"model": tiny_dirs["draft"]} if name == "draft-model" else {}
    prop = specplug.get_proposer(name, target=target, **options) if name else None
    budgets = [40, 7, 25, 40, 3, 33, 18, 40]
    want = [specplug.generate(target, None, p, max_new_tokens=b, sampling=specplug.GREEDY).tokens
            for p, b in zip(PROMPTS, budgets)]
    for cap in (1, 3, 8):  # at 1 and 3 rows leave and others join mid-flight
        got = generate_batch(target, prop, PROMPTS, max_new_tokens=budgets, sampling=specplug.GREEDY,
                             num_speculative_tokens=4, strict=True, max_batch_size=cap)
        assert [r.tokens for r in got] == want, cap


def test_a_single_prompt_batch_is_exactly_generate(tiny_dirs, tiny_target):
    prop = specplug.get_proposer("draft-model", target=tiny_target, model=tiny_dirs["draft"])
    sampling = specplug.SamplingParams(temperature=0.9, top_k=50, seed=4)
    one = specplug.generate(tiny_target, prop, PROMPTS[0], max_new_tokens=30, sampling=sampling)
    batch = generate_batch(tiny_target, prop, [PROMPTS[0]], max_new_tokens=30, sampling=sampling)[0]
    assert batch.tokens == one.tokens and batch.stats.step_accepted == one.stats.step_accepted


# --- the drift between the two loops, fixed ------------------------------------------------------------------
class Duck:
    """A duck-typed policy (no GammaPolicy base): choose only."""

    name = "duck"

    def choose(self, seq, max_k):
        return 2


@pytest.mark.parametrize("spec, gamma", [(3, 3), (GammaPolicy, None), (Duck(), 2), (lambda seq: 1, 1), ([2], 2)],
                         ids=["int", "gamma-policy", "duck-typed", "callable", "list"])
def test_one_rule_for_num_speculative_tokens_alone_and_in_a_batch(spec, gamma, tiny_target):
    if spec is GammaPolicy:
        class Two(GammaPolicy):
            def choose(self, seq, max_k):
                return min(2, max_k)
        spec, gamma = Two(), 2
    one = specplug.generate(tiny_target, Repeat(), PROMPTS[0], max_new_tokens=12, sampling=specplug.GREEDY,
                            num_speculative_tokens=spec)
    rows = generate_batch(tiny_target, Repeat(), PROMPTS[:1] * (1 if isinstance(spec, list) else 2),
                          max_new_tokens=12, sampling=specplug.GREEDY, num_speculative_tokens=spec)
    for result in (one, *rows):
        assert max(result.stats.step_gammas) == gamma


def test_a_bad_gamma_is_refused_alike_alone_and_in_a_batch(tiny_target):
    for decode in (lambda g: specplug.generate(tiny_target, Repeat(), "x", num_speculative_tokens=g),
                   lambda g: generate_batch(tiny_target, Repeat(), ["x", "y"], num_speculative_tokens=g)):
        with pytest.raises(ValueError, match=">= 0"):
            decode(-1)
        with pytest.raises(TypeError, match="num_speculative_tokens"):
            decode("four")


class Elsewhere(Proposal):
    """A proposal that says where the engine moved it (a plugin might build q on another device)."""

    moved_to: list = []

    def to(self, device):
        Elsewhere.moved_to.append(torch.device(device))
        return super().to(device)


class SoftRepeat(Proposer):
    name = "soft-repeat"

    def propose(self, seq, k):
        q = torch.full((k, seq.target.vocab_size), 1.0 / seq.target.vocab_size)
        tokens = torch.randint(0, seq.target.vocab_size, (k,), generator=seq.rng)
        return Elsewhere(tokens, q)


@pytest.mark.parametrize("batched", [False, True])
def test_every_proposal_is_moved_to_the_targets_device(batched, tiny_target):
    Elsewhere.moved_to.clear()
    sampling = specplug.SamplingParams(temperature=1.0, seed=1)
    if batched:
        generate_batch(tiny_target, SoftRepeat(), PROMPTS[:2], max_new_tokens=6, sampling=sampling)
    else:
        specplug.generate(tiny_target, SoftRepeat(), PROMPTS[0], max_new_tokens=6, sampling=sampling)
    assert Elsewhere.moved_to and set(Elsewhere.moved_to) == {tiny_target.device}


class Ends(Repeat):
    """Counts end(); fails in observe() or end() when told to."""

    def __init__(self, fail_in=None):
        self.ended, self.fail_in = 0, fail_in

    def observe(self, seq, verdict):
        if self.fail_in == "observe":
            raise RuntimeError("observe broke")

    def end(self, seq):
        self.ended += 1
        if self.fail_in == "end":
            raise RuntimeError("end broke")


@pytest.mark.parametrize("batched", [False, True])
def test_end_is_called_once_even_after_observe_failed(batched, tiny_target):
    prop = Ends("observe")
    with pytest.warns(UserWarning, match="observe"):
        if batched:
            generate_batch(tiny_target, prop, PROMPTS[:3], max_new_tokens=8, sampling=specplug.GREEDY)
        else:
            specplug.generate(tiny_target, prop, PROMPTS[0], max_new_tokens=8, sampling=specplug.GREEDY)
    assert prop.ended == (3 if batched else 1)


@pytest.mark.parametrize("batched", [False, True])
def test_a_failing_end_is_warned_about_and_an_error_under_strict(batched, tiny_target):
    def run(prop, strict=False):
        if batched:
            return generate_batch(tiny_target, prop, PROMPTS[:2], max_new_tokens=5, sampling=specplug.GREEDY,
                                  strict=strict)
        return specplug.generate(tiny_target, prop, PROMPTS[0], max_new_tokens=5, sampling=specplug.GREEDY,
                                 strict=strict)

    with pytest.warns(UserWarning, match="end broke"):
        run(Ends("end"))
    with pytest.raises(specplug.SpeculationError, match="end\\(\\) raised"):
        run(Ends("end"), strict=True)


class RngWatcher(Repeat):
    """Records, at every propose, whether the row's generator is still where it started."""

    def begin(self, seq):
        seq.scratch["start"] = seq.rng.get_state()
        seq.scratch["untouched"] = []

    def propose(self, seq, k):
        seq.scratch["untouched"].append(torch.equal(seq.rng.get_state(), seq.scratch["start"]))
        return super().propose(seq, k)

    def end(self, seq):
        self.seen = getattr(self, "seen", {})
        self.seen[seq.sampling.greedy] = seq.scratch["untouched"]


def test_greedy_rows_of_a_mixed_batch_draw_no_uniforms(tiny_target):
    watcher = RngWatcher()
    generate_batch(tiny_target, watcher, PROMPTS[:2], max_new_tokens=10,
                   sampling=[specplug.GREEDY, specplug.SamplingParams(temperature=1.0, seed=2)])
    assert len(watcher.seen[True]) > 2 and all(watcher.seen[True])
    assert not all(watcher.seen[False])  # the sampled row's verifier did draw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_ids_are_torchs_argmax_first_of_ties_and_nan_first(dtype):
    """Greedy verification and greedy drafting take their ids from sampling.argmax_ids (numpy on the CPU, for
    speed): it must pick what torch's argmax picks, or a greedy step would part from processed_probs' one-hot."""
    from specplug.sampling import argmax_ids

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie: the first
    logits[2, 40] = logits[2, 9] = float("nan")  # NaN counts as the largest: the first NaN
    logits[3] = float("-inf")
    assert argmax_ids(logits) == logits.argmax(-1).tolist() == [argmax_ids(row)[0] for row in logits]
    assert argmax_ids(logits.reshape(2, 3, 300)) == logits.argmax(-1).tolist()
    assert argmax_ids(logits[1]) == [7]


# --- bugs ------------------------------------------------------------------------------------------------------
def test_top_k_and_top_p_none_mean_off_as_in_hf():
    params = specplug.SamplingParams(temperature=1.0, top_k=None, top_p=None)
    assert params == specplug.SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    logits = torch.randn(4, 10)
    torch.testing.assert_close(specplug.processed_probs(logits, params), logits.softmax(-1))


def test_stream_chunks_add_up_to_the_result_even_when_it_ends_inside_a_character(tiny_target):
    """The random tiny model emits stray bytes: some outputs end half-way through a UTF-8 character, which
    the stream holds back while waiting for its last byte and must flush at the end."""
    cut = 0
    for seed in range(12):
        options = dict(max_new_tokens=15, sampling=specplug.SamplingParams(temperature=1.0, seed=seed))
        chunks = list(specplug.stream(tiny_target, None, "x", **options))
        result = specplug.generate(tiny_target, None, "x", **options)
        assert "".join(c.text for c in chunks) == result.text
        assert [t for c in chunks for t in c.tokens] == result.tokens
        cut += result.text.endswith("\ufffd")
    assert cut  # the case was exercised


def test_stream_decodes_only_the_newest_tokens_at_each_step(tiny_target, monkeypatch):
    sizes = []
    decode = tiny_target.decode
    monkeypatch.setattr(tiny_target, "decode", lambda ids: sizes.append(len(ids)) or decode(ids))
    chunks = list(specplug.stream(tiny_target, None, "def add(a, b):", max_new_tokens=80, sampling=specplug.GREEDY))
    assert len(chunks) >= 80
    whole = [n for n in sizes if n == 80]  # the result's text and the final flush decode everything, once each
    assert len(whole) == 2
    steps = [n for n in sizes if n != 80]
    assert max(steps) <= 5 + 4 + 1, max(steps)  # context, held-back bytes, the step's token


def test_incremental_detokenizer_matches_a_whole_decode(tiny_target):
    ids = tiny_target.encode("héllo wörld — ünïcode €uro\n")
    pieces = IncrementalDetokenizer(tiny_target.decode)
    text = "".join(pieces.push([t]) for t in ids) + pieces.flush()
    assert text == tiny_target.decode(ids)


class RaisesMidDraft(DraftModelProposer):
    """Raises in propose() after its first draft was fed into its cache (the draw of the second fails)."""

    armed = False

    def _draw(self, logits, seq, projection):
        if self.armed and getattr(self, "drawn", 0) == 1:
            self.armed = False
            raise RuntimeError("lost the draft")
        self.drawn = getattr(self, "drawn", 0) + 1
        return super()._draw(logits, seq, projection)


@pytest.mark.parametrize("batched", [False, True], ids=["propose", "propose_batch"])
def test_draft_model_recovers_its_cache_after_a_propose_that_raised(batched, tiny_dirs, tiny_target):
    prop = RaisesMidDraft(target=tiny_target, model=tiny_dirs["draft"])
    fresh = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"])

    def sequences():
        out = []
        for text in PROMPTS[:2]:
            ids = tiny_target.encode(text)
            out.append(SequenceState(ids=list(ids), num_prompt=len(ids), sampling=specplug.GREEDY,
                                     rng=torch.Generator(), target=tiny_target))
        return out

    seqs = sequences()
    for seq in seqs:
        prop.begin(seq)
    prop.armed, prop.drawn = True, 0
    with pytest.raises(RuntimeError, match="lost the draft"):
        prop.propose(seqs[0], 4)  # fed one draft, then raised: the engine makes this a plain step
    first = fresh.propose(_begun(fresh, sequences()[0]), 1).tokens.tolist()[0]
    for seq in seqs:  # the target emits a token other than that draft
        seq.ids.append((first + 1) % tiny_target.vocab_size)
    again = sequences()
    for seq, token in zip(again, [s.ids[-1] for s in seqs]):
        seq.ids.append(token)
        fresh.begin(seq)
    if batched:
        got, want = prop.propose_batch(seqs, [3, 3]), fresh.propose_batch(again, [3, 3])
    else:
        got, want = [prop.propose(seqs[0], 3)], [fresh.propose(again[0], 3)]
    assert [p.tokens.tolist() for p in got] == [p.tokens.tolist() for p in want]


def _begun(prop, seq):
    prop.begin(seq)
    return seq


def test_a_type_error_inside_a_factory_is_its_own_error_not_bad_options():
    from specplug.plugins import registry

    def factory(target=None, size: int = 1):
        raise TypeError("unsupported operand type(s) inside the plugin")

    plugin = types.SimpleNamespace(register_proposers=specplug.hookimpl(
        lambda register: register("typo-inside", factory, "raises a TypeError of its own")))
    registry.load_plugins()
    registry.pm.register(plugin, name="typo-inside-plugin")
    try:
        with pytest.raises(TypeError, match="unsupported operand") as info:
            specplug.get_proposer("typo-inside", size=2)
        assert "bad options" not in str(info.value)
        with pytest.raises(TypeError, match="proposer 'typo-inside': bad options \\['colour'\\]"):
            specplug.get_proposer("typo-inside", colour="blue")
    finally:
        registry.pm.unregister(name="typo-inside-plugin")


class Empty(Repeat):
    """A proposer that is a container (of nothing yet): falsy, and still a proposer."""

    name = "empty-container"

    def __len__(self):
        return 0


def test_a_falsy_proposer_still_drafts(tiny_target):
    result = specplug.generate(tiny_target, Empty(), PROMPTS[0], max_new_tokens=10, sampling=specplug.GREEDY)
    assert result.stats.draft_tokens > 0


@pytest.mark.slow
def test_device_check_runs_on_the_cpu(tmp_path):
    """The device check is for an accelerator; on the CPU it runs smaller, so it is known to work."""
    import subprocess
    import sys

    script = BENCHMARKS / "device_check.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick"], capture_output=True,
                         text=True, timeout=1500, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exactness draft-model batched" in out.stdout and "compare draft-model" in out.stdout


@pytest.mark.parametrize("pace, want", [(0.001, 300), (0.01, 200), (0.1, 50)])
def test_device_check_draws_what_its_time_allows_and_never_fewer_than_the_least(monkeypatch, pace, want):
    # a lease is minutes: an exactness row draws as many samples as its 2 s allow at the pace of its first
    # draws (here at most 300, at least 50), each sample's seed new
    from collections import Counter

    module, now, seeds = load_benchmark("device_check"), [0.0], []

    def draw(n, first):
        now[0] += pace * n
        seeds.extend(range(first, first + n))
        return Counter({"drawn": n})

    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    assert module.sized(draw, 300, 50, 2.0)["drawn"] == want
    assert seeds == list(range(want))


def test_device_check_reports_a_part_that_raises_and_goes_on():
    rows = load_benchmark("device_check").Rows()
    rows.section("greedy", lambda: 1 / 0)
    rows.section("compare", lambda: rows(("compare target-only", "1 tok/s", True, 0.0)))
    assert [(check, ok) for check, _, ok, _ in rows.rows] == [("greedy raised", False), ("compare target-only", True)]
    assert "ZeroDivisionError" in rows.rows[0][1]


# --- the product path is chosen by a probe on the machine at hand ------------------------------------------------
def fake_probe(results):
    """A probe answering by the product dtype in force (what a real CPU might answer: not asserted here)."""
    def probe(self, rows=16):
        return dict(results[self.matmul_dtype])
    return probe


def test_float32_products_are_chosen_where_only_they_keep_verify_passes_bit_identical(tiny_dirs, monkeypatch):
    monkeypatch.setattr(specplug.Target, "probe_bit_identity", fake_probe(
        {torch.bfloat16: {"single": True, "batched": False}, None: {"single": True, "batched": True}}))
    target = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="bfloat16")
    assert target.matmul_dtype is None and target.verify_bit_identical
    assert target.lean is not None and target.lean.layers[0].qkv.weight.dtype == torch.float32
    assert "batched verify passes not bit-identical" in target.lean_note and "float32 products chosen" in target.lean_note
    free = specplug.generate(target, None, PROMPTS[0], max_new_tokens=20, sampling=specplug.GREEDY)
    assert len(free.tokens) == 20  # the rebuilt path decodes


def test_where_no_path_is_bit_identical_the_target_says_so_and_keeps_its_products(tiny_dirs, monkeypatch):
    monkeypatch.setattr(specplug.Target, "probe_bit_identity", fake_probe(
        {torch.bfloat16: {"single": True, "batched": False}, None: {"single": False, "batched": False}}))
    target = specplug.Target.from_pretrained(tiny_dirs["target"], matmul_dtype="bfloat16")
    assert target.matmul_dtype == torch.bfloat16 and target.verify_bit_identical is False
    assert target.lean.layers[0].qkv.weight.dtype == torch.bfloat16
    assert target.bit_identity == {"single": True, "batched": False}
    assert "batched verify passes not bit-identical to one-token steps" in target.lean_note


class ShorterRowsRoundOff:
    """Target rows whose shorter-prompt rows come out a rounding off in a batch: what a padded forward can do
    (HF's pads them, and a different reduction length may round differently)."""

    def __init__(self, rows):
        self.rows, self.lengths = rows, []

    def add(self, prompts, features=()):
        self.lengths += [len(p) for p in prompts]
        return self.rows.add(prompts, features)

    def score(self, fed, features=(), trees=None):
        scores = self.rows.score(fed, features, trees)
        shorter = torch.tensor([n < max(self.lengths) for n, c in zip(self.lengths, scores.counts) for _ in range(c)])
        scores.logits = scores.logits + 1e-3 * shorter[:, None]
        return scores

    def keep(self, lengths, kept=None):
        self.rows.keep(lengths, kept)


def test_the_probe_checks_rows_of_different_lengths_each_against_that_sequence_alone(tiny_target, monkeypatch):
    new_rows = specplug.Target.new_rows
    monkeypatch.setattr(specplug.Target, "new_rows", lambda self: ShorterRowsRoundOff(new_rows(self)))
    assert tiny_target.probe_bit_identity(rows=4)["batched"] is False


def test_the_probe_compares_a_verify_pass_with_one_token_steps(tiny_target):
    found = tiny_target.probe_bit_identity(rows=3)
    assert set(found) == {"single", "batched"} and all(isinstance(v, bool) for v in found.values())
    assert tiny_target.verify_bit_identical == all(tiny_target.bit_identity.values())
