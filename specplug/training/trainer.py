"""Resumable trainer for the zoo models (plain CE, or KL distillation toward a teacher).

Work-dir layout (outside the repo):
    <work>/ckpt/model.safetensors   model weights (fp32)
    <work>/ckpt/optim.pt            optimizer state (torch.save; our own file)
    <work>/ckpt/state.json          step, tokens seen, elapsed seconds, run arguments
    <work>/config.json              model config
    <work>/log.tsv                  step, loss, lr, tokens/s, elapsed
    <work>/eval.json                final validation figures
Batches are a pure function of (seed, step), so a resumed run sees exactly the
batches an uninterrupted one would.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class TrainArgs:
    work_dir: str
    tokenizer_dir: str
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    ckpt_every: int = 50
    log_every: int = 1
    threads: int = 2             # max threads; drops to 1 while other processes keep a core busy
    teacher: str | None = None   # path/work dir of the frozen teacher (distillation)
    kd_weight: float = 1.0       # weight of KL(teacher || student)
    ce_weight: float = 0.0       # weight of plain CE (with distillation)
    kd_temperature: float = 1.0
    eval_tokens: int | None = None
    init_from: str | None = None  # start weights (e.g. the CE-trained draft) for a fresh run
    extra: dict = field(default_factory=dict)


def keeps_caller_threads(fn):
    """Trainers choose their own thread count; the caller's comes back when they return (a test suite or a
    notebook that trained a head would otherwise go on with 2 threads, which contend on a shared box)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper


class _ThreadGovernor:
    """Use `max_threads` intra-op threads, but only 1 while other processes keep >0.6 core busy:
    on a shared 2-core box, 2 threads fighting a third busy process run ~4x slower than 1."""

    def __init__(self, max_threads: int):
        self.max = max_threads
        self.cur = max_threads
        self.last = self._read()
        torch.set_num_threads(self.cur)

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            busy = sum(v) - v[3] - (v[4] if len(v) > 4 else 0)
            with open("/proc/self/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            mine = int(st[11]) + int(st[12])
            return busy, mine, time.time()
        except (OSError, ValueError, IndexError):
            return None

    def update(self):
        if self.max <= 1:
            return self.cur
        now = self._read()
        if now is None or self.last is None:
            return self.cur
        hz = os.sysconf("SC_CLK_TCK")
        dt = now[2] - self.last[2]
        if dt < 5:
            return self.cur
        others = ((now[0] - self.last[0]) - (now[1] - self.last[1])) / hz / dt
        self.last = now
        want = 1 if others > 0.6 else self.max
        if want != self.cur:
            self.cur = want
            torch.set_num_threads(want)
        return self.cur


def lr_at(step: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    prog = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def _save_ckpt(work: Path, model, opt, state: dict):
    from safetensors.torch import save_model

    tmp = work / "ckpt.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(opt.state_dict(), tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    final = work / "ckpt"
    old = work / "ckpt.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def load_trained(path: str | Path, dtype=torch.float32):
    """A model from a work dir (its latest checkpoint) or an exported HF directory."""
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    p = Path(path)
    if (p / "ckpt" / "model.safetensors").exists():
        cfg = LlamaConfig.from_json_file(str(p / "config.json"))
        model = LlamaForCausalLM(cfg)
        model.tie_weights()
        load_model(model, str(p / "ckpt" / "model.safetensors"))
        return model.to(dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).eval()


def _kd_loss(s_logits, t_logits, T: float):
    s = F.log_softmax(s_logits.float() / T, dim=-1)
    t = F.log_softmax(t_logits.float() / T, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean() * (T * T)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, max_tokens: int | None = None,
             batch_size: int = 8, autocast: bool = True) -> dict:
    from .data import eval_windows

    model.eval()
    tot, n = 0.0, 0
    wins = list(eval_windows(stream, seq_len, max_tokens))
    for i in range(0, len(wins), batch_size):
        x = torch.stack(wins[i : i + batch_size])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        n += x[:, 1:].numel()
    model.train()
    return {"val_loss": tot / n, "val_ppl": math.exp(tot / n), "val_tokens": n}


@keeps_caller_threads
def train(args: TrainArgs, config=None, log=print) -> dict:
    """Train (or resume) in args.work_dir. `config` is required for a fresh run."""
    from safetensors.torch import load_model
    from tqdm import tqdm
    from transformers import LlamaConfig

    from .data import batch_for_step, token_stream
    from .models import build_model, n_params

    gov = _ThreadGovernor(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cache = work.parent / "cache"

    resumed = (work / "ckpt" / "state.json").exists()
    if resumed:
        config = LlamaConfig.from_json_file(str(work / "config.json"))
        state = json.loads((work / "ckpt" / "state.json").read_text())
    else:
        if config is None:
            raise ValueError("fresh run needs a model config")
        config.to_json_file(str(work / "config.json"))
        state = {"step": 0, "tokens": 0, "elapsed_s": 0.0}

    model = build_model(config, args.seed)
    if resumed:
        load_model(model, str(work / "ckpt" / "model.safetensors"))
    elif args.init_from:
        init = load_trained(args.init_from)
        missing = model.load_state_dict(init.state_dict(), strict=False)
        log(f"init from {args.init_from}: {missing}")
    model.train()
    log(f"model: {n_params(model):,} params; resumed={resumed} at step {state['step']}")

    teacher = None
    if args.teacher:
        teacher = load_trained(args.teacher)
        for p in teacher.parameters():
            p.requires_grad_(False)
        if teacher.config.vocab_size != config.vocab_size:
            raise ValueError("teacher and student vocabularies differ")
        log(f"teacher: {args.teacher} ({n_params(teacher):,} params)")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    if resumed:
        opt.load_state_dict(torch.load(work / "ckpt" / "optim.pt", weights_only=True))

    train_stream = token_stream("train", args.tokenizer_dir, cache)
    log(f"train stream: {train_stream.numel():,} tokens")

    stop = {"flag": False}

    def _handler(signum, frame):
        stop["flag"] = True

    old_handlers = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    logf = open(work / "log.tsv", "a")
    if os.path.getsize(work / "log.tsv") == 0:
        logf.write("step\tloss\tlr\ttok_per_s\telapsed_s\tthreads\n")

    step = state["step"]
    tokens = state["tokens"]
    elapsed0 = state["elapsed_s"]
    t_start = time.time()
    bar = tqdm(total=args.steps, initial=step, desc=work.name, dynamic_ncols=True, mininterval=5)

    def snapshot():
        return {"step": step, "tokens": tokens, "elapsed_s": elapsed0 + time.time() - t_start,
                "args": asdict(args)}

    try:
        while step < args.steps and not stop["flag"]:
            t0 = time.time()
            nthr = gov.update()
            lr = lr_at(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            x = batch_for_step(train_stream, step, args.seed, args.batch_size, args.seq_len)
            inp, tgt = x[:, :-1], x[:, 1:]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=inp).logits
                if teacher is not None:
                    with torch.no_grad():
                        t_logits = teacher(input_ids=inp).logits
            if teacher is not None:
                loss = args.kd_weight * _kd_loss(logits, t_logits, args.kd_temperature)
                if args.ce_weight:
                    loss = loss + args.ce_weight * F.cross_entropy(
                        logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
            else:
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            step += 1
            tokens += inp.numel()
            dt = time.time() - t0
            lv = loss.item()
            if not math.isfinite(lv):
                raise FloatingPointError(f"non-finite loss at step {step}")
            if step % args.log_every == 0:
                logf.write(f"{step}\t{lv:.5f}\t{lr:.3e}\t{inp.numel() / dt:.0f}\t{elapsed0 + time.time() - t_start:.1f}\t{nthr}\n")
                logf.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{lv:.3f}", lr=f"{lr:.2e}", tps=f"{inp.numel() / dt:.0f}", refresh=False)
            if step % args.ckpt_every == 0 or step == args.steps:
                _save_ckpt(work, model, opt, snapshot())
    finally:
        bar.close()
        logf.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    if step < args.steps:
        _save_ckpt(work, model, opt, snapshot())
        log(f"stopped at step {step}/{args.steps}; checkpoint saved, rerun to resume")
        return {"finished": False, **snapshot()}

    snap = snapshot()
    val_stream = token_stream("heldout", args.tokenizer_dir, cache)
    res = evaluate(model, val_stream, args.seq_len, args.eval_tokens)
    res.update({"steps": step, "tokens_seen": tokens, "train_time_s": snap["elapsed_s"],
                "params": n_params(model)})
    (work / "eval.json").write_text(json.dumps(res, indent=1))
    log(f"done: {json.dumps(res)}")
    return {"finished": True, **res}


def export(work_dir: str | Path, tokenizer_dir: str | Path, out_dir: str | Path,
           dtype: str = "float16") -> Path:
    """Write <out_dir>/{config.json, model.safetensors, generation_config.json, tokenizer files}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = load_trained(work_dir)
    td = getattr(torch, dtype)
    model = model.to(td)
    model.config.dtype = dtype
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    # sanity: loads back offline, fp32 logits finite and close to the fp16 weights' model
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ref = load_trained(work_dir).eval()
    ids = torch.tensor([tok.encode("def main():\n    ", add_special_tokens=False)])
    with torch.no_grad():
        a, b = back(input_ids=ids).logits, ref(input_ids=ids).logits
    if not torch.isfinite(a).all() or (a - b).abs().max() > 0.1 * b.abs().max():
        raise AssertionError("exported model's logits are off")
    return out
