"""EAGLE-3 heads in the `speculators` format, the one vLLM serves: export a specplug ``eagle3`` head, import one.

A speculators-format directory holds ``config.json`` (an ``Eagle3SpeculatorConfig``: the decoder layer's
``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``, the verifier's layers
``eagle_aux_hidden_state_layer_ids`` and the ``speculators_config`` naming the verifier) and
``model.safetensors`` with ``fc``, ``layers.0.*`` (the published EAGLE-3 heads for Llama verifiers call it
``midlayer.*``), ``norm``, ``lm_head`` over the drafting vocabulary, ``d2t`` (draft id + d2t[id] = target id),
``t2d`` (which target ids are drafted) and, optionally, ``embed_tokens`` (the verifier's).

Export builds the directory with speculators' own classes (``Eagle3SpeculatorConfig``, ``Eagle3DraftModel``
and its ``save_pretrained``), so the files are what speculators itself writes. Layer numbers are the same in
both: specplug's ``"layer:N"`` (HF ``hidden_states[N]``, the output of layer N) is the input vLLM captures at
its layer N, for 0 < N < num_layers; other numbers do not mean the same in vLLM and are refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

EXTRA = 'pip install "specplug[vllm]"'
_UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")  # speculators' EAGLE-3 variants this head lacks


class SpeculatorsMissingError(ImportError):
    """The `speculators` library (the optional ``vllm`` extra) is not installed."""


def require_speculators():
    """The speculators package, or one clear error naming the extra that installs it."""
    try:
        import speculators  # noqa: F401
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: F401
    except ImportError as exc:
        raise SpeculatorsMissingError(f"the speculators format needs the `speculators` library, which is not "
                                      f"installed ({exc}); install the extra: {EXTRA}") from exc
    return speculators


def is_speculators_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a speculators-format config (``speculators_model_type``)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return "speculators_model_type" in json.loads(config.read_text())
    except ValueError:
        return False


def _check_vllm_layers(layers, num_layers: int, who: str) -> None:
    if len(set(layers)) != 3 or not all(0 < i < num_layers for i in layers):
        raise ValueError(f"{who}: feature layers {list(layers)} cannot be served by vLLM, which reads three distinct "
                         f"layers 1..{num_layers - 1} of a {num_layers}-layer target")


def export_eagle3(head_dir: str | os.PathLike, out: str | os.PathLike, *, target=None,
                  speculative_tokens: int = 3, dtype: torch.dtype = torch.float16) -> Path:
    """Write the specplug ``eagle3`` head at ``head_dir`` (a directory or ``zoo:`` name) to ``out`` in the
    speculators format. ``target``: the Target it was trained for (default: the one its config names, which
    must then be a ``zoo:`` name or a local directory); its embedding is written as ``embed_tokens``."""
    require_speculators()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from . import heads, zoo
    from .feature_heads import llama_config
    from .target import Target

    path = heads.resolve_head_path(head_dir)
    config = heads.read_head_config(path)
    if config.get("specplug_head") != "eagle3":
        raise ValueError(f"export: {path} holds a {config.get('specplug_head')!r} head; the speculators format (the "
                         "one vLLM serves) takes eagle3 heads — train one with `specplug train eagle3`")
    if target is None:
        target = Target.from_pretrained(config["target"]["name"], matmul_dtype=None)
    _, state = heads.load_head(path, "eagle3", target)
    cfg = config["head"]
    top = target.model.config.num_hidden_layers
    _check_vllm_layers(cfg["feature_layers"], top, f"export {path}")
    layer_config = llama_config(cfg)
    layer_config.vocab_size = target.vocab_size
    layer_config.architectures = ["LlamaForCausalLM"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the target's special tokens, not Llama's defaults
        setattr(layer_config, key, getattr(target.model.config, key, None))
    layer_config._attn_implementation = "sdpa"  # speculators' default (flex attention) is for training
    verifier_path = str(zoo.resolve(target.name) if zoo.is_zoo_name(target.name) else (target.path or target.name))
    spec_config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=int(cfg["draft_vocab_size"]),
        norm_before_residual=bool(cfg.get("norm_before_residual", True)),
        eagle_aux_hidden_state_layer_ids=list(cfg["feature_layers"]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(verifier_path)))
    model = Eagle3DraftModel(spec_config)
    weights = {_speculators_name(k): v for k, v in state.items() if k != "vocab_ids"}
    ids = state["vocab_ids"].long()
    if ids.numel() != target.vocab_size:
        weights["d2t"] = ids - torch.arange(ids.numel())
        weights["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    weights["embed_tokens.weight"] = target.embedding.weight.detach().cpu()
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in weights.items()}, strict=False)
    left = [k for k in missing if not k.startswith("verifier_")]
    if left or unexpected:
        raise ValueError(f"export {path}: weights do not fit speculators' Eagle3DraftModel "
                         f"(missing {left}, unexpected {unexpected})")
    model.to(dtype).save_pretrained(str(out))
    return Path(out)


def _speculators_name(name: str) -> str:
    return "layers.0." + name[len("layer."):] if name.startswith("layer.") else name


def _specplug_name(name: str) -> str | None:
    for prefix in ("layers.0.", "midlayer."):
        if name.startswith(prefix):
            return "layer." + name[len(prefix):]
    return name if name in ("fc.weight", "norm.weight", "lm_head.weight") else None


def load_eagle3(path: str | os.PathLike, target):
    """An :class:`specplug.proposers.eagle3.Eagle3Head` from a speculators-format EAGLE-3 directory, checked
    against ``target`` (hidden size, vocabulary, layers, embedding)."""
    require_speculators()
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from specplug.proposers.eagle3 import Eagle3Head, eagle3_config_for

    path = Path(path)
    spec = Eagle3SpeculatorConfig.from_pretrained(str(path))
    where = f"eagle3: speculators head {path}"
    layer = spec.transformer_layer_config
    if layer.model_type != "llama" or layer.num_hidden_layers != 1:
        raise ValueError(f"{where}: a {layer.num_hidden_layers}-layer {layer.model_type!r} decoder; specplug reads "
                         "one Llama decoder layer (the layout published for Llama verifiers)")
    used = [flag for flag in _UNSUPPORTED if getattr(spec, flag, False)]
    if used or (spec.target_hidden_size not in (None, layer.hidden_size)):
        raise ValueError(f"{where}: uses {used or ['target_hidden_size']}, which specplug's eagle3 head lacks")
    if layer.hidden_size != target.hidden_size or layer.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: hidden {layer.hidden_size}, vocab {layer.vocab_size} does not fit target "
                         f"{target.name!r} (hidden {target.hidden_size}, vocab {target.vocab_size})")
    top = target.model.config.num_hidden_layers
    layers = spec.eagle_aux_hidden_state_layer_ids or [2, top // 2, top - 3]  # vLLM's default
    _check_vllm_layers(layers, top, where)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{where}: no *.safetensors (heads are read from safetensors only)")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    head = Eagle3Head(eagle3_config_for(layer, feature_layers=layers, draft_vocab_size=spec.draft_vocab_size,
                                        norm_before_residual=spec.norm_before_residual, num_layers=top))
    state = {_specplug_name(k): v for k, v in weights.items() if _specplug_name(k)}
    size = spec.draft_vocab_size
    d2t = weights.get("d2t")
    state["vocab_ids"] = torch.arange(size) + (d2t.long() if d2t is not None else 0)
    ids = state["vocab_ids"]
    if ids.numel() != size or ids.min() < 0 or ids.max() >= target.vocab_size or ids.unique().numel() != size:
        raise ValueError(f"{where}: d2t does not map {size} draft ids to distinct target ids")
    _check_embedding(weights.get("embed_tokens.weight"), target, where)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not fit an EAGLE-3 head (missing {missing}, unexpected {unexpected})")
    if not torch.equal(ids, ids.sort().values):  # specplug keeps the drafting vocabulary sorted
        order = ids.argsort()
        with torch.no_grad():
            head.vocab_ids.copy_(ids[order])
            head.lm_head.weight.copy_(head.lm_head.weight[order])
    return head


def _check_embedding(embed: torch.Tensor | None, target, where: str) -> None:
    """specplug embeds drafted tokens with the target's own table: a head shipping another one would differ."""
    if embed is None:
        return
    mine = target.embedding.weight.detach().float().cpu()
    if embed.shape != mine.shape or (embed.float() - mine).abs().max() > 1e-2 * mine.abs().max():
        raise ValueError(f"{where}: its embed_tokens differ from target {target.name!r}'s embedding; specplug "
                         "embeds drafted tokens with the target's")
