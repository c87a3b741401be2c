"""``mtp``: Medusa/MTP-style heads on the target's last hidden state.

Let t be the last verified position (its LM-head token is the token the step just emitted, at t+1). Head i
(i = 0..n-1) reads the target's feature f[t] (final-normed last hidden state) and predicts the token at
t+2+i: ``logits_i = proj_i(block_i(f[t]))`` where block_i is a residual block ``x + SiLU(W x + b)`` (W, b
zero-initialised, so the block starts as the identity) and proj_i an output projection initialised from the
target's LM head — or, with ``share_lm_head``, ``lm_head(A_i x)``: the target's LM head itself (by reference,
frozen) after a learned h x h map A_i initialised to the identity (1 MB per head in fp16 instead of ~8.5 MB for
an own 8192 x 512 projection; A_i lets the head reach any point of the LM head's input space, which a residual
SiLU block alone cannot: SiLU >= -0.28 bounds how far it can move a coordinate down). q_i = processed softmax of head i and
draft token i is sampled from q_i with ``seq.rng`` (independently of the earlier drafts: q_i is exactly the
distribution it was drawn from, which is all the verifier needs). At most n tokens are drafted per step.

The prompt's f[t] comes from the decode loop's prefill (which computes the features a proposer declares), else
from one extra target forward in ``begin`` (``prompt_features=False`` skips that: the first step then drafts
nothing, and the proposal depends on the history, not only on the sequence).

Drafting runs the heads' products directly (no module calls), in int8 by default where torch has the kernel
and it is the faster form on the machine (see :mod:`specplug.drafting_products`), and projects onto a drafting
vocabulary (see :mod:`specplug.drafting_vocab`): neither touches exactness, since each token is drawn from the q
reported.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specplug import heads, int8_products, zoo
from specplug.drafting_vocab import drafting_subsets, full_q, projection_onto, same_subset
from specplug.drafting_products import drafting_weights, linear_shapes
from specplug.lean_llama import Product
from specplug.plugins.hookspecs import hookimpl
from specplug.sampling import argmax_ids, processed_probs, sample_rows
from specplug.tree_drafting import best_first, node_budget, point_mass_tree, tree_budget
from specplug.types import Proposal, Proposer, SequenceState, Verdict
from specplug.verifier import TreeProposal

KIND = "mtp"


def head_config_for(target_config, *, num_heads: int = 3, num_layers: int = 1, share_lm_head: bool = False) -> dict:
    return {"hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size,
            "num_heads": int(num_heads), "num_layers": int(num_layers), "share_lm_head": bool(share_lm_head)}


class ResBlock(nn.Module):
    """x + SiLU(W x + b); zero W and b make it the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class MTPHeads(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        h, v, n = config["hidden_size"], config["vocab_size"], config["num_heads"]
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.get("num_layers", 1))]) for _ in range(n))
        share = config.get("share_lm_head")
        self.proj = None if share else nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(n))
        self.adapt = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n)) if share else None

    @property
    def num_heads(self) -> int:
        return self.config["num_heads"]

    @classmethod
    def for_target(cls, target_model, *, num_heads: int = 3, num_layers: int = 1, share_lm_head: bool = False,
                   seed: int | None = None, std: float = 0.0) -> "MTPHeads":
        """Identity blocks + projections copied from the target's LM head (the issue's initialisation);
        ``std`` > 0 instead draws the block weights at random (seeded) — random heads for tests."""
        mod = cls(head_config_for(target_model.config, num_heads=num_heads, num_layers=num_layers,
                                  share_lm_head=share_lm_head))
        mod.reset_parameters(target_model.get_output_embeddings().weight, seed=seed, std=std)
        return mod

    def reset_parameters(self, lm_head_weight: torch.Tensor, seed: int | None = None, std: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed or 0)
        with torch.no_grad():
            for block in self.blocks:
                for res in block:
                    if std > 0:
                        res.linear.weight.copy_(torch.randn(res.linear.weight.shape, generator=g) * std)
                        res.linear.bias.copy_(torch.randn(res.linear.bias.shape, generator=g) * std)
                    else:
                        res.linear.weight.zero_()
                        res.linear.bias.zero_()
            if self.proj is not None:
                for proj in self.proj:
                    proj.weight.copy_(lm_head_weight.detach().to(proj.weight.dtype))
            if self.adapt is not None:
                for adapt in self.adapt:
                    adapt.weight.copy_(torch.eye(adapt.weight.shape[0]))

    def hidden(self, features: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """features [..., h] -> per-head hidden states [..., n, h] (the first n heads)."""
        n = self.num_heads if n is None else n
        return torch.stack([self.blocks[i](features) for i in range(n)], dim=-2)

    def logits(self, features: torch.Tensor, lm_head: nn.Module | None = None, n: int | None = None) -> torch.Tensor:
        """features [..., h] -> logits [..., n, V]; ``lm_head`` is the target's (needed with share_lm_head)."""
        hid = self.hidden(features, n)
        if self.proj is None:
            if lm_head is None:
                raise ValueError("these MTP heads share the target's LM head: pass lm_head=")
            hid = torch.stack([self.adapt[i](hid[..., i, :]) for i in range(hid.shape[-2])], dim=-2)
            return lm_head(hid)
        return torch.stack([self.proj[i](hid[..., i, :]) for i in range(hid.shape[-2])], dim=-2)


@dataclass
class _State:
    feature: torch.Tensor | None = None  # the target's feature at position `at`
    at: int = -1


class MTPProposer(Proposer):
    # the conformance kit's tiny target has no trained heads: check the mechanism with random ones
    conformance_options = {"head": "random"}
    name = KIND
    needs_features = ("last",)

    def __init__(self, target=None, head: str | os.PathLike | MTPHeads | None = None, num_heads: int = 3,
                 num_layers: int = 1, share_lm_head: bool = False, seed: int = 0, init_std: float = 0.1,
                 prompt_features: bool = True, vocab: int | Sequence[int] | str | None = None,
                 sampled_vocab: int | Sequence[int] | str | None = None, weights: str | None = None,
                 tree: int = 0):
        """``head``: a heads directory, a ``zoo:`` name, an :class:`MTPHeads`, or ``"random"`` (random blocks
        with ``num_heads``/``num_layers``/``share_lm_head``, seeded; for tests). Default: the heads bundled
        for a zoo target or found beside a local target directory (``<target>-mtp``).
        ``vocab`` / ``sampled_vocab``: the drafting vocabulary for greedy / sampling sequences, as for
        ``eagle`` (token ids, a count of the most frequent, or ``"all"``); None: the heads' ``config.json``
        recommendation (``drafting.vocab`` / ``drafting.sampled_vocab``), else all.
        ``weights``: ``"int8"`` (int8 copies of every drafting product) or ``"loaded"`` (the weights as loaded,
        the target's LM head as it multiplies). None: int8 where torch has the kernel for the device and int8
        drafts faster on this machine (timed once, :func:`specplug.drafting_products.drafting_weights`; the heads'
        ``drafting.weights`` recommendation is where the probe starts), else loaded.
        ``tree``: a node budget: draft a Medusa-style tree of at most this many nodes (head i's top candidates
        at depth i + 1, see :meth:`propose_tree`); 0 drafts the chain."""
        if target is None:
            raise TypeError("mtp needs target= (the Target whose features it reads)")
        self.tree = tree_budget(tree, KIND)
        self.target = target
        self.prompt_features = bool(prompt_features)
        self.head_path = None
        head = heads.given_or_default(head, target, KIND, zoo.DEFAULT_MTP)
        recommended = {}  # the heads' config.json may recommend drafting settings (drafting.vocab, ...)
        if isinstance(head, MTPHeads):
            module = head
        elif isinstance(head, str) and head == "random":
            module = MTPHeads.for_target(target.model, num_heads=num_heads, num_layers=num_layers,
                                         share_lm_head=share_lm_head, seed=int(seed), std=float(init_std))
        else:
            self.head_path = heads.resolve_head_path(head)
            config, state = heads.load_head(self.head_path, KIND, target)
            module = MTPHeads(config["head"])
            module.load_state_dict(state)
            recommended = config.get("drafting", {})
        heads.check_fits(module, target, KIND)
        self.heads = module.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.subset, self.sampled_subset = drafting_subsets(vocab, sampled_vocab, recommended, self.head_path, target,
                                                            KIND)
        self.vocab_size = target.vocab_size
        if weights is None:  # int8 where it drafts faster here (the heads' recommendation was measured elsewhere)
            projection = (target.vocab_size if self.subset is None else len(self.subset), target.hidden_size)
            weights = drafting_weights(linear_shapes(module) + [projection], target.device, target.dtype, "loaded",
                                       recommended.get("weights"))
        self.weights = int8_products.checked_weights(weights, ("int8", "loaded"), target.device, KIND,
                                                     "loaded")
        int8 = self.weights == "int8"
        # the products a draft runs, called directly: a module call costs more than a one-row product
        self.blocks = [[Product(res.linear.weight, res.linear.bias, int8=int8) for res in block]
                       for block in module.blocks]
        self.adapt = None if module.adapt is None else [Product(a.weight, int8=int8) for a in module.adapt]
        self.greedy_projections = self._projections(self.subset, int8)
        self.sampled_projections = (self.greedy_projections if same_subset(self.subset, self.sampled_subset)
                                    else self._projections(self.sampled_subset, int8))
        if int8 and not isinstance(head, MTPHeads):  # heads loaded here are ours: their float weights can go
            heads.release_float_weights(self.heads)

    def _projections(self, subset: torch.Tensor | None, int8: bool) -> list:
        """One projection per head: the target's LM head (one projection shared by every head) or each head's
        own output projection, over ``subset``."""
        if self.heads.proj is None:
            shared = projection_onto(self.target.lm_head.weight, subset, int8, whole=self.target.head_product)
            return [shared] * self.heads.num_heads
        return [projection_onto(proj.weight, subset, int8) for proj in self.heads.proj]

    def _check_target(self, seq: SequenceState) -> None:
        if seq.target.model is not self.target.model:
            raise ValueError(f"mtp: this proposer was built for target {self.target.name!r}, not {seq.target.name!r}")

    def begin(self, seq: SequenceState) -> None:
        self._check_target(seq)
        st = _State()
        n = len(seq.ids)
        given = (getattr(seq, "prompt_features", None) or {}).get("last")  # if the loop prefilled with features
        if given is not None and n >= 2 and given.shape[0] == n - 1:
            st.feature, st.at = given[-1], n - 2
        elif self.prompt_features and n >= 2:
            st.feature, st.at = heads.prefix_features(seq.target, seq.ids[: n - 1])[-1], n - 2
        seq.scratch[self.name] = st

    def propose(self, seq: SequenceState, k: int) -> Proposal | TreeProposal:
        st = seq.scratch.get(self.name)
        k = min(k, self.heads.num_heads)
        # head i reads f[t], t = the position before the newest token, and predicts the token at t+2+i
        if st is None or st.feature is None or st.at != len(seq.ids) - 2 or k <= 0:
            return Proposal.empty(seq.target.device)
        budget = node_budget(self.tree, seq)
        if budget:
            return self.propose_tree(seq, k, budget)
        with torch.inference_mode():
            logits, subset = self._logits(st.feature, k, seq)
            if seq.sampling.greedy:  # q is the point mass at each argmax: no dense q to carry
                best = torch.tensor(argmax_ids(logits), dtype=torch.long, device=logits.device)
                return Proposal((best if subset is None else subset[best]).to(seq.target.device), None)
            q = processed_probs(logits, seq.sampling)  # [k, V] or [k, |subset|]: what the tokens are drawn from
            drawn = sample_rows(q, seq.rng)
            tokens = drawn if subset is None else subset[drawn]
            q = full_q(q, subset, self.vocab_size)  # zero outside the subset
        return Proposal(tokens.to(seq.target.device), q.to(seq.target.device))

    def propose_tree(self, seq: SequenceState, k: int, budget: int) -> TreeProposal:
        """A Medusa-style tree of at most ``tree`` nodes, depth <= k: the children of every node at depth i are
        head i's top candidates, and the tree keeps the nodes whose path probability (the product of the heads'
        probabilities of its candidates: the softmax under greedy decoding, the processed q when sampling) is
        highest — pruned per step, not a static shape. Candidates are deterministic: point masses (q=None),
        exact at any temperature."""
        st = seq.scratch[self.name]
        with torch.inference_mode():
            logits, subset = self._logits(st.feature, k, seq)
            probs = (torch.softmax(logits.float(), -1) if seq.sampling.greedy
                     else processed_probs(logits, seq.sampling))
            top = probs.topk(min(budget, probs.shape[-1]), dim=-1)
            ids = top.indices if subset is None else subset[top.indices]
        # children of a node at depth d: head d's candidates, whatever the path (the heads read f[t] only)
        candidates = [list(zip(row_ids, row_p, [d + 1] * len(row_ids)))
                      for d, (row_ids, row_p) in enumerate(zip(ids.tolist(), top.values.tolist()))]
        tokens, parents, _ = best_first(candidates.__getitem__, 0, budget, k)
        return point_mass_tree(tokens, parents, seq.target.device)

    def _logits(self, feature: torch.Tensor, k: int, seq: SequenceState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first k heads' logits [k, V or |subset|] from the feature, and the drafting subset (None: all)."""
        projections = self.greedy_projections if seq.sampling.greedy else self.sampled_projections
        hidden = torch.stack([self._hidden(feature, i) for i in range(k)])  # [k, h]
        if all(p is projections[0] for p in projections[:k]):  # shared LM head: one product for all heads
            logits = projections[0].product(hidden)
        else:
            logits = torch.stack([projections[i].product(hidden[i]) for i in range(k)])
        return logits, projections[0].subset

    def _hidden(self, feature: torch.Tensor, i: int) -> torch.Tensor:
        """Head i's hidden state from the feature [h]: its residual blocks, then (shared LM head) its map A_i."""
        x = feature
        for product in self.blocks[i]:
            x = x + F.silu(product(x))
        return x if self.adapt is None else self.adapt[i](x)

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        st = seq.scratch.setdefault(self.name, _State())
        feats = (verdict.features or {}).get("last")
        if feats is None:
            st.feature, st.at = None, -1
            return
        # features of [last, x1..x_accepted]; `last` sat at position len(ids) - 1 - (tokens emitted)
        first = len(seq.ids) - 1 - len(verdict.tokens)
        st.feature, st.at = feats[verdict.accepted], first + verdict.accepted

    def end(self, seq: SequenceState) -> None:
        seq.scratch.pop(self.name, None)

    def memory_bytes(self) -> int:
        products = [p for block in self.blocks for p in block] + list(self.adapt or [])
        projections = {id(p): p for p in (*self.greedy_projections, *self.sampled_projections)}.values()
        return (sum(p.nbytes() for p in products) + sum(p.copied_bytes for p in projections)
                + sum(p.numel() * p.element_size() for p in self.heads.parameters()))


@hookimpl
def register_proposers(register):
    register(KIND, MTPProposer,
             "Medusa/MTP heads on the target's last hidden state; head i drafts token t+2+i from its softmax.")
