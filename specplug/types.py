"""The proposer contract, in one place: what a proposer sees of a request, what it must and may implement, and
what the decode engine (:mod:`specplug.engine`) promises it.

The calls, per request (alone or in a batch, the same):

    begin(seq)                      once, after the target's prefill
    propose(seq, k) -> Proposal     before each step that drafts (k >= 1); or, for several rows at once,
    propose_batch(seqs, ks)         if the proposer has it and more than one row drafts this step
    observe(seq, verdict)           after each step whose proposal it made (not after one whose propose raised)
    end(seq)                        exactly once, when the request finishes, fails or is abandoned

The cache invariant (what ``seq.ids`` holds): prompt + every token emitted so far, nothing else. At ``begin``
it is the prompt; at ``propose`` the accepted sequence, whose newest token the target has not yet scored; at
``observe`` it already ends with the step's emitted tokens (``verdict.tokens``, possibly cut at EOS, the budget
or a stop string). The target's cache then holds all of ``seq.ids`` but its newest token. A proposer that
caches anything (a draft KV cache, features) keeps a prefix of ``seq.ids`` and rolls back to it in ``observe``;
after a ``propose`` that raised no ``observe`` follows, so it must not trust entries that step added (compare
with ``seq.ids`` at the next ``propose``).

Failures: a raise in ``propose``/``propose_batch`` makes the step a plain target step for those rows (counted,
warned once; an error under ``strict``); a raise in ``begin`` or ``observe`` drops the proposer for that request
(it decodes target-only; ``end`` still comes); a proposal with more than k tokens, an id outside the target
vocabulary or a q that is no distribution (or 0 at a drafted token) is an error naming the proposer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, Sequence, TypedDict, runtime_checkable

import torch

from specplug.verifier import Proposal, ProposalError, Verdict

from .sampling import SamplingParams

if TYPE_CHECKING:
    from .target import Target

__all__ = ["Proposal", "ProposalError", "Verdict", "SequenceState", "Proposer", "BatchProposer", "BatchStep",
           "ENGINE_SCRATCH_KEYS", "NODE_BUDGET"]

# The keys of ``SequenceState.scratch`` the engine writes (a proposer or policy may read them, never write):
# "proposer": the proposer's name (e.g. for per-proposer statistics); "batch_size": rows decoded together this
# step, set before each choice of k; "batch_step": a :class:`BatchStep`, set before a batched ``update``;
# "max_node_budget": the proposer's ``tree`` option (0: it drafts chains only), set when the request starts;
# "drafted_tree": (nodes, depth) of the tree this row's step drafted, or None for a chain, set before ``update``.
ENGINE_SCRATCH_KEYS = ("proposer", "batch_size", "batch_step", "max_node_budget", "drafted_tree")
# The key a γ policy may write in ``choose``/``choose_batch``: the node budget a tree-drafting proposer uses this
# step (0: a chain; absent: its own ``tree`` option, which it never exceeds).
NODE_BUDGET = "node_budget"


class BatchStep(TypedDict):
    """What a batched step cost, shared by its rows (one dict a step): for batch-aware γ policies."""

    scored: int  # K + 1, K the longest draft (the drafting passes every row waits for)
    tokens: int  # positions the target's pass scored over all rows (each row its own; padded rows K + 1 each)
    drafted: int  # tokens drafted by all rows
    draft_rows: int  # rows that drafted at least one token
    asked_rows: int  # rows asked to draft (each ran its drafter, drafting or not: ngram without a match)
    backlog_rows: int  # of the rows asked to draft, those whose drafter did not run the step before
    draft_time: float  # seconds: choosing k and all rows' drafting
    verify_time: float  # seconds: the target's pass and the rule
    batch_size: int  # rows in the step
    tree_rows: int  # rows that drafted a tree
    padded: bool  # every row was scored over K + 1 positions (HF's padded rows), not its own draft's


@dataclass
class SequenceState:
    """One request as a proposer sees it. ``ids`` is prompt + everything emitted so far (see the module's cache
    invariant); ``rng`` is the request's generator (on the target's device): draw drafts with it, nothing else."""

    ids: list[int]
    num_prompt: int
    sampling: SamplingParams
    rng: torch.Generator
    target: "Target"
    request_id: int = 0
    # The target's cache for this request (has ``length``: cached tokens), for diagnostics only: never modify it.
    target_cache: object | None = None
    # Per-request state, keyed by name: a proposer's own under its name (its draft cache, its index), a policy's
    # under its own; the keys in ENGINE_SCRATCH_KEYS are the engine's.
    scratch: dict = field(default_factory=dict)
    # The target's features (``needs_features``) of the prompt's prefilled positions (all but its last token),
    # [num_prompt - 1, h] each, computed by the engine's prefill: a proposer may take them in ``begin`` instead of
    # a second pass (and may set this to None once taken). None for a one-token prompt.
    prompt_features: dict[str, torch.Tensor] | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_prompt:]


class Proposer:
    """Base class of every draft proposer, built-in or plugin.

    Contract: ``propose`` returns at most k tokens **and the distribution q each was drawn from** (drawn with
    ``seq.rng``), or a point mass (``q=None``) for a deterministic drafter; the verifier does the rest, so the
    output is exact for any honest q. Tensors may live anywhere: the engine moves proposals to the target's
    device (building them there saves the copy).

    Class attributes a proposer may set:

    - ``name``: how errors, warnings and the bench name it (the registry sets it to the registered name);
    - ``needs_features``: target features ``observe`` receives in ``verdict.features`` (``"last"``: the
      final-normed last hidden state; ``"layer:N"``: layer N's output), each [accepted + 1, h] for the verified
      positions, and ``seq.prompt_features`` for the prompt's;
    - ``conformance_options``: keyword options ``specplug check`` passes to the factory to build it for the
      kit's tiny target (``"@kit-draft"`` stands for the kit's tiny draft model's directory).

    For batches a proposer may also implement ``propose_batch`` (see :class:`BatchProposer`).
    """

    name: str = "proposer"
    needs_features: tuple[str, ...] = ()
    conformance_options: ClassVar[dict[str, object]] = {}

    def begin(self, seq: SequenceState) -> None:
        """A new request starts: prompt ids, sampling params, rng and target are in ``seq``."""

    def propose(self, seq: SequenceState, k: int) -> Proposal:
        """At most ``k`` (>= 1) draft tokens continuing ``seq.ids``, each drawn from the q it reports."""
        raise NotImplementedError

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        """The step's outcome; ``seq.ids`` already holds the emitted tokens. Roll back private state here."""

    def end(self, seq: SequenceState) -> None:
        """The request finished (or failed, or was abandoned); release per-request state."""

    def memory_bytes(self) -> int:
        """Extra memory this proposer holds (weights, caches), for the bench."""
        return 0


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that drafts for several requests in one call (e.g. one pass of a draft model over all rows)."""

    def propose_batch(self, seqs: Sequence[SequenceState], ks: Sequence[int]) -> list[Proposal]:
        """One proposal per sequence (at most ``ks[i]`` >= 1 tokens), each drawn
        with its own ``seqs[i].rng`` exactly as ``propose`` would. A raise makes every row of the call fall back."""
        ...
