"""Batched speculative decoding: B sequences, ONE target forward per step over ragged drafts.

The cache scheme (:class:`BatchedCache`)
----------------------------------------
All rows share one ``DynamicCache`` whose key/value tensors have the same number of *slots* L for every
row. A boolean ``valid`` mask [B, L] says which slots hold a token of that row's accepted sequence; all
other slots are *holes* (padding, rejected drafts of a row whose neighbours kept more). Each forward passes

* ``attention_mask`` = ``valid`` followed by the validity of the new input tokens, so a query never sees a
  hole (HF combines this 2D mask with the causal order of slots, and new tokens are appended in order);
* ``position_ids`` = the row's own count of accepted tokens + offset, so RoPE (or learned positions) see
  exactly the positions the single-sequence loop uses, whatever slot a token sits in.

A step feeds every row ``[last, x1..xk_b]`` right-padded to ``[B, K+1]`` (K = max k_b). After verification
row b keeps its first ``1 + accepted_b`` new slots; the rest become holes, and trailing slots that are holes in
every row are cropped off (``cache.crop(-n)`` crops all rows alike). When holes make up a large share of the
cache it is *compacted*: each row's valid slots are gathered to the front (one gather per layer). A finished
row is dropped from the batch dimension at once, so it costs no more drafting or attention.

Exactness and reproducibility
-----------------------------
Each row has its own ``torch.Generator`` seeded from its SamplingParams. Its proposer draws with it, and the
verifier's uniforms for that row are drawn from it too, in the same order and shapes as the single-sequence
loop (``rand(1, k_b + 1)`` after the proposal), then placed in the batched ``uniforms=`` tensor. Acceptance is
one vectorised :func:`verify_batch` call per step. So every row is distributed exactly as plain sampling from
the target, and a row's output does not depend on the other rows of the batch (up to float rounding of the
batched forward).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specplug.verifier import Proposal, ProposalError, Verdict, validate_proposal
from specplug.verifier.rule import verify_batch

from .decode import GenerationResult, SpeculationError, _emit, _prompt_ids, _proposer_name, _request_ids
from .hf_compat import cache_kwargs, output_cache
from .metrics import GenerationStats
from .sampling import SamplingParams, processed_probs
from .target import Target, feature_layer
from .types import Proposer, SequenceState

__all__ = ["BatchedCache", "generate_batch", "BatchCacheView"]

# compact when holes exceed this share of the slots (and at least MIN_HOLES_TO_COMPACT slots per row)
COMPACT_HOLE_SHARE = 0.25
MIN_HOLES_TO_COMPACT = 8


class BatchedCache:
    """One HF ``DynamicCache`` for B rows sharing a slot count, with per-row validity and lengths."""

    def __init__(self, model, batch_size: int, device: torch.device, max_positions: int | None = None):
        self.model = model
        self.cache = None
        self.device = device
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # accepted tokens per row
        self.max_positions = max_positions
        self.compactions = 0

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    def forward(self, input_ids: torch.Tensor, input_valid: torch.Tensor, output_hidden_states: bool = False,
                logits_to_keep: int = 0):
        """Append ``input_ids`` [B, n] (``input_valid`` marks real tokens; pads only after a row's real ones).

        Returns the model output. The new slots are provisional until :meth:`commit`.
        """
        B, n = input_ids.shape
        positions = self.lengths.unsqueeze(1) + torch.arange(n, device=self.device).unsqueeze(0)
        if self.max_positions is not None:
            positions = positions.clamp(max=self.max_positions - 1)  # only pads can exceed it
        attention = torch.cat([self.valid, input_valid], dim=1)
        # a query with no visible key at all (a row with nothing cached and only padding in this forward)
        # would give NaNs: let such a row's first new slot see itself. Nothing valid ever attends to it.
        blind = ~attention.any(dim=1)
        if bool(blind.any()):
            attention = attention.clone()
            attention[blind, self.slots] = True
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=attention.long(), position_ids=positions,
                             **cache_kwargs(self.cache), use_cache=True, output_hidden_states=output_hidden_states,
                             logits_to_keep=logits_to_keep)
        if self.cache is None and any(getattr(layer, "is_sliding", False) for layer in output_cache(out).layers):
            raise NotImplementedError("batched decoding needs full-attention layers: the shared cache leaves holes "
                                      "between a row's tokens, which a sliding window over slots would miscount")
        self.cache = output_cache(out)
        self.valid = torch.cat([self.valid, input_valid], dim=1)
        self._pending = n
        return out

    def commit(self, keep: torch.Tensor) -> None:
        """Row b keeps the first ``keep[b]`` of the slots the last forward appended; the rest become holes."""
        n = self._pending
        start = self.slots - n
        kept = torch.arange(n, device=self.device).unsqueeze(0) < keep.unsqueeze(1)
        self.valid[:, start:] &= kept
        self.lengths += keep
        trim = n - int(keep.max()) if keep.numel() else n
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
    """What ``seq.target_cache`` holds for a row of a batch (diagnostics only)."""

    batch: BatchedCache
    row: int

    @property
    def length(self) -> int:
        return int(self.batch.lengths[self.row])


def _pick_features(out, names: Sequence[str], row: int, n: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The named target features (see :func:`specplug.target.feature_layer`) of one row, first ``n`` positions."""
    return {name: out.hidden_states[feature_layer(name, num_layers)][row, :n] for name in names}


def _policy_name(policy) -> str:
    return getattr(policy, "name", None) or type(policy).__name__


class _Row:
    """One request in the batch: its SequenceState, stats, proposer status and γ policy."""

    def __init__(self, index: int, ids: list[int], sampling: SamplingParams, gamma, target: Target):
        self.index = index
        self.prompt = list(ids)
        self.sampling = sampling
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.seq = SequenceState(ids=list(ids), num_prompt=len(ids), sampling=sampling,
                                 rng=sampling.generator(target.device), target=target,
                                 request_id=next(_request_ids))
        self.gamma = gamma  # int, or a policy object with choose(seq, max_k) / update(...)
        self.active: Proposer | None = None
        self.drafted_last = False  # whether its drafter ran last step (if not, it catches up when it next does)
        self.warned = False
        self.result: GenerationResult | None = None


def _normalise_gamma(spec, index: int):
    if hasattr(spec, "choose"):
        return spec
    if callable(spec):  # a bare function seq -> k: wrap it as a policy without update
        return _CallablePolicy(spec)
    k = int(spec)
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {spec} (row {index})")
    return k


class _CallablePolicy:
    def __init__(self, fn: Callable):
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def choose(self, seq, max_k):
        return self.fn(seq)


def generate_batch(target: Target, proposer: Proposer | None, prompts: Sequence[str | Sequence[int]], *,
                   max_new_tokens: int | Sequence[int] = 64,
                   sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                   num_speculative_tokens=4, stop: Sequence[str] = (), strict: bool = False,
                   max_batch_size: int | None = None,
                   callback: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
    """Decode every prompt with ``target`` at once, drafting with ``proposer`` (None: target-only).

    ``sampling`` and ``max_new_tokens`` may be one value or one per prompt (give per-row seeds for per-row
    reproducibility). ``num_speculative_tokens`` is an int γ, a policy object (``choose(seq, max_k) -> k``,
    optional ``begin(seq)`` and ``update(seq, proposed, accepted, draft_time, verify_time, batch_size)``), a
    callable ``seq -> k``, or a list of those, one per row. One policy object shared by every row may instead
    have ``choose_batch(seqs, max_ks) -> list[int]`` to pick all rows' k together (a step costs the longest
    draft); ``seq.scratch["batch_size"]`` holds the current batch size before each choice, and before ``update``
    ``seq.scratch["batch_step"]`` holds the step's costs (one dict per step, shared by its rows): positions
    scored per row ``scored`` (K + 1), tokens ``drafted`` by all rows, ``draft_rows`` that drafted, of which
    ``backlog_rows`` had not drafted the step before (their drafters caught up on a prompt or on tokens emitted
    meanwhile), ``draft_time`` (all rows' drafting),
    ``verify_time`` (the forward and the rule) and ``batch_size``. ``max_batch_size`` caps the rows decoded together;
    the others wait and join as rows finish. ``callback(row, tokens)`` receives each row's emitted tokens.

    Proposers are called per row (``propose(seq, k)`` with that row's SequenceState), unless the proposer has
    ``propose_batch(seqs, ks) -> list[Proposal]``: then the rows that draft this step go in one call (each
    proposal drawn with its own ``seq.rng``, as ``propose`` would; a raise makes all of them fall back).

    One target forward per step scores every active row's ``[last, drafts]``; each row is verified with its
    own uniforms from its own generator, so rows are exact and independent of the batch they ran in.
    Returns one :class:`GenerationResult` per prompt, in order. Per-row stats: ``draft_time`` is the row's own
    drafting, ``target_time``/``verify_time`` and ``step_times`` are the shared step's (what the row waited).
    """
    n = len(prompts)
    if n == 0:
        return []
    samplings = _per_row(sampling or SamplingParams(), n, "sampling")
    budgets = [int(b) for b in _per_row(max_new_tokens, n, "max_new_tokens")]
    if any(b < 1 for b in budgets):
        raise ValueError(f"max_new_tokens must be >= 1, got {min(budgets)}")
    gammas = _per_row(num_speculative_tokens, n, "num_speculative_tokens")
    gammas = [_normalise_gamma(g, i) for i, g in enumerate(gammas)]
    ids_list = [_prompt_ids(target, p) for p in prompts]
    cap = max_batch_size or n
    if cap < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")

    name = _proposer_name(proposer) if proposer is not None else "target-only"
    features = tuple(getattr(proposer, "needs_features", ())) if proposer is not None else ()
    num_layers = target.model.config.num_hidden_layers  # for the feature names (see target.feature_layer)
    eos = target.eos_token_ids
    limit = target.max_positions or 1 << 62
    max_stop = max((len(s) for s in stop), default=0)
    device = target.device
    V = target.vocab_size
    warned = [False]
    t_start = time.perf_counter()

    rows = [_Row(i, ids_list[i], samplings[i], gammas[i], target) for i in range(n)]
    waiting = list(range(n))
    active: list[_Row] = []
    batch = BatchedCache(target.model, 0, device, target.max_positions)

    def result(row: _Row) -> GenerationResult:
        out = row.seq.output_ids
        return GenerationResult(tokens=out, text=target.decode(out), stats=row.stats, prompt_ids=list(row.prompt))

    def fail(row: _Row, message: str, kind: str = "proposer", culprit: str = name) -> SpeculationError:
        now = time.perf_counter()
        for r in active:
            if r.result is None:
                r.stats.wall_time = now - t_start
                r.stats.finish_reason = "error"
        err = SpeculationError(f"{kind} {culprit!r} (batch row {row.index}): {message}", culprit, result(row))
        err.row = row.index
        err.partials = [r.result or result(r) for r in rows]
        return err

    def ask_policy(row: _Row, method: str, *args):
        policy = row.gamma
        fn = getattr(policy, method, None)
        if fn is None:
            return None
        try:
            return fn(row.seq, *args)
        except Exception as exc:  # no sensible fallback γ: always an error, as in the single loop
            raise fail(row, f"{method}() raised {exc!r}", "policy", _policy_name(policy)) from exc

    def proposer_failed(row: _Row, where: str, exc: Exception) -> None:
        if strict:
            raise fail(row, f"{where}() raised {exc!r}") from exc
        if not warned[0]:
            warnings.warn(f"proposer {name!r} raised {exc!r} in {where}() (batch row {row.index}); that row falls "
                          "back to target-only steps (counted in stats.fallback_steps; strict=True makes this an "
                          "error)", stacklevel=3)
            warned[0] = True

    def proposer_dropped(row: _Row, where: str, exc: Exception) -> None:
        """begin() or observe() failed: the row's proposer state is unknown, so the row decodes target-only."""
        if strict:
            raise fail(row, f"{where}() raised {exc!r}") from exc
        warnings.warn(f"proposer {name!r} failed in {where}() ({exc!r}) for batch row {row.index}; that row "
                      "decodes target-only", stacklevel=3)
        row.active, warned[0] = None, True

    def admit(new: list[_Row]) -> None:
        """Prefill the new rows (all but each prompt's last token) and append them to the batch."""
        t0 = time.perf_counter()
        nonlocal batch
        fresh = BatchedCache(target.model, len(new), device, target.max_positions)
        width = max(len(r.prompt) - 1 for r in new)
        if width > 0:
            ids = torch.zeros(len(new), width, dtype=torch.long, device=device)
            valid = torch.zeros(len(new), width, dtype=torch.bool, device=device)
            for j, r in enumerate(new):
                ids[j, : len(r.prompt) - 1] = torch.tensor(r.prompt[:-1], device=device)
                valid[j, : len(r.prompt) - 1] = True
            fresh.forward(ids, valid, logits_to_keep=1)
            fresh.commit(valid.sum(1))
        prefill = time.perf_counter() - t0
        for r in new:
            r.stats.prefill_time = prefill
            r.seq.scratch["proposer"] = name
            ask_policy(r, "begin")
            r.active = proposer
            if proposer is not None:
                try:
                    proposer.begin(r.seq)
                except Exception as exc:
                    proposer_dropped(r, "begin", exc)
        batch = _concat(batch, fresh) if active else fresh
        active.extend(new)
        for j, r in enumerate(active):
            r.seq.target_cache = BatchCacheView(batch, j)

    def finish(row: _Row, reason: str) -> None:
        row.stats.finish_reason = reason
        if row.active is not None:
            try:
                row.active.end(row.seq)
            except Exception as exc:
                if strict:
                    raise fail(row, f"end() raised {exc!r}") from exc
        row.stats.wall_time = time.perf_counter() - t_start
        row.result = result(row)

    admit([rows[i] for i in waiting[:cap]])
    del waiting[:cap]

    try:
        while active:
            B = len(active)
            # --- propose: per row, or in one call for a proposer with propose_batch ---------------------------
            t0 = time.perf_counter()
            k_maxes = []
            for row in active:
                seq = row.seq
                seq.scratch["batch_size"] = B  # what a policy may read in choose(); update() gets it too
                remaining = budgets[row.index] - len(seq.output_ids)
                k_maxes.append(max(0, min(remaining - 1, limit - len(seq.ids) - 1)) if row.active is not None else 0)
            shared = active[0].gamma
            if hasattr(shared, "choose_batch") and all(row.gamma is shared for row in active):
                # one policy for the whole batch may choose every row's k at once (the step costs max k)
                try:
                    chosen = [int(k) for k in shared.choose_batch([row.seq for row in active], list(k_maxes))]
                    if len(chosen) != B:
                        raise ValueError(f"returned {len(chosen)} values for {B} sequences")
                except Exception as exc:
                    raise fail(active[0], f"choose_batch() raised {exc!r}", "policy", _policy_name(shared)) from exc
                asked = [max(0, min(k, m)) if m else 0 for k, m in zip(chosen, k_maxes)]
            else:
                asked = []
                for row, k_max in zip(active, k_maxes):
                    if isinstance(row.gamma, int):
                        asked.append(min(row.gamma, k_max))
                    else:
                        asked.append(k_max and max(0, min(int(ask_policy(row, "choose", k_max)), k_max)))
            drafting = [j for j, row in enumerate(active) if row.active is not None and asked[j] > 0]
            raw: list[Proposal | None] = [None] * B
            fell = [False] * B
            draft_times = [0.0] * B
            batched = getattr(proposer, "propose_batch", None)
            if batched is not None and drafting:
                td = time.perf_counter()
                try:
                    got = list(batched([active[j].seq for j in drafting], [asked[j] for j in drafting]))
                    if len(got) != len(drafting):
                        raise fail(active[drafting[0]], f"propose_batch() returned {len(got)} proposals for "
                                                       f"{len(drafting)} sequences")
                except SpeculationError:
                    raise
                except Exception as exc:
                    for j in drafting:
                        proposer_failed(active[j], "propose_batch", exc)
                        fell[j] = True
                else:
                    for j, p in zip(drafting, got):
                        raw[j] = p
                share = (time.perf_counter() - td) / len(drafting)
                for j in drafting:
                    draft_times[j] = share
            else:
                for j in drafting:
                    td = time.perf_counter()
                    try:
                        raw[j] = active[j].active.propose(active[j].seq, asked[j])
                    except Exception as exc:
                        proposer_failed(active[j], "propose", exc)
                        fell[j] = True
                    draft_times[j] = time.perf_counter() - td
            proposals: list[Proposal] = []
            for j, (row, proposal) in enumerate(zip(active, raw)):
                if proposal is None:
                    proposal = Proposal.empty(device)
                else:
                    if proposal.k > asked[j]:
                        raise fail(row, f"proposed {proposal.k} tokens when asked for at most {asked[j]}")
                    try:  # before scoring: a bad id must never reach the model
                        validate_proposal(proposal, V)
                    except ProposalError as exc:
                        raise fail(row, str(exc)) from exc
                    proposal = proposal.to(device)
                proposals.append(proposal)
            # --- one target forward over the ragged drafts ---------------------------------------------------
            t1 = time.perf_counter()
            lengths = torch.tensor([p.k for p in proposals], dtype=torch.long, device=device)
            K = int(lengths.max())
            input_ids = torch.zeros(B, K + 1, dtype=torch.long, device=device)
            for j, (row, p) in enumerate(zip(active, proposals)):
                input_ids[j, 0] = row.seq.ids[-1]
                if p.k:
                    input_ids[j, 1: p.k + 1] = p.tokens
            input_valid = torch.arange(K + 1, device=device).unsqueeze(0) <= lengths.unsqueeze(1)
            out = batch.forward(input_ids, input_valid, output_hidden_states=bool(features))
            p_target = _processed(out.logits, [r.sampling for r in active])
            t2 = time.perf_counter()
            # --- verify all rows at once, each with its own uniforms ----------------------------------------
            draft_tokens = input_ids[:, 1:]
            q_draft = _dense_q(proposals, K, V, device)
            uniforms = torch.zeros(B, K + 1, dtype=p_target.dtype, device=device)
            for j, (row, p) in enumerate(zip(active, proposals)):
                # same draw, same shape, same point in the row's stream as the single-sequence verify()
                u = torch.rand(1, p.k + 1, generator=row.seq.rng, device=device, dtype=p_target.dtype)[0]
                uniforms[j, : p.k] = u[: p.k]
                uniforms[j, K] = u[p.k]
            verdicts = verify_batch(p_target, draft_tokens, q_draft, lengths, uniforms=uniforms, validate=False)
            accepted = verdicts.accepted
            # keep [last, accepted drafts] in the cache; the emitted token is fed by the next step
            batch.commit(accepted + 1)
            t3 = time.perf_counter()
            accepted_list = accepted.tolist()
            tokens_list = verdicts.tokens.tolist()
            # what the whole step cost, for batch-aware policies: every row waits for all the drafting, and the
            # forward scores K + 1 positions for every row whatever each proposed (one dict per step)
            step_info = {"scored": K + 1, "drafted": int(lengths.sum()), "draft_rows": int((lengths > 0).sum()),
                         "backlog_rows": sum(1 for j in drafting if not active[j].drafted_last),
                         "draft_time": t1 - t0,
                         "verify_time": t3 - t1, "batch_size": B}
            for j, row in enumerate(active):
                row.drafted_last = j in drafting

            # --- per-row bookkeeping -----------------------------------------------------------------------
            done: list[int] = []
            for j, row in enumerate(active):
                seq, stats = row.seq, row.stats
                acc = accepted_list[j]
                verdict = Verdict(accepted=acc, proposed=proposals[j].k, tokens=tokens_list[j][: acc + 1])
                if features:
                    verdict.features = _pick_features(out, features, j, acc + 1, num_layers)
                if row.active is not None and not isinstance(row.gamma, int):
                    seq.scratch["batch_step"] = step_info
                    ask_policy(row, "update", proposals[j].k, acc, draft_times[j], t2 - t1, B)
                remaining = budgets[row.index] - len(seq.output_ids)
                emitted, reason = _emit(target, seq, verdict.tokens, remaining, eos, stop, max_stop)
                if row.active is not None and not fell[j]:
                    try:
                        row.active.observe(seq, verdict)
                    except Exception as exc:
                        proposer_dropped(row, "observe", exc)
                stats.fallback_steps += fell[j]
                stats.draft_time += draft_times[j]
                stats.target_time += t2 - t1
                stats.verify_time += t3 - t2
                stats.record_step(asked[j], proposals[j].k, acc, len(emitted), time.perf_counter() - t0)
                if emitted and callback is not None:
                    callback(row.index, emitted)
                if not reason and len(seq.ids) >= limit:
                    reason = "max_positions"
                if reason:
                    finish(row, reason)
                    done.append(j)
            if done:
                keep = [j for j in range(B) if j not in set(done)]
                active[:] = [active[j] for j in keep]
                if keep:
                    batch.select(keep)
                if waiting and len(active) < cap:
                    joining = [rows[i] for i in waiting[: cap - len(active)]]
                    del waiting[: len(joining)]
                    admit(joining)
                for j, r in enumerate(active):
                    r.seq.target_cache = BatchCacheView(batch, j)
            else:
                batch.maybe_compact()
    except BaseException:
        # the batch fails as a whole: every live row's proposer still hears end() (never masking the error)
        for row in active:
            if row.active is not None:
                try:
                    row.active.end(row.seq)
                except Exception as exc:
                    warnings.warn(f"proposer {name!r} failed in end() after an interrupted batch ({exc!r})",
                                  stacklevel=2)
        raise
    return [r.result for r in rows]


def _per_row(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what}: {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


def _processed(logits: torch.Tensor, samplings: list[SamplingParams]) -> torch.Tensor:
    """Per-row processed distributions [B, n, V]; rows sharing SamplingParams go through one call."""
    groups: dict[tuple, list[int]] = {}
    for j, s in enumerate(samplings):
        groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(j)
    if len(groups) == 1:
        return processed_probs(logits, samplings[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        out[index] = processed_probs(logits[index], samplings[rows[0]])
    return out


def _dense_q(proposals: list[Proposal], K: int, V: int, device) -> torch.Tensor | None:
    """None when every row is a point mass (the verifier's cheap path); else [B, K, V] with one-hot rows for
    point-mass proposals and zeros in padding."""
    if K == 0 or all(p.q is None for p in proposals):
        return None
    q = torch.zeros(len(proposals), K, V, dtype=torch.float32, device=device)
    for j, p in enumerate(proposals):
        if not p.k:
            continue
        if p.q is None:
            q[j, torch.arange(p.k, device=device), p.tokens] = 1.0
        else:
            q[j, : p.k] = p.q.to(device=device, dtype=torch.float32)
    return q


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
    for i, (la, lb) in enumerate(zip(la_list, lb_list)):
        ref = (la if la is not None else lb)
        keys = [_pad_kv(x.keys, L) if x is not None else _zeros_like_rows(ref.keys, rows, L)
                for x, rows in ((la, a.batch_size), (lb, b.batch_size))]
        values = [_pad_kv(x.values, L) if x is not None else _zeros_like_rows(ref.values, rows, L)
                  for x, rows in ((la, a.batch_size), (lb, b.batch_size))]
        ref.keys, ref.values = torch.cat(keys, dim=0), torch.cat(values, dim=0)
    out.cache = a.cache if _layers(a.cache) else b.cache
    return out


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
