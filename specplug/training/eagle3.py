"""Train an EAGLE-3 head (see :mod:`specplug.proposers.eagle3`) for a frozen target.

The machinery is the EAGLE trainer's (:mod:`.eagle`): features computed once and cached (here the target's
final feature and its three feature layers, concatenated), seeded batches, the resumable loop, the export.
The loss is EAGLE-3's: no feature regression, only the soft cross-entropy between the target's distribution
over the drafting vocabulary (its LM-head rows there, renormalised) and the head's, at each depth of the
training-time test (depth d drafts on the head's own depth d-1 outputs, :func:`.eagle.unroll`), weighted
``depth_decay ** (d - 1)``.

A fresh head starts from the target's LM-head rows and final norm (so its norm + lm_head begins as the
target's own projection) and, with ``init_shared``, from a trained EAGLE-1 head's decoder-layer weights
wherever names and shapes agree (the attention output, the MLP and their norms; not q/k/v, which read 2h).
"""
from __future__ import annotations

import torch

from .eagle import HeadTrainArgs, finish_run, prepare_run, ensure_features, init_from, train_head, unroll
from .trainer import keeps_caller_threads

EAGLE3_DEFAULTS = {"depth": 3, "depth_decay": 0.8, "vocab": 2048, "feature_layers": None, "init_shared": None}


def eagle3_loss(target, depth: int, depth_decay: float):
    """``loss_fn(head, tokens, feats, step)``: feats [B, L, 4h] = [last ; layer a ; layer b ; layer c]."""
    emb, h = target.embedding, target.hidden_size
    rows = target.lm_head.weight.detach()

    def loss_fn(head, tokens, feats, step):
        t = feats.shape[1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                e = emb(tokens[:, 1:t])
                p = (feats[:, 1:, :h] @ rows[head.vocab_ids].t()).float().softmax(-1)  # p over the drafting vocab
            parts, total = {}, 0.0
            for d, out in enumerate(unroll(head, head.fuse(feats[:, :-1, h:]), e, depth), start=1):
                logits = head.logits(out[:, d - 1:]).float()
                ce = -(p[:, d - 1:] * logits.log_softmax(-1)).sum(-1).mean()
                total = total + depth_decay ** (d - 1) * ce
                suffix = "" if d == 1 else str(d)
                parts[f"ce{suffix}"] = ce.item()
                with torch.no_grad():
                    parts[f"top1{suffix}"] = (logits.argmax(-1) == p[:, d - 1:].argmax(-1)).float().mean().item()
        return total, parts

    return loss_fn


@torch.no_grad()
def eagle3_figures(head, target, data, max_depth: int = 4) -> dict:
    """Held-out top-1 agreement with the target's argmax (over the whole vocabulary) at each depth of drafting
    on the head's own outputs, and E[sum min(p, q)] (acceptance at temperature 1, q zero off the vocabulary)."""
    head.eval()
    h = target.hidden_size
    tokens, feats = data["tokens"].long(), data["features"].float()
    t = feats.shape[1]
    p = target.lm_head(feats[:, 1:, :h]).softmax(-1)
    outs = unroll(head, head.fuse(feats[:, :-1, h:]), target.embedding(tokens[:, 1:t]), max_depth)
    top1, accept = [], []
    for d, out in enumerate(outs, start=1):
        q_sub = head.logits(out[:, d - 1:]).softmax(-1)
        q = q_sub.new_zeros(*q_sub.shape[:-1], p.shape[-1]).index_copy_(-1, head.vocab_ids, q_sub)
        pd = p[:, d - 1:]
        top1.append(round((q.argmax(-1) == pd.argmax(-1)).float().mean().item(), 4))
        accept.append(round(torch.minimum(pd, q).sum(-1).mean().item(), 4))
    return {"heldout_top1_by_depth": top1, "heldout_accept_t1_by_depth": accept, "heldout_top1": top1[0]}


def _fresh_head(target, extra: dict, seed: int):
    from specplug.drafting_vocab import read_ranks, vocab_subset
    from specplug.proposers.eagle3 import Eagle3Head

    ranks, ranks_file = read_ranks(target.path)
    subset = vocab_subset(extra["vocab"], ranks, ranks_file, target.vocab_size, "train eagle3")
    head = Eagle3Head.for_target(target, vocab=subset, feature_layers=extra["feature_layers"], seed=seed)
    if extra.get("init_shared"):
        extra["init_shared"] = {"from": str(extra["init_shared"]),
                                "tensors": share_from_eagle(head, extra["init_shared"], target)}
    return head


def share_from_eagle(head, eagle_dir, target) -> list[str]:
    """Copy a trained EAGLE-1 head's decoder-layer tensors into ``head`` wherever names and shapes agree;
    returns their names."""
    from specplug.heads import load_head, resolve_head_path

    _, state = load_head(resolve_head_path(eagle_dir), "eagle", target)
    mine = head.state_dict()
    shared = {k: v for k, v in state.items() if k.startswith("layer.") and k in mine and mine[k].shape == v.shape}
    head.load_state_dict(shared, strict=False)
    return sorted(shared)


@keeps_caller_threads
def train_eagle3(args: HeadTrainArgs, log=print) -> dict:
    """Train (or resume) an EAGLE-3 head in ``args.work_dir``; export it to ``args.out`` when done."""
    from specplug.proposers.eagle3 import KIND, default_feature_layers

    extra = {**EAGLE3_DEFAULTS, **args.extra}
    extra["feature_layers"] = list(extra["feature_layers"] or default_feature_layers(_num_layers(args.target)))
    args.extra = extra
    target, data, cache, feature_dir = prepare_run(args, log, layers=extra["feature_layers"])
    if extra.get("init"):
        from specplug.proposers.eagle3 import Eagle3Head

        head = Eagle3Head(_init_config(extra["init"]))
        init_from(head, KIND, extra, target)
    else:
        head = _fresh_head(target, extra, args.seed)
    n_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    log(f"eagle3: head {n_params:,} params ({n_params * 2 / 1e6:.1f} MB fp16), layers {extra['feature_layers']}, "
        f"drafting vocabulary {head.vocab_ids.numel()}; {data['tokens'].shape[0]} x {args.seq_len} feature windows")
    res = train_head(args, KIND, head, eagle3_loss(target, int(extra["depth"]), float(extra["depth_decay"])),
                     target, data, log)
    if not res["finished"]:
        return res
    held = ensure_features(target, "heldout", args.eval_windows, args.seq_len, args.seed, cache, feature_dir, log,
                           layers=extra["feature_layers"])
    figures = eagle3_figures(head, target, held)
    figures["params"] = n_params
    return finish_run(args, KIND, head, target, res, figures, log)


def _num_layers(target_name: str) -> int:
    from transformers import AutoConfig

    from specplug import zoo

    path = zoo.resolve(target_name) if zoo.is_zoo_name(target_name) else target_name
    return AutoConfig.from_pretrained(str(path)).num_hidden_layers


def _init_config(path) -> dict:
    from specplug.heads import read_head_config, resolve_head_path

    return read_head_config(resolve_head_path(path))["head"]
