"""Tiny models and tokenizers for tests: built from configs, saved, loaded back through from_pretrained."""
from __future__ import annotations

from pathlib import Path

import pytest

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
]


def make_tokenizer(out: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on a few lines of Python, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def make_llama(out: Path, vocab_size: int, *, tokenizer_from: Path | None = None, **options) -> Path:
    """A random Llama saved as safetensors (see specplug.testing.tiny_llama), with a tokenizer if given."""
    from transformers import AutoTokenizer

    from specplug.testing import tiny_llama

    tiny_llama(out, vocab_size, **options)
    if tokenizer_from is not None:
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    return out


# Architectures for tests/test_architectures.py: the Llama family the lean path covers, and others it does not.
ARCHITECTURES = ("mistral", "qwen2", "qwen3", "gpt2", "phi3")


def make_architecture(out: Path, kind: str, vocab_size: int, *, hidden: int = 32, layers: int = 2, seed: int = 0,
                      init: float = 0.3, tokenizer_from: Path | None = None, **config) -> Path:
    """A random causal LM of ``kind`` (one of ARCHITECTURES) saved as safetensors, no EOS, with a tokenizer if
    given; ``config`` overrides the config's fields (e.g. ``sliding_window``)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    fields = {
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(heads, sliding_window=None)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", heads),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(heads, head_dim=hidden // 4)),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512)),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(heads, pad_token_id=None)),
    }
    config_name, model_name, extra = fields[kind]
    common = dict(vocab_size=vocab_size, initializer_range=init, eos_token_id=None, bos_token_id=None,
                  tie_word_embeddings=False)
    if kind != "gpt2":
        common.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      max_position_embeddings=512, pad_token_id=None)
    built = getattr(transformers, config_name)(**{**common, **extra, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(built)
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: give them values a forward could get wrong
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, init)
            elif "norm" in name or name.split(".")[-2].startswith("ln_"):
                param.normal_(1.0, 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(out)
    if tokenizer_from is not None:
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    return Path(out)


@pytest.fixture(autouse=True)
def private_machine_cache(tmp_path, monkeypatch):
    """Imported by a test module: the speed choices its tests probe are cached under each test's own directory
    (never the user's ~/.cache/specplug), and no decision carries over from one test to the next."""
    from specplug import machine

    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "machine-cache"))
    machine.forget()
    yield
    machine.forget()
