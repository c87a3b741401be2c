"""Byte-level BPE tokenizer for the zoo, trained on the corpus' train split.

No normalisation, no prefix space, byte-level decoder: decode(encode(x)) == x
for any text.  Saved as tokenizer.json and wrapped as a
`transformers.PreTrainedTokenizerFast` so `AutoTokenizer.from_pretrained` works.
"""
from __future__ import annotations

from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<|pad|>"
DEFAULT_VOCAB = 8192


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB, root: str | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .corpus import iter_texts

    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts("train", root), trainer=trainer)
    return tok


def wrap(tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=None,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.add_bos_token = False
    return fast


def save_tokenizer(tok, out_dir: str | Path):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = wrap(tok)
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def check_round_trip(fast, root: str | None = None) -> int:
    """Assert exact round trip on every held-out file; returns the number checked."""
    from .corpus import iter_texts

    n = 0
    for text in iter_texts("heldout", root):
        ids = fast.encode(text, add_special_tokens=False)
        back = fast.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text:
            raise AssertionError("tokenizer round trip failed")
        n += 1
    return n
