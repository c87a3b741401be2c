"""`specplug train eagle|eagle3|mtp|continuations`: train feature heads for a frozen target, on its corpus or its own text.

    specplug train eagle --target zoo:pycode --work-dir WORK/heads/eagle --out specplug/models/pycode-eagle
    specplug train mtp   --target zoo:pycode --work-dir WORK/heads/mtp   --out specplug/models/pycode-mtp

The commands that made the bundled heads, round by round, with their training times: docs/zoo.md.

The target's features for ``--tokens`` corpus positions are computed once into WORK/heads/features/ and
shared by both commands. Rerunning a command with the same --work-dir resumes from its last checkpoint.

Attach to a click group with ``group.add_command(eagle_cmd)`` / ``group.add_command(mtp_cmd)`` (or
``add_head_commands(group)``).
"""
from __future__ import annotations

from pathlib import Path

import click


def _common(f):
    opts = [
        click.option("--target", "target", default="zoo:pycode", show_default=True,
                     help="the frozen target: a zoo: name or a local model directory with its tokenizer"),
        click.option("--work-dir", type=click.Path(file_okay=False), required=True,
                     help="checkpoints/logs; rerun with the same dir to resume (features go to its parent)"),
        click.option("--out", type=click.Path(file_okay=False), default=None,
                     help="export the head (fp16 safetensors + config.json) here when done"),
        click.option("--tokens", default=300_000, show_default=True,
                     help="target positions whose features are computed once and trained on"),
        click.option("--seq-len", default=512, show_default=True),
        click.option("--batch-size", default=8, show_default=True),
        click.option("--steps", type=int, default=300, show_default=True),
        click.option("--lr", type=float, default=1e-3, show_default=True),
        click.option("--warmup", default=30, show_default=True),
        click.option("--seed", default=1234, show_default=True),
        click.option("--ckpt-every", default=25, show_default=True),
        click.option("--eval-windows", default=16, show_default=True, help="held-out windows for the figures"),
        click.option("--threads", default=2, show_default=True),
        click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                     help="token-stream cache (default: WORK_DIR/../cache)"),
        click.option("--data", type=click.Path(exists=True, file_okay=False), default=None,
                     help="train on the target's own continuations made by `specplug train continuations` "
                          "(self-distillation) instead of the corpus; held-out figures stay on the corpus"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _args(extra: dict, **kw):
    from .eagle import HeadTrainArgs

    return HeadTrainArgs(**kw, extra=extra)


@click.command("eagle")
@_common
@click.option("--noise", default=0.1, show_default=True, help="uniform noise U(-x, x) on the input features")
@click.option("--feature-weight", default=1.0, show_default=True, help="weight of the smooth-L1 feature loss")
@click.option("--prob-weight", default=0.1, show_default=True, help="weight of the soft cross-entropy")
@click.option("--depth", default=1, show_default=True,
              help="unroll drafting this deep in training (EAGLE-3's training-time test); 1: EAGLE-1's loss")
@click.option("--depth-decay", default=0.8, show_default=True, help="loss weight of depth d is decay**(d-1)")
@click.option("--init", "init", type=click.Path(exists=True, file_okay=False), default=None,
              help="start from this trained eagle head (for the same target) instead of random weights")
def eagle_cmd(noise, feature_weight, prob_weight, depth, depth_decay, init, **kw):
    """Train an EAGLE head (fc + one decoder layer) for a frozen target."""
    from .eagle import train_eagle

    extra = {"noise": noise, "feature_weight": feature_weight, "prob_weight": prob_weight, "depth": depth,
             "depth_decay": depth_decay}
    if init:
        extra["init"] = init
    train_eagle(_args(extra, **kw), log=click.echo)


@click.command("eagle3")
@_common
@click.option("--depth", default=3, show_default=True,
              help="training-time test: unroll drafting this deep on the head's own outputs")
@click.option("--depth-decay", default=0.8, show_default=True, help="loss weight of depth d is decay**(d-1)")
@click.option("--vocab", default="2048", show_default=True,
              help="drafting vocabulary: the target's N most frequent tokens (frequent_tokens.json), or 'all'")
@click.option("--feature-layers", default=None,
              help="three target layers to fuse, e.g. 1,3,4 (default: a low, a middle and a high one)")
@click.option("--init-shared", type=click.Path(exists=True, file_okay=False), default=None,
              help="start a fresh head's decoder-layer tensors from this trained eagle head where shapes agree")
@click.option("--init", "init", type=click.Path(exists=True, file_okay=False), default=None,
              help="continue from this trained eagle3 head (for the same target)")
def eagle3_cmd(depth, depth_decay, vocab, feature_layers, init_shared, init, **kw):
    """Train an EAGLE-3 head (fused features of three layers, own drafting vocabulary) for a frozen target."""
    from .eagle3 import train_eagle3

    if vocab != "all" and not vocab.isdigit():
        raise click.BadParameter(f"{vocab!r} is neither a token count nor 'all'", param_hint="--vocab")
    try:
        layers = [int(v) for v in feature_layers.split(",")] if feature_layers else None
    except ValueError:
        raise click.BadParameter(f"three comma-separated layer numbers, got {feature_layers!r}",
                                 param_hint="--feature-layers") from None
    extra = {"depth": depth, "depth_decay": depth_decay, "vocab": vocab if vocab == "all" else int(vocab),
             "feature_layers": layers, "init_shared": init_shared}
    if init:
        extra["init"] = init
    train_eagle3(_args(extra, **kw), log=click.echo)


@click.command("mtp")
@_common
@click.option("--heads", "num_heads", default=3, show_default=True, help="number of heads (tokens drafted)")
@click.option("--layers", "num_layers", default=1, show_default=True, help="residual blocks per head")
@click.option("--share-lm-head/--own-lm-head", default=True, show_default=True,
              help="project with the target's LM head (frozen, by reference) after a learned h x h map per "
                   "head, or train an own copy of the LM head per head (+ hidden x vocab parameters each)")
@click.option("--decay", default=0.8, show_default=True, help="loss weight of head i is decay**i")
@click.option("--init", "init", type=click.Path(exists=True, file_okay=False), default=None,
              help="start from these trained MTP heads (for the same target, same shape) instead of fresh ones")
def mtp_cmd(num_heads, num_layers, share_lm_head, decay, init, **kw):
    """Train Medusa/MTP heads (head i predicts token t+2+i) for a frozen target."""
    from .mtp import train_mtp

    extra = {"num_heads": num_heads, "num_layers": num_layers, "share_lm_head": share_lm_head, "decay": decay}
    if init:
        extra["init"] = init
    train_mtp(_args(extra, **kw), log=click.echo)


def _temperatures(ctx, param, value: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of temperatures, got {value!r}") from None
    if any(v < 0 for v in values):
        raise click.BadParameter(f"temperatures must be >= 0, got {value!r}")
    return values


@click.command("continuations")
@click.option("--target", "target", default="zoo:pycode", show_default=True,
              help="the frozen target: a zoo: name or a local model directory with its tokenizer")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="directory for the chunks; rerun with the same settings to resume")
@click.option("--sequences", default=2048, show_default=True)
@click.option("--prefix-tokens", default=48, show_default=True, help="corpus window each sequence starts from")
@click.option("--new-tokens", default=208, show_default=True, help="tokens the target adds to each")
@click.option("--temperatures", default="0,1", show_default=True, callback=_temperatures,
              help="row i samples at the (i mod n)-th, seed i; 0 is greedy")
@click.option("--proposer", default="draft-model", show_default=True,
              help="drafts for the target while it continues (exact, only faster); 'none': target-only")
@click.option("-k", "--gamma", default=6, show_default=True)
@click.option("--batch-size", default=16, show_default=True, help="sequences decoded together")
@click.option("--seed", default=4242, show_default=True, help="picks the corpus windows")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="token-stream cache (default: OUT/../cache)")
def continuations_cmd(target, out, temperatures, proposer, cache_dir, **kw):
    """Self-distillation text for `train eagle|mtp --data`: corpus prefixes continued by the target itself."""
    from tokenizers import Tokenizer

    from .continuations import generate_continuations
    from .data import token_stream
    from .eagle import load_frozen_target
    from .tokenizer import EOS

    tgt = load_frozen_target(target)
    eos = Tokenizer.from_file(str(tgt.path / "tokenizer.json")).token_to_id(EOS)
    if eos is None:
        raise click.UsageError(f"--target {target}: its tokenizer has no {EOS} token to separate documents")
    cache = Path(cache_dir) if cache_dir else Path(out).resolve().parent / "cache"
    stream = token_stream("train", tgt.path, cache)
    generate_continuations(tgt, stream, eos, out, temperatures=temperatures,
                           proposer=None if proposer == "none" else proposer, log=click.echo, **kw)


def add_head_commands(group: click.Group) -> click.Group:
    group.add_command(eagle_cmd)
    group.add_command(eagle3_cmd)
    group.add_command(mtp_cmd)
    group.add_command(continuations_cmd)
    return group


if __name__ == "__main__":
    add_head_commands(click.Group("train"))()
