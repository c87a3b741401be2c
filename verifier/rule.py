"""The rejection rule of Leviathan et al. (2022) / Chen et al. (2023), vectorised over a batch.

Letters: p = target, q = draft (the two papers swap them; we never do). One step, per row:
  1. p_target[0..k] are the target's processed distributions at [last, x1..xk] (k+1 rows).
  2. accept x_i while u_i < min(1, p_target_i(x_i) / q_draft_i(x_i)).
  3. at the first rejection i, emit a sample from norm(max(0, p_target_i - q_draft_i)).
  4. if all k are accepted, emit a bonus sample from p_target_k (q = 0 there, so step 3's formula gives p).
  5. so a step emits 1..k+1 tokens, never zero.
Everything is tensors in, tokens out: no model, no plugin, no Python loop over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .proposal import Proposal, ProposalError, Verdict

# q rows must sum to 1 within this (they are computed in float32 by the proposers).
Q_SUM_TOLERANCE = 1e-3
# Below this mass the residual is numerically empty (p == q up to rounding); sample from p instead.
RESIDUAL_MIN_MASS = 1e-6
# How a chain is verified: token by token (Leviathan / Chen) or jointly (Sun et al.'s block verification).
VERIFICATIONS = ("token", "block")


def acceptance_probability(p_target_x: torch.Tensor, q_draft_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for each drafted token."""
    return torch.clamp(p_target_x / q_draft_x, max=1.0)


def residual_distribution(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised; where it has no mass, p itself."""
    residual = torch.clamp(p_target - q_draft, min=0.0)
    empty = residual.sum(-1, keepdim=True) <= RESIDUAL_MIN_MASS
    return torch.where(empty, p_target, residual)


def sample_from_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from unnormalised non-negative ``weights`` [B, V] with uniforms ``u`` [B]."""
    cdf = weights.cumsum(-1)
    threshold = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return idx.clamp_(max=weights.shape[-1] - 1)


@dataclass
class BatchVerdict:
    """Per-row outcome of :func:`verify_batch`; ``tokens`` is padded with -1 beyond ``num_emitted``."""

    accepted: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [B, K+1] long
    num_emitted: torch.Tensor  # [B] long, == accepted + 1

    def row(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.num_emitted[b])].tolist()


def verify_batch(
    p_target: torch.Tensor,
    draft_tokens: torch.Tensor,
    q_draft: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    uniforms: torch.Tensor | None = None,
    validate: bool = True,
    verification: str = "token",
) -> BatchVerdict:
    """Apply the rule to B rows at once.

    p_target: [B, K+1, V] processed target distributions at [last, x1..xK].
    draft_tokens: [B, K] drafted ids (anything beyond a row's length is ignored).
    q_draft: [B, K, V] distributions the drafts were drawn from, or None for point masses.
    lengths: [B] number of drafted tokens per row (default K for every row).
    uniforms: [B, K+1] explicit U[0,1) draws (K for acceptance, 1 for the final sample); drawn from
        ``generator`` when omitted.
    verification: "token" (the rule above, the default) or "block" (Sun et al.'s block verification,
        :func:`specplug.verifier.block.verify_block_batch`: same inputs, same uniforms layout, exact too).
    """
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
    B, K1, V = p_target.shape
    K = K1 - 1
    device = p_target.device
    draft_tokens = draft_tokens.to(device=device, dtype=torch.long).reshape(B, K)
    lengths = torch.full((B,), K, device=device, dtype=torch.long) if lengths is None else lengths.to(device).long()
    if uniforms is None:
        uniforms = torch.rand(B, K1, generator=generator, device=device, dtype=p_target.dtype)
    valid = torch.arange(K, device=device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, K]
    safe_tokens = torch.where(valid, draft_tokens, 0)
    if validate:
        validate_draft_rows(draft_tokens, q_draft, lengths, valid, V)
    if verification == "block":
        from .block import verify_block_batch  # block builds on this module's primitives
        return verify_block_batch(p_target, safe_tokens, q_draft, lengths, uniforms)

    # 2. accept while u < min(1, p(x)/q(x)); a point-mass q has q(x) = 1.
    p_x = p_target[:, :K].gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1)
    q_x = torch.ones_like(p_x) if q_draft is None else q_draft.gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1)
    accept = (uniforms[:, :K] < acceptance_probability(p_x, q_x)) & valid
    accepted = accept.long().cumprod(-1).sum(-1)  # length of the accepted prefix

    # 3./4. one more token from the residual at the first rejection, or from p (bonus) after all accepted.
    rows = torch.arange(B, device=device)
    p_n = p_target[rows, accepted]
    rejected = accepted < lengths
    at = accepted.clamp(max=max(K - 1, 0))
    if K == 0:
        q_n = torch.zeros_like(p_n)
    elif q_draft is None:
        q_n = torch.nn.functional.one_hot(safe_tokens[rows, at], V).to(p_n.dtype)
    else:
        q_n = q_draft[rows, at].to(p_n.dtype)
    q_n = q_n * rejected.unsqueeze(-1)  # the bonus position has no draft: q = 0 there
    final = sample_from_weights(residual_distribution(p_n, q_n), uniforms[:, K])

    # 5. emitted = accepted prefix + the final token.
    positions = torch.arange(K1, device=device).unsqueeze(0)
    tokens = torch.cat([safe_tokens, torch.zeros(B, 1, dtype=torch.long, device=device)], dim=1)
    tokens = torch.where(positions == accepted.unsqueeze(1), final.unsqueeze(1), tokens)
    tokens = torch.where(positions <= accepted.unsqueeze(1), tokens, -1)
    return BatchVerdict(accepted=accepted, tokens=tokens, num_emitted=accepted + 1)


def validate_proposal(proposal: Proposal, vocab_size: int) -> None:
    """Raise ProposalError unless ``proposal`` can be scored and verified over ``vocab_size`` tokens.

    The decode loop calls this *before* the target scores the drafts, so a bad id never reaches the model.
    """
    k = proposal.k
    q = proposal.q
    if q is None:  # a point mass: its few ids are all there is to check, cheaper in Python than as tensor ops
        bad = next(((i, t) for i, t in enumerate(proposal.tokens.tolist()) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise _outside_vocabulary(bad[1], bad[0], vocab_size)
        return
    if q.dim() != 2 or q.shape[0] != k:
        raise ProposalError(f"q has shape {tuple(q.shape)} for {k} draft tokens; it must be [k, V] = [{k}, {vocab_size}] "
                            "(q rows must match the drafted tokens one to one)")
    tokens = proposal.tokens.unsqueeze(0)
    validate_draft_rows(tokens, q.unsqueeze(0), torch.full((1,), k, device=tokens.device),
                        torch.ones_like(tokens, dtype=torch.bool), vocab_size)


def verify(p_target: torch.Tensor, proposal: Proposal, generator: torch.Generator | None = None, *,
           uniforms: torch.Tensor | None = None, validate: bool = True, verification: str = "token") -> Verdict:
    """Verify one sequence's proposal against ``p_target`` [k+1, V]; k = 0 is a plain target step.

    ``verification`` is "token" (default) or "block"; see :func:`verify_batch`.
    """
    k = proposal.k
    if p_target.dim() != 2 or p_target.shape[0] != k + 1:
        raise ProposalError(f"p_target must have shape [k+1, V] = [{k + 1}, V] for {k} draft tokens, "
                            f"got {tuple(p_target.shape)}")
    if validate:
        validate_proposal(proposal, p_target.shape[-1])
    q = None if proposal.q is None else proposal.q.unsqueeze(0)
    out = verify_batch(p_target.unsqueeze(0), proposal.tokens.unsqueeze(0), q, None, generator,
                       uniforms=None if uniforms is None else uniforms.unsqueeze(0), validate=False,
                       verification=verification)
    return Verdict(accepted=int(out.accepted[0]), proposed=k, tokens=out.row(0))


def verify_greedy(target_argmax: torch.Tensor | list[int], proposal: Proposal) -> Verdict:
    """The rule when every p_target row is one-hot (temperature 0), given the argmax of each of the k+1 rows.

    With p one-hot at a, p(x)/q(x) is 0 for x != a and >= 1 for x == a, whatever q is: a draft is kept iff it
    is the argmax. At the first mismatch the residual max(0, p - q) has mass only at a (q(a) < 1 there, since
    x != a was drawn), and the bonus is a too. So the step is deterministic and draws no uniforms. Callers
    check the proposal (``validate_proposal``) first, as for :func:`verify`.
    """
    best = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else list(target_argmax)
    drafts = proposal.ids
    if len(best) != len(drafts) + 1:
        raise ProposalError(f"need the argmax of k+1 = {len(drafts) + 1} target rows, got {len(best)}")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return Verdict(accepted=accepted, proposed=len(drafts), tokens=drafts[:accepted] + [best[accepted]])


def _outside_vocabulary(token: int, index: int, V: int, what: str = "position") -> ProposalError:
    return ProposalError(f"draft token id {token} at {what} {index} is outside the target vocabulary [0, {V})")


def validate_draft_rows(draft_tokens: torch.Tensor, q_draft: torch.Tensor | None, lengths: torch.Tensor,
                        valid: torch.Tensor, V: int, what: str = "position") -> None:
    """Proposer bugs become ProposalErrors here rather than silently wrong samples.

    ``draft_tokens`` [B, K], ``q_draft`` [B, K, V] or None, ``valid`` [B, K] marks the drafted entries; ``what``
    names an entry in the messages ("position" for chains, "node" for trees).
    """
    B, K = draft_tokens.shape
    if bool((lengths < 0).any()) or bool((lengths > K).any()):
        raise ProposalError(f"draft lengths must lie in [0, {K}], got {lengths.tolist()}")
    bad = valid & ((draft_tokens < 0) | (draft_tokens >= V))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise _outside_vocabulary(int(draft_tokens[b, i]), i, V, what)
    if q_draft is None:
        return
    if q_draft.shape != (B, K, V):
        raise ProposalError(f"q must have shape [k, V] = [{K}, {V}] over the target vocabulary, "
                            f"got {tuple(q_draft.shape[1:])}")
    q = q_draft.float()
    # NaN or inf anywhere makes the sum fail the test, so no separate finiteness pass is needed
    row_ok = (q.amin(-1) >= 0) & ((q.sum(-1) - 1).abs() <= Q_SUM_TOLERANCE)
    bad = valid & ~row_ok
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ProposalError(f"q at {what} {i} is not a distribution (min {float(q[b, i].min()):.3g}, "
                            f"sum {float(q[b, i].sum()):.6f})")
    q_x = q.gather(-1, torch.where(valid, draft_tokens, 0).unsqueeze(-1)).squeeze(-1)
    bad = valid & (q_x <= 0)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ProposalError(f"draft token {int(draft_tokens[b, i])} at {what} {i} has q = 0: it cannot "
                            f"have been drawn from the q the proposer reports")
