"""Feature-head proposers (``eagle``, ``mtp``): exactness with random heads, greedy equality with the target,
heads that refuse a target they were not trained for, EAGLE's cache hygiene, resumable head training."""
import json
import os
import signal

import pytest
import torch

import specplug
from specplug import heads, zoo
from specplug.proposers.eagle import EagleHead, EagleProposer, KVCache
from specplug.proposers.mtp import MTPHeads, MTPProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from tiny import make_llama

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
N_TOKENS = 3
N_SAMPLES = 1500
SETTINGS = {
    "temperature-1": specplug.SamplingParams(temperature=1.0),
    "top-k-3-top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
}


def random_proposer(name, target, **options):
    if name == "eagle":
        return specplug.get_proposer("eagle", target=target, head="random", seed=3, init_std=0.15, **options)
    # prompt_features: the first step drafts too, so both heads are exercised within 3 tokens
    return specplug.get_proposer("mtp", target=target, head="random", seed=3, num_heads=2, init_std=0.3,
                                 prompt_features=True, **options)


def pvalue(target, proposer, sampling, n=N_SAMPLES):
    expected = exact_distribution(target, PROMPT, N_TOKENS, sampling)
    counts = sampled_distribution(target, proposer, PROMPT, N_TOKENS, sampling, n)
    return chi_square_pvalue(counts, expected)


def test_registered_as_builtins():
    found = specplug.plugins.list_proposers()
    assert found["eagle"].source == found["mtp"].source == "specplug"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", ["eagle", "mtp"])
def test_random_heads_are_exact(name, setting, small_target):
    proposer = random_proposer(name, small_target)
    assert pvalue(small_target, proposer, SETTINGS[setting]) > EXACTNESS_ALPHA


SUBSET = [0, 2, 3, 5]  # of the small target's 6 tokens


@pytest.mark.parametrize("setting", SETTINGS)
def test_eagle_over_a_vocabulary_subset_is_exact(setting, small_target):
    proposer = random_proposer("eagle", small_target, vocab=SUBSET)
    assert pvalue(small_target, proposer, SETTINGS[setting]) > EXACTNESS_ALPHA


def test_eagle_drafts_only_subset_tokens_and_its_q_is_zero_elsewhere(small_target):
    proposer = random_proposer("eagle", small_target, vocab=SUBSET)
    seq = specplug.SequenceState(ids=list(PROMPT), num_prompt=len(PROMPT), sampling=SETTINGS["temperature-1"],
                                 rng=torch.Generator().manual_seed(0), target=small_target)
    proposer.begin(seq)
    proposal = proposer.propose(seq, 4)
    outside = [i for i in range(small_target.vocab_size) if i not in SUBSET]
    assert set(proposal.tokens.tolist()) <= set(SUBSET)
    assert proposal.q.shape == (4, small_target.vocab_size) and float(proposal.q[:, outside].abs().max()) == 0.0
    assert torch.allclose(proposal.q.sum(-1), torch.ones(4))


def first_proposal(proposer, target, sampling, k):
    seq = specplug.SequenceState(ids=list(PROMPT), num_prompt=len(PROMPT), sampling=sampling,
                                 rng=torch.Generator().manual_seed(0), target=target)
    proposer.begin(seq)
    return proposer.propose(seq, k)


def test_eagle_sampled_vocab_covers_sampling_and_vocab_greedy(small_target, tmp_path):
    def proposal(proposer, sampling):
        return first_proposal(proposer, small_target, sampling, 4)

    proposer = random_proposer("eagle", small_target, vocab=SUBSET, sampled_vocab="all")
    outside = [i for i in range(small_target.vocab_size) if i not in SUBSET]
    assert float(proposal(proposer, SETTINGS["temperature-1"]).q[:, outside].sum()) > 0  # the whole vocabulary
    greedy = proposal(proposer, specplug.SamplingParams(temperature=0))
    assert set(greedy.tokens.tolist()) <= set(SUBSET)
    # the head's config may recommend both (the bundled head: 2,048 tokens greedy, all of them sampled)
    module = EagleHead.for_target(small_target.model.config, seed=1)
    heads.save_head(tmp_path / "e", "eagle", module.state_dict(), module.config, small_target,
                    drafting={"vocab": SUBSET, "sampled_vocab": "all"})
    loaded = EagleProposer(small_target, head=tmp_path / "e")
    assert loaded.subset.tolist() == SUBSET and loaded.sampled_subset is None


def test_mtp_drafts_greedy_in_vocab_and_samples_over_sampled_vocab(small_target, tmp_path):
    def proposal(proposer, sampling):
        return first_proposal(proposer, small_target, sampling, 2)

    outside = [i for i in range(small_target.vocab_size) if i not in SUBSET]
    narrow = random_proposer("mtp", small_target, vocab=SUBSET, sampled_vocab=SUBSET)
    sampled = proposal(narrow, SETTINGS["temperature-1"])
    assert set(sampled.tokens.tolist()) <= set(SUBSET) and float(sampled.q[:, outside].abs().max()) == 0.0
    assert torch.allclose(sampled.q.sum(-1), torch.ones(2))
    wide = random_proposer("mtp", small_target, vocab=SUBSET, sampled_vocab="all")
    assert float(proposal(wide, SETTINGS["temperature-1"]).q[:, outside].sum()) > 0
    assert set(proposal(wide, specplug.SamplingParams(temperature=0)).tokens.tolist()) <= set(SUBSET)
    # the heads' config may recommend both (the bundled heads: 2,048 tokens greedy, all of them sampled)
    module = MTPHeads.for_target(small_target.model, num_heads=2, share_lm_head=True)
    heads.save_head(tmp_path / "m", "mtp", module.state_dict(), module.config, small_target,
                    drafting={"vocab": SUBSET, "sampled_vocab": "all", "weights": "loaded"})
    loaded = MTPProposer(small_target, head=tmp_path / "m")
    assert loaded.subset.tolist() == SUBSET and loaded.sampled_subset is None and loaded.weights == "loaded"
    with pytest.raises(ValueError, match="mtp: vocab ids must be"):
        random_proposer("mtp", small_target, vocab=[small_target.vocab_size])


def test_eagle_vocab_errors_name_the_proposer(small_target):
    with pytest.raises(ValueError, match="eagle: vocab ids must be"):
        random_proposer("eagle", small_target, vocab=[small_target.vocab_size])
    with pytest.raises(ValueError, match=r"eagle: vocab=3 needs frequent_tokens.json"):
        random_proposer("eagle", small_target, vocab=3)


class GreedyEagleSoftQ(EagleProposer):
    """A dishonest EAGLE: drafts the argmax of q but reports the soft q (the harness must catch it)."""

    def propose(self, seq, k):
        proposal = super().propose(seq, k)
        if proposal.k:
            proposal.tokens = proposal.q.argmax(-1)
        return proposal


def test_harness_has_power_against_a_dishonest_eagle(small_target):
    dishonest = GreedyEagleSoftQ(target=small_target, head="random", seed=3, init_std=0.15)
    assert pvalue(small_target, dishonest, SETTINGS["temperature-1"], 800) < EXACTNESS_ALPHA


@pytest.mark.parametrize("name", ["eagle", "mtp"])
def test_greedy_equals_target_only_on_tiny_models(name, small_target, tiny_target):
    for target, prompt in ((small_target, PROMPT), (tiny_target, "def add(a, b):\n")):
        base = specplug.generate(target, None, prompt, max_new_tokens=200, sampling=specplug.GREEDY)
        for gamma in (1, 3, 5):
            out = specplug.generate(target, random_proposer(name, target), prompt, max_new_tokens=200,
                                    sampling=specplug.SamplingParams(temperature=0), num_speculative_tokens=gamma,
                                    strict=True)
            assert len(out.tokens) == 200
            assert out.tokens == base.tokens, (name, gamma)
            assert out.stats.draft_tokens > 0
    # the 6-token model accepts plenty of drafts, so the accept paths are exercised too
    assert out.stats.fallback_steps == 0


def _zoo_target():
    for name in ("pycode", zoo.DEFAULT_EAGLE["pycode"], zoo.DEFAULT_MTP["pycode"]):
        if not (zoo.models_dir() / name / "model.safetensors").is_file():
            pytest.skip(f"bundled {name} is absent from this checkout")
    return specplug.Target.from_pretrained("zoo:pycode")


def test_zoo_heads_are_picked_automatically_and_greedy_is_exact():
    target = _zoo_target()
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    base = specplug.generate(target, None, prompt, max_new_tokens=96, sampling=specplug.SamplingParams(temperature=0))
    for name in ("eagle", "mtp"):
        proposer = specplug.get_proposer(name, target=target)  # no head=: the bundled one
        assert proposer.head_path is not None and proposer.head_path.name.startswith("pycode-")
        out = specplug.generate(target, proposer, prompt, max_new_tokens=96,
                                sampling=specplug.SamplingParams(temperature=0), num_speculative_tokens=4,
                                strict=True)
        assert out.tokens == base.tokens, name
        assert out.stats.accepted_tokens > 0, name  # trained heads do get drafts accepted


def test_a_head_refuses_a_target_it_was_not_trained_for(small_vocab_dirs, small_target, tmp_path):
    # same architecture, other weights: only the fingerprint tells them apart
    other = specplug.Target.from_pretrained(make_llama(tmp_path / "other", 6, hidden=32, layers=2, seed=11))
    eagle = EagleHead.for_target(small_target.model.config, seed=1)
    heads.save_head(tmp_path / "eagle", "eagle", eagle.state_dict(), eagle.config, small_target)
    mtp = MTPHeads.for_target(small_target.model, num_heads=2)
    heads.save_head(tmp_path / "mtp", "mtp", mtp.state_dict(), mtp.config, small_target)
    for kind in ("eagle", "mtp"):
        with pytest.raises(heads.HeadMismatchError) as err:
            specplug.get_proposer(kind, target=other, head=tmp_path / kind)
        message = str(err.value)
        assert small_target.name in message and other.name in message
        assert heads.target_fingerprint(small_target) in message and heads.target_fingerprint(other) in message
        # the right target loads it, and a head of the other kind is refused by kind
        assert specplug.get_proposer(kind, target=small_target, head=tmp_path / kind).head_path == tmp_path / kind
    with pytest.raises(ValueError, match="not a 'eagle' head"):
        specplug.get_proposer("eagle", target=small_target, head=tmp_path / "mtp")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["target"]["name"] == small_target.name and config["dtype"] == "float16"


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_a_head_built_for_another_width_is_refused_by_name(kind, small_vocab_dirs, small_target):
    narrow = specplug.Target.from_pretrained(small_vocab_dirs["draft"])  # hidden 16 against the target's 32
    head = (EagleHead.for_target(narrow.model.config) if kind == "eagle"
            else MTPHeads.for_target(narrow.model, num_heads=2))
    with pytest.raises(ValueError, match=rf"^{kind}: head \(hidden 16, vocab 6\) does not fit target .*hidden 32"):
        specplug.get_proposer(kind, target=small_target, head=head)


def test_a_head_without_a_default_must_be_named(small_target):
    for kind in ("eagle", "mtp", "eagle3"):
        with pytest.raises(TypeError, match=rf"^{kind} needs head="):
            specplug.get_proposer(kind, target=small_target)


def test_a_head_fits_its_target_in_any_load_dtype(small_vocab_dirs, small_target, tmp_path):
    module = EagleHead.for_target(small_target.model.config, seed=1)
    heads.save_head(tmp_path / "e", "eagle", module.state_dict(), module.config, small_target)
    for dtype in (torch.float16, torch.bfloat16):
        other = specplug.Target.from_pretrained(small_vocab_dirs["target"], dtype=dtype)
        assert EagleProposer(other, head=tmp_path / "e", weights="target").head.fc.weight.dtype == dtype


def test_saved_head_drafts_like_the_module(small_target, tmp_path):
    module = EagleHead.for_target(small_target.model.config, seed=5, std=0.3)
    heads.save_head(tmp_path / "e", "eagle", module.state_dict(), module.config, small_target, dtype=torch.float32)
    a = specplug.generate(small_target, EagleProposer(small_target, head=module), PROMPT, max_new_tokens=30,
                          sampling=specplug.SamplingParams(temperature=1.0, seed=4), strict=True)
    b = specplug.generate(small_target, EagleProposer(small_target, head=tmp_path / "e"), PROMPT, max_new_tokens=30,
                          sampling=specplug.SamplingParams(temperature=1.0, seed=4), strict=True)
    assert a.tokens == b.tokens and a.stats.accepted_tokens == b.stats.accepted_tokens


class CheckedEagle(EagleProposer):
    """After every propose: the head's cache holds exactly the verified entries, equal to a fresh rebuild.
    On the 4th call it fails once (a fallback step the proposer never observes) to exercise the resync."""

    calls = 0
    checked = 0

    def propose(self, seq, k):
        self.calls += 1
        if self.calls == 4:
            raise RuntimeError("one-off failure")
        proposal = super().propose(seq, k)
        st = seq.scratch[self.name]
        n = len(seq.ids)
        assert st.fed == n - 1 and st.known == n - 1 and not st.pending
        assert st.cache.length == st.fed - st.base  # no drafted entries left behind
        if st.base == 0 and st.fed:
            fresh = KVCache()
            feats = heads.prefix_features(seq.target, seq.ids[: n - 1])
            with torch.inference_mode():
                self.head(feats[None], self.target.embedding(torch.tensor([seq.ids[1:n]])),
                          torch.arange(n - 1)[None], fresh)
            # the lean drafting path built the same keys/values as HF's layer over the whole prefix
            length = st.cache.length
            torch.testing.assert_close(st.cache.k[:, :length], fresh.key[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(st.cache.v[:, :length], fresh.value[0], atol=1e-4, rtol=1e-4)
            self.checked += 1
        return proposal


@pytest.mark.parametrize("prompt_features", [True, False])
def test_eagle_cache_holds_only_verified_entries(small_target, prompt_features):
    # float32 products: the check rebuilds the cache through HF's layer on the same weights
    proposer = CheckedEagle(small_target, head="random", seed=3, init_std=0.15, prompt_features=prompt_features,
                            weights="float32")
    with pytest.warns(UserWarning, match="falling back"):
        out = specplug.generate(small_target, proposer, PROMPT, max_new_tokens=60, num_speculative_tokens=4,
                                sampling=specplug.SamplingParams(temperature=1.0, seed=0))
    assert out.stats.fallback_steps == 1
    assert 0 < out.stats.accepted_tokens < out.stats.draft_tokens  # rejections happened, so did rollbacks
    assert proposer.checked > 5


def test_head_training_is_resumable_and_exact(small_target, tmp_path):
    from specplug.training.eagle import HeadTrainArgs, eagle_loss, train_head
    from specplug.training.mtp import mtp_loss

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (8, 17), generator=g)
    with torch.no_grad():
        feats = small_target.model(input_ids=tokens[:, :16], output_hidden_states=True).hidden_states[-1]
    data = {"tokens": tokens.to(torch.int32), "features": feats.to(torch.float16)}

    def run(work, kind, interrupt_at=None):
        args = HeadTrainArgs(target="", work_dir=str(tmp_path / work), steps=4, batch_size=2, seq_len=16,
                             warmup=1, ckpt_every=3, threads=1)
        if kind == "eagle":
            module = EagleHead.for_target(small_target.model.config)
            loss = eagle_loss(small_target, 0.1, 1.0, 0.1, 0, depth=2)  # unrolled: the backward goes through it too
        else:
            module, loss = MTPHeads.for_target(small_target.model, num_heads=2, share_lm_head=True), mtp_loss(small_target, 0.8)

        def interrupted(module, tokens, feats, step):
            if step == interrupt_at:  # as if Ctrl-C arrived during this step
                os.kill(os.getpid(), signal.SIGINT)
            return loss(module, tokens, feats, step)

        return module, train_head(args, kind, module, interrupted, small_target, data, log=lambda *a: None)

    for kind in ("eagle", "mtp"):
        straight, _ = run(f"{kind}-a", kind)
        _, stopped = run(f"{kind}-b", kind, interrupt_at=1)
        assert not stopped["finished"] and stopped["step"] == 2
        resumed, res = run(f"{kind}-b", kind)
        assert res["finished"] and res["step"] == 4
        for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
            torch.testing.assert_close(a, b, msg=name)


def test_unrolled_training_pass_predicts_what_drafting_computes(small_target):
    """Training-time test: the depth-d prediction at entry p is the head's d-th draft from verified position
    p-d+1, fed its own features (the drafted tokens being the window's)."""
    from specplug.training.eagle import unroll

    head = EagleHead.for_target(small_target.model.config, seed=5, std=0.2).eval()
    g = torch.Generator().manual_seed(0)
    length, h = 9, small_target.hidden_size
    feats, embeds = torch.randn(2, length, h, generator=g), torch.randn(2, length, h, generator=g)
    with torch.no_grad():
        preds = unroll(head, feats, embeds, 3)
        for s in range(0, length - 2):
            cache = KVCache()
            out = head(feats[:, :s + 1], embeds[:, :s + 1], torch.arange(s + 1)[None].expand(2, -1), cache)[:, -1]
            assert torch.allclose(preds[0][:, s], out, atol=1e-5)
            for d in (2, 3):  # drafting on: entry s+d-1 reads the previous draft's feature
                p = s + d - 1
                out = head(out[:, None], embeds[:, p:p + 1], torch.full((2, 1), p), cache)[:, -1]
                assert torch.allclose(preds[d - 1][:, p], out, atol=1e-5), (s, d)


def test_eagle_takes_the_prompt_features_from_the_loops_prefill(small_target, monkeypatch):
    sampling = specplug.SamplingParams(temperature=1.0, seed=2)
    want = specplug.generate(small_target, random_proposer("eagle", small_target), PROMPT, max_new_tokens=20,
                             sampling=sampling, strict=True)

    def second_pass(*args, **kwargs):
        raise AssertionError("eagle ran a second target pass over the prompt")

    monkeypatch.setattr(heads, "prefix_features", second_pass)
    got = specplug.generate(small_target, random_proposer("eagle", small_target), PROMPT, max_new_tokens=20,
                            sampling=sampling, strict=True)
    # the same features either way (the prefill's and a separate pass's agree), so the same draws
    assert got.tokens == want.tokens and got.stats.accepted_tokens == want.stats.accepted_tokens > 0


def test_a_trainer_gives_the_caller_its_thread_count_back(small_target, tmp_path):
    from specplug.training.eagle import HeadTrainArgs, eagle_loss, train_head

    tokens = torch.randint(0, 6, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats = small_target.model(input_ids=tokens[:, :8], output_hidden_states=True).hidden_states[-1]
    args = HeadTrainArgs(target="", work_dir=str(tmp_path / "w"), steps=1, batch_size=2, seq_len=8, warmup=1,
                         threads=torch.get_num_threads() + 1)
    before = torch.get_num_threads()
    train_head(args, "eagle", EagleHead.for_target(small_target.model.config), eagle_loss(small_target, 0.1, 1.0, 0.1, 0),
               small_target, {"tokens": tokens.to(torch.int32), "features": feats.to(torch.float16)}, log=lambda *a: None)
    assert torch.get_num_threads() == before


def test_a_whole_vocabulary_head_drafts_through_the_targets_own_head_product(small_target):
    """Not a copy and not HF's module (oneDNN's one-row product, several times slower on some CPUs): the very
    product the target's lean forward scores with (mtp heads that share the target's LM head take it alike)."""
    proposer = random_proposer("eagle", small_target, weights="target")
    assert small_target.lean is not None
    for projection in (proposer.greedy_projection, proposer.sampled_projection):
        assert projection.product is small_target.head_product is small_target.lean.head
