"""The lean forward: same logits as HF through prefills, single steps and rollbacks; refused (with the reason)
wherever it could differ; and the draft-model proposer and the target decode the same with and without it."""
import pytest
import torch

import specplug
import specplug.lean_llama as lean_llama
from specplug.lean_llama import lean_or_reason
from specplug.proposers.draft_model import DraftModelProposer
from specplug.target import KVState
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)



def test_lean_forward_matches_hf_through_steps_and_rollbacks(tiny_dirs):
    draft = specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)  # 2 layers, grouped-query attention
    lean, why = lean_or_reason(draft.model)
    assert lean is not None, why
    hf_state, cache = KVState(), lean.new_cache()
    gen = torch.Generator().manual_seed(3)
    chunks = [torch.randint(0, draft.vocab_size, (n,), generator=gen).tolist() for n in (9, 1, 2, 1, 3, 1, 1)]
    for i, chunk in enumerate(chunks * 40):  # long enough to grow the preallocated cache past 256
        want = draft.forward(hf_state, chunk).logits
        got = lean.forward(cache, chunk, last_only=False)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if i % 3 == 2:  # roll both back by one token, as a rejected draft does
            draft.rollback(hf_state, hf_state.length - 1)
            cache.crop(cache.length - 1)
        assert cache.length == hf_state.length
    assert cache.length > 256


def test_long_runs_attend_causally_from_an_empty_cache_and_after_cached_tokens(tiny_dirs):
    # runs longer than SMALL_ATTENTION take the fused prefill attention: unmasked-causal from an empty cache,
    # masked after cached tokens, where each query must see every cached key and the new ones up to its own
    draft = specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)
    lean, why = lean_or_reason(draft.model)
    assert lean is not None, why
    hf_state, cache = KVState(), lean.new_cache()
    gen = torch.Generator().manual_seed(5)
    for n in (40, 30, 1, 20):
        chunk = torch.randint(0, draft.vocab_size, (n,), generator=gen).tolist()
        torch.testing.assert_close(lean.forward(cache, chunk, last_only=False), draft.forward(hf_state, chunk).logits,
                                   atol=1e-4, rtol=1e-4)


def test_rows_whose_output_is_not_read_still_fill_the_cache_as_a_full_pass_does(tiny_dirs):
    """``keep``: the last layer runs attention and MLP for the rows whose logits are read; every row's keys and
    values still enter each layer's cache, so what follows decodes as after a full pass."""
    draft = specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)
    lean, why = lean_or_reason(draft.model)
    assert lean is not None, why
    gen = torch.Generator().manual_seed(5)
    full, kept = lean.new_cache(), lean.new_cache()
    for n in (30, 5, 1, 3):  # a fused-attention prefill (> SMALL_ATTENTION rows), then short runs
        chunk = torch.randint(0, draft.vocab_size, (n,), generator=gen).tolist()
        want, _ = lean.run(full, chunk)
        got, _ = lean.run(kept, chunk, keep=1)
        assert got.shape[0] == 1
        torch.testing.assert_close(got[-1], want[-1], atol=1e-5, rtol=1e-5)
        for a, b in zip(full.layers, kept.layers):
            assert a.length == b.length
            torch.testing.assert_close(a.k[:, :a.length], b.k[:, :b.length], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.v[:, :a.length], b.v[:, :b.length], atol=1e-5, rtol=1e-5)
    # asking for the final hidden state of every row keeps the last layer whole
    logits, states = lean.run(kept, [1, 2, 3], keep=1, hidden=(len(lean.layers),))
    assert states[len(lean.layers)].shape[0] == 3 and logits.shape[0] == 1


def test_a_silu_activation_module_runs_as_the_function_it_wraps(tiny_dirs):
    """transformers' SiLUActivation (and torch's SiLU) only call F.silu: a layer calls the function, not the
    module, whose dispatch cost ~0.13 ms of a one-row step; any other activation runs as the model's own."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"])
    assert type(model.model.layers[0].mlp.act_fn) in lean_llama._SILU_MODULES
    layer = lean_llama.LeanLayer(model.model.layers[0])
    assert layer.act is F.silu
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert isinstance(lean_llama.LeanLayer(model.model.layers[1]).act, torch.nn.GELU)


def test_one_row_copies_change_only_the_layout_of_products(tiny_dirs):
    """A drafter's column-major one-row copies: the same logits (to float rounding) through steps and
    several-row passes, used for one-row inputs only, and counted as the memory they take."""
    draft = specplug.Target.from_pretrained(tiny_dirs["draft"], lean=False)
    plain, _ = lean_or_reason(draft.model)
    copied, why = lean_or_reason(draft.model, one_row_copies=True)
    assert copied is not None, why
    product = copied.layers[0].qkv
    assert product.one_row is not None and not product.one_row.is_contiguous()
    assert product.one_row.data_ptr() != product.weight.data_ptr()
    assert plain.extra_bytes() == 0
    assert copied.extra_bytes() == sum(p.weight.numel() * 4 for layer in copied.layers for p in layer.products()) \
        + copied.head.weight.numel() * 4
    caches = plain.new_cache(), copied.new_cache()
    gen = torch.Generator().manual_seed(4)
    for n in (7, 1, 1, 3, 1):
        chunk = torch.randint(0, draft.vocab_size, (n,), generator=gen).tolist()
        want, got = (lean.forward(cache, chunk, last_only=False) for lean, cache in zip((plain, copied), caches))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # poison the copy: only the one-row step may read it
    product.one_row = torch.full_like(product.weight, float("nan")).t().contiguous().t()
    assert copied.forward(caches[1], [1]).isnan().all()
    caches[1].crop(caches[1].length - 1)
    assert not copied.forward(caches[1], [1, 2]).isnan().any()


def test_lean_path_refuses_other_architectures_and_dynamic_rope(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    lean, why = lean_or_reason(GPT2LMHeadModel(GPT2Config(vocab_size=20, n_embd=16, n_layer=1, n_head=2)).eval())
    assert lean is None and "GPT2LMHeadModel" in why
    dynamic = LlamaConfig(**small, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    lean, why = lean_or_reason(LlamaForCausalLM(dynamic).eval())
    assert lean is None and "dynamic" in why


def test_lean_path_that_disagrees_with_hf_is_refused(tiny_dirs, monkeypatch):
    draft = specplug.Target.from_pretrained(tiny_dirs["draft"])
    monkeypatch.setattr(lean_llama, "_rotate", lambda x, cos, sin: x)  # a lean path that forgot rotary positions
    lean, why = lean_or_reason(draft.model)
    assert lean is None and "differ" in why


def test_lean_target_scores_and_features_equal_hf_forward_through_rollbacks(tiny_dirs):
    lean = specplug.Target.from_pretrained(tiny_dirs["target"])
    hf = specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)
    assert lean.lean is not None and hf.lean is None and hf.lean_note.startswith("lean=False")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, lean.vocab_size, (40,), generator=gen).tolist()
    states = {t: t.prefill(ids[:12]) for t in (lean, hf)}
    at = 11
    for n in (5, 1, 3, 6, 2):
        got, want = (t.forward(states[t], ids[at:at + n], features=("last", "layer:0", "layer:1")) for t in (lean, hf))
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        for name in want.features:
            torch.testing.assert_close(got.features[name], want.features[name], atol=1e-4, rtol=1e-4)
        at += n - 1  # keep all but the last token, as a step with one rejection does
        for t in (lean, hf):
            t.rollback(states[t], at)
        assert states[lean].cache.get_seq_length() == states[hf].cache.get_seq_length() == at
    with pytest.raises(ValueError, match="layer:9"):
        lean.forward(states[lean], ids[:1], features=("layer:9",))


def test_target_only_and_speculative_decoding_match_across_lean_and_hf_targets(tiny_dirs):
    lean = specplug.Target.from_pretrained(tiny_dirs["target"])
    hf = specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)
    for target in (lean, hf):
        prop = DraftModelProposer(target=target, model=tiny_dirs["draft"])
        target.greedy = specplug.generate(target, None, "def add(a, b):", max_new_tokens=50,
                                          sampling=specplug.GREEDY).tokens
        target.spec = specplug.generate(target, prop, "def add(a, b):", max_new_tokens=50, sampling=specplug.GREEDY,
                                        num_speculative_tokens=3).tokens
    assert lean.greedy == hf.greedy == lean.spec == hf.spec


def test_non_llama_target_keeps_hf_forward_and_says_why():
    from transformers import MistralConfig, MistralForCausalLM

    small = dict(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    target = specplug.Target(MistralForCausalLM(MistralConfig(**small, num_key_value_heads=1)).eval())
    assert target.lean is None and "MistralForCausalLM" in target.lean_note
    state = target.prefill([1, 2, 3])
    assert target.forward(state, [3, 4]).logits.shape == (2, 20)
    target.rollback(state, 3)
    assert state.cache.get_seq_length() == 3


def test_draft_model_uses_lean_path_and_decodes_as_the_hf_path(tiny_dirs, tiny_target):
    # weights as loaded: the same arithmetic both ways, so the same draws (int8 copies would draft otherwise)
    fast = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], weights="loaded")
    slow = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], fast=False)
    assert fast.lean is not None and slow.lean is None and slow.lean_note == "fast=False"
    for sampling in (specplug.GREEDY, specplug.SamplingParams(temperature=1.0, seed=11)):
        a = specplug.generate(tiny_target, fast, "def add(a, b):", max_new_tokens=40, sampling=sampling)
        b = specplug.generate(tiny_target, slow, "def add(a, b):", max_new_tokens=40, sampling=sampling)
        assert a.tokens == b.tokens
        assert a.stats.accepted_tokens == b.stats.accepted_tokens


def test_greedy_draft_reports_a_point_mass_not_a_dense_q(tiny_dirs, tiny_target):
    proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"])
    seq = specplug.types.SequenceState(ids=tiny_target.encode("def add(a, b):"), num_prompt=5,
                                       sampling=specplug.GREEDY, rng=torch.Generator(), target=tiny_target)
    proposer.begin(seq)
    proposal = proposer.propose(seq, 3)
    assert proposal.k == 3 and proposal.q is None


def test_non_llama_draft_falls_back_to_hf_forward_and_stays_exact_in_greedy(tmp_path, tiny_dirs, tiny_target):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=tiny_target.vocab_size, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    AutoTokenizer.from_pretrained(tiny_dirs["tokenizer"]).save_pretrained(tmp_path / "mistral")
    proposer = DraftModelProposer(target=tiny_target, model=tmp_path / "mistral")
    assert proposer.lean is None and "MistralForCausalLM" in proposer.lean_note
    spec = specplug.generate(tiny_target, proposer, "for i in", max_new_tokens=30, sampling=specplug.GREEDY)
    plain = specplug.generate(tiny_target, None, "for i in", max_new_tokens=30, sampling=specplug.GREEDY)
    assert spec.tokens == plain.tokens


def test_draft_model_batch_proposals_equal_its_per_row_proposals(tiny_dirs, tiny_target):
    proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"])
    prompts = ["def add(a, b):", "import os\n", "for i in range(10):\n    print(i"]
    samplings = [specplug.GREEDY, specplug.SamplingParams(temperature=1.0, seed=5),
                 specplug.SamplingParams(temperature=0.8, top_k=20, seed=6)]

    def fresh():
        seqs = []
        for text, sampling in zip(prompts, samplings):
            ids = tiny_target.encode(text)
            seq = specplug.types.SequenceState(ids=list(ids), num_prompt=len(ids), sampling=sampling,
                                               rng=sampling.generator(), target=tiny_target)
            proposer.begin(seq)
            seqs.append(seq)
        return seqs

    ks = [4, 0, 3]
    one_by_one = [proposer.propose(seq, k) if k else None for seq, k in zip(fresh(), ks)]
    together = proposer.propose_batch(fresh(), ks)
    assert together[1].k == 0
    for a, b in zip(one_by_one, together):
        if a is not None:
            assert b.tokens.tolist() == a.tokens.tolist()
            assert (a.q is None) == (b.q is None)
            if a.q is not None:
                torch.testing.assert_close(b.q, a.q, atol=1e-5, rtol=1e-4)


def test_forward_rows_feeds_each_sequence_its_own_few_tokens(tiny_dirs):
    """A batched drafting pass catches a row up on two tokens while another feeds one: the same logits and
    caches as feeding each sequence on its own."""
    draft = specplug.Target.from_pretrained(tiny_dirs["draft"])
    lean = draft.lean
    gen = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, draft.vocab_size, (n,), generator=gen).tolist() for n in (7, 12, 3)]
    feeds = [[5, 9], [11], [2, 3]]
    alone, together = [lean.new_cache() for _ in prefixes], [lean.new_cache() for _ in prefixes]
    for prefix, a, b in zip(prefixes, alone, together):
        lean.forward(a, prefix)
        lean.forward(b, prefix)
    want = torch.stack([lean.forward(cache, feed) for cache, feed in zip(alone, feeds)])
    got = lean.forward_rows(together, feeds)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [c.length for c in together] == [c.length for c in alone]
    nxt = [4, 6, 8]  # and the caches agree: one more token each
    torch.testing.assert_close(lean.forward_rows(together, nxt),
                               torch.stack([lean.forward(c, [t]) for c, t in zip(alone, nxt)]), atol=1e-5, rtol=1e-5)
