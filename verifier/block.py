"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025, Algorithm 2).

The token-wise rule decides each draft on its own ratio; block verification weighs the whole drafted prefix
and may keep x1..xi although a token-wise test would have stopped earlier. Same inputs, same output law (the
paper's Theorem: exact for any q), and never fewer accepted tokens in expectation. Paper letters -> ours:
M_b = p_target, M_s = q_draft, X^i = x1..xi, gamma = L (a row's draft length). One step, per row:
  1. eta_1..eta_L ~ U(0, 1).
  2. p_0 = 1, tau = 0.
  3. for i = 1..L:  p_i = min(1, p_{i-1} * p_target_{i-1}(x_i) / q_draft_{i-1}(x_i))
  4.   h_i = w_i / (w_i + 1 - p_i) with w_i = sum_x max(0, p_i * p_target_i(x) - q_draft_i(x))  (i < L);  h_L = p_L
  5.   if eta_i < h_i: tau = i
  6. emit x1..x_tau, then Y ~ p_target_L if tau = L, else Y ~ norm(max(0, p_tau * p_target_tau - q_draft_tau)).
Row i of p_target / q_draft is the distribution after x1..xi, as in the token-wise rule. A point-mass q is the
one-hot row of its token. Uniforms: [B, K+1] as token-wise (column i-1 is eta_i, column K the final sample).
Vectorised over rows; step 3 is a loop over the K positions on [B] scalars (its min makes it a clamped product).
"""
from __future__ import annotations

import torch

from .rule import RESIDUAL_MIN_MASS, BatchVerdict, sample_from_weights


def block_ratio(p_prev: torch.Tensor, p_target_x: torch.Tensor, q_draft_x: torch.Tensor) -> torch.Tensor:
    """Line 3: p_i = min(1, p_{i-1} * p(x_i) / q(x_i)), the weight carried by the drafted prefix x1..xi."""
    return torch.clamp(p_prev * p_target_x / q_draft_x, max=1.0)


def block_residual(p_target_i: torch.Tensor, q_draft_i: torch.Tensor, p_i: torch.Tensor) -> torch.Tensor:
    """max(0, p_i * p_target_i - q_draft_i) over the last axis, unnormalised: the block residual after x1..xi."""
    excess = p_target_i * p_i.unsqueeze(-1)
    return excess.sub_(q_draft_i).clamp_(min=0.0)


def block_weights(p_target: torch.Tensor, draft_tokens: torch.Tensor, q_draft: torch.Tensor | None,
                  lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lines 2-4 for B rows: ``p_chain`` [B, K+1] (p_0..p_K) and ``h`` [B, K+1] (h_0 = 0 unused; 0 beyond a row's
    length). ``draft_tokens`` must already be in range everywhere (padding replaced by any valid id).
    """
    B, K1, V = p_target.shape
    K = K1 - 1
    tokens = draft_tokens.unsqueeze(-1)
    p_x = p_target[:, :K].gather(-1, tokens).squeeze(-1)
    q_x = torch.ones_like(p_x) if q_draft is None else q_draft.to(p_target.dtype).gather(-1, tokens).squeeze(-1)
    # 2./3. p_0 = 1, then p_i from p_{i-1}
    p_chain = [torch.ones(B, dtype=p_target.dtype, device=p_target.device)]
    for i in range(K):
        p_chain.append(block_ratio(p_chain[-1], p_x[:, i], q_x[:, i]))
    p_chain = torch.stack(p_chain, dim=1)
    # 4. w_i is the block residual's mass; for a point mass at x_{i+1} it is p_i * (1 - p_target_i(x_{i+1}))
    if q_draft is None:
        w = p_chain[:, :K] * (1 - p_x)
    else:
        w = block_residual(p_target[:, :K], q_draft.to(p_target.dtype), p_chain[:, :K]).sum(-1)
    # h_i = w_i / (w_i + 1 - p_i) before the row's last draft, h_L = p_L; a residual without mass is never chosen
    h = torch.where(w > RESIDUAL_MIN_MASS, w / (w + 1 - p_chain[:, :K]).clamp(min=RESIDUAL_MIN_MASS),
                    torch.zeros_like(w))
    h = torch.cat([h, h.new_zeros(B, 1)], dim=1)  # index K: only ever the last position
    positions = torch.arange(K1, device=p_target.device).unsqueeze(0)
    last = lengths.unsqueeze(1)
    h = torch.where(positions == last, p_chain, h)
    h = torch.where((positions > last) | (positions == 0), torch.zeros_like(h), h)
    return p_chain, h


def verify_block_batch(p_target: torch.Tensor, draft_tokens: torch.Tensor, q_draft: torch.Tensor | None,
                       lengths: torch.Tensor, uniforms: torch.Tensor) -> BatchVerdict:
    """Block verification of B chains; arguments as :func:`specplug.verifier.verify_batch` (already validated,
    padding in ``draft_tokens`` replaced by a valid id). Call it through ``verify_batch(..., verification="block")``.
    """
    B, K1, V = p_target.shape
    K = K1 - 1
    device = p_target.device
    rows = torch.arange(B, device=device)
    p_chain, h = block_weights(p_target, draft_tokens, q_draft, lengths)
    # 1./5. tau = the last i with eta_i < h_i, else 0
    eta = torch.cat([torch.ones_like(uniforms[:, :1]), uniforms[:, :K]], dim=1)  # eta_0 = 1 never stops
    stops = eta < h
    tau = torch.where(stops, torch.arange(K1, device=device), 0).amax(-1)
    # 6. the bonus from p_target_L after the whole block, else a sample from the block residual at tau
    p_tau = p_target[rows, tau]
    weights = p_tau
    if K:
        at = tau.clamp(max=K - 1)
        q_tau = (torch.nn.functional.one_hot(draft_tokens[rows, at], V).to(p_target.dtype) if q_draft is None
                 else q_draft[rows, at].to(p_target.dtype))
        weights = torch.where((tau == lengths).unsqueeze(-1), p_tau, block_residual(p_tau, q_tau, p_chain[rows, tau]))
    empty = weights.sum(-1, keepdim=True) <= RESIDUAL_MIN_MASS
    final = sample_from_weights(torch.where(empty, p_tau, weights), uniforms[:, K])
    positions = torch.arange(K1, device=device).unsqueeze(0)
    tokens = torch.cat([draft_tokens, torch.zeros(B, 1, dtype=torch.long, device=device)], dim=1)
    tokens = torch.where(positions == tau.unsqueeze(1), final.unsqueeze(1), tokens)
    tokens = torch.where(positions <= tau.unsqueeze(1), tokens, -1)
    return BatchVerdict(accepted=tau, tokens=tokens, num_emitted=tau + 1)
