"""Train an EAGLE head for a frozen target (and the machinery both head trainers share).

The target is frozen, so its features are computed **once** for a fixed token budget (windows of the
training corpus token stream, or with ``data`` of the target's own continuations — see
:mod:`.continuations` — chosen by seed) and cached in the work dir's parent (``features/``, fp16); the MTP
trainer reuses the same file. The head then trains on those features for ``steps`` steps of
``batch_size`` windows; batches are a pure function of (seed, step), so a resumed run sees the batches an
uninterrupted one would. bf16 autocast on CPU, AdamW, warmup + cosine, a tqdm progress bar, checkpoints
every ``ckpt_every`` steps (and on SIGINT/SIGTERM) under ``<work>/ckpt``; rerun the same command to resume.

EAGLE loss (per entry i of a window: input [embedding(x[i+1]) ; f[i] + noise], output f^[i+1]):
    ``feature_weight * smoothL1(f^[i+1], f[i+1]) + prob_weight * CE(softmax(lm_head(f[i+1])), lm_head(f^[i+1]))``
with EAGLE-1's weights 1.0 / 0.1 and uniform noise U(-noise, noise) on the input features (EAGLE: 0.1);
``depth`` > 1 adds the same terms for drafting unrolled on the head's own predictions (see :func:`eagle_loss`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .trainer import keeps_caller_threads


@dataclass
class HeadTrainArgs:
    target: str                       # zoo: name or a local target directory (with its tokenizer)
    work_dir: str
    out: str | None = None            # export the head here when done
    tokens: int = 300_000             # feature budget: windows x seq_len target positions, computed once
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 300
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1234
    ckpt_every: int = 25
    threads: int = 2
    cache_dir: str | None = None      # token-stream cache (default: <work>/../cache)
    eval_windows: int = 16            # held-out windows for the final figures
    data: str | None = None           # train on these continuations (training/continuations.py), not the corpus
    extra: dict = field(default_factory=dict)  # head-specific settings (noise, loss weights, heads, ...)


# --------------------------------------------------------------------------------------------------
# shared by the head trainers: the frozen target, its cached features, batches, the resumable loop
# --------------------------------------------------------------------------------------------------
def load_frozen_target(name: str):
    from specplug.target import Target

    target = Target.from_pretrained(name, dtype=torch.float32)
    for p in target.model.parameters():
        p.requires_grad_(False)
    if target.path is None or not (target.path / "tokenizer.json").is_file():
        raise ValueError(f"target {name!r}: need a local directory with tokenizer.json (the corpus is tokenized "
                         "with the target's own tokenizer)")
    return target


def _stream(target, split: str, cache_dir: Path):
    from .data import token_stream

    return token_stream(split, target.path, cache_dir)


def ensure_features(target, split: str, n_windows: int, seq_len: int, seed: int, cache_dir: Path,
                    feature_dir: Path, log=print, batch: int = 4, stream: torch.Tensor | None = None,
                    layers: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """``{"tokens": [N, seq_len+1] int32, "features": [N, seq_len, H] fp16}``: N windows of the ``split``
    token stream (or of ``stream``) and the target's final-normed last hidden state at their first seq_len
    positions (bf16 autocast), followed along the last axis by the outputs of ``layers`` (HF hidden_states
    indices; then [N, seq_len, H·(1 + len(layers))]). Computed once per (target fingerprint, split or stream,
    N, seq_len, seed, layers) and cached as safetensors."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    from specplug.heads import target_fingerprint

    from .data import batch_for_step

    fp = target_fingerprint(target)
    source = split
    if stream is not None:  # named by its content, so other continuations never reuse these features
        source = f"{split}-data{hashlib.sha256(stream.to(torch.int32).numpy().tobytes()).hexdigest()[:12]}"
    if layers:
        source += "-L" + ".".join(str(i) for i in layers)
    path = feature_dir / f"features-{fp}-{source}-{n_windows}x{seq_len}-s{seed}.safetensors"
    if path.exists():
        log(f"features: reusing {path}")
        return load_file(str(path))
    if stream is None:
        stream = _stream(target, split, cache_dir)
    if stream.numel() < seq_len + 2:
        raise ValueError(f"the {split} stream has only {stream.numel()} tokens")
    tokens, feats = [], []
    t0 = time.time()
    bar = tqdm(total=n_windows, desc=f"features ({split})", dynamic_ncols=True, mininterval=5)
    model = target.model
    for i in range(0, n_windows, batch):
        b = min(batch, n_windows - i)
        x = batch_for_step(stream, i // batch, seed + (0 if split == "train" else 7919), b, seq_len)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x[:, :seq_len], output_hidden_states=True, use_cache=False, logits_to_keep=1)
        tokens.append(x.to(torch.int32))
        hidden = out.hidden_states
        feats.append(torch.cat([hidden[-1], *(hidden[i] for i in layers)], dim=-1).to(torch.float16))
        bar.update(b)
    bar.close()
    data = {"tokens": torch.cat(tokens).contiguous(), "features": torch.cat(feats).contiguous()}
    feature_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(data, str(tmp), metadata={"target": target.name, "fingerprint": fp})
    os.replace(tmp, path)
    log(f"features: {n_windows} x {seq_len} {split} positions in {time.time() - t0:.0f}s -> {path}")
    return data


def window_batch(n_windows: int, step: int, seed: int, batch_size: int) -> torch.Tensor:
    """Window indices of a step: epochs of seeded permutations, a pure function of (seed, step)."""
    per_epoch = max(1, n_windows // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed * 7_919 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size]


@keeps_caller_threads
def train_head(args: HeadTrainArgs, kind: str, module: torch.nn.Module, loss_fn: Callable, target, data,
               log=print) -> dict:
    """The resumable loop: ``loss_fn(module, tokens, features) -> (loss, {name: float})`` per batch; the language
    model trainer's checkpoints, log, optimizer and signal handling (:mod:`specplug.training.trainer`)."""
    from safetensors.torch import load_model

    from .trainer import (Clock, Progress, ThreadGovernor, TrainArgs, descend, lr_at, optimizer_for, save_checkpoint,
                          stop_on_signals)

    gov = ThreadGovernor(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    sched = TrainArgs(work_dir=str(work), tokenizer_dir="", steps=args.steps, lr=args.lr,
                      min_lr_ratio=args.min_lr_ratio, warmup=args.warmup)
    resumed = (work / "ckpt" / "state.json").exists()
    clock = Clock(json.loads((work / "ckpt" / "state.json").read_text()) if resumed
                   else {"step": 0, "tokens": 0, "elapsed_s": 0.0})
    if resumed:
        load_model(module, str(work / "ckpt" / "model.safetensors"))
        log(f"{kind}: resumed at step {clock.step}")
    opt = optimizer_for(module, args, work if resumed else None)
    module.train()
    n_windows = data["tokens"].shape[0]
    progress = Progress(work, args.steps, clock.step, desc=kind, parts=True)
    try:
        with stop_on_signals() as stop:
            while clock.step < args.steps and not stop.is_set():
                t0, threads, lr = time.time(), gov.update(), lr_at(clock.step, sched)
                idx = window_batch(n_windows, clock.step, args.seed, args.batch_size)
                tokens, feats = data["tokens"][idx].long(), data["features"][idx].float()
                loss, parts = loss_fn(module, tokens, feats, clock.step)
                descend(module, opt, loss, lr, args.grad_clip)
                fed = feats.shape[0] * feats.shape[1]
                clock.step += 1
                clock.tokens += fed
                if not math.isfinite(value := loss.item()):
                    raise FloatingPointError(f"{kind}: non-finite loss at step {clock.step}")
                progress.record(clock, value, lr, fed / (time.time() - t0), threads, parts)
                if clock.step % args.ckpt_every == 0 or clock.step == args.steps:
                    save_checkpoint(work, module, opt, clock.state(args))
    finally:
        progress.close()
    if clock.step < args.steps:
        save_checkpoint(work, module, opt, clock.state(args))
        log(f"{kind}: stopped at step {clock.step}/{args.steps}; checkpoint saved, rerun to resume")
        return {"finished": False, **clock.state(args)}
    module.eval()
    return {"finished": True, **clock.state(args)}

def prepare_run(args: HeadTrainArgs, log, layers: Sequence[int] = ()):
    torch.manual_seed(args.seed)
    target = load_frozen_target(args.target)
    work = Path(args.work_dir)
    cache = Path(args.cache_dir) if args.cache_dir else work.parent / "cache"
    feature_dir = work.parent / "features"
    n_windows = max(args.batch_size, args.tokens // args.seq_len)
    torch.set_num_threads(args.threads)
    stream = None
    if args.data:
        from .continuations import read_continuations

        stream = read_continuations(args.data, target)
        log(f"training on {stream.numel()} tokens of the target's continuations in {args.data}")
    data = ensure_features(target, "train", n_windows, args.seq_len, args.seed, cache, feature_dir, log,
                           stream=stream, layers=layers)
    return target, data, cache, feature_dir


def finish_run(args: HeadTrainArgs, kind: str, module, target, res: dict, figures: dict, log) -> dict:
    from specplug.heads import save_head

    res = {**res, **figures}
    work = Path(args.work_dir)
    (work / "eval.json").write_text(json.dumps(res, indent=1, default=str))
    if args.out:
        drafting = args.extra.pop("drafting", None)
        training = {"steps": res.get("step"), "feature_tokens": args.tokens, "tokens_seen": res.get("tokens"),
                    "train_time_s": round(res.get("elapsed_s", 0.0), 1), "seq_len": args.seq_len,
                    "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, **args.extra,
                    **{k: v for k, v in figures.items() if isinstance(v, (int, float))}}
        if args.data:  # what it learnt from: the continuations' settings
            meta = json.loads((Path(args.data) / "continuations.json").read_text())
            training["data"] = {"continuations": {k: v for k, v in meta.items() if k != "fingerprint"}}
        save_head(args.out, kind, module.state_dict(), module.config, target, training=training, drafting=drafting)
        log(f"{kind}: exported -> {args.out}")
    log(json.dumps(res, default=str))
    return res


def init_from(module: torch.nn.Module, kind: str, extra: dict, target) -> None:
    """Continue from the trained head at ``extra["init"]`` (checked against this target and the module's
    config); its drafting advice is kept and its training recorded beside the new one, in ``extra``."""
    from specplug.heads import load_head

    config, state = load_head(extra["init"], kind, target)
    if config["head"] != module.config:
        raise ValueError(f"{kind}: --init {extra['init']}: head config {config['head']} differs from the one "
                         f"this target gets ({module.config})")
    module.load_state_dict(state)
    if config.get("drafting"):  # how the head drafts best (measured): kept unless measured again
        extra["drafting"] = config["drafting"]
    earlier = config.get("training", {})
    extra["init"] = {"from": str(extra["init"]), "steps": earlier.get("steps"),
                     "tokens_seen": earlier.get("tokens_seen"), "train_time_s": earlier.get("train_time_s"),
                     "feature_tokens": earlier.get("feature_tokens"), "data": earlier.get("data"),
                     "init": earlier.get("init")}


# --------------------------------------------------------------------------------------------------
# EAGLE
# --------------------------------------------------------------------------------------------------
EAGLE_DEFAULTS = {"noise": 0.1, "feature_weight": 1.0, "prob_weight": 0.1, "depth": 1, "depth_decay": 0.8}


def chain_mask(length: int, depth: int) -> torch.Tensor:
    """Which keys depth-``depth`` entries see when a training pass unrolls drafting (bool [L, depth·L]: keys
    are the L entries of depth 1, then of depth 2, ...). Drafting from verified position s, the head's
    cache holds depth-1 entries 0..s (built from the target's features); the entry at s+1 is built from its
    own prediction (depth 2), the one at s+2 from that one's (depth 3). So the depth-d entry at position p
    sees the depth-1 entries up to p-d+1, and the depth-j entry at p-(d-j) for each j = 2..d (itself last)."""
    p = torch.arange(length)[:, None]
    q = torch.arange(length)[None, :]
    parts = [q <= p - depth + 1] + [q == p - (depth - j) for j in range(2, depth + 1)]
    return torch.cat(parts, dim=1)


def unroll(head, features: torch.Tensor, embeds: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The head's predictions at depths 1..depth for every entry of a window (features, embeds [B, L, h]:
    entry p reads embeds[:, p] and, at depth 1, features[:, p]); depth d at entry p is what drafting computes
    at p when it started from verified position p-d+1 (entries p < d-1 have no such start: ignore them)."""
    from specplug.feature_heads import KVCache

    b, length, _ = features.shape
    pos = torch.arange(length)[None].expand(b, -1)
    cache = KVCache() if depth > 1 else None
    preds = [head(features, embeds, pos, cache)]
    for d in range(2, depth + 1):  # entry p reads the depth-(d-1) prediction made at p-1
        prev = torch.cat([torch.zeros_like(preds[-1][:, :1]), preds[-1][:, :-1]], dim=1)
        preds.append(head(prev, embeds, pos, cache, mask=chain_mask(length, d)))
    return preds


def eagle_loss(target, noise: float, feature_weight: float, prob_weight: float, seed: int, depth: int = 1,
               depth_decay: float = 0.8):
    """The EAGLE loss; with ``depth`` > 1 the pass also unrolls drafting ("training-time test", as in EAGLE-3):
    depth d feeds each entry the head's own depth-(d-1) prediction of its feature instead of the target's,
    attending as drafting would (:func:`chain_mask`), and its loss (the same two terms) weighs depth_decay^(d-1).
    Online the head drafts on its own features after the first token; trained on the target's alone, its
    acceptance fell from 0.87 at the first drafted position to 0.55 at the second."""
    emb, lm_head = target.embedding, target.lm_head

    def terms(pred, want, p_logits):
        vloss = F.smooth_l1_loss(pred.float(), want)
        logits = lm_head(pred)
        p = p_logits.float().softmax(-1)
        ploss = -(p * logits.float().log_softmax(-1)).sum(-1).mean()
        return vloss, ploss, logits

    def loss_fn(head, tokens, feats, step):
        b, t, _ = feats.shape
        inp = feats[:, :-1]
        if noise > 0:
            g = torch.Generator().manual_seed(seed * 31 + step)
            inp = inp + (torch.rand(inp.shape, generator=g) * 2 - 1) * noise
        want = feats[:, 1:]
        parts, total = {}, 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                e = emb(tokens[:, 1:t])
                p_logits = lm_head(want)
            for d, pred in enumerate(unroll(head, inp, e, depth), start=1):
                vloss, ploss, logits = terms(pred[:, d - 1:], want[:, d - 1:], p_logits[:, d - 1:])
                total = total + depth_decay ** (d - 1) * (feature_weight * vloss + prob_weight * ploss)
                suffix = "" if d == 1 else str(d)
                parts[f"vloss{suffix}"], parts[f"ploss{suffix}"] = vloss.item(), ploss.item()
                with torch.no_grad():
                    parts[f"top1{suffix}"] = (logits.argmax(-1) == p_logits[:, d - 1:].argmax(-1)).float().mean().item()
        return total, parts

    return loss_fn


@torch.no_grad()
def eagle_figures(head, target, data, max_depth: int = 4) -> dict:
    """Held-out figures, teacher-forced (depth 1) and autoregressive on the head's own features (depth d):
    top-1 agreement with the target's argmax and E[sum min(p, q)] (acceptance at temperature 1)."""
    head.eval()
    emb, lm_head = target.embedding, target.lm_head
    tokens, feats = data["tokens"].long(), data["features"].float()
    n, t, _ = feats.shape
    p_logits = lm_head(feats)  # p for the token after each position
    top1, accept = [], []
    # depth 1: every entry from true features
    pos = torch.arange(t - 1)[None].expand(n, -1)
    pred = head(feats[:, :-1], emb(tokens[:, 1:t]), pos)
    q = lm_head(pred).softmax(-1)
    p = p_logits[:, 1:].softmax(-1)
    top1.append((q.argmax(-1) == p.argmax(-1)).float().mean().item())
    accept.append(torch.minimum(p, q).sum(-1).mean().item())
    # depths 2..: from a few start points s, the head continues on its own predicted features (with the
    # corpus tokens, as after accepted drafts); depth d predicts the token after position s+d
    from specplug.feature_heads import KVCache

    hits, accs = [[] for _ in range(max_depth + 1)], [[] for _ in range(max_depth + 1)]
    for s in range(t // 8, t - max_depth - 1, max(1, t // 8)):
        cache = KVCache()
        out = head(feats[:, :s + 1], emb(tokens[:, 1:s + 2]), torch.arange(s + 1)[None].expand(n, -1), cache)[:, -1]
        for d in range(1, max_depth + 1):
            if d > 1:
                out = head(out[:, None], emb(tokens[:, s + d:s + d + 1]),
                           torch.full((n, 1), s + d - 1), cache)[:, -1]
            qd = lm_head(out).softmax(-1)
            pd = p_logits[:, s + d].softmax(-1)
            hits[d].append((qd.argmax(-1) == pd.argmax(-1)).float().mean().item())
            accs[d].append(torch.minimum(pd, qd).sum(-1).mean().item())
    for d in range(2, max_depth + 1):
        top1.append(sum(hits[d]) / len(hits[d]))
        accept.append(sum(accs[d]) / len(accs[d]))
    return {"heldout_top1_by_depth": [round(x, 4) for x in top1],
            "heldout_accept_t1_by_depth": [round(x, 4) for x in accept],
            "heldout_top1": round(top1[0], 4)}


@keeps_caller_threads
def train_eagle(args: HeadTrainArgs, log=print) -> dict:
    from specplug.proposers.eagle import KIND, EagleHead

    extra = {**EAGLE_DEFAULTS, **args.extra}
    args.extra = extra
    target, data, cache, feature_dir = prepare_run(args, log)
    head = EagleHead.for_target(target.model.config, seed=args.seed)
    if extra.get("init"):
        init_from(head, KIND, extra, target)
    n_params = sum(p.numel() for p in head.parameters())
    log(f"eagle: head {n_params:,} params ({n_params * 2 / 1e6:.1f} MB fp16); "
        f"{data['tokens'].shape[0]} x {args.seq_len} feature windows")
    loss_fn = eagle_loss(target, extra["noise"], extra["feature_weight"], extra["prob_weight"], args.seed,
                         int(extra["depth"]), float(extra["depth_decay"]))
    res = train_head(args, KIND, head, loss_fn, target, data, log)
    if not res["finished"]:
        return res
    held = ensure_features(target, "heldout", args.eval_windows, args.seq_len, args.seed, cache, feature_dir, log)
    figures = eagle_figures(head, target, held)
    figures["params"] = n_params
    return finish_run(args, KIND, head, target, res, figures, log)
