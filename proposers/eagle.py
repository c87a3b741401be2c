"""``eagle``: an EAGLE-1-style feature head drafts from the target's own hidden features.

Entry i of the head's sequence is ``fc([embedding(x[i+1]) ; f[i]])`` where f[i] is the target's feature at
position i (its final-normed last hidden state, exactly what the LM head reads) and x[i+1] the token that
follows; one Llama decoder layer (own KV cache, rotary positions i) turns it into f^[i+1], a prediction of the
target's feature at i+1, and the target's LM head (shared by reference, frozen) turns that into logits for
x[i+2]. q = ``processed_probs(logits, seq.sampling)``; the draft token is sampled from q with ``seq.rng``.
Drafting k tokens feeds the head its own predicted features k-1 times.

Why the post-norm feature: ``lm_head(f) == logits`` holds for the target's "last" feature, so the head
regresses exactly what the LM head consumes, at a fixed scale (RMS-normalised) that suits a smooth-L1 loss;
the target's final norm is already inside f and is therefore not applied again (EAGLE-1 does the same).

The head's cache and the verified features it is built from are kept as :mod:`specplug.feature_heads`
describes (shared with ``eagle3``).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import nn

from specplug import draft_stop, heads, int8_products, zoo
from specplug.drafting_vocab import Projection, drafting_subsets, projection_onto, same_subset
from specplug.drafting_products import head_weights, linear_shapes
from specplug.feature_heads import (KVCache, FeatureHeadProposer, attention_mask, frozen_for_drafting,
                                    head_config_for, llama_config, reset_head_parameters)
from specplug.hf_compat import cache_kwargs
from specplug.lean_llama import LayerCache, LeanLayer, Product, RopeTable
from specplug.plugins.hookspecs import hookimpl
from specplug.tree_drafting import tree_budget, tree_width_checked
from specplug.types import SequenceState

KIND = "eagle"


class EagleHead(nn.Module):
    """fc(2h -> h) + one Llama decoder layer. Reads [embedding(token t+1) ; feature t], predicts feature t+1."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = dict(config)
        llama = llama_config(self.config)
        h = llama.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(llama)

    @classmethod
    def for_target(cls, target_config, *, seed: int = 0, std: float = 0.02) -> "EagleHead":
        head = cls(head_config_for(target_config))
        head.reset_parameters(seed=seed, std=std)
        return head

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        reset_head_parameters(self, seed, std)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """features, embeds [B, T, h]; position_ids [B, T] -> predicted next features [B, T, h]. ``mask``
        (bool, [T, cached + T], True = attend): which keys each entry sees; default causal."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos_sin = self.rotary(x, position_ids)
        mask = attention_mask(x.shape[1], cache.length if cache is not None else 0, mask, x.device)
        return self.layer(x, attention_mask=mask, position_ids=position_ids, **cache_kwargs(cache),
                          use_cache=cache is not None, position_embeddings=cos_sin)


class EagleProposer(FeatureHeadProposer):
    # the conformance kit's tiny target has no trained head: check the mechanism with a random one
    conformance_options = {"head": "random"}
    name = KIND
    needs_features = ("last",)

    def __init__(self, target=None, head: str | os.PathLike | EagleHead | None = None, seed: int = 0,
                 init_std: float = 0.02, prompt_features: bool = True,
                 vocab: int | Sequence[int] | str | None = None, weights: str | None = None,
                 stop_below: float | str | None = None, sampled_vocab: int | Sequence[int] | str | None = None,
                 tree: int = 0, tree_width: int = 4):
        """``head``: a head directory, a ``zoo:`` head name, an :class:`EagleHead`, or ``"random"`` (a
        randomly initialised head, for tests; ``seed``/``init_std`` set it). Default: the head bundled for a
        zoo target or found beside a local target directory (``<target>-eagle``).
        ``prompt_features``: start from the prompt's features in ``begin``: those the decode loop's prefill
        hands over (``seq.prompt_features``), else one extra target forward; False starts drafting from the
        first verified step.
        ``vocab``: draft only among these token ids (a list), the ``vocab`` most frequent ones (an int; needs
        ``frequent_tokens.json`` in the head's or the target's directory), or all (``"all"``); the LM head then
        projects onto those rows only (see :mod:`specplug.drafting_vocab`). None: the head's ``config.json``
        recommendation (``drafting.vocab``), else all.
        ``sampled_vocab``: the same for sequences that sample (temperature > 0); None: the head's
        recommendation (``drafting.sampled_vocab``), else as ``vocab`` (see
        :func:`specplug.drafting_vocab.sampled_or_greedy`; zoo head, T = 1, γ = 6: 3.39 tokens per call over
        2,048 tokens, 4.30 over all 8,192).
        ``weights``: how the head multiplies while drafting: ``"int8"`` (weight-only int8 copies of its
        products, see :mod:`specplug.int8_products`; a subset's LM-head rows too), ``"target"`` (in the
        target's product dtype, bf16 for the zoo target, as the head was trained) or ``"float32"``. None: int8
        where torch has the kernel for the device and int8 drafts faster on this machine (timed once,
        :func:`specplug.drafting_products.drafting_weights`; the head's ``drafting.weights`` recommendation, measured
        on another machine, is where the probe starts), else the recommendation if not int8, else ``"target"``.
        ``stop_below``: end a draft after a token the head gives less than this probability (see
        :mod:`specplug.draft_stop`). None: the head's recommendation (``drafting.stop_below``), else off.
        ``tree``: a node budget: draft an EAGLE-2-style dynamic tree of at most this many nodes, ``tree_width``
        children per expanded node and nodes expanded per level (see
        :func:`specplug.tree_drafting.grow_tree`; ``stop_below`` does not apply); 0 drafts the chain."""
        if target is None:
            raise TypeError("eagle needs target= (the Target whose features it reads)")
        self.tree = tree_budget(tree, KIND)
        self.tree_width = tree_width_checked(tree_width, KIND)
        self.target = target
        self.prompt_features = bool(prompt_features)
        self.head_path = None
        head = heads.given_or_default(head, target, KIND, zoo.DEFAULT_EAGLE)
        recommended = {}  # the head's config.json may recommend drafting settings (drafting.vocab, ...)
        if isinstance(head, EagleHead):
            module = head
        elif isinstance(head, str) and head == "random":
            module = EagleHead.for_target(target.model.config, seed=int(seed), std=float(init_std))
        else:
            self.head_path = heads.resolve_head_path(head)
            config, state = heads.load_head(self.head_path, KIND, target)
            module = EagleHead(config["head"])
            module.load_state_dict(state)
            recommended = config.get("drafting", {})
        heads.check_fits(module, target, KIND)
        self.subset, self.sampled_subset = drafting_subsets(vocab, sampled_vocab, recommended, self.head_path, target,
                                                            KIND)
        if weights is None:  # int8 where it drafts faster here (the head's recommendation was measured elsewhere)
            projection = (target.vocab_size if self.subset is None else len(self.subset), target.hidden_size)
            weights = head_weights(linear_shapes(module) + [projection], target, recommended.get("weights"))
        self.weights = int8_products.checked_weights(weights, ("int8", "target", "float32"), target.device, KIND,
                                                     "target")
        self.stop_below = draft_stop.threshold(stop_below, recommended.get("stop_below"), KIND)
        self.vocab_size = target.vocab_size
        # "target": bf16 for the zoo target, as the head was trained under bf16 autocast: a drafting step reads
        # half the bytes of float32 (zoo head: 0.71 -> 0.50 ms a token)
        self.head = frozen_for_drafting(module, target, self.weights)
        int8 = self.weights == "int8"
        # drafting runs the head's layer through specplug.lean_llama: HF's per-call cost would dominate
        self.lean_layer = LeanLayer(self.head.layer, int8=int8)
        self.fc = Product(self.head.fc.weight, self.head.fc.bias, int8=int8)
        self.greedy_projection = _projection(self.subset, target, int8)
        self.sampled_projection = (self.greedy_projection if same_subset(self.subset, self.sampled_subset)
                                   else _projection(self.sampled_subset, target, int8))
        if int8 and not isinstance(head, EagleHead):  # a head loaded here is ours: its float weights can go
            heads.release_float_weights(self.head)
        self.rope = RopeTable(self.head.rotary, target.device, target.dtype)
        # a drafted token's embedding as a row of the table (~1 µs) rather than a module call on a new tensor
        # (~7 µs a step); only for a plain nn.Embedding, whose forward is exactly that lookup
        embedding = target.embedding
        self.embedding_table = embedding.weight if type(embedding) is nn.Embedding else None

    # --- FeatureHeadProposer's hooks -------------------------------------------------------------
    def _new_cache(self) -> LayerCache:
        return self.lean_layer.new_cache()

    def _verified(self, features: dict) -> torch.Tensor | None:
        return features.get("last")

    def _catch_up(self, features, embeds, start, cache):
        return self._step(features, embeds, start, cache)

    def _draft_step(self, out, embeds, start, cache):
        return self._step(out, embeds, start, cache)

    def _rows_step(self, hidden, embeds, starts, caches, first):
        counts = [h.shape[0] for h in hidden]
        x = self.fc(torch.cat([torch.cat(embeds), torch.cat(hidden)], dim=-1))
        cos, sin = self.rope.rows(starts, counts)
        return self.lean_layer.rows(x, cos, sin, caches, counts)

    def _projection_for(self, seq: SequenceState) -> Projection:
        return self.greedy_projection if seq.sampling.greedy else self.sampled_projection

    def _step(self, features: torch.Tensor, embeds: torch.Tensor, start: int, cache: LayerCache) -> torch.Tensor:
        """The head's forward for one sequence: features, embeds [T, h] at positions start.. -> f^ [h] of the
        last (the others only add their keys and values to the cache)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rope.get(start, x.shape[0])
        return self.lean_layer(x, cos, sin, cache, keep=1)[-1]

    def _tree_step(self, outs, embeds, positions, cache, visible):
        x = self.fc(torch.cat([embeds, outs], dim=-1))
        at = torch.tensor(positions, device=x.device)
        self.rope.get(int(at.max()), 1)  # make sure the table reaches the deepest node
        return self.lean_layer(x, self.rope.cos[at], self.rope.signed_sin[at], cache, visible=visible)

    def memory_bytes(self) -> int:
        products = [*self.lean_layer.products(), self.fc]
        projections = {id(p): p for p in (self.greedy_projection, self.sampled_projection)}.values()
        return (sum(p.nbytes() for p in products) + sum(p.copied_bytes for p in projections)
                + sum(p.numel() * p.element_size() for p in self.head.parameters()))


def _projection(subset: torch.Tensor | None, target, int8: bool) -> Projection:
    """The target's LM head for drafting: over a subset (a copy of its rows), or all of it (shared by reference,
    or one int8 copy)."""
    return projection_onto(target.lm_head.weight, subset, int8, whole=target.head_product)


@hookimpl
def register_proposers(register):
    register(KIND, EagleProposer,
             "EAGLE-style head: [embedding; target feature] -> one decoder layer -> target LM head; q = its softmax.")
