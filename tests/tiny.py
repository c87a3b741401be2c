"""Tiny models and tokenizers for tests: built from configs, saved, loaded back through from_pretrained."""
from __future__ import annotations

from pathlib import Path

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
