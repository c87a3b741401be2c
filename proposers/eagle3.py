"""``eagle3``: an EAGLE-3 head (Li et al. 2025) drafts from fused features of three target layers.

The architecture is the one vLLM serves for speculators-format ``eagle3`` heads (``Eagle3LlamaForCausalLM``),
so a head exported with ``specplug export`` computes there what it computes here. Entry i of the head's
sequence, at rotary position i:

    g[i]   = fc([f_a[i] ; f_b[i] ; f_c[i]])        the target's layers a < b < c at position i (3h -> h)
    x      = [input_layernorm(embedding(x[i+1])) ; hidden_norm(g[i])]          (2h: attention reads both)
    r      = hidden_norm(g[i]) if norm_before_residual else g[i]
    u      = r + o_proj(attention(x));   o[i] = u + mlp(post_attention_layernorm(u))
    logits = lm_head(norm(o[i]))   over the drafting vocabulary (ids ``vocab_ids``: vLLM's d2t map)

Drafting feeds o (not fc of anything) back as the next entry's g: the head continues on its own outputs, as
its training-time test taught it. q = ``processed_probs(logits)`` over the drafting vocabulary, zero elsewhere
(see :mod:`specplug.drafting_vocab`); the token is drawn from q with ``seq.rng``, so the verifier stays exact.

Feature layers are HF ``hidden_states`` indices (``"layer:N"``: the output of layer N), which are vLLM's
``eagle_aux_hidden_state_layer_ids`` for 0 < N < num_layers (vLLM captures the input of layer N).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specplug import draft_stop, heads
from specplug.drafting_vocab import Projection, read_ranks, vocab_subset
from specplug.drafting_products import head_weights, linear_shapes
from specplug.feature_heads import (FeatureHeadProposer, attention_mask, drafting_weights, frozen_for_drafting,
                                    head_config_for, llama_config, reset_head_parameters)
from specplug.lean_llama import LeanLayer, Norm, Product, RopeTable
from specplug.plugins.hookspecs import hookimpl
from specplug.types import SequenceState

KIND = "eagle3"
DEFAULT_HEADS = {"pycode": "pycode-eagle3"}  # zoo target -> its bundled head (specplug/models/)
DEFAULT_VOCAB = 2048  # drafting vocabulary of a new head where the target ranks its tokens (else all)


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """A low, a middle and a high layer (zoo target, 6 layers: 1, 3, 4), all below the last for vLLM."""
    if num_layers >= 4:
        high = num_layers - 2 if num_layers >= 6 else num_layers - 1
        return 1, (high + 2) // 2, high
    return 0, num_layers // 2, num_layers  # tiny test targets: whatever three there are


def eagle3_config_for(target_config, *, feature_layers: Sequence[int] | None = None, draft_vocab_size: int,
                      norm_before_residual: bool = True, num_layers: int | None = None) -> dict:
    """A head's config: the target's layer shape, its three feature layers (of ``num_layers``, default the
    config's), its drafting vocabulary size."""
    top = num_layers or target_config.num_hidden_layers
    layers = list(feature_layers or default_feature_layers(top))
    if len(layers) != 3 or not all(0 <= i <= top for i in layers):
        raise ValueError(f"eagle3: feature_layers must be three layer numbers within 0..{top}, got {layers}")
    return {**head_config_for(target_config), "feature_layers": layers, "draft_vocab_size": int(draft_vocab_size),
            "norm_before_residual": bool(norm_before_residual)}


class Eagle3Head(nn.Module):
    """fc over three target layers (3h -> h), one decoder layer attending over [embedding ; hidden] (2h), a
    final norm and an LM head over the drafting vocabulary (``vocab_ids``, sorted target ids). Parameter
    names follow speculators' layout (``layer`` is its ``layers.0``)."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        self.config = dict(config)
        llama = llama_config(self.config)
        h, d = llama.hidden_size, llama.head_dim
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        attn = self.layer.self_attn
        attn.q_proj = nn.Linear(2 * h, llama.num_attention_heads * d, bias=False)
        attn.k_proj = nn.Linear(2 * h, llama.num_key_value_heads * d, bias=False)
        attn.v_proj = nn.Linear(2 * h, llama.num_key_value_heads * d, bias=False)
        self.layer.hidden_norm = LlamaRMSNorm(h, eps=llama.rms_norm_eps)
        self.norm = LlamaRMSNorm(h, eps=llama.rms_norm_eps)
        size = int(self.config["draft_vocab_size"])
        self.lm_head = nn.Linear(h, size, bias=False)
        self.register_buffer("vocab_ids", torch.arange(size, dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(llama)
        self.norm_before_residual = bool(self.config.get("norm_before_residual", True))
        self.heads, self.kv_heads, self.head_dim = llama.num_attention_heads, llama.num_key_value_heads, d

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f"layer:{i}" for i in self.config["feature_layers"])

    @classmethod
    def for_target(cls, target, *, vocab: torch.Tensor | None = None, feature_layers: Sequence[int] | None = None,
                   seed: int = 0, std: float = 0.02) -> "Eagle3Head":
        """A fresh head for ``target``: random layer weights, the target's LM-head rows for ``vocab`` (sorted ids;
        None: all) and its final norm, so that before training norm + lm_head is the target's own projection."""
        model = getattr(target, "model", target)
        size = model.config.vocab_size if vocab is None else int(vocab.numel())
        head = cls(eagle3_config_for(model.config, feature_layers=feature_layers, draft_vocab_size=size))
        head.reset_parameters(seed=seed, std=std)
        with torch.no_grad():
            if vocab is not None:
                head.vocab_ids.copy_(vocab)
            rows = model.get_output_embeddings().weight.detach()
            head.lm_head.weight.copy_(rows[head.vocab_ids.to(rows.device)].to(head.lm_head.weight))
            final = getattr(getattr(model, "model", None), "norm", None)
            if final is not None:
                head.norm.weight.copy_(final.weight.detach().to(head.norm.weight))
        return head

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        reset_head_parameters(self, seed, std)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., 3h] (the three layers' features, concatenated in config order) -> [..., h]."""
        return self.fc(features)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The drafting logits [..., draft_vocab_size] of the layer's output."""
        return self.lm_head(self.norm(out))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor, cache=None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (fused features or the previous output), embeds [B, T, h]; position_ids [B, T] -> the layer's
        output [B, T, h] (before ``norm``). ``cache``: a :class:`specplug.feature_heads.KVCache`; ``mask`` (bool,
        [T, cached + T], True = attend): which keys each entry sees, default causal."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer, attn = self.layer, self.layer.self_attn
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        past = cache.length if cache is not None else 0
        if cache is not None:
            k, v = cache.update(k, v)
        mask = attention_mask(t, past, mask, x.device)
        out = F.scaled_dot_product_attention(q, k, v.to(q.dtype), attn_mask=mask, is_causal=mask is None and t > 1,
                                             scale=attn.scaling, enable_gqa=self.heads != self.kv_heads)
        u = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return u + layer.mlp(layer.post_attention_layernorm(u))


class Eagle3Layer(LeanLayer):
    """The head's decoder layer on :mod:`specplug.lean_llama`'s products: its two input norms run before the
    fused q/k/v product over [embedding ; hidden], and the residual is the (normed) hidden."""

    def __init__(self, layer: nn.Module, norm_before_residual: bool, int8: bool = False):
        super().__init__(layer, int8=int8)
        self.norm_embeds, self.norm_hidden = Norm(layer.input_layernorm), Norm(layer.hidden_norm)
        self.norm_in = _identity  # the q/k/v product reads the two halves normed already
        self.norm_before_residual = norm_before_residual

    def step(self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
             keep: int = 0) -> torch.Tensor:
        """hidden, embeds [T, h] at the positions of cos/sin after ``cache.length`` cached entries -> outputs
        [T, h] (only the last ``keep`` rows' where keep > 0; every row's keys and values are cached)."""
        normed = self.norm_hidden(hidden)
        residual = normed if self.norm_before_residual else hidden
        T, start = hidden.shape[0], cache.length
        q, k, v = self._qkv(torch.cat([self.norm_embeds(embeds), normed], dim=-1), cos, sin)
        cache.append(k.transpose(0, 1), v.transpose(0, 1))
        if 0 < keep < T:
            residual, q, start, T = residual[-keep:], q[-keep:], start + T - keep, keep
        out = self._attend_spans(q * self.scaling, [(cache.k, cache.v, start, T)])
        return self._finish(residual, out.reshape(T, -1))

    def step_rows(self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  caches: list, counts: list[int]) -> torch.Tensor:
        """:meth:`step` for several sequences at once (``counts[r]`` rows of hidden/embeds for cache r, in
        order): every row's output [N, h], each row as :meth:`step` would give it."""
        normed = self.norm_hidden(hidden)
        residual = normed if self.norm_before_residual else hidden
        q, k, v = self._qkv(torch.cat([self.norm_embeds(embeds), normed], dim=-1), cos, sin)
        out = self._attend_rows(q, k, v, caches, counts)
        return self._finish(residual, out.reshape(hidden.shape[0], -1))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Eagle3Proposer(FeatureHeadProposer):
    # the conformance kit's tiny target has no trained head: check the mechanism with a random one
    conformance_options = {"head": "random"}
    name = KIND

    def __init__(self, target=None, head: str | os.PathLike | Eagle3Head | None = None, seed: int = 0,
                 init_std: float = 0.02, prompt_features: bool = True, weights: str | None = None,
                 stop_below: float | str | None = None, vocab: int | str | None = None,
                 feature_layers: Sequence[int] | None = None):
        """``head``: a specplug ``eagle3`` head directory, a speculators-format EAGLE-3 directory (see
        :mod:`specplug.speculators_format`), a ``zoo:`` head name, an :class:`Eagle3Head`, or ``"random"`` (for
        tests: ``seed``/``init_std`` set it, ``vocab`` its drafting vocabulary — a count of the target's most
        frequent tokens, or ``"all"`` — and ``feature_layers`` its three layers). Default: the head bundled for a
        zoo target or found beside a local target directory (``<target>-eagle3``).
        The drafting vocabulary is the head's own (its LM head has a row per drafted token).
        ``prompt_features``, ``weights`` and ``stop_below``: as for ``eagle``."""
        if target is None:
            raise TypeError("eagle3 needs target= (the Target whose features it reads)")
        self.target, self.prompt_features, self.head_path = target, bool(prompt_features), None
        module, recommended = self._load(target, head, seed, init_std, vocab, feature_layers)
        heads.check_fits(module, target, KIND)
        top = target.model.config.num_hidden_layers
        if not all(0 <= i <= top for i in module.config["feature_layers"]):
            raise ValueError(f"eagle3: head reads layers {module.config['feature_layers']}, but target "
                             f"{target.name!r} has {top}")
        self.needs_features = module.feature_names
        if weights is None:  # int8 where it drafts faster here (the head's recommendation was measured elsewhere)
            weights = head_weights(linear_shapes(module), target, recommended.get("weights"))
        self.weights = drafting_weights(weights, target, KIND)
        self.stop_below = draft_stop.threshold(stop_below, recommended.get("stop_below"), KIND)
        self.vocab_size = target.vocab_size
        self.head = frozen_for_drafting(module, target, self.weights)
        int8 = self.weights == "int8"
        self.layer = Eagle3Layer(self.head.layer, self.head.norm_before_residual, int8=int8)
        self.fc = Product(self.head.fc.weight, int8=int8)
        self.final_norm = Norm(self.head.norm)
        ids = self.head.vocab_ids
        subset = None if ids.numel() == target.vocab_size and bool((ids == torch.arange(ids.numel(), device=ids.device)).all()) else ids
        lm_head = Product(self.head.lm_head.weight, int8=int8)
        self.projection = Projection(subset, lambda out: lm_head(self.final_norm(out)),
                                     lm_head.nbytes())
        self.rope = RopeTable(self.head.rotary, target.device, target.dtype)
        embedding = target.embedding
        self.embedding_table = embedding.weight if type(embedding) is nn.Embedding else None

    def _load(self, target, head, seed, init_std, vocab, feature_layers) -> tuple[Eagle3Head, dict]:
        """The head module and its drafting recommendations (``drafting`` in its config.json)."""
        head = heads.given_or_default(head, target, KIND, DEFAULT_HEADS)
        if isinstance(head, Eagle3Head):
            return head, {}
        if isinstance(head, str) and head == "random":
            ranks, ranks_file = read_ranks(getattr(target, "path", None))
            if vocab is None:
                vocab = DEFAULT_VOCAB if ranks is not None and len(ranks["tokens"]) > DEFAULT_VOCAB else "all"
            subset = vocab_subset(vocab, ranks, ranks_file, target.vocab_size, KIND)
            return Eagle3Head.for_target(target, vocab=subset, feature_layers=feature_layers, seed=int(seed),
                                         std=float(init_std)), {}
        self.head_path = heads.resolve_head_path(head)
        from specplug import speculators_format

        if speculators_format.is_speculators_dir(self.head_path):
            return speculators_format.load_eagle3(self.head_path, target), {}
        config, state = heads.load_head(self.head_path, KIND, target)
        module = Eagle3Head(config["head"])
        module.load_state_dict(state)
        return module, config.get("drafting", {})

    # --- FeatureHeadProposer's hooks -------------------------------------------------------------
    def _new_cache(self):
        return self.layer.new_cache()

    def _verified(self, features: dict) -> torch.Tensor | None:
        parts = [features.get(name) for name in self.needs_features]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=-1)

    def _catch_up(self, features, embeds, start, cache):
        cos, sin = self.rope.get(start, features.shape[0])
        return self.layer.step(self.fc(features), embeds, cos, sin, cache, keep=1)[-1]

    def _draft_step(self, out, embeds, start, cache):
        cos, sin = self.rope.get(start, 1)
        return self.layer.step(out, embeds, cos, sin, cache)[-1]

    def _rows_step(self, hidden, embeds, starts, caches, first):
        counts = [h.shape[0] for h in hidden]
        x = torch.cat(hidden)
        cos, sin = self.rope.rows(starts, counts)
        return self.layer.step_rows(self.fc(x) if first else x, torch.cat(embeds), cos, sin, caches, counts)

    def _projection_for(self, seq: SequenceState) -> Projection:
        return self.projection

    def memory_bytes(self) -> int:
        products = [*self.layer.products(), self.fc]
        return (sum(p.nbytes() for p in products) + self.projection.copied_bytes
                + sum(p.numel() * p.element_size() for p in self.head.parameters()))


@hookimpl
def register_proposers(register):
    register(KIND, Eagle3Proposer, "EAGLE-3 head: fused features of 3 target layers -> one decoder layer over "
                                   "[embedding; hidden] -> own LM head over a drafting vocabulary; q = its softmax.")
