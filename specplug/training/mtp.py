"""Train Medusa/MTP heads for a frozen target on its cached features (see :mod:`.eagle` for the shared
feature cache and the resumable loop).

Head i at position t reads the target's feature f[t] and is trained with cross-entropy against the token at
t+2+i of the training text (the corpus, or with ``data`` the target's own continuations); the heads' losses are summed with weights ``decay**i`` (0.8, as in Medusa). Blocks start as
the identity and projections as copies of the target's LM head (or the LM head itself, ``share_lm_head``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .eagle import HeadTrainArgs, finish_run, prepare_run, ensure_features, init_from, train_head
from .trainer import keeps_caller_threads

MTP_DEFAULTS = {"num_heads": 3, "num_layers": 1, "share_lm_head": True, "decay": 0.8}


def mtp_loss(target, decay: float):
    lm_head = target.lm_head

    def loss_fn(heads, tokens, feats, step):
        t = feats.shape[1]
        n = heads.num_heads
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = heads.logits(feats[:, : t - 1], lm_head)  # [B, t-1, n, V]
        total, parts = 0.0, {}
        for i in range(n):
            # position j predicts the token at j+2+i: valid for j < t-1-i
            li = logits[:, : t - 1 - i, i].float()
            ce = F.cross_entropy(li.reshape(-1, li.shape[-1]), tokens[:, 2 + i:t + 1].reshape(-1))
            total = total + decay ** i * ce
            parts[f"ce{i}"] = ce.item()
        return total, parts

    return loss_fn


@torch.no_grad()
def mtp_figures(heads, target, data) -> dict:
    """Held-out, teacher-forced on the corpus: head i's top-1 against the corpus token at t+2+i, its top-1
    agreement with the target's argmax for that token (given the corpus prefix), and E[sum min(p, q_i)]."""
    heads.eval()
    tokens, feats = data["tokens"].long(), data["features"].float()
    t = feats.shape[1]
    logits = heads.logits(feats[:, : t - 1], target.lm_head)
    p_logits = target.lm_head(feats)
    top1_corpus, top1_target, accept = [], [], []
    for i in range(heads.num_heads):
        li = logits[:, : t - 1 - i, i]
        top1_corpus.append((li.argmax(-1) == tokens[:, 2 + i:t + 1]).float().mean().item())
        # the target's distribution for the token at j+2+i is p_logits at position j+1+i
        pi = p_logits[:, 1 + i:t].softmax(-1)
        qi = li.softmax(-1)
        top1_target.append((qi.argmax(-1) == pi.argmax(-1)).float().mean().item())
        accept.append(torch.minimum(pi, qi).sum(-1).mean().item())
    return {"heldout_top1_corpus_by_head": [round(x, 4) for x in top1_corpus],
            "heldout_top1_target_by_head": [round(x, 4) for x in top1_target],
            "heldout_accept_t1_by_head": [round(x, 4) for x in accept]}


@keeps_caller_threads
def train_mtp(args: HeadTrainArgs, log=print) -> dict:
    from specplug.proposers.mtp import KIND, MTPHeads

    extra = {**MTP_DEFAULTS, **args.extra}
    args.extra = extra
    target, data, cache, feature_dir = prepare_run(args, log)
    heads = MTPHeads.for_target(target.model, num_heads=extra["num_heads"], num_layers=extra["num_layers"],
                                share_lm_head=extra["share_lm_head"])
    if extra.get("init"):
        init_from(heads, KIND, extra, target)
    n_params = sum(p.numel() for p in heads.parameters())
    log(f"mtp: {extra['num_heads']} heads, {n_params:,} own params ({n_params * 2 / 1e6:.1f} MB fp16), "
        f"share_lm_head={extra['share_lm_head']}; {data['tokens'].shape[0]} x {args.seq_len} feature windows")
    res = train_head(args, KIND, heads, mtp_loss(target, extra["decay"]), target, data, log)
    if not res["finished"]:
        return res
    held = ensure_features(target, "heldout", args.eval_windows, args.seq_len, args.seed, cache, feature_dir, log)
    figures = mtp_figures(heads, target, held)
    figures["params"] = n_params
    return finish_run(args, KIND, heads, target, res, figures, log)
