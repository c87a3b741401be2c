"""The file format of feature heads (``eagle``, ``mtp``): safetensors weights + a ``config.json`` that records
the target the head was trained for.

A head reads the target's hidden features and (for EAGLE, and MTP heads sharing it) uses the target's own
embedding / LM head, so a head is only meaningful for the exact target it was trained against. The config
records that target's name and a *fingerprint* — a hash of the architecture fields of its config and of its
input embedding matrix — and :func:`load_head` refuses a head whose fingerprint differs from the target's,
naming both.

The embedding is hashed after rounding to bfloat16, so the same fp16/bf16 weights loaded in float32, float16
or bfloat16 give the same fingerprint. Weights stored in float32 and loaded in a half type can round a few
values differently; the config therefore also records a *probe* (256 embedding values at fixed places), and a
head is accepted when the fingerprints agree, or the architectures agree and the probes agree to 1%.

Layout of a head directory::

    config.json         {"specplug_head": "eagle"|"mtp", "format": 1, "target": {...}, "head": {...}, "training": {...},
                         "drafting": {...} (optional: the proposer's measured defaults, e.g. "vocab")}
    model.safetensors   the head's own weights (float16 by default); never a copy of the target's LM head
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch

from . import zoo

FORMAT = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# The config fields that decide whether a head fits a target (beyond the embedding itself).
_ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "head_dim", "rms_norm_eps", "tie_word_embeddings")


class HeadMismatchError(ValueError):
    """A head was loaded against a target it was not trained for."""


def _model_of(target):
    return getattr(target, "model", target)


def target_name(target) -> str:
    name = getattr(target, "name", None)
    if name:
        return str(name)
    return str(getattr(_model_of(target).config, "_name_or_path", "") or type(_model_of(target)).__name__)


def target_config_summary(target) -> dict:
    cfg = _model_of(target).config
    out = {}
    for key in _ARCH_FIELDS:
        value = getattr(cfg, key, None)
        if value is not None:
            out[key] = value
    return out


def target_fingerprint(target) -> str:
    """16 hex digits: sha256 of the target's architecture fields and its bf16-rounded input embedding."""
    model = _model_of(target)
    h = hashlib.sha256()
    h.update(json.dumps(target_config_summary(target), sort_keys=True).encode())
    weight = model.get_input_embeddings().weight.detach()
    h.update(weight.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


PROBE_SIZE = 256


def target_probe(target) -> list[float]:
    """PROBE_SIZE embedding values at evenly spaced places (a dtype-tolerant second check)."""
    weight = _model_of(target).get_input_embeddings().weight.detach().reshape(-1)
    idx = torch.linspace(0, weight.numel() - 1, PROBE_SIZE).long().to(weight.device)
    return [round(float(x), 6) for x in weight[idx].float().cpu()]


def target_record(target) -> dict:
    return {"name": target_name(target), "fingerprint": target_fingerprint(target),
            "config": target_config_summary(target), "probe": target_probe(target)}


def _same_target(record: dict, target) -> bool:
    if record.get("fingerprint") == target_fingerprint(target):
        return True
    probe = record.get("probe")
    if not probe or record.get("config") != target_config_summary(target):
        return False
    mine = torch.tensor(target_probe(target))
    theirs = torch.tensor(probe)
    return mine.shape == theirs.shape and bool((mine - theirs).abs().max() <= 1e-2 * theirs.abs().max() + 1e-8)


def save_head(out_dir: str | os.PathLike, kind: str, state_dict: Mapping[str, torch.Tensor], head_config: dict,
              target, *, dtype: torch.dtype = torch.float16, training: dict | None = None,
              drafting: dict | None = None) -> Path:
    """Write ``model.safetensors`` (``dtype``) and ``config.json`` recording ``target`` (and, if given, how
    the head drafts best, e.g. ``{"vocab": 2048}``: the proposer's defaults)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in state_dict.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"specplug_head": kind, "format": str(FORMAT)})
    config = {"specplug_head": kind, "format": FORMAT, "dtype": str(dtype).replace("torch.", ""),
              "target": target_record(target), "head": head_config, "training": training or {}}
    if drafting:
        config["drafting"] = drafting
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out


def read_head_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: not a specplug head directory (no {CONFIG_FILE})")
    config = json.loads(cfg_file.read_text())
    if "specplug_head" not in config:
        raise ValueError(f"{path}: {CONFIG_FILE} is not a specplug head config (no 'specplug_head' field)")
    return config


def check_head_target(config: dict, target, path: str | os.PathLike = "") -> None:
    """Raise :class:`HeadMismatchError` unless the head in ``config`` was trained for ``target``."""
    kind = config.get("specplug_head", "head")
    rec = config.get("target", {})
    if not _same_target(rec, target):
        want, have = rec.get("fingerprint"), target_fingerprint(target)
        where = f" at {path}" if path else ""
        raise HeadMismatchError(
            f"{kind} head{where} was trained for target {rec.get('name', '?')!r} (fingerprint {want}), "
            f"not for target {target_name(target)!r} (fingerprint {have}); a head only fits the target it was "
            f"trained against — train one with `specplug train {kind} --target {target_name(target)} --out DIR`")


def load_head(path: str | os.PathLike, kind: str, target, *, check: bool = True
              ) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of the head at ``path``; refuses a head of another kind or for another target."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_head_config(path)
    if config["specplug_head"] != kind:
        raise ValueError(f"{path} holds a {config['specplug_head']!r} head, not a {kind!r} head")
    if config.get("format", FORMAT) > FORMAT:
        raise ValueError(f"{path}: head format {config['format']} is newer than this specplug reads ({FORMAT})")
    if check:
        check_head_target(config, target, path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE} (heads are stored as safetensors only)")
    return config, load_file(str(weights))


def default_head_dir(target, kind: str, defaults: Mapping[str, str]) -> Path | None:
    """The head bundled for a zoo target (``defaults``: zoo name -> head dir), or ``<target dir>-<kind>``
    beside a local target directory; None when there is none."""
    name = target_name(target)
    if zoo.is_zoo_name(name):
        short = name[len(zoo.PREFIX):]
        if short in defaults:
            path = zoo.models_dir() / defaults[short]
            return path if (path / CONFIG_FILE).is_file() else None
        return None
    tpath = getattr(target, "path", None)
    if tpath is not None:
        beside = Path(tpath).parent / f"{Path(tpath).name}-{kind}"
        if (beside / CONFIG_FILE).is_file():
            return beside
    return None


def given_or_default(head, target, kind: str, defaults: Mapping[str, str]):
    """``head`` as given, else the head bundled for ``target`` or found beside it (:func:`default_head_dir`); a
    TypeError naming ``kind`` where there is none."""
    if head is not None:
        return head
    found = default_head_dir(target, kind, defaults)
    if found is None:
        raise TypeError(f"{kind} needs head= (a trained head directory, or 'random') for target {target.name!r}; "
                        "only bundled zoo targets have a default head")
    return found


def check_fits(module, target, kind: str) -> None:
    """A ValueError naming ``kind`` where the head's hidden size or vocabulary is not the target's."""
    hidden, vocab = module.config["hidden_size"], module.config.get("vocab_size", target.vocab_size)
    if hidden != target.hidden_size or vocab != target.vocab_size:
        raise ValueError(f"{kind}: head (hidden {hidden}, vocab {vocab}) does not fit target {target.name!r} "
                         f"(hidden {target.hidden_size}, vocab {target.vocab_size})")


def release_float_weights(module: torch.nn.Module) -> None:
    """Empty the linear layers' weights of a head its proposer loaded, once int8 copies multiply in their place."""
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight = torch.nn.Parameter(m.weight.new_empty(0), requires_grad=False)
            m.bias = None if m.bias is None else torch.nn.Parameter(m.bias.new_empty(0), requires_grad=False)


def resolve_head_path(head: str | os.PathLike) -> Path:
    """A head directory, or a ``zoo:`` name of a bundled head."""
    if isinstance(head, str) and zoo.is_zoo_name(head):
        path = zoo.models_dir() / head[len(zoo.PREFIX):]
        if not (path / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"no bundled head {head!r} in this install")
        return path
    return Path(head)


def prefix_features(target, ids, feature: str | Sequence[str] = "last") -> torch.Tensor | dict[str, torch.Tensor]:
    """The target's feature at every position of ``ids`` [n, H] (``"last"``: the final-normed last hidden
    state; ``"layer:N"``: layer N's output), or a dict of several (``feature`` a sequence of names), from one
    forward without a cache — what a feature head needs for a prompt the decode loop prefilled."""
    from .target import feature_layer

    model = _model_of(target)
    names = (feature,) if isinstance(feature, str) else tuple(feature)
    layers = {name: feature_layer(name, model.config.num_hidden_layers) for name in names}
    device = next(model.parameters()).device
    x = torch.as_tensor(list(ids), dtype=torch.long, device=device).reshape(1, -1)
    if x.shape[1] == 0:
        empty = torch.zeros(0, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype)
        out = {name: empty for name in names}
    else:
        with torch.inference_mode():
            hidden = model(input_ids=x, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states
        out = {name: hidden[i][0].clone() for name, i in layers.items()}
    return out[feature] if isinstance(feature, str) else out
