"""``draft-model``: a small HF causal LM with the target's vocabulary drafts autoregressively.

q at each position is the processed softmax of the draft's logits (same SamplingParams as the target),
and the drafted token is sampled from exactly that q with the sequence's rng. Under greedy decoding q is the
point mass at the argmax, so the proposal carries no dense q at all.

A Llama-architecture draft runs through :mod:`specplug.lean_llama` (same weights, a fraction of HF's per-call
cost) when the lean path reproduces HF's logits; ``fast=False`` or any other architecture uses HF's forward.

``vocab`` restricts drafting to a subset of the vocabulary (see :mod:`specplug.drafting_vocab`): for a small
draft the LM head over all V tokens is most of a step, and rare tokens are rarely accepted anyway.
"""
from __future__ import annotations

import copy
import os
from typing import Sequence

import torch

from specplug import bf16_products, draft_stop, few_rows, int8_products, machine, zoo
from specplug.drafting_products import drafting_weights, faster_drafting_form, linear_shapes
from specplug.drafting_vocab import Projection, read_ranks, same_subset, sampled_or_greedy, vocab_subset
from specplug.plugins.hookspecs import hookimpl
from specplug.lean_llama import LeanCache, Product, lean_or_reason
from specplug.sampling import argmax_ids, draw, multinomial
from specplug.target import KVState, Target, load_causal_lm, load_tokenizer
from specplug.tree_drafting import (GrowingTree, grow_tree, node_budget, tree_budget, tree_width_checked,
                                    visible_rows)
from specplug.types import Proposal, Proposer, SequenceState, Verdict
from specplug.verifier import TreeProposal


class DraftModelProposer(Proposer):
    name = "draft-model"
    conformance_options = {"model": "@kit-draft"}  # the conformance kit supplies a draft for its tiny target

    def __init__(self, target: Target | None = None, model: str | os.PathLike | torch.nn.Module | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                 trust_remote_code: bool = False, fast: bool = True,
                 vocab: int | Sequence[int] | str | None = None, stop_below: float | str | None = None,
                 weights: str | None = None, sampled_vocab: int | Sequence[int] | str | None = None,
                 tree: int = 0, tree_width: int = 4):
        """``vocab``: draft only among these token ids (a list), or among the ``vocab`` most frequent ones (an
        int: the draft's directory or else the target's must hold ``frequent_tokens.json``, as the bundled
        target's does; ``specplug train token-ranks`` writes one), or over the whole vocabulary (``"all"``).
        None (the default) takes the ``default_vocab`` that file recommends, if it has one, else the whole
        vocabulary.

        ``stop_below``: end a draft early once the draft's own probability of the token it just drafted falls
        below this (the token is still proposed; drafting beyond it would mostly be rejected). The draft's
        length then depends only on the draft's own draws, so the verifier stays exact. None (the default)
        takes that file's recommendation (``frequent_tokens.json``'s ``stop_below``), if any; 0
        turns it off.

        ``sampled_vocab``: the drafting vocabulary for sequences that sample (as ``vocab``); None: the ranking
        file's ``sampled_vocab`` recommendation, else as ``vocab`` (see
        :func:`specplug.drafting_vocab.sampled_or_greedy`).

        ``weights``: ``"loaded"`` multiplies by the weights as loaded (``dtype``); ``"int8"`` by weight-only int8
        copies of every product (see :mod:`specplug.int8_products`; needs the lean path, ``fast=True``);
        ``"bf16"`` by a bfloat16 copy of the draft, activations staying float32 (needs the lean path; on
        specplug's bf16 kernel every layer then runs in C). None (the default): int8 where the lean path runs,
        torch has the kernel for the device and int8 drafts faster on this machine (timed once,
        :func:`specplug.drafting_products.drafting_weights`), else loaded; then, for a float32 draft it loaded
        itself on a CPU with the bf16 kernel, bf16 where a whole drafted token is faster so (timed once,
        :func:`specplug.drafting_products.faster_drafting_form`).

        ``tree``: a node budget: draft a dynamic tree of at most this many nodes by top-k expansion, ``tree_width``
        children per expanded node and nodes expanded per level, each level one masked lean run (see
        :meth:`propose_tree`; needs the lean path; ``stop_below`` does not apply); 0 drafts the chain."""
        asked = weights  # None: this machine decides (below)
        self.tree = tree_budget(tree, "draft-model")
        self.tree_width = tree_width_checked(tree_width, "draft-model")
        if weights is not None and weights not in WEIGHTS:
            raise ValueError(f"draft-model: weights must be one of {', '.join(map(repr, WEIGHTS))}, got {weights!r}")
        if target is None:
            raise TypeError("draft-model needs target= (the Target it drafts for)")
        if model is None:
            # in the target's dtype: on the 2-core CPU a bf16 copy was no faster once both run the lean path
            # (c 0.17 vs 0.16) and accepted less at temperature 1 (tokens per call 2.8 vs 3.0 at γ = 4)
            model = _default_draft(target)
        device = device or target.device
        model, lm, tokenizer = _load_draft(model, target, device, dtype, trust_remote_code)
        # the lean path is chosen below (fast=); the Target wrapper is for HF's forward, vocabulary and text
        self.draft = Target(lm, tokenizer, name=str(getattr(lm.config, "_name_or_path", "")) or "draft", lean=False)
        self.bf16_model: torch.nn.Module | None = None
        _check_vocabulary(target, self.draft)
        # one-row copies: drafting is one row a step, and the draft's small matrices multiply one row fastest
        # column-major (see lean_llama.Product)
        self.lean, self.lean_note = lean_or_reason(lm, one_row_copies=True) if fast else (None, "fast=False")
        if self.tree and self.lean is None:
            raise ValueError(f"draft-model: tree= drafts through the lean path's masked runs, which this draft "
                             f"cannot take ({self.lean_note})")
        ranks, ranks_file = read_ranks(None if isinstance(model, torch.nn.Module) else model, target.path)
        self.subset = vocab_subset(vocab, ranks, ranks_file, target.vocab_size, "draft-model")
        self.sampled_subset = vocab_subset(sampled_or_greedy(sampled_vocab, (ranks or {}).get("sampled_vocab"), vocab),
                                           ranks, ranks_file, target.vocab_size, "draft-model")
        self.stop_below = draft_stop.threshold(stop_below, (ranks or {}).get("stop_below"), "draft-model")
        self.vocab_size = target.vocab_size
        self.weights = self._weights(weights, target.vocab_size, lm.config.hidden_size, device)
        self.greedy_projection = self._projection(self.subset, lm, device)
        self.sampled_projection = (self.greedy_projection if same_subset(self.subset, self.sampled_subset)
                                   else self._projection(self.sampled_subset, lm, device))
        if self.lean is not None:
            self.lean.head = self.greedy_projection.product  # the model's own head product is not used
        if asked == "bf16" or (asked is None and not isinstance(model, torch.nn.Module)):
            self._bf16_products(lm, device, chosen=asked == "bf16")

    def _weights(self, weights: str | None, vocab_size: int, hidden: int, device) -> str:
        """The form the draft multiplies by: ``weights`` as asked, or (None) int8 where that drafts faster here
        than the loaded weights (with one-row copies); int8 products installed where chosen."""
        if weights is None:
            weights = "loaded"
            if self.lean is not None:
                head = (vocab_size if self.subset is None else len(self.subset), hidden)
                shapes = [tuple(p.weight.shape) for layer in self.lean.layers for p in layer.products()] + [head]
                weights = drafting_weights(shapes, device, self.lean.dtype, "loaded", one_row_copies=True)
        if weights == "int8":
            if self.lean is None:
                raise ValueError(f"draft-model: weights='int8' needs the lean path, which this draft cannot take "
                                 f"({self.lean_note})")
            if not int8_products.available(str(device)):
                raise ValueError(f"draft-model: weights='int8' needs torch's int8 kernel "
                                 f"(torch._weight_int8pack_mm), which this torch build does not run on {device}")
            self.lean.to_int8(head=False)  # the heads are the projections' below
        return weights

    def _bf16_products(self, lm: torch.nn.Module, device, chosen: bool) -> None:
        """Multiply in bfloat16 (a copy of the draft; activations stay float32, as the target's bf16 products
        run) where ``chosen``, or by default where that drafts faster here than the form built so far: on
        specplug's bf16 kernel every layer can then run in C (:mod:`specplug.fused_layers`)."""
        if self.lean is None:
            if chosen:
                raise ValueError(f"draft-model: weights='bf16' needs the lean path, which this draft cannot take "
                                 f"({self.lean_note})")
            return
        shapes = linear_shapes(lm)
        nbytes = sum(n * k for n, k in shapes) * 4
        if not chosen and (torch.device(device).type != "cpu" or self.lean.dtype != torch.float32
                           or bf16_products.load()[0] is None or nbytes < machine.MIN_BYTES):
            return  # no kernel to run bf16 products on, or too small to matter: the form built so far stands
        lm16 = copy.deepcopy(lm)
        few_rows.install(lm16, weight_dtype=torch.bfloat16)
        lean, note = lean_or_reason(lm16)
        if lean is None:
            if chosen:
                raise ValueError(f"draft-model: weights='bf16': the lean path does not take the bf16 copy ({note})")
            return
        before = self.lean, self.weights, self.greedy_projection, self.sampled_projection
        self.lean, self.weights = lean, "bf16"
        self.greedy_projection = self._projection(self.subset, lm16, device)
        self.sampled_projection = (self.greedy_projection if same_subset(self.subset, self.sampled_subset)
                                   else self._projection(self.sampled_subset, lm16, device))
        lean.head = self.greedy_projection.product
        if not chosen:
            key = (f"float32 {device} " + " ".join(f"{n}x{k}" for n, k in shapes)
                   + f" drafting over {self.greedy_projection.product.weight.shape[0]}: {before[1]} or bf16")
            forms = {before[1]: (before[0], before[2].product), "bf16": (lean, self.greedy_projection.product)}
            if faster_drafting_form(forms, before[1], key, nbytes) != "bf16":
                self.lean, self.weights, self.greedy_projection, self.sampled_projection = before
                return
        self.bf16_model = lm16  # what the lean form multiplies by (HF's forward, unused here, keeps the loaded one)

    def _projection(self, subset: torch.Tensor | None, lm: torch.nn.Module, device) -> Projection:
        """The draft's LM head for drafting over ``subset`` (a copy of its rows: the head computes only those)
        or over the whole vocabulary; on the lean path a product (one-row copy or int8 copy), else HF's logits
        indexed by the subset."""
        if subset is not None:
            subset = subset.to(device)
        if self.lean is None:
            return Projection(subset, None)
        head = lm.get_output_embeddings()
        weight, bias = head.weight.detach(), head.bias
        if subset is not None:
            weight = weight[subset].contiguous()
            bias = None if bias is None else bias.detach()[subset].contiguous()
        int8 = self.weights == "int8"
        product = Product(weight, bias, one_row_copy=not int8 and weight.dtype == torch.float32, int8=int8)
        rows = 0 if int8 or subset is None else weight.numel() * weight.element_size()
        return Projection(subset, product, product.nbytes() + rows)

    def _new_state(self) -> KVState | LeanCache:
        return self.lean.new_cache() if self.lean is not None else KVState()

    def _state(self, seq: SequenceState) -> KVState | LeanCache:
        """The sequence's draft cache, holding a prefix of ``seq.ids``: entries beyond what ``observe`` last
        confirmed (drafts fed by a ``propose`` that raised, which no ``observe`` followed) are dropped."""
        state = seq.scratch.get(self.name)
        if state is None:
            state = seq.scratch[self.name] = self._new_state()
        confirmed = seq.scratch.get(f"{self.name}:confirmed", 0)
        seq.scratch.pop(f"{self.name}:tree", None)  # a tree drafted by a propose no observe followed
        if state.length > confirmed:
            self._crop(state, confirmed)
        return state

    def _crop(self, state: KVState | LeanCache, length: int) -> None:
        if self.lean is not None:
            state.crop(length)
        else:
            self.draft.rollback(state, length)

    def _confirm(self, seq: SequenceState, state: KVState | LeanCache) -> None:
        """What the cache holds now is a prefix of ``seq.ids`` (before drafting on, or after a rollback)."""
        seq.scratch[f"{self.name}:confirmed"] = state.length

    def _projection_for(self, seq: SequenceState) -> Projection:
        return self.greedy_projection if seq.sampling.greedy else self.sampled_projection

    def _next_logits(self, state: KVState | LeanCache, tokens: list[int], projection: Projection) -> torch.Tensor:
        """Run ``tokens`` past the cached ones; the draft's logits after the last of them, over the projection's
        vocabulary."""
        if self.lean is not None:
            return self.lean.forward(state, tokens, head=projection.product)
        logits = self.draft.forward(state, tokens, logits_to_keep=1).logits[-1]
        return logits if projection.subset is None else logits[projection.subset]

    def _draw(self, logits: torch.Tensor, seq: SequenceState,
              projection: Projection) -> tuple[int, torch.Tensor | None, bool]:
        """A token and its q over the whole vocabulary from logits over the drafting vocabulary, and whether
        drafting may go on after it (see ``stop_below``)."""
        token, q = draw(logits, seq.sampling, seq.rng, self._sample)
        go_on = not self.stop_below or draft_stop.confidence(logits, token, q) >= self.stop_below
        return (*projection.token_and_q(token, q, self.vocab_size), go_on)

    def begin(self, seq: SequenceState) -> None:
        seq.scratch[self.name] = self._new_state()
        self._confirm(seq, seq.scratch[self.name])

    def propose(self, seq: SequenceState, k: int) -> Proposal | TreeProposal:
        limit = self.draft.max_positions
        if limit is not None:
            k = min(k, limit - len(seq.ids))
        if k <= 0:
            return Proposal.empty(seq.target.device)
        state = self._state(seq)
        projection = self._projection_for(seq)
        # the cache covers a prefix of seq.ids; feed what it lacks (the prompt at first, then 1-2 tokens)
        logits = self._next_logits(state, seq.ids[state.length:], projection)
        self._confirm(seq, state)
        budget = node_budget(self.tree, seq)
        if budget:
            return self.propose_tree(seq, k, state, logits, projection, budget)
        tokens, q_rows = [], []
        for i in range(k):
            token, q, go_on = self._draw(logits, seq, projection)
            tokens.append(token)
            if q is not None:
                q_rows.append(q)
            if not go_on:
                break
            if i + 1 < k:
                logits = self._next_logits(state, [token], projection)
        device = seq.target.device
        return Proposal(torch.tensor(tokens, device=device), torch.stack(q_rows).to(device) if q_rows else None)

    def propose_tree(self, seq: SequenceState, k: int, state: LeanCache, logits: torch.Tensor,
                     projection: Projection, budget: int) -> TreeProposal:
        """A dynamic tree (:func:`specplug.tree_drafting.grow_tree`) from the draft's ``logits`` after the newest
        token: each level's expanded nodes run in one masked lean pass (a node at depth d at position
        n - 1 + d, seeing the cached sequence and its ancestors). Their entries stay in the cache until
        ``observe`` keeps the accepted path's (:meth:`LeanCache.keep_entries`)."""
        n, entry = state.length, {}

        def run_level(tree: GrowingTree, nodes: list[int]) -> torch.Tensor:
            visible = visible_rows(tree, nodes, entry, n, state.length)
            return self.lean.run_masked(state, [tree.tokens[i] for i in nodes],
                                        [n - 1 + tree.depths[i] for i in nodes], visible, head=projection.product)[0]

        tree, grown = grow_tree(logits, run_level, seq.sampling, seq.rng, budget=budget, max_depth=k,
                                width=self.tree_width, subset=projection.subset, vocab_size=self.vocab_size)
        # cache entries of the returned nodes that were run (expanded), for observe
        seq.scratch[f"{self.name}:tree"] = (n, {new: entry[old] for new, old in enumerate(grown) if old in entry})
        return tree.to(seq.target.device)

    def propose_batch(self, seqs: list[SequenceState], ks: list[int]) -> list[Proposal]:
        """Draft for several sequences at once: each drafting step is one lean pass over all rows still
        drafting (the draft's weights are read once, not once per row). Each row is drawn with its own rng,
        exactly as :meth:`propose` would draw it. (Trees: one row after another.)"""
        if self.lean is None or any(node_budget(self.tree, seq) for seq in seqs):
            return [self.propose(seq, k) for seq, k in zip(seqs, ks)]
        limit = self.draft.max_positions
        ks = [min(k, limit - len(seq.ids)) if limit is not None else k for seq, k in zip(seqs, ks)]
        rows = [j for j, k in enumerate(ks) if k > 0]
        states = {j: self._state(seqs[j]) for j in rows}
        # one head for the pass: greedy rows stay exact under the sampled one too (their argmax is their token)
        greedy = all(seqs[j].sampling.greedy for j in rows)
        projection = self.greedy_projection if greedy else self.sampled_projection
        for j in rows:  # a long backlog (a prompt) runs on its own first, down to the newest token
            backlog = seqs[j].ids[states[j].length:]
            if len(backlog) > 2:
                self.lean.forward(states[j], backlog[:-1])
            self._confirm(seqs[j], states[j])
        tokens: dict[int, list[int]] = {j: [] for j in rows}
        q_rows: dict[int, list[torch.Tensor]] = {j: [] for j in rows}
        # the first pass feeds each row what its cache lacks: the newest token, and the row's last draft too
        # where the whole draft was accepted (a last draft is never fed: see below)
        live, feed = rows, [seqs[j].ids[states[j].length:] for j in rows]
        first = True
        while live:
            logits = self.lean.forward_rows([states[j] for j in live], feed, head=projection.product)
            if first:  # each row's cache now holds exactly its seq.ids; drafts come after
                for j in live:
                    self._confirm(seqs[j], states[j])
                first = False
            stopped = set()
            if all(seqs[j].sampling.greedy for j in live):  # one argmax for all rows
                best = argmax_ids(logits)
                for j, token in zip(live, best if projection.ids is None else [projection.ids[b] for b in best]):
                    tokens[j].append(token)
                if self.stop_below:
                    top = torch.softmax(logits.float(), -1).amax(-1).tolist()
                    stopped = {j for j, p in zip(live, top) if p < self.stop_below}
            else:
                for row, j in enumerate(live):
                    token, q, go_on = self._draw(logits[row], seqs[j], projection)
                    tokens[j].append(token)
                    if q is not None:
                        q_rows[j].append(q)
                    if not go_on:
                        stopped.add(j)
            # a row's last draft is never fed (propose does the same): the next step feeds what was accepted
            live = [j for j in live if len(tokens[j]) < ks[j] and j not in stopped]
            feed = [tokens[j][-1] for j in live]
        out = []
        for j, seq in enumerate(seqs):
            device = seq.target.device
            if j not in tokens:
                out.append(Proposal.empty(device))
            else:
                q = torch.stack(q_rows[j]).to(device) if q_rows[j] else None
                out.append(Proposal(torch.tensor(tokens[j], device=device), q))
        return out

    _sample = staticmethod(multinomial)  # the draw from q (a test's dishonest subclass replaces it)

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        # keep only what matches the accepted sequence: everything but its newest token at most
        state = seq.scratch[self.name]
        drafted = seq.scratch.pop(f"{self.name}:tree", None)
        if drafted is not None:  # a tree's entries: keep the accepted path's, in order, after the sequence
            start, entry = drafted
            state.keep_entries(start, [entry[i] for i in getattr(verdict, "path", []) if i in entry])
        keep = min(state.length, len(seq.ids) - 1)
        if keep < state.length:
            self._crop(state, keep)
        self._confirm(seq, state)

    def end(self, seq: SequenceState) -> None:
        seq.scratch.pop(self.name, None)
        seq.scratch.pop(f"{self.name}:confirmed", None)
        seq.scratch.pop(f"{self.name}:tree", None)

    def memory_bytes(self) -> int:
        layers = 0 if self.lean is None else sum(p.nbytes() for layer in self.lean.layers for p in layer.products())
        projections = {id(p): p for p in (self.greedy_projection, self.sampled_projection)}.values()
        models = [self.draft.model] + ([self.bf16_model] if self.bf16_model is not None else [])
        return (layers + sum(p.copied_bytes for p in projections)
                + sum(p.numel() * p.element_size() for m in models for p in m.parameters()))


WEIGHTS = ("loaded", "int8", "bf16")


def _load_draft(model: str | os.PathLike | torch.nn.Module, target: Target, device, dtype, trust_remote_code: bool):
    """(model as resolved, the draft LM on ``device``, its tokenizer or None): a module as given, else loaded
    (a zoo name resolved) in ``dtype`` or the target's."""
    if isinstance(model, torch.nn.Module):
        return model, model.to(device).eval(), None
    if isinstance(model, str) and zoo.is_zoo_name(model):
        model = zoo.resolve(model)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    lm = load_causal_lm(model, device=device, dtype=dtype or target.dtype, trust_remote_code=trust_remote_code)
    return model, lm, load_tokenizer(model, trust_remote_code=trust_remote_code)


def _default_draft(target: Target):
    short = target.name[len(zoo.PREFIX):] if zoo.is_zoo_name(target.name) else None
    if short in zoo.DEFAULT_DRAFT:
        return zoo.resolve(zoo.PREFIX + zoo.DEFAULT_DRAFT[short])
    raise TypeError(f"draft-model needs model= (a directory, hub id or zoo: name) for target {target.name!r}; "
                    "only bundled zoo targets have a default draft")


def _check_vocabulary(target: Target, draft: Target) -> None:
    """Draft and target must index the same tokens, or q and p would talk about different things."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft-model: vocabulary mismatch: the draft {draft.name!r} has {draft.vocab_size} "
                         f"logits, the target {target.name!r} has {target.vocab_size}")
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft-model: the tokenizers of draft {draft.name!r} and target {target.name!r} "
                             "map tokens to different ids (equal sizes are not enough)")


@hookimpl
def register_proposers(register):
    register("draft-model", DraftModelProposer,
             "A small causal LM with the target's vocabulary drafts; q = its processed softmax.")
