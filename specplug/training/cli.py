r"""`specplug train ...`: reproduce the bundled zoo (tokenizer, target, draft).

The bundled weights were made with (W = a work dir outside the repo):

    specplug train tokenizer --out W/tokenizer
    specplug train target --work-dir W/target --tokenizer W/tokenizer --steps 900 \
        --batch-size 8 --seq-len 512 --lr 1e-3 --warmup 60 --seed 1234 --out specplug/models/pycode
    specplug train draft --work-dir W/draft-ce --tokenizer W/tokenizer --steps 150 \
        --batch-size 16 --seq-len 512 --lr 2e-3 --warmup 30 --seed 1234
    specplug train draft --work-dir W/draft-kd --tokenizer W/tokenizer --teacher W/target \
        --init-from W/draft-ce --steps 700 --batch-size 8 --seq-len 512 --lr 1e-3 --warmup 20 \
        --seed 4321 --out W/draft-kd-export
    specplug train draft --work-dir W/draft-kd2 --tokenizer W/tokenizer --teacher W/target \
        --init-from W/draft-kd --steps 700 --batch-size 8 --seq-len 512 --lr 5e-4 --warmup 20 \
        --seed 777 --threads 1 --out W/draft-kd2-export
    specplug train draft --work-dir W/draft-kd3 --tokenizer W/tokenizer --teacher W/target \
        --init-from W/draft-kd2 --steps 700 --batch-size 8 --seq-len 512 --lr 3e-4 --warmup 20 \
        --seed 999 --threads 1 --out specplug/models/pycode-draft
    specplug train report --target specplug/models/pycode --draft specplug/models/pycode-draft \
        --tokenizer W/tokenizer
    specplug train token-ranks --tokenizer specplug/models/pycode --default-vocab 2048 \
        --sampled-vocab all --out specplug/models/pycode/frequent_tokens.json

(`python -m specplug.training.cli ...` is the same group.)  Runs are resumable: rerunning a command
with the same --work-dir continues from its last checkpoint (SIGTERM/Ctrl-C saves one); batches depend
only on (seed, step). What each run took and what changed mid-run: docs/zoo.md.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

DEFAULT_WORK = Path("zoo-work")
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


@click.group("train")
def train_group():
    """Train the bundled model zoo (tokenizer, target, draft)."""


@train_group.command("tokenizer")
@click.option("--out", type=click.Path(file_okay=False), default=str(DEFAULT_WORK / "tokenizer"), show_default=True)
@click.option("--vocab-size", default=8192, show_default=True)
def tokenizer_cmd(out, vocab_size):
    """Train the byte-level BPE tokenizer on the stdlib train split."""
    from .tokenizer import check_round_trip, save_tokenizer, train_tokenizer

    tok = train_tokenizer(vocab_size)
    fast = save_tokenizer(tok, out)
    n = check_round_trip(fast)
    click.echo(f"tokenizer: vocab {len(fast)} -> {out}; round trip exact on {n} held-out files")


def _common(f):
    opts = [
        click.option("--work-dir", type=click.Path(file_okay=False), required=True,
                     help="checkpoints/logs; rerun with the same dir to resume"),
        click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False),
                     default=str(DEFAULT_WORK / "tokenizer"), show_default=True),
        click.option("--out", type=click.Path(file_okay=False), default=None,
                     help="export fp16 safetensors + config + tokenizer here when done"),
        click.option("--steps", type=int, required=True),
        click.option("--batch-size", default=8, show_default=True),
        click.option("--seq-len", default=512, show_default=True),
        click.option("--lr", type=float, default=1e-3, show_default=True),
        click.option("--warmup", default=60, show_default=True),
        click.option("--seed", default=1234, show_default=True),
        click.option("--ckpt-every", default=50, show_default=True),
        click.option("--threads", default=2, show_default=True),
        click.option("--layers", type=int, default=None), click.option("--hidden", type=int, default=None),
        click.option("--heads", type=int, default=None), click.option("--kv-heads", type=int, default=None),
        click.option("--intermediate", type=int, default=None),
        click.option("--dtype", type=click.Choice(["float16", "bfloat16"]), default="float16", show_default=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _run(preset, work_dir, tokenizer_dir, out, steps, batch_size, seq_len, lr, warmup, seed, ckpt_every,
         threads, layers, hidden, heads, kv_heads, intermediate, dtype, **kd):
    from transformers import AutoTokenizer

    from .models import make_config
    from .trainer import TrainArgs, export, train

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = make_config(preset, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate)
    args = TrainArgs(work_dir=work_dir, tokenizer_dir=tokenizer_dir, steps=steps, batch_size=batch_size,
                     seq_len=seq_len, lr=lr, warmup=warmup, seed=seed, ckpt_every=ckpt_every,
                     threads=threads, **kd)
    res = train(args, cfg, log=click.echo)
    if res["finished"] and out:
        export(work_dir, tokenizer_dir, out, dtype=dtype)
        click.echo(f"exported -> {out}")
    click.echo(json.dumps(res))


@train_group.command("target")
@_common
def target_cmd(**kw):
    """Train the Llama-style target (default: 6 layers x 512, `pycode`)."""
    _run("pycode", **kw)


@train_group.command("draft")
@_common
@click.option("--teacher", type=click.Path(exists=True), default=None,
              help="target work dir or exported dir: distil with KL(teacher || draft)")
@click.option("--init-from", type=click.Path(exists=True), default=None,
              help="start from these weights (e.g. the CE-trained draft work dir)")
@click.option("--kd-weight", default=1.0, show_default=True)
@click.option("--ce-weight", default=0.0, show_default=True)
@click.option("--kd-temperature", default=1.0, show_default=True)
def draft_cmd(teacher, init_from, kd_weight, ce_weight, kd_temperature, **kw):
    """Train the draft (default: 1 layer x 256, `pycode-draft`); with --teacher, distil."""
    _run("pycode-draft", teacher=teacher, init_from=init_from, kd_weight=kd_weight, ce_weight=ce_weight,
         kd_temperature=kd_temperature, **kw)


@train_group.command("export")
@click.option("--work-dir", type=click.Path(exists=True, file_okay=False), required=True)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False),
              default=str(DEFAULT_WORK / "tokenizer"), show_default=True)
@click.option("--out", type=click.Path(file_okay=False), required=True)
@click.option("--dtype", type=click.Choice(["float16", "bfloat16"]), default="float16", show_default=True)
def export_cmd(work_dir, tokenizer_dir, out, dtype):
    """Export a work dir's latest checkpoint as a HF model directory."""
    from .trainer import export

    export(work_dir, tokenizer_dir, out, dtype=dtype)
    click.echo(f"exported -> {out}")


@train_group.command("token-ranks")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False),
              default=str(DEFAULT_WORK / "tokenizer"), show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="e.g. specplug/models/pycode/frequent_tokens.json")
@click.option("--default-vocab", type=int, default=None,
              help="the subset draft-model uses when vocab= is not given (pick it with specplug compare)")
@click.option("--sampled-vocab", default=None,
              help="the same for sequences that sample (sampled_vocab=): a count or 'all'")
def token_ranks_cmd(tokenizer_dir, out, default_vocab, sampled_vocab):
    """Rank the vocabulary by frequency in the train split (draft-model's vocab= reads the top of it)."""
    if sampled_vocab not in (None, "all") and not sampled_vocab.isdigit():
        raise click.BadParameter(f"{sampled_vocab!r} is neither a token count nor 'all'", param_hint="--sampled-vocab")
    import torch

    from .data import token_stream

    stream = token_stream("train", tokenizer_dir)
    counts = torch.bincount(stream, minlength=int(stream.max()) + 1)
    ranked = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))  # ties: the smaller id first
    total = int(counts.sum())
    covered = torch.cumsum(counts[ranked], 0) / total
    Path(out).write_text(json.dumps({
        "about": "token ids by frequency in the zoo's train split (specplug train token-ranks)",
        "corpus_tokens": total,
        "coverage": {str(n): round(float(covered[n - 1]), 4) for n in (512, 1024, 2048, 4096) if n <= len(ranked)},
        **({"default_vocab": default_vocab} if default_vocab else {}),
        **({"sampled_vocab": sampled_vocab if sampled_vocab == "all" else int(sampled_vocab)} if sampled_vocab else {}),
        "tokens": ranked}, separators=(",", ":")) + "\n")
    click.echo(f"{len(ranked)} tokens ranked over {total} -> {out}; coverage of the top 1024/2048/4096: "
               + ", ".join(f"{float(covered[n - 1]):.3f}" for n in (1024, 2048, 4096) if n <= len(ranked)))


@train_group.command("report")
@click.option("--target", "target_dir", type=click.Path(exists=True), required=True)
@click.option("--draft", "draft_dir", type=click.Path(exists=True), required=True)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False),
              default=str(DEFAULT_WORK / "tokenizer"), show_default=True)
@click.option("--max-tokens", default=65536, show_default=True)
@click.option("--threads", default=2, show_default=True)
def report_cmd(target_dir, draft_dir, tokenizer_dir, max_tokens, threads):
    """Decode cost (fp32, batch 1, KV cache), held-out loss, draft/target agreement."""
    from .evaluate import report

    click.echo(json.dumps(report(target_dir, draft_dir, tokenizer_dir, threads, max_tokens), indent=1))


if __name__ == "__main__":
    train_group()
