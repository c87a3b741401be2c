"""Self-distillation text: training-corpus prefixes continued by the frozen target itself.

A feature head drafts what the *target* will say, but the corpus is what people wrote, so heads trained
on the target's own continuations (Medusa-2's self-distillation) draft it better (docs/zoo.md). The
continuations are decoded through speculative decoding, whose output is distributed exactly as the
target's (greedy rows token for token), so a proposer only makes them faster.

Layout of ``out_dir``: ``continuations.json`` (the settings and the target's fingerprint) and
``chunkNNNNN.safetensors`` files, each ``{"ids": int32}`` holding EOS prefix continuation EOS prefix ... for
``CHUNK`` sequences from row NNNNN on. Finished chunks are kept, so an interrupted run resumes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

CHUNK = 64  # sequences per file: the unit of resuming
MIN_PREFIX = 8  # a prefix cut at a document boundary keeps at least this many tokens
META = "continuations.json"


def _prefix(window: list[int], eos: int) -> list[int]:
    """One document's text from a corpus window: after its last boundary if that leaves MIN_PREFIX tokens,
    else before it if that does, else the window as it is."""
    if eos not in window:
        return window
    j = len(window) - 1 - window[::-1].index(eos)
    if len(window) - j - 1 >= MIN_PREFIX:
        return window[j + 1:]
    return window[:j] if j >= MIN_PREFIX else window


def _settings(target, sequences, prefix_tokens, new_tokens, temperatures, proposer, gamma, batch_size, seed):
    from specplug.heads import target_fingerprint, target_name

    return {"target": target_name(target), "fingerprint": target_fingerprint(target),
            "sequences": sequences, "prefix_tokens": prefix_tokens, "new_tokens": new_tokens,
            "temperatures": list(temperatures), "proposer": proposer, "gamma": gamma, "batch_size": batch_size,
            "seed": seed}


def generate_continuations(target, stream: torch.Tensor, eos: int, out_dir: str | os.PathLike, *,
                           sequences: int, prefix_tokens: int = 48, new_tokens: int = 208,
                           temperatures: Sequence[float] = (0.0, 1.0), proposer: str | None = "draft-model",
                           gamma: int = 6, batch_size: int = 16, seed: int = 4242, log=print) -> Path:
    """Continue ``sequences`` prefixes of ``stream`` (a corpus token stream; windows of ``prefix_tokens`` at
    seeded positions, cut to one document) by ``new_tokens`` of the target's own decoding. Row i samples at
    ``temperatures[i % len(temperatures)]`` with seed i (0: greedy). Decoded with ``proposer`` at γ =
    ``gamma``, ``batch_size`` rows at a time (``None``: target-only). Returns ``out_dir``."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    import specplug
    from specplug.batch import generate_batch

    if sequences < 1 or prefix_tokens < 1 or new_tokens < 1:
        raise ValueError("continuations: sequences, prefix_tokens and new_tokens must be positive, got "
                         f"{sequences}, {prefix_tokens} and {new_tokens}")
    if not temperatures or any(t < 0 for t in temperatures):
        raise ValueError(f"continuations: temperatures must be a non-empty list of values >= 0, got {temperatures}")
    if stream.numel() < prefix_tokens + 2:
        raise ValueError(f"continuations: the corpus stream has {stream.numel()} tokens, fewer than a prefix")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(target, sequences, prefix_tokens, new_tokens, temperatures, proposer, gamma, batch_size,
                         seed)
    meta = out / META
    if meta.exists():
        earlier = json.loads(meta.read_text())
        changed = [k for k in settings if earlier.get(k) != settings[k]]
        if changed:
            raise ValueError(f"continuations: {out} was made with other settings ({', '.join(changed)}); "
                             "resume with the same ones or choose another --out")
    else:
        meta.write_text(json.dumps(settings, indent=1))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - prefix_tokens - 1, (sequences,), generator=g).tolist()
    drafter = specplug.get_proposer(proposer, target=target) if proposer else None
    bar = tqdm(total=sequences, desc="continuations", dynamic_ncols=True, mininterval=5)
    for first in range(0, sequences, CHUNK):
        rows = range(first, min(first + CHUNK, sequences))
        path = out / f"chunk{first:05d}.safetensors"
        if not path.exists():
            prompts = [_prefix(stream[s:s + prefix_tokens].tolist(), eos) for s in starts[rows.start:rows.stop]]
            sampling = [specplug.SamplingParams(temperature=temperatures[i % len(temperatures)], seed=i) for i in rows]
            results = generate_batch(target, drafter, prompts, max_new_tokens=new_tokens, sampling=sampling,
                                     num_speculative_tokens=gamma, max_batch_size=batch_size)
            ids: list[int] = []
            for prompt, result in zip(prompts, results):
                ids += [eos, *prompt, *result.tokens]
            tmp = path.with_suffix(".tmp")
            save_file({"ids": torch.tensor(ids, dtype=torch.int32)}, str(tmp))
            os.replace(tmp, path)
        bar.update(len(rows))
    bar.close()
    log(f"continuations: {sequences} sequences in {out}")
    return out


def read_continuations(path: str | os.PathLike, target) -> torch.Tensor:
    """The token stream (int64) of a finished ``generate_continuations`` directory, checked to be complete
    and made by ``target``."""
    from safetensors.torch import load_file

    from specplug.heads import HeadMismatchError, target_fingerprint, target_name

    out = Path(path)
    if not (out / META).is_file():
        raise ValueError(f"--data {out}: no {META} there (make one with `specplug train continuations`)")
    meta = json.loads((out / META).read_text())
    if meta.get("fingerprint") != target_fingerprint(target):
        raise HeadMismatchError(f"--data {out}: continuations of target {meta.get('target')!r}, not of "
                                f"{target_name(target)!r}; a head learns what its own target says")
    chunks = [out / f"chunk{first:05d}.safetensors" for first in range(0, meta["sequences"], CHUNK)]
    missing = [c.name for c in chunks if not c.is_file()]
    if missing:
        raise ValueError(f"--data {out}: unfinished ({len(missing)} of {len(chunks)} chunks missing, e.g. "
                         f"{missing[0]}); rerun `specplug train continuations` with the same settings")
    return torch.cat([load_file(str(c))["ids"].long() for c in chunks])
