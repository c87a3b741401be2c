"""Zoo figures: per-token decode cost, validation loss, draft/target agreement."""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from specplug.hf_compat import cache_kwargs, output_cache

from .trainer import keeps_caller_threads


@torch.no_grad()
def decode_ms_per_token(model, prompt_ids: torch.Tensor, n_tokens: int = 64, repeats: int = 3) -> float:
    """Median ms per incremental greedy step with a KV cache (batch 1, model's dtype)."""
    from transformers import DynamicCache

    model.eval()
    per = []
    for _ in range(repeats):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt_ids, **cache_kwargs(cache), use_cache=True)
        cache = output_cache(out)
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            out = model(input_ids=nxt, **cache_kwargs(cache), use_cache=True)
            cache = output_cache(out)
            nxt = out.logits[:, -1:].argmax(-1)
        per.append((time.perf_counter() - t0) / n_tokens * 1e3)
    return statistics.median(per)


@torch.no_grad()
def agreement(target, draft, stream: torch.Tensor, seq_len: int = 512, max_tokens: int = 65536,
              batch_size: int = 8) -> dict:
    """Over held-out windows (teacher forcing): greedy top-1 agreement between draft and target,
    and the expected acceptance at temperature 1, E_p-context[sum_x min(p(x), q(x))]."""
    from .data import eval_windows

    wins = list(eval_windows(stream, seq_len, max_tokens))
    agree = acc = n = 0.0
    t_loss = d_loss = 0.0
    for i in range(0, len(wins), batch_size):
        x = torch.stack(wins[i : i + batch_size])
        inp, tgt = x[:, :-1], x[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pl = target(input_ids=inp).logits.float()
            ql = draft(input_ids=inp).logits.float()
        p, q = pl.softmax(-1), ql.softmax(-1)
        agree += (pl.argmax(-1) == ql.argmax(-1)).sum().item()
        acc += torch.minimum(p, q).sum(-1).sum().item()
        t_loss += F.cross_entropy(pl.reshape(-1, pl.shape[-1]), tgt.reshape(-1), reduction="sum").item()
        d_loss += F.cross_entropy(ql.reshape(-1, ql.shape[-1]), tgt.reshape(-1), reduction="sum").item()
        n += tgt.numel()
    return {"greedy_top1_agreement": agree / n, "expected_accept_t1": acc / n,
            "target_val_loss": t_loss / n, "target_val_ppl": math.exp(t_loss / n),
            "draft_val_loss": d_loss / n, "draft_val_ppl": math.exp(d_loss / n), "tokens": int(n)}


@keeps_caller_threads
def report(target_dir: str, draft_dir: str, tokenizer_dir: str, threads: int = 2,
           max_tokens: int = 65536, cache_dir: str | None = None) -> dict:
    from .corpus import heldout_prompts
    from .data import token_stream
    from .trainer import load_trained

    torch.set_num_threads(threads)
    target = load_trained(target_dir)
    draft = load_trained(draft_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = torch.tensor([tok.encode(heldout_prompts(1)[0], add_special_tokens=False)])
    # interleave to share machine noise
    tms, dms = [], []
    for _ in range(3):
        tms.append(decode_ms_per_token(target, prompt, repeats=1))
        dms.append(decode_ms_per_token(draft, prompt, repeats=1))
    res = {"target_ms_per_token": statistics.median(tms), "draft_ms_per_token": statistics.median(dms),
           "prompt_tokens": prompt.shape[1]}
    res["cost_ratio"] = res["target_ms_per_token"] / res["draft_ms_per_token"]
    stream = token_stream("heldout", tokenizer_dir, cache_dir)
    res.update(agreement(target, draft, stream, max_tokens=max_tokens))
    return res
