"""What the feature-head proposers (``eagle``, ``eagle3``) and their trainers share.

A feature head drafts from the target's hidden features: it keeps its own one-layer KV cache built from the
features of *verified* positions, and each ``propose`` first feeds the features the last verification
delivered (one forward), then drafts on its own outputs. :class:`FeatureHeadProposer` owns that
bookkeeping; a subclass says how its head catches up (``_catch_up``), steps (``_draft_step``) and projects
(``_projection_for``), and which verified features it keeps (``_verified``).

Cache invariant: between calls the head's cache holds only entries built from verified target features
(entries 0..fed-1); the entries a draft adds are cropped before ``propose`` returns. ``observe`` queues the
features of the newly verified positions, which the next ``propose`` feeds in one forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import draft_stop, few_rows, heads, int8_products
from .sampling import argmax_ids, draw
from .tree_drafting import GrowingTree, grow_tree, node_budget, visible_rows
from .types import Proposal, Proposer, SequenceState, Verdict
from .verifier import TreeProposal

ARCH_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "hidden_act")


def head_config_for(target_config) -> dict:
    """A head's architecture, mirrored from the target's (one layer of the same width)."""
    cfg = {k: getattr(target_config, k, None) for k in ARCH_KEYS}
    cfg["head_dim"] = cfg["head_dim"] or target_config.hidden_size // target_config.num_attention_heads
    cfg["hidden_act"] = cfg["hidden_act"] or "silu"
    return {k: v for k, v in cfg.items() if v is not None}


def llama_config(head_config: dict):
    """The one-layer ``LlamaConfig`` a head's decoder layer is built from (keys outside ARCH_KEYS ignored)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in head_config.items() if k in ARCH_KEYS}, num_hidden_layers=1,
                       attention_bias=False, mlp_bias=False, attn_implementation="sdpa")


def reset_head_parameters(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """A fresh head's weights, a pure function of ``seed``: norms 1, biases 0, the rest N(0, std²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


class KVCache:
    """A training-time head's key/value cache: ``update`` appends (HF's attention calls it too); ``crop``
    rolls back."""

    def __init__(self):
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def update(self, key, value, layer_idx=0, *args, **kwargs):
        if self.key is None:
            self.key, self.value = key, value
        else:
            self.key = torch.cat([self.key, key], dim=2)
            self.value = torch.cat([self.value, value], dim=2)
        return self.key, self.value

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def crop(self, length: int) -> None:
        if self.key is not None and length < self.length:
            self.key, self.value = self.key[:, :, :length], self.value[:, :, :length]


def attention_mask(q_len: int, past: int, mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """The [1, 1, T, past + T] bool mask (True = attend) of T new entries after ``past`` cached ones: ``mask``
    ([T, past + T]) where given, else bottom-right-aligned causal; None where plain causal attention does."""
    if mask is not None:
        return mask[None, None]
    if q_len > 1 and past > 0:
        rows = torch.arange(q_len, device=device)[:, None] + past
        return (torch.arange(past + q_len, device=device)[None, :] <= rows)[None, None]
    return None


def drafting_weights(weights: str | None, target, who: str) -> str:
    """How a head multiplies while drafting: ``weights`` checked, or (None) int8 where torch has the kernel for
    the target's device, else ``"target"`` (see :mod:`specplug.int8_products`)."""
    if weights is None:
        weights = "int8" if int8_products.available(str(target.device)) else "target"
    return int8_products.checked_weights(weights, ("int8", "target", "float32"), target.device, who, "target")


def frozen_for_drafting(module: torch.nn.Module, target, weights: str) -> torch.nn.Module:
    """``module`` on the target's device and dtype, in eval mode, without gradients; with ``weights="target"``
    its linear weights in the target's product dtype (bf16 for the zoo target, as heads are trained)."""
    module = module.to(device=target.device, dtype=target.dtype).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    if weights == "target":
        few_rows.install(module, weight_dtype=getattr(target, "matmul_dtype", None))
    return module


@dataclass
class HeadState:
    """One sequence's head state."""

    cache: object
    base: int = 0        # position of the head's first entry (0 when the prompt's features were computed)
    fed: int = 0         # positions base..fed-1 have entries in the cache (built from verified features)
    known: int = 0       # verified target features exist for positions < known (those >= fed are pending)
    pending: list = field(default_factory=list)  # feature tensors [n_i, F] for positions fed..known-1


class FeatureHeadProposer(Proposer):
    """The verified-feature bookkeeping of a feature head (see the module docstring). Subclasses set
    ``needs_features``, ``target``, ``vocab_size``, ``stop_below``, ``embedding_table`` and implement the
    four hooks."""

    target = None
    stop_below: float | None = None
    embedding_table: torch.Tensor | None = None
    tree: int = 0  # a node budget: draft trees (see _draft_tree); 0: chains
    tree_width: int = 4  # children per expanded node, and nodes expanded per level

    # --- the hooks ---------------------------------------------------------------------------------
    def _new_cache(self):
        raise NotImplementedError

    def _verified(self, features: dict) -> torch.Tensor | None:
        """The tensor [n, F] the head keeps of verified positions' target features (None: not delivered)."""
        raise NotImplementedError

    def _catch_up(self, features: torch.Tensor, embeds: torch.Tensor, start: int, cache) -> torch.Tensor:
        """Feed verified features [T, F] with the embeddings [T, h] of the tokens that follow them (positions
        start..): the head's output for the last, from which the first draft token is projected."""
        raise NotImplementedError

    def _draft_step(self, out: torch.Tensor, embeds: torch.Tensor, start: int, cache) -> torch.Tensor:
        """One drafting step: the previous output [1, h] and the drafted token's embedding [1, h]."""
        raise NotImplementedError

    def _projection_for(self, seq: SequenceState):
        """The :class:`specplug.drafting_vocab.Projection` that turns an output into drafting logits."""
        raise NotImplementedError

    def _rows_step(self, hidden: list[torch.Tensor], embeds: list[torch.Tensor], starts: list[int], caches: list,
                   first: bool) -> torch.Tensor:
        """Batched drafting (:meth:`propose_batch`): for each sequence r, ``hidden[r]`` (its verified features
        [n_r, F] when ``first``, else its previous output [1, h]) with ``embeds[r]`` [n_r, h] at positions
        ``starts[r]``.. into ``caches[r]``, in one pass over all rows: the outputs of every row [sum n_r, h], each
        as ``_catch_up`` / ``_draft_step`` would give it row by row."""
        raise NotImplementedError

    def _tree_step(self, outs: torch.Tensor, embeds: torch.Tensor, positions: list[int], cache,
                   visible: torch.Tensor) -> torch.Tensor:
        """Tree drafting (``tree`` > 0): one level of nodes in one masked run, their parents' outputs [E, h] and
        their tokens' embeddings [E, h] at ``positions``, entry i attending over the cache entries ``visible[i]``
        marks: their outputs [E, h]."""
        raise NotImplementedError(f"{self.name} does not draft trees")

    # --- per-sequence state ------------------------------------------------------------------------
    def _state(self, seq: SequenceState) -> HeadState:
        st = seq.scratch.get(self.name)
        if st is None:
            st = seq.scratch[self.name] = self._fresh(seq)
        return st

    def _fresh(self, seq: SequenceState, full: bool = True) -> HeadState:
        """Restart from the verified sequence: queue the target's features of every position but the newest
        (the prefill's, else one extra target forward), or, with ``full=False``, wait for the features the
        loop delivers."""
        if seq.target.model is not self.target.model:
            raise ValueError(f"{self.name}: this proposer was built for target {self.target.name!r}, "
                             f"not {seq.target.name!r}")
        n = len(seq.ids)
        if not full:
            return HeadState(self._new_cache(), base=n - 1, fed=n - 1, known=n - 1)
        # a loop that prefills with features may hand them over (seq.prompt_features); else one extra forward
        given = self._verified(getattr(seq, "prompt_features", None) or {})
        if given is not None and given.shape[0] == n - 1 and n - 1 == seq.num_prompt - 1:
            feats, seq.prompt_features = given, None  # taken: the sequence need not keep them
        else:
            feats = self._verified(heads.prefix_features(seq.target, seq.ids[: n - 1], self.needs_features))
        return HeadState(self._new_cache(), base=0, fed=0, known=n - 1, pending=[feats] if n > 1 else [])

    def begin(self, seq: SequenceState) -> None:
        seq.scratch[self.name] = self._fresh(seq, full=getattr(self, "prompt_features", True))

    def _embed(self, token: int, device) -> torch.Tensor:
        # a drafted token's embedding as a row of the table (~1 µs) rather than a module call (~7 µs a step)
        table = self.embedding_table
        return table[token][None] if table is not None else self.target.embedding(torch.tensor([token], device=device))

    def propose(self, seq: SequenceState, k: int) -> Proposal | TreeProposal:
        device = seq.target.device
        st = self._state(seq)
        n = len(seq.ids)
        if st.known != n - 1:  # a step went by unobserved (e.g. a fallback step): rebuild from the target
            st = seq.scratch[self.name] = self._fresh(seq)
        if k <= 0 or not st.pending:
            return Proposal.empty(device)
        projection = self._projection_for(seq)
        with torch.inference_mode():
            feats = torch.cat(st.pending).to(device=device, dtype=self.target.dtype)
            tokens = torch.tensor(seq.ids[st.fed + 1: n], device=device)
            out = self._catch_up(feats, self.target.embedding(tokens), st.fed, st.cache)
            st.fed, st.pending = n - 1, []
            budget = node_budget(self.tree, seq)
            if budget:
                tree = self._draft_tree(seq, k, out, st.cache, projection, budget)
                st.cache.crop(st.fed - st.base)  # drop the drafted entries: only verified features stay cached
                return tree
            drafted, q_rows = [], []
            for j in range(k):
                logits = projection.product(out)
                token, q = draw(logits, seq.sampling, seq.rng)
                go_on = not self.stop_below or draft_stop.confidence(logits, token, q) >= self.stop_below
                token, q = projection.token_and_q(token, q, self.vocab_size)
                drafted.append(token)
                if q is not None:
                    q_rows.append(q)
                if not go_on:
                    break
                if j + 1 < k:
                    out = self._draft_step(out[None], self._embed(token, device), n - 1 + j, st.cache)
            st.cache.crop(st.fed - st.base)  # drop the drafted entries: only verified features stay cached
        return Proposal(torch.tensor(drafted, device=device), torch.stack(q_rows) if q_rows else None)

    def propose_batch(self, seqs: list[SequenceState], ks: list[int]) -> list[Proposal | TreeProposal]:
        """Draft for several sequences at once: the catch-up and then each drafting step is one pass of the head
        over every row still drafting (its weights read once, not once per row); each row is drawn with its own
        rng, exactly as :meth:`propose` would draw it. Trees, and heads without ``_rows_step``: row by row."""
        batched = type(self)._rows_step is not FeatureHeadProposer._rows_step
        if not batched or any(node_budget(self.tree, seq) for seq in seqs):
            return [self.propose(seq, k) for seq, k in zip(seqs, ks)]
        device = seqs[0].target.device if seqs else None  # a batch's rows share one target: read it once
        out: list[Proposal | TreeProposal] = [Proposal.empty(device) for _ in seqs]
        rows, states = [], []
        for j, (seq, k) in enumerate(zip(seqs, ks)):
            st = self._state(seq)
            if st.known != len(seq.ids) - 1:  # as in propose: rebuild a row that fell out of step
                st = seq.scratch[self.name] = self._fresh(seq)
            if k > 0 and st.pending:
                rows.append(j), states.append(st)
        if not rows:
            return out
        try:
            drafted = self._draft_rows([seqs[j] for j in rows], [ks[j] for j in rows], states)
        except BaseException:
            for j in rows:  # the caches may hold a half-fed step: the next propose rebuilds these rows
                seqs[j].scratch.pop(self.name, None)
            raise
        for j, proposal in zip(rows, drafted):
            out[j] = proposal
        return out

    def _draft_rows(self, seqs: list[SequenceState], ks: list[int], states: list[HeadState]) -> list[Proposal]:
        """:meth:`propose_batch`'s drafting for rows that draft (k >= 1, features pending)."""
        device, dtype = seqs[0].target.device, self.target.dtype
        projections = [self._projection_for(seq) for seq in seqs]
        with torch.inference_mode():
            feats = [torch.cat(st.pending).to(device=device, dtype=dtype) for st in states]
            fed = [seq.ids[st.fed + 1:] for seq, st in zip(seqs, states)]
            # one lookup for every row's tokens (a module call each cost more than the lookup itself)
            embeds = self.target.embedding(torch.tensor([t for row in fed for t in row], device=device)).split(
                [len(row) for row in fed])
            outs = self._rows_step(feats, embeds, [st.fed for st in states], [st.cache for st in states], True)
            outs = outs[torch.tensor([f.shape[0] for f in feats]).cumsum(0) - 1]  # each sequence's newest
            for seq, st in zip(seqs, states):
                st.fed, st.pending = len(seq.ids) - 1, []
            drafted, q_rows = [[] for _ in seqs], [[] for _ in seqs]
            live, depth = list(range(len(seqs))), 0
            while live:
                going = []
                for projection in {id(projections[r]): projections[r] for r in live}.values():
                    mine = [i for i, r in enumerate(live) if projections[r] is projection]
                    # one product for all its live rows, one draw per row
                    for i, (token, q, go_on) in zip(mine, self._draw_rows(projection.product(outs[mine]),
                                                                         [seqs[live[i]] for i in mine], projection)):
                        r = live[i]
                        drafted[r].append(token)
                        if q is not None:
                            q_rows[r].append(q)
                        if go_on and depth + 1 < ks[r]:
                            going.append(i)
                depth += 1
                if going:
                    live = [live[i] for i in going]
                    outs = self._rows_step([outs[i][None] for i in going],
                                           [self._embed(drafted[r][-1], device) for r in live],
                                           [len(seqs[r].ids) - 2 + depth for r in live],
                                           [states[r].cache for r in live], False)
                else:
                    live = []
            for st in states:
                st.cache.crop(st.fed - st.base)  # drop the drafted entries: only verified features stay cached
        return [Proposal(torch.tensor(tokens, device=device), torch.stack(q) if q else None)
                for tokens, q in zip(drafted, q_rows)]

    def _draw_rows(self, logits: torch.Tensor, seqs: list[SequenceState],
                   projection) -> list[tuple[int, torch.Tensor | None, bool]]:
        """Each row's draft from its drafting logits [R, V'] as :meth:`propose` draws it: (token, q over the whole
        vocabulary or None, whether drafting may go on after it); greedy rows in one argmax."""
        if all(seq.sampling.greedy for seq in seqs):
            picked = argmax_ids(logits)
            sure = (torch.softmax(logits.float(), -1).amax(-1) >= self.stop_below).tolist() if self.stop_below \
                else [True] * len(seqs)
            ids = picked if projection.ids is None else [projection.ids[i] for i in picked]
            return [(token, None, go_on) for token, go_on in zip(ids, sure)]
        drawn = []
        for row, seq in zip(logits, seqs):
            token, q = draw(row, seq.sampling, seq.rng)
            go_on = not self.stop_below or draft_stop.confidence(row, token, q) >= self.stop_below
            drawn.append((*projection.token_and_q(token, q, self.vocab_size), go_on))
        return drawn

    def _draft_tree(self, seq: SequenceState, k: int, out: torch.Tensor, cache, projection,
                    budget: int) -> TreeProposal:
        """An EAGLE-2-style dynamic tree (:func:`specplug.tree_drafting.grow_tree`) from the head's output for
        the newest token: each level's expanded nodes run through the head in one masked run (a node sees the
        verified entries and its ancestors')."""
        device, n = seq.target.device, len(seq.ids)
        outs, entry, prefix = {-1: out}, {}, cache.length

        def run_level(tree: GrowingTree, nodes: list[int]) -> torch.Tensor:
            parents = torch.stack([outs[tree.parents[i]] for i in nodes])
            embeds = torch.cat([self._embed(tree.tokens[i], device) for i in nodes])
            visible = visible_rows(tree, nodes, entry, prefix, cache.length).to(device)
            # a node at depth d holds the token at position n - 1 + d, fed beside its parent's output at n - 2 + d
            new = self._tree_step(parents, embeds, [n - 2 + tree.depths[i] for i in nodes], cache, visible)
            outs.update(zip(nodes, new))
            return projection.product(new)

        return grow_tree(projection.product(out), run_level, seq.sampling, seq.rng, budget=budget, max_depth=k,
                         width=self.tree_width, subset=projection.subset, vocab_size=self.vocab_size)[0]

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        st = self._state(seq)
        feats = self._verified(verdict.features or {})
        # the features cover [last, x1..x_accepted]; `last` sat at position len(ids) - 1 - (tokens emitted)
        first = len(seq.ids) - 1 - len(verdict.tokens)
        if feats is None or first != st.known:
            st.known = -1  # out of step (a cut final step, or an unobserved one): rebuild on the next propose
            return
        st.pending.append(feats[: verdict.accepted + 1])
        st.known += verdict.accepted + 1

    def end(self, seq: SequenceState) -> None:
        seq.scratch.pop(self.name, None)
