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

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F

from .data import batch_for_step, token_stream
from .models import build_model, n_params


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


class ThreadGovernor:
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


def save_checkpoint(work: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """``work``/ckpt: the model's weights (safetensors), the optimizer's state and ``state``, written beside the
    last checkpoint and then swapped in by renames, never over it."""
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


class Clock:
    """A run's steps, tokens seen and training seconds, carried over from the checkpoint it resumes."""

    def __init__(self, state: dict):
        self.step, self.tokens = state["step"], state["tokens"]
        self._before, self._start = state["elapsed_s"], time.time()

    def elapsed(self) -> float:
        return self._before + time.time() - self._start

    def state(self, args: TrainArgs) -> dict:
        return {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed(), "args": asdict(args)}


class Progress:
    """log.tsv (appended across resumes, one header) and the progress bar; with ``parts``, a column of the loss's
    named parts as JSON (a head's losses report several)."""

    def __init__(self, work: Path, steps: int, step: int, every: int = 1, desc: str | None = None,
                 parts: bool = False):
        from tqdm import tqdm

        self.every, self.parts = every, parts
        self.file = open(work / "log.tsv", "a")
        if os.path.getsize(work / "log.tsv") == 0:
            self.file.write("step\tloss\t" + ("parts\t" if parts else "") + "lr\ttok_per_s\telapsed_s\tthreads\n")
        self.bar = tqdm(total=steps, initial=step, desc=desc or work.name, dynamic_ncols=True, mininterval=5)

    def record(self, clock: Clock, loss: float, lr: float, tok_per_s: float, threads: int,
               parts: dict[str, float] | None = None) -> None:
        if clock.step % self.every == 0:
            named = f"{json.dumps(parts)}\t" if self.parts else ""
            self.file.write(f"{clock.step}\t{loss:.5f}\t{named}{lr:.3e}\t{tok_per_s:.0f}\t{clock.elapsed():.1f}\t"
                            f"{threads}\n")
            self.file.flush()
        self.bar.update(1)
        shown = {k: f"{v:.3f}" for k, v in parts.items()} if self.parts else {"lr": f"{lr:.2e}"}
        self.bar.set_postfix(loss=f"{loss:.3f}", tps=f"{tok_per_s:.0f}", **shown, refresh=False)

    def close(self) -> None:
        self.bar.close()
        self.file.close()


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT ask the loop to stop after its current step and save, not to die mid-checkpoint."""
    stop = threading.Event()
    old = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class _LazyStreams:
    """The corpus's token streams by split, tokenized (or read from the cache) when first asked for."""

    def __init__(self, tokenizer_dir: str, cache: Path):
        self.tokenizer_dir, self.cache = tokenizer_dir, cache

    def __getitem__(self, split: str) -> torch.Tensor:
        return token_stream(split, self.tokenizer_dir, self.cache)


def _open_run(work: Path, config) -> tuple[object, dict, bool]:
    """(config, state, resumed): the checkpoint's where there is one, else a fresh run's from ``config``."""
    from transformers import LlamaConfig

    if (work / "ckpt" / "state.json").exists():
        state = json.loads((work / "ckpt" / "state.json").read_text())
        return LlamaConfig.from_json_file(str(work / "config.json")), state, True
    if config is None:
        raise ValueError("fresh run needs a model config")
    config.to_json_file(str(work / "config.json"))
    return config, {"step": 0, "tokens": 0, "elapsed_s": 0.0}, False


def _student(args: TrainArgs, config, work: Path, resumed: bool, log):
    """The model to train: the checkpoint's weights, ``init_from``'s, or fresh ones from ``seed``."""
    from safetensors.torch import load_model

    model = build_model(config, args.seed)
    if resumed:
        load_model(model, str(work / "ckpt" / "model.safetensors"))
    elif args.init_from:
        missing = model.load_state_dict(load_trained(args.init_from).state_dict(), strict=False)
        log(f"init from {args.init_from}: {missing}")
    return model.train()


def _teacher(args: TrainArgs, config, log):
    """The frozen teacher of a distillation run, or None."""
    if not args.teacher:
        return None
    teacher = load_trained(args.teacher).requires_grad_(False)
    if teacher.config.vocab_size != config.vocab_size:
        raise ValueError(f"teacher {args.teacher} has a vocabulary of {teacher.config.vocab_size} tokens, "
                         f"the student {config.vocab_size}")
    log(f"teacher: {args.teacher} ({n_params(teacher):,} params)")
    return teacher


def optimizer_for(model, args, resume_from: Path | None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, no weight decay on norms and biases; its state from the checkpoint
    when resuming."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    if resume_from is not None:
        opt.load_state_dict(torch.load(resume_from / "ckpt" / "optim.pt", weights_only=True))
    return opt


def _next_token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _loss(model, teacher, x: torch.Tensor, args: TrainArgs) -> torch.Tensor:
    """The loss on windows x [B, T + 1]: next-token CE, or KL toward the teacher (plus CE where weighted)."""
    inp, tgt = x[:, :-1], x[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=inp).logits
        if teacher is not None:
            with torch.no_grad():
                t_logits = teacher(input_ids=inp).logits
    if teacher is None:
        return _next_token_ce(logits, tgt)
    loss = args.kd_weight * _kd_loss(logits, t_logits, args.kd_temperature)
    return loss + args.ce_weight * _next_token_ce(logits, tgt) if args.ce_weight else loss


def descend(model, opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, grad_clip: float) -> None:
    """One optimizer step on ``loss`` at learning rate ``lr``, gradients clipped to norm ``grad_clip`` (0: not)."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()


@keeps_caller_threads
def train(args: TrainArgs, config=None, log=print, streams: Mapping[str, torch.Tensor] | None = None) -> dict:
    """Train (or resume) in args.work_dir. `config` is required for a fresh run. `streams` maps "train" and
    "heldout" to 1-D token tensors (default: the stdlib corpus through ``args.tokenizer_dir``)."""
    gov = ThreadGovernor(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    streams = streams or _LazyStreams(args.tokenizer_dir, work.parent / "cache")
    config, state, resumed = _open_run(work, config)
    model = _student(args, config, work, resumed, log)
    log(f"model: {n_params(model):,} params; resumed={resumed} at step {state['step']}")
    teacher = _teacher(args, config, log)
    opt = optimizer_for(model, args, work if resumed else None)
    stream = streams["train"]
    log(f"train stream: {stream.numel():,} tokens")

    clock = Clock(state)
    progress = Progress(work, args.steps, clock.step, args.log_every)
    try:
        with stop_on_signals() as stop:
            while clock.step < args.steps and not stop.is_set():
                t0, threads, lr = time.time(), gov.update(), lr_at(clock.step, args)
                x = batch_for_step(stream, clock.step, args.seed, args.batch_size, args.seq_len)
                loss = _loss(model, teacher, x, args)
                descend(model, opt, loss, lr, args.grad_clip)
                fed = x[:, :-1].numel()
                clock.step += 1
                clock.tokens += fed
                if not math.isfinite(value := loss.item()):
                    raise FloatingPointError(f"non-finite loss at step {clock.step}")
                progress.record(clock, value, lr, fed / (time.time() - t0), threads)
                if clock.step % args.ckpt_every == 0 or clock.step == args.steps:
                    save_checkpoint(work, model, opt, clock.state(args))
    finally:
        progress.close()
    if clock.step < args.steps:
        save_checkpoint(work, model, opt, clock.state(args))
        log(f"stopped at step {clock.step}/{args.steps}; checkpoint saved, rerun to resume")
        return {"finished": False, **clock.state(args)}

    trained_s = clock.elapsed()
    res = evaluate(model, streams["heldout"], args.seq_len, args.eval_tokens)
    res.update({"steps": clock.step, "tokens_seen": clock.tokens, "train_time_s": trained_s,
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
