"""Other architectures than Llama, each built from a tiny config, saved and loaded back through from_pretrained:
the Llama family (Mistral, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms) takes the lean path, every
other architecture (GPT-2, Phi-3) HF's forward with the reason in ``lean_note``; either way greedy decoding —
target-only and speculative with a draft of the same architecture — equals HF's own ``generate()``, and
speculative sampling follows the target's exact distribution."""
import pytest
import torch
from conftest import SMALL_V
from tiny import ARCHITECTURES, make_architecture, private_machine_cache  # noqa: F401 (autouse)

import specplug
from specplug.proposers.draft_model import DraftModelProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution


LEAN = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FALLBACK = {"gpt2": "GPT2LMHeadModel", "phi3": "Phi3ForCausalLM"}
assert set(LEAN) | set(FALLBACK) == set(ARCHITECTURES)
PROMPT = "def add(a, b):\n"
N_TOKENS = 24


@pytest.fixture(scope="session")
def architecture_dirs(tmp_path_factory, tiny_dirs):
    """Per architecture: a target and a draft over the tiny tokenizer, and a pair over 6 tokens (no tokenizer)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("architectures")
    vocab = len(AutoTokenizer.from_pretrained(tiny_dirs["tokenizer"]))
    dirs = {}
    for kind in ARCHITECTURES:
        tok = dict(tokenizer_from=tiny_dirs["tokenizer"])
        dirs[kind] = {
            "target": make_architecture(root / kind / "target", kind, vocab, hidden=32, layers=2, seed=0, **tok),
            "draft": make_architecture(root / kind / "draft", kind, vocab, hidden=16, layers=1, seed=1, **tok),
            "small-target": make_architecture(root / kind / "small-target", kind, SMALL_V, seed=0, init=0.3),
            "small-draft": make_architecture(root / kind / "small-draft", kind, SMALL_V, hidden=16, layers=1,
                                             seed=7, init=0.6),  # q far from p: power
        }
    return dirs


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_llama_family_takes_the_lean_path_and_other_architectures_say_why_not(kind, architecture_dirs):
    target = specplug.Target.from_pretrained(architecture_dirs[kind]["target"])
    if kind in LEAN:
        assert type(target.model).__name__ == LEAN[kind]
        assert target.lean is not None, target.lean_note
    else:
        assert target.lean is None and FALLBACK[kind] in target.lean_note


def hf_greedy(path, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """HF's own greedy generate() on a fresh load of the model, stopping at ``eos`` as specplug does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                             eos_token_id=sorted(eos) or None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_greedy_target_only_and_speculative_output_equal_hf_generate(kind, architecture_dirs):
    dirs = architecture_dirs[kind]
    target = specplug.Target.from_pretrained(dirs["target"])
    ids = target.encode(PROMPT)
    want = hf_greedy(dirs["target"], ids, N_TOKENS, target.eos_token_ids)
    plain = specplug.generate(target, None, ids, max_new_tokens=N_TOKENS, sampling=specplug.GREEDY)
    assert plain.tokens == want
    draft = DraftModelProposer(target=target, model=dirs["draft"])
    assert (draft.lean is not None) == (kind in LEAN), draft.lean_note
    spec = specplug.generate(target, draft, ids, max_new_tokens=N_TOKENS, sampling=specplug.GREEDY,
                             num_speculative_tokens=3)
    assert spec.tokens == want
    assert spec.stats.draft_tokens > 0


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_speculative_sampling_matches_target_distribution(kind, architecture_dirs):
    dirs = architecture_dirs[kind]
    target = specplug.Target.from_pretrained(dirs["small-target"])
    assert (target.lean is not None) == (kind in LEAN), target.lean_note
    draft = DraftModelProposer(target=target, model=dirs["small-draft"])
    sampling = specplug.SamplingParams(temperature=1.0)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2]
    expected = exact_distribution(target, prompt, 3, sampling)
    counts = sampled_distribution(target, draft, prompt, 3, sampling, 600)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_a_sliding_window_a_sequence_can_outgrow_keeps_hf_forward(kind, tmp_path, architecture_dirs):
    """The lean path attends to every cached key; where a layer's window is shorter than the model's positions
    it is refused (with the window in the reason), and where no sequence can outgrow it, it is taken."""
    vocab = specplug.Target.from_pretrained(architecture_dirs[kind]["target"]).vocab_size
    window = dict(sliding_window=8) if kind == "mistral" else dict(use_sliding_window=True, sliding_window=8,
                                                                    max_window_layers=1)
    short = specplug.Target.from_pretrained(make_architecture(tmp_path / "short", kind, vocab, **window))
    assert short.lean is None and "sliding_window=8" in short.lean_note
    ids = list(range(1, 21))  # longer than the window: HF's forward masks the keys beyond it
    assert specplug.generate(short, None, ids, max_new_tokens=8, sampling=specplug.GREEDY).tokens == \
        hf_greedy(tmp_path / "short", ids, 8, short.eos_token_ids)
    window["sliding_window"] = 512  # max_position_embeddings: no sequence outgrows it
    wide = specplug.Target.from_pretrained(make_architecture(tmp_path / "wide", kind, vocab, **window))
    assert wide.lean is not None, wide.lean_note
