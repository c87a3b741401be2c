"""The target's caches for the requests being decoded together ("rows"), behind one API for every batch size.

:class:`LeanRows` (the lean forward, :mod:`specplug.lean_llama`) keeps one preallocated cache per row with its
own length: positions are per row, each query attends to its own row only, rollback is a length reset, and rows
join and leave without touching anyone else's cache. Each verified position is computed by the very call a
one-token step makes, so where the products are row-invariant (probed at load: see ``Target``) a batch scores
every row bit for bit as that row decoded alone would.

:class:`PaddedRows` is the fallback for models the lean path does not cover: HF's own forward over one shared
cache with per-row validity (:class:`BatchedCache`), padded and masked.

A row's scored block is a chain ``[last, x1..xk]`` or a tree ``[last, node 0..n-1]`` (a
:class:`~specplug.verifier.TreeProposal` given in ``trees``): its nodes sit at positions by depth and each
sees the row's cache, the last token and its own ancestors only. ``keep`` then keeps the accepted path's
entries (``kept``: block indices) in place of a prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .hf_compat import cache_kwargs, output_cache
from .lean_llama import LeanCache, LeanLlama

__all__ = ["RowScores", "TargetRows", "LeanRows", "PaddedRows", "BatchedCache", "BatchCacheView", "feature_layer",
           "tree_visibility"]

# compact when holes exceed this share of the slots (and at least MIN_HOLES_TO_COMPACT slots per row)
COMPACT_HOLE_SHARE = 0.25
MIN_HOLES_TO_COMPACT = 8


def feature_layer(name: str, num_layers: int) -> int:
    """Index into HF's ``hidden_states`` of a target feature: ``"last"`` is the final-normed last hidden state
    (lm_head(last) == logits), ``"layer:N"`` the output of layer N (0: the embeddings; N < 0 counts back)."""
    if name == "last":
        return num_layers
    if name.startswith("layer:"):
        i = int(name.split(":", 1)[1])
        if -num_layers - 1 <= i <= num_layers:
            return i % (num_layers + 1)
    raise ValueError(f"unknown target feature {name!r}; known: 'last', 'layer:N' (0 <= N <= {num_layers})")


def tree_visibility(tree, cached: int, device=None) -> torch.Tensor:
    """[n+1, cached + n+1] bool: what each entry of a tree's scored block [last, nodes] sees, the row's
    ``cached`` entries (all visible) then the block (``tree.attention_mask()``: ancestors only)."""
    block = tree.attention_mask()
    prefix = torch.ones(block.shape[0], cached, dtype=torch.bool, device=block.device)
    out = torch.cat([prefix, block], dim=1)
    return out if device is None else out.to(device)


@dataclass
class RowScores:
    """One scoring pass over B rows: ``logits`` [N, V] of every row's new positions, row after row
    (``counts[b]`` for row b), and the requested features, each [N, h] in the same order."""

    logits: torch.Tensor
    counts: list[int]
    features: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.offsets = [0]
        for n in self.counts:
            self.offsets.append(self.offsets[-1] + n)

    def span(self, row: int) -> slice:
        """Where row ``row``'s positions sit in ``logits`` and the features."""
        return slice(self.offsets[row], self.offsets[row + 1])


class TargetRows:
    """The contract of both kinds: rows are numbered 0..B-1 in the order they were added (``select`` renumbers).

    Each row caches all of its sequence but the newest token, which the next ``score`` feeds first."""

    padded: bool = False  # a pass runs every row as long as the longest (else each row only its own tokens)

    def add(self, prompts: Sequence[Sequence[int]], features: Sequence[str] = ()) -> list[dict | None]:
        """Append one row per prompt, caching all but its last token; return each prompt's features of those
        positions (None for a one-token prompt or when none are asked for)."""
        raise NotImplementedError

    def score(self, fed: Sequence[Sequence[int]], features: Sequence[str] = (), trees: Sequence | None = None) -> RowScores:
        """Run ``fed[b]`` (1 or more tokens) after row b's cached ones, for every row, and cache them.
        ``trees[b]`` (a TreeProposal, or None for a chain): ``fed[b]`` is ``[last] + tree.tokens``, scored as a tree."""
        raise NotImplementedError

    def keep(self, lengths: Sequence[int], kept: Sequence[Sequence[int] | None] | None = None) -> None:
        """Row b keeps its first ``lengths[b]`` cached tokens (the rollback after a verification); where
        ``kept[b]`` is given (a tree row), it keeps those entries of its last scored block instead, moved into
        place after its earlier ones (``lengths[b]`` is then what the row holds after)."""
        raise NotImplementedError

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order): the others leave."""
        raise NotImplementedError

    def view(self, row: int):
        """What ``SequenceState.target_cache`` shows of row ``row`` (has ``length``; diagnostics only)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LeanRows(TargetRows):
    """Ragged rows on the lean forward: one :class:`LeanCache` a row."""

    def __init__(self, lean: LeanLlama, num_layers: int):
        self.lean, self.num_layers = lean, num_layers
        self.caches: list[LeanCache] = []

    def _layers(self, features: Sequence[str]) -> dict[str, int]:
        return {name: feature_layer(name, self.num_layers) for name in features} if features else {}

    def add(self, prompts, features=()):
        layers = self._layers(features)
        out = []
        for prompt in prompts:
            cache = self.lean.new_cache()
            found = None
            if len(prompt) > 1:  # the same prefill a single sequence gets, whatever else is in the batch
                _, hidden = self.lean.run(cache, list(prompt[:-1]), keep=1, hidden=tuple(layers.values()))
                found = {name: hidden[i] for name, i in layers.items()} if layers else None
            self.caches.append(cache)
            out.append(found)
        return out

    def score(self, fed, features=(), trees=None):
        layers = self._layers(features)
        self._starts = [cache.length for cache in self.caches]
        positions = visible = None
        if trees is not None and any(t is not None for t in trees):
            positions = [None if t is None else t.positions(s) for t, s in zip(trees, self._starts)]
            visible = [None if t is None else tree_visibility(t, s) for t, s in zip(trees, self._starts)]
        logits, hidden = self.lean.run_rows(self.caches, fed, hidden=tuple(layers.values()), positions=positions,
                                            visible=visible)
        return RowScores(logits, [len(f) for f in fed], {name: hidden[i] for name, i in layers.items()})

    def keep(self, lengths, kept=None):
        for b, (cache, n) in enumerate(zip(self.caches, lengths)):
            if kept is None or kept[b] is None:
                cache.crop(int(n))
            else:
                start = self._starts[b]
                cache.keep_entries(start, [start + i for i in kept[b]])

    def select(self, rows):
        self.caches = [self.caches[j] for j in rows]

    def view(self, row):
        return self.caches[row]

    def __len__(self):
        return len(self.caches)


class PaddedRows(TargetRows):
    """HF's forward over a padded batch (:class:`BatchedCache`), for models the lean path does not cover."""

    padded = True

    def __init__(self, model: torch.nn.Module, device: torch.device, max_positions: int | None):
        self.model, self.device, self.max_positions = model, device, max_positions
        self.batch = BatchedCache(model, 0, device, max_positions)
        self._before: torch.Tensor | None = None

    def add(self, prompts, features=()):
        fresh = BatchedCache(self.model, len(prompts), self.device, self.max_positions)
        width = max(len(p) - 1 for p in prompts)
        found: list[dict | None] = [None] * len(prompts)
        if width > 0:
            ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
            valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=self.device)
            for j, p in enumerate(prompts):
                ids[j, : len(p) - 1] = torch.tensor(list(p[:-1]), device=self.device)
                valid[j, : len(p) - 1] = True
            out = fresh.forward(ids, valid, output_hidden_states=bool(features), logits_to_keep=1)
            fresh.commit(valid.sum(1))
            if features:
                top = self.model.config.num_hidden_layers
                found = [{name: out.hidden_states[feature_layer(name, top)][j, : len(p) - 1] for name in features}
                         if len(p) > 1 else None for j, p in enumerate(prompts)]
        self.batch = _concat(self.batch, fresh) if len(self) else fresh
        return found

    def score(self, fed, features=(), trees=None):
        counts = [len(f) for f in fed]
        B, width = len(fed), max(counts)
        ids = torch.zeros(B, width, dtype=torch.long, device=self.device)
        for j, f in enumerate(fed):
            ids[j, : len(f)] = torch.as_tensor(list(f), dtype=torch.long, device=self.device)
        valid = torch.arange(width, device=self.device).unsqueeze(0) < torch.tensor(counts, device=self.device)[:, None]
        self._before = self.batch.lengths.clone()
        block = offsets = None
        if trees is not None and any(t is not None for t in trees):
            block, offsets = _blocks(trees, counts, width, self.device)
        out = self.batch.forward(ids, valid, output_hidden_states=bool(features), block=block, offsets=offsets)
        top = self.model.config.num_hidden_layers
        return RowScores(out.logits[valid], counts,
                         {name: out.hidden_states[feature_layer(name, top)][valid] for name in features})

    def keep(self, lengths, kept=None):
        lengths = torch.as_tensor(list(lengths), dtype=torch.long, device=self.device)
        keep = lengths - self._before
        n = self.batch.pending
        slots = torch.arange(n, device=self.device).unsqueeze(0) < keep.unsqueeze(1)
        for b, rows in enumerate(kept or ()):
            if rows is not None:  # a tree row: its path's slots stay, its siblings' become holes
                slots[b] = False
                slots[b, torch.as_tensor(list(rows), dtype=torch.long, device=self.device)] = True
        self.batch.commit_slots(slots)
        self.batch.maybe_compact()

    def select(self, rows):
        if len(rows):
            self.batch.select(rows)
        else:
            self.batch = BatchedCache(self.model, 0, self.device, self.max_positions)

    def view(self, row):
        return BatchCacheView(self.batch, row)

    def __len__(self):
        return self.batch.batch_size


class BatchedCache:
    """One HF ``DynamicCache`` for B rows sharing a slot count L, with per-row validity and lengths.

    A boolean ``valid`` mask [B, L] says which slots hold a token of that row's accepted sequence; all other
    slots are *holes* (padding, rejected drafts of a row whose neighbours kept more). Each forward passes the
    mask (so a query never sees a hole) and per-row ``position_ids`` (so positions are those the row alone
    would have, whatever slot a token sits in). Trailing slots that are holes in every row are cropped;
    when holes make up a large share, each row's valid slots are gathered to the front (:meth:`compact`)."""

    def __init__(self, model, batch_size: int, device: torch.device, max_positions: int | None = None):
        self.model = model
        self.cache = None
        self.device = device
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # accepted tokens per row
        self.max_positions = max_positions
        self.compactions = 0
        self._pending = 0

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def pending(self) -> int:
        """Slots the last forward appended, provisional until :meth:`commit`."""
        return self._pending

    def forward(self, input_ids: torch.Tensor, input_valid: torch.Tensor, output_hidden_states: bool = False,
                logits_to_keep: int = 0, block: torch.Tensor | None = None, offsets: torch.Tensor | None = None):
        """Append ``input_ids`` [B, n] (``input_valid`` marks real tokens; pads only after a row's real ones).

        ``block`` [B, n, n] bool (with ``offsets`` [B, n], positions after each row's length): which new slot each
        new query sees, e.g. a tree's ancestors; causal when None. Returns the model output. The new slots are
        provisional until :meth:`commit`.
        """
        B, n = input_ids.shape
        if offsets is None:
            offsets = torch.arange(n, device=self.device).unsqueeze(0)
        positions = self.lengths.unsqueeze(1) + offsets
        if self.max_positions is not None:
            positions = positions.clamp(max=self.max_positions - 1)  # only pads can exceed it
        if block is not None:
            attention = self._mask_4d(block)
        else:
            attention = torch.cat([self.valid, input_valid], dim=1)
            # a query with no visible key at all (a row with nothing cached and only padding in this forward)
            # would give NaNs: let such a row's first new slot see itself. Nothing valid ever attends to it.
            blind = ~attention.any(dim=1)
            if bool(blind.any()):
                attention = attention.clone()
                attention[blind, self.slots] = True
            attention = attention.long()
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                             **cache_kwargs(self.cache), use_cache=True, output_hidden_states=output_hidden_states,
                             logits_to_keep=logits_to_keep)
        if B > 1 and any(getattr(layer, "is_sliding", False) for layer in output_cache(out).layers):
            # at one row there are no holes, so a sliding window over slots is one over positions
            raise NotImplementedError("batched decoding on HF's forward needs full-attention layers: the shared "
                                      "cache leaves holes between a row's tokens, which a sliding window over "
                                      "slots would miscount")
        self.cache = output_cache(out)
        self.valid = torch.cat([self.valid, input_valid], dim=1)
        self._pending = n
        return out

    def _mask_4d(self, block: torch.Tensor) -> torch.Tensor:
        """HF's custom-mask form [B, 1, n, slots + n]: 0 where a query sees a key, the dtype's minimum elsewhere
        (transformers passes a 4-D mask on as it is; an additive float mask means the same to eager and SDPA)."""
        B, n, _ = block.shape
        sees = torch.cat([self.valid.unsqueeze(1).expand(B, n, self.slots), block], dim=-1)
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = torch.zeros(B, 1, n, self.slots + n, dtype=dtype, device=self.device)
        return mask.masked_fill(~sees.unsqueeze(1), torch.finfo(dtype).min)

    def commit(self, keep: torch.Tensor) -> None:
        """Row b keeps the first ``keep[b]`` of the slots the last forward appended; the rest become holes."""
        self.commit_slots(torch.arange(self._pending, device=self.device).unsqueeze(0) < keep.unsqueeze(1))

    def commit_slots(self, kept: torch.Tensor) -> None:
        """Row b keeps the slots ``kept[b]`` [n] bool marks of those the last forward appended (a tree row: its
        accepted path, in slot order); the rest become holes."""
        n = self._pending
        start = self.slots - n
        self.valid[:, start:] &= kept
        self.lengths += kept.sum(1)
        used = kept.any(0).nonzero()
        trim = n - (int(used[-1]) + 1 if used.numel() else 0)
        if trim > 0:
            self._crop(trim)
        self._pending = 0

    def _crop(self, n: int) -> None:
        self.cache.crop(-n)  # transformers 5.x: a negative count removes that many slots from every row
        self.valid = self.valid[:, : self.slots - n]

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order) of the batch dimension."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        if self.cache is not None:
            for layer in self.cache.layers:
                if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                    layer.keys = layer.keys.index_select(0, index)
                    layer.values = layer.values.index_select(0, index)
        self.valid = self.valid.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        self.maybe_compact()  # a departed long row may leave everyone else with leading holes

    def holes(self) -> int:
        return int(self.valid.numel() - self.valid.sum())

    def maybe_compact(self) -> bool:
        B, L = self.valid.shape
        if not B or not L:
            return False
        holes = self.holes()
        if holes < COMPACT_HOLE_SHARE * B * L or holes < MIN_HOLES_TO_COMPACT * B:
            return False
        self.compact()
        return True

    def compact(self) -> None:
        """Gather each row's valid slots to the front; the new slot count is the longest row's."""
        B, L = self.valid.shape
        counts = self.valid.sum(1)
        new_L = int(counts.max()) if B else 0
        # stable sort puts valid slots (key 0) first, in their original order
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :new_L]
        if self.cache is not None:
            for layer in self.cache.layers:
                if layer.keys is None or not layer.keys.numel():
                    continue
                _, H, _, D = layer.keys.shape
                idx = order[:, None, :, None].expand(B, H, new_L, D)
                layer.keys = layer.keys.gather(2, idx)
                layer.values = layer.values.gather(2, idx)
        self.valid = torch.arange(new_L, device=self.device).unsqueeze(0) < counts.unsqueeze(1)
        self.compactions += 1


@dataclass
class BatchCacheView:
    """What ``seq.target_cache`` holds for a row of a padded batch (diagnostics only)."""

    batch: BatchedCache
    row: int

    @property
    def length(self) -> int:
        return int(self.batch.lengths[self.row])

    def get_seq_length(self) -> int:
        return self.length


def _concat(a: BatchedCache, b: BatchedCache) -> BatchedCache:
    """Stack two batches (rows of ``a`` first), padding the one with fewer slots with holes at the end."""
    L = max(a.slots, b.slots)
    out = BatchedCache(a.model, 0, a.device, a.max_positions)
    out.valid = torch.cat([_pad_slots(a.valid, L), _pad_slots(b.valid, L)], dim=0)
    out.lengths = torch.cat([a.lengths, b.lengths])
    out.compactions = a.compactions + b.compactions
    if L == 0:
        return out
    # a batch with no slots has no cache (or an empty one): stand in zero-row-sized tensors for it
    la_list = _layers(a.cache)
    lb_list = _layers(b.cache)
    template = la_list or lb_list
    if not la_list:
        la_list = [None] * len(template)
    if not lb_list:
        lb_list = [None] * len(template)
    for la, lb in zip(la_list, lb_list):
        ref = (la if la is not None else lb)
        keys = [_pad_kv(x.keys, L) if x is not None else _zeros_like_rows(ref.keys, rows, L)
                for x, rows in ((la, a.batch_size), (lb, b.batch_size))]
        values = [_pad_kv(x.values, L) if x is not None else _zeros_like_rows(ref.values, rows, L)
                  for x, rows in ((la, a.batch_size), (lb, b.batch_size))]
        ref.keys, ref.values = torch.cat(keys, dim=0), torch.cat(values, dim=0)
    out.cache = a.cache if _layers(a.cache) else b.cache
    return out


def _blocks(trees: Sequence, counts: list[int], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a padded pass, which new slot each new query sees [B, width, width] and its position offset
    [B, width]: a chain row causal, a tree row by ancestry and depth; a pad sees only itself (no NaN rows)."""
    B = len(counts)
    block = torch.eye(width, dtype=torch.bool, device=device).repeat(B, 1, 1)
    offsets = torch.arange(width, device=device).repeat(B, 1)
    for b, (tree, n) in enumerate(zip(trees, counts)):
        if tree is None:
            block[b, :n, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        else:
            block[b, :n, :n] = tree.attention_mask().to(device)
            offsets[b, :n] = tree.positions(0).to(device)
    return block, offsets


def _layers(cache) -> list:
    if cache is None:
        return []
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    return layers if len(layers) == len(cache.layers) else []


def _zeros_like_rows(t: torch.Tensor, rows: int, L: int) -> torch.Tensor:
    return t.new_zeros((rows, t.shape[1], L, t.shape[3]))


def _pad_slots(valid: torch.Tensor, L: int) -> torch.Tensor:
    return torch.nn.functional.pad(valid, (0, L - valid.shape[1]), value=False)


def _pad_kv(t: torch.Tensor, L: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, 0, L - t.shape[2]))
