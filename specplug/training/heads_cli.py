"""`specplug train eagle|mtp`: train feature heads for a frozen target.

    specplug train eagle --target zoo:pycode --work-dir WORK/heads/eagle --out specplug/models/pycode-eagle
    specplug train mtp   --target zoo:pycode --work-dir WORK/heads/mtp   --out specplug/models/pycode-mtp

The bundled heads (common flags: --seq-len 512 --batch-size 8 --seed 1234 --eval-windows 16):

    eagle  --tokens 262144 --steps 300 --lr 1e-3 --warmup 20                            (27 min)
    then   --tokens 1048576 --steps 900 --lr 6e-4 --warmup 20 --init <the first>          (26 min)
    then   --tokens 1048576 --steps 300 --lr 3e-4 --warmup 10 --depth 3 --init <the second> (33 min;
           started with --steps 400, lowered to 300 at step 51 to fit the session)
    mtp    --tokens 262144 --steps 120 --lr 1e-3 --warmup 20 --heads 4 --share-lm-head  (24 min)

The target's features for ``--tokens`` corpus positions are computed once into WORK/heads/features/ and
shared by both commands. Rerunning a command with the same --work-dir resumes from its last checkpoint.

Attach to a click group with ``group.add_command(eagle_cmd)`` / ``group.add_command(mtp_cmd)`` (or
``add_head_commands(group)``).
"""
from __future__ import annotations

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


@click.command("mtp")
@_common
@click.option("--heads", "num_heads", default=3, show_default=True, help="number of heads (tokens drafted)")
@click.option("--layers", "num_layers", default=1, show_default=True, help="residual blocks per head")
@click.option("--share-lm-head/--own-lm-head", default=True, show_default=True,
              help="project with the target's LM head (frozen, by reference) after a learned h x h map per "
                   "head, or train an own copy of the LM head per head (+ hidden x vocab parameters each)")
@click.option("--decay", default=0.8, show_default=True, help="loss weight of head i is decay**i")
def mtp_cmd(num_heads, num_layers, share_lm_head, decay, **kw):
    """Train Medusa/MTP heads (head i predicts token t+2+i) for a frozen target."""
    from .mtp import train_mtp

    train_mtp(_args({"num_heads": num_heads, "num_layers": num_layers, "share_lm_head": share_lm_head,
                     "decay": decay}, **kw), log=click.echo)


def add_head_commands(group: click.Group) -> click.Group:
    group.add_command(eagle_cmd)
    group.add_command(mtp_cmd)
    return group


if __name__ == "__main__":
    add_head_commands(click.Group("train"))()
