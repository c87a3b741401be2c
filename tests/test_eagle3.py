"""The EAGLE-3 head (``eagle3``): exactness with random heads, greedy equality with the target, the lean drafting
path against the training forward, resumable training, and the speculators format vLLM serves — export and
import round trip, and a head built by speculators itself drafting as speculators computes."""
import os
import signal
import sys

import pytest
import torch
from click.testing import CliRunner

import specplug
from specplug import heads, zoo
from specplug.cli import main
from specplug.feature_heads import KVCache
from specplug.proposers.eagle3 import DEFAULT_HEADS, Eagle3Head, Eagle3Proposer
from specplug.speculators_format import EXTRA, SpeculatorsMissingError
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from tiny import make_llama

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
SUBSET = [0, 2, 3, 5]  # of the small target's 6 tokens
SETTINGS = {
    "temperature-1": specplug.SamplingParams(temperature=1.0),
    "top-k-3-top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
}


def random_eagle3(target, **options):
    return specplug.get_proposer("eagle3", target=target, head="random", seed=3, init_std=0.15, **options)


def pvalue(target, proposer, sampling, n=1500):
    expected = exact_distribution(target, PROMPT, 3, sampling)
    return chi_square_pvalue(sampled_distribution(target, proposer, PROMPT, 3, sampling, n), expected)


def needs_speculators():
    """Skip where the `vllm` extra is absent — except under CI, where a missing extra is a failure."""
    try:
        import speculators  # noqa: F401
    except ImportError:
        reason = f"speculators is not installed ({EXTRA})"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def test_registered_as_a_builtin():
    assert specplug.plugins.list_proposers()["eagle3"].source == "specplug"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("vocab", ["all", SUBSET])
def test_random_head_is_exact(setting, vocab, small_target):
    proposer = random_eagle3(small_target, vocab=vocab)
    assert pvalue(small_target, proposer, SETTINGS[setting]) > EXACTNESS_ALPHA


class GreedyEagle3SoftQ(Eagle3Proposer):
    """A dishonest EAGLE-3: drafts the argmax of q but reports the soft q (the harness must catch it)."""

    def propose(self, seq, k):
        proposal = super().propose(seq, k)
        if proposal.k:
            proposal.tokens = proposal.q.argmax(-1)
        return proposal


def test_harness_has_power_against_a_dishonest_eagle3(small_target):
    dishonest = GreedyEagle3SoftQ(target=small_target, head="random", seed=3, init_std=0.15)
    assert pvalue(small_target, dishonest, SETTINGS["temperature-1"], 800) < EXACTNESS_ALPHA


def first_proposal(proposer, target, sampling, k, prompt=PROMPT, seed=0):
    seq = specplug.SequenceState(ids=list(prompt), num_prompt=len(prompt), sampling=sampling,
                                 rng=torch.Generator().manual_seed(seed), target=target)
    proposer.begin(seq)
    return proposer.propose(seq, k)


def test_drafts_only_its_vocabulary_and_q_is_zero_elsewhere(small_target):
    proposal = first_proposal(random_eagle3(small_target, vocab=SUBSET), small_target, SETTINGS["temperature-1"], 4)
    outside = [i for i in range(small_target.vocab_size) if i not in SUBSET]
    assert set(proposal.tokens.tolist()) <= set(SUBSET)
    assert proposal.q.shape == (4, small_target.vocab_size) and float(proposal.q[:, outside].abs().max()) == 0.0
    assert torch.allclose(proposal.q.sum(-1), torch.ones(4))


def test_greedy_equals_target_only_on_tiny_models(small_target, tiny_target):
    for target, prompt in ((small_target, PROMPT), (tiny_target, "def add(a, b):\n")):
        base = specplug.generate(target, None, prompt, max_new_tokens=200, sampling=specplug.GREEDY)
        for gamma in (1, 3, 5):
            out = specplug.generate(target, random_eagle3(target), prompt, max_new_tokens=200,
                                    sampling=specplug.GREEDY, num_speculative_tokens=gamma, strict=True)
            assert out.tokens == base.tokens, gamma
            assert out.stats.draft_tokens > 0
    assert out.stats.fallback_steps == 0


def test_batched_greedy_equals_target_only(tiny_target):
    from specplug.batch import generate_batch

    prompts = ["def add(a, b):\n", "for i in range(10):\n", "class Point:\n"]
    base = [specplug.generate(tiny_target, None, p, max_new_tokens=40, sampling=specplug.GREEDY).tokens
            for p in prompts]
    out = generate_batch(tiny_target, random_eagle3(tiny_target), prompts, max_new_tokens=40,
                         sampling=specplug.GREEDY, num_speculative_tokens=3, strict=True)
    assert [r.tokens for r in out] == base
    assert sum(r.stats.draft_tokens for r in out) > 0


def test_zoo_head_is_picked_automatically_and_greedy_is_exact():
    for name in ("pycode", DEFAULT_HEADS["pycode"]):
        if not (zoo.models_dir() / name / "model.safetensors").is_file():
            pytest.skip(f"bundled {name} is absent from this checkout")
    target = specplug.Target.from_pretrained("zoo:pycode")
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    base = specplug.generate(target, None, prompt, max_new_tokens=96, sampling=specplug.GREEDY)
    proposer = specplug.get_proposer("eagle3", target=target)  # no head=: the bundled one
    assert proposer.head_path.name == DEFAULT_HEADS["pycode"]
    out = specplug.generate(target, proposer, prompt, max_new_tokens=96, sampling=specplug.GREEDY,
                            num_speculative_tokens=6, strict=True)
    assert out.tokens == base.tokens
    assert out.stats.accepted_tokens > 0  # a trained head does get drafts accepted


def test_lean_drafting_computes_the_training_forward(tiny_target):
    """The proposer's catch-up and drafting steps produce the outputs (and cache) of the module's forward."""
    proposer = random_eagle3(tiny_target, weights="float32")
    head, ids = proposer.head, tiny_target.encode("def add(a, b):\n    return a + b\n")
    n = len(ids)
    feats = proposer._verified(heads.prefix_features(tiny_target, ids, proposer.needs_features))
    emb = tiny_target.embedding
    with torch.inference_mode():
        cache = proposer._new_cache()
        lean = [proposer._catch_up(feats[:-1], emb(torch.tensor(ids[1:])), 0, cache)]
        drafted = [7, 11]
        for j, token in enumerate(drafted):
            lean.append(proposer._draft_step(lean[-1][None], emb(torch.tensor([token])), n - 1 + j, cache))
        ref_cache = KVCache()
        out = head(head.fuse(feats[None, :-1]), emb(torch.tensor([ids[1:]])), torch.arange(n - 1)[None], ref_cache)
        ref = [out[0, -1]]
        for j, token in enumerate(drafted):
            ref.append(head(ref[-1][None, None], emb(torch.tensor([[token]])), torch.tensor([[n - 1 + j]]), ref_cache)[0, -1])
    for a, b in zip(lean, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.k[:, :cache.length], ref_cache.key[0], atol=1e-4, rtol=1e-4)


def test_takes_the_prompt_features_from_the_loops_prefill(small_target, monkeypatch):
    sampling = specplug.SamplingParams(temperature=1.0, seed=2)
    want = specplug.generate(small_target, random_eagle3(small_target), PROMPT, max_new_tokens=20,
                             sampling=sampling, strict=True)

    def second_pass(*args, **kwargs):
        raise AssertionError("eagle3 ran a second target pass over the prompt")

    monkeypatch.setattr(heads, "prefix_features", second_pass)
    got = specplug.generate(small_target, random_eagle3(small_target), PROMPT, max_new_tokens=20,
                            sampling=sampling, strict=True)
    assert got.tokens == want.tokens and got.stats.accepted_tokens == want.stats.accepted_tokens > 0


def test_training_is_resumable_and_exact(small_target, tmp_path):
    from specplug.training.eagle import HeadTrainArgs, train_head
    from specplug.training.eagle3 import eagle3_loss

    tokens = torch.randint(0, 6, (8, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = small_target.model(input_ids=tokens[:, :16], output_hidden_states=True).hidden_states
    data = {"tokens": tokens.to(torch.int32),
            "features": torch.cat([hidden[-1], hidden[0], hidden[1], hidden[2]], -1).to(torch.float16)}
    loss = eagle3_loss(small_target, depth=3, depth_decay=0.8)  # unrolled: the backward goes through it too

    def run(work, interrupt_at=None):
        args = HeadTrainArgs(target="", work_dir=str(tmp_path / work), steps=4, batch_size=2, seq_len=16,
                             warmup=1, ckpt_every=3, threads=1)
        module = Eagle3Head.for_target(small_target, vocab=torch.tensor(SUBSET))

        def interrupted(module, tokens, feats, step):
            if step == interrupt_at:  # as if Ctrl-C arrived during this step
                os.kill(os.getpid(), signal.SIGINT)
            return loss(module, tokens, feats, step)

        return module, train_head(args, "eagle3", module, interrupted, small_target, data, log=lambda *a: None)

    straight, _ = run("a")
    _, stopped = run("b", interrupt_at=1)
    assert not stopped["finished"] and stopped["step"] == 2
    resumed, res = run("b")
    assert res["finished"] and res["step"] == 4
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


# --- the speculators format (vLLM's) -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """A 4-layer target: vLLM reads three distinct layers below the last."""
    path = make_llama(tmp_path_factory.mktemp("deep") / "target", 40, hidden=32, layers=4, seed=5, init=0.3)
    return specplug.Target.from_pretrained(path)


def saved_head(target, out, vocab=None):
    head = Eagle3Head.for_target(target, vocab=vocab, seed=4, std=0.15)
    heads.save_head(out, "eagle3", head.state_dict(), head.config, target)
    return out


def drafts(target, head, sampling, seed=0):
    proposer = specplug.get_proposer("eagle3", target=target, head=head, weights="float32")
    return first_proposal(proposer, target, sampling, 5, prompt=[3, 1, 4, 1, 5, 9, 2, 6], seed=seed)


def test_export_then_import_drafts_identically(deep_target, tmp_path):
    needs_speculators()
    mine = saved_head(deep_target, tmp_path / "head", vocab=torch.arange(0, 40, 2))
    result = CliRunner().invoke(main, ["export", str(mine), "--format", "speculators", "--out",
                                       str(tmp_path / "spec"), "--target", str(deep_target.path)])
    assert result.exit_code == 0, result.output
    config = (tmp_path / "spec" / "config.json").read_text()
    assert '"speculators_model_type": "eagle3"' in config and '"eagle_aux_hidden_state_layer_ids"' in config
    published = published_layout(tmp_path / "spec", tmp_path / "published")
    for sampling in (specplug.GREEDY, specplug.SamplingParams(temperature=1.0)):
        a = drafts(deep_target, mine, sampling)
        for other in (tmp_path / "spec", published):
            b = drafts(deep_target, other, sampling)
            assert a.tokens.tolist() == b.tokens.tolist()
            if a.q is not None:
                assert torch.equal(a.q, b.q)


def published_layout(spec_dir, out):
    """The same head as the EAGLE-3 heads published for Llama verifiers store it: ``midlayer.*``, no embedding."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    shutil.copy(spec_dir / "config.json", out / "config.json")
    weights = load_file(str(spec_dir / "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in weights.items() if not k.startswith("embed_tokens")},
              str(out / "model.safetensors"))
    return out


def test_export_refuses_layers_vllm_cannot_serve(small_target, tmp_path):
    needs_speculators()
    mine = saved_head(small_target, tmp_path / "head")  # 2 layers: no three distinct ones below the last
    result = CliRunner().invoke(main, ["export", str(mine), "--out", str(tmp_path / "spec"),
                                       "--target", str(small_target.path)])
    assert result.exit_code != 0 and "cannot be served by vLLM" in result.output


def test_a_head_built_by_speculators_drafts_as_speculators_computes(deep_target, tmp_path):
    needs_speculators()
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    vocab = torch.tensor([0, 1, 2, 5, 8, 13, 21, 34])
    t2d = torch.zeros(deep_target.vocab_size, dtype=torch.bool).index_fill_(0, vocab, True)
    config = AutoConfig.from_pretrained(deep_target.path)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    spec = Eagle3DraftModel.from_training_args(config, draft_vocab_size=len(vocab), norm_before_residual=True,
                                               ttt_steps=3, verifier_name_or_path=str(deep_target.path),
                                               target_layer_ids=[1, 2, 3], draft_attn_impl="sdpa",
                                               t2d=t2d, d2t=vocab - torch.arange(len(vocab)))
    with torch.no_grad():  # weights far from their init, so that every tensor matters
        for p in spec.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    spec.save_pretrained(tmp_path / "spec")
    proposer = specplug.get_proposer("eagle3", target=deep_target, head=tmp_path / "spec", weights="float32")
    assert proposer.needs_features == ("layer:1", "layer:2", "layer:3")

    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    feats = heads.prefix_features(deep_target, ids, proposer.needs_features)
    fused = torch.cat([feats[name] for name in proposer.needs_features], -1)[None]
    logits = []
    hook = spec.lm_head.register_forward_hook(lambda module, args, out: logits.append(out))
    spec.eval()
    with torch.no_grad():
        spec(hidden_states=fused, input_ids=torch.tensor([ids]), document_ids=torch.zeros(1, len(ids), dtype=torch.long),
             ttt_steps=3)
    hook.remove()

    from specplug.training.eagle import unroll

    head = proposer.head
    with torch.no_grad():
        # speculators' step d (0-based) at index p reads token ids[p + d]: the unrolled depth d + 1 at p + d
        ours = unroll(head, head.fuse(fused), deep_target.embedding(torch.tensor([ids])), 3)
        for d, theirs in enumerate(logits):
            want = theirs[0, : len(ids) - d]
            got = head.logits(ours[d][0, d:])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_without_speculators_export_and_import_name_the_extra(deep_target, tmp_path, monkeypatch):
    mine = saved_head(deep_target, tmp_path / "head")
    monkeypatch.setitem(sys.modules, "speculators", None)  # as if it were not installed
    result = CliRunner().invoke(main, ["export", str(mine), "--out", str(tmp_path / "spec"),
                                       "--target", str(deep_target.path)])
    assert result.exit_code != 0 and EXTRA in result.output
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    with pytest.raises(SpeculatorsMissingError, match=EXTRA.replace("[", r"\[").replace("]", r"\]")):
        Eagle3Proposer(target=deep_target, head=tmp_path / "fake")
