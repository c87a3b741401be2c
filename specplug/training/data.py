"""Token streams for training/validation: tokenized files joined by EOS."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def _tok_fingerprint(tokenizer_dir: Path) -> str:
    return hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]


def token_stream(split: str, tokenizer_dir: str | Path, cache_dir: str | Path | None = None) -> torch.Tensor:
    """1-D int64 tensor: EOS f1 EOS f2 EOS ... fn EOS (files of `split`, sorted order)."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    from .corpus import iter_texts
    from .tokenizer import EOS

    tokenizer_dir = Path(tokenizer_dir)
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"tokens-{split}-{_tok_fingerprint(tokenizer_dir)}.safetensors"
        if cache.exists():
            return load_file(str(cache))["ids"].long()
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    texts = list(iter_texts(split))
    encs = tok.encode_batch(texts, add_special_tokens=False)
    ids = [eos]
    for e in encs:
        ids.extend(e.ids)
        ids.append(eos)
    t = torch.tensor(ids, dtype=torch.int32)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file({"ids": t}, str(cache))
    return t.long()


def batch_for_step(stream: torch.Tensor, step: int, seed: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Random windows of seq_len+1 tokens; a pure function of (seed, step) so resuming is exact."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


def eval_windows(stream: torch.Tensor, seq_len: int, max_tokens: int | None = None):
    """Non-overlapping windows of seq_len+1 tokens (sharing one boundary token)."""
    n = (stream.numel() - 1) // seq_len
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    for i in range(n):
        yield stream[i * seq_len : (i + 1) * seq_len + 1]
