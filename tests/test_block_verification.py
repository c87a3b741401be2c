"""Block verification (Sun et al. 2025) as a specification: the paper's example, the exact output law by
enumeration, the sampled law through verify_batch, never fewer accepted tokens than token-wise, and the mutant
(acceptance by the token-wise ratio) rejected.

The toy target and draft are two-level: p(next | previous token) and q(next | previous token), V = 4.
"""
import itertools

import pytest
import torch

import specplug.verifier.block as block
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue
from specplug.verifier import Proposal, verify, verify_batch, verify_greedy

V = 4
START = 0  # the last emitted token


def markov(seed, sharpness=1.5):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(sharpness * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.log(p) + torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    return p, q


def target_law(p, m):
    law = {}
    for ys in itertools.product(range(V), repeat=m):
        prev, prob = START, 1.0
        for y in ys:
            prob, prev = prob * float(p[prev, y]), y
        law[ys] = prob
    return law


def drafts_of(q, k, point_mass):
    """(draft, probability) for every draft a drafter with q can make; point mass: the argmax chain."""
    if point_mass:
        x, prev = [], START
        for _ in range(k):
            prev = int(q[prev].argmax())
            x.append(prev)
        yield tuple(x), 1.0
        return
    for x in itertools.product(range(V), repeat=k):
        prob = 1.0
        for prev, y in zip((START,) + x, x):
            prob *= float(q[prev, y])
        yield x, prob


def block_step_law(p, q, k, point_mass):
    """Exact law of (x1..x_tau, Y) from the verifier's own lines 2-4 and 6, looked up on the module so that
    mutants apply: P(tau = i | x) = h_i prod_{j>i} (1 - h_j)."""
    law = {}
    for x, prob in drafts_of(q, k, point_mass):
        rows = (START,) + x
        p_rows = p[list(rows)].unsqueeze(0)
        q_rows = None if point_mass else q[list(rows[:-1])].unsqueeze(0)
        p_chain, h = block.block_weights(p_rows, torch.tensor([x]), q_rows, torch.tensor([k]))
        h = h[0]
        for tau in range(k + 1):
            stop = float(h[tau]) if tau else 1.0
            p_tau = stop * float(torch.prod(1 - h[tau + 1:]))
            if p_tau == 0:  # never chosen; its residual may have no mass
                continue
            if tau == k:
                weights = p_rows[0, k]
            else:
                q_tau = torch.nn.functional.one_hot(torch.tensor(x[tau]), V).double() if point_mass else q_rows[0, tau]
                weights = block.block_residual(p_rows[0, tau], q_tau, p_chain[0, tau])
            for y in range(V):
                out = x[:tau] + (y,)
                law[out] = law.get(out, 0.0) + prob * p_tau * float(weights[y] / weights.sum())
    return law


def extend_with_target(step_law, p, m):
    """The first m tokens of (one step, then plain sampling from p)."""
    law = {}
    for out, prob in step_law.items():
        for rest in itertools.product(range(V), repeat=m - len(out)):
            seq, prev, extra = out + rest, out[-1], 1.0
            for y in rest:
                extra, prev = extra * float(p[prev, y]), y
            law[seq] = law.get(seq, 0.0) + prob * extra
    return law


def expected_accepted_block(p, q, k):
    total = 0.0
    for x, prob in drafts_of(q, k, False):
        rows = (START,) + x
        _, h = block.block_weights(p[list(rows)].unsqueeze(0), torch.tensor([x]), q[list(rows[:-1])].unsqueeze(0),
                             torch.tensor([k]))
        h = h[0]
        total += prob * sum(i * float(h[i]) * float(torch.prod(1 - h[i + 1:])) for i in range(1, k + 1))
    return total


def expected_accepted_token_wise(p, q, k):
    total = 0.0
    for x, prob in drafts_of(q, k, False):
        rows = (START,) + x
        ratio = torch.clamp(p[list(rows[:-1]), list(x)] / q[list(rows[:-1]), list(x)], max=1.0)
        total += prob * float(torch.cumprod(ratio, 0).sum())
    return total


def max_law_error(seed, k, point_mass):
    p, q = markov(seed)
    got = extend_with_target(block_step_law(p, q, k, point_mass), p, k + 1)
    want = target_law(p, k + 1)
    return max(abs(got.get(s, 0.0) - w) for s, w in want.items())


# --- the paper's example ---------------------------------------------------------------------------------------


def test_paper_example_accepts_11_ninths_of_a_token_where_token_wise_accepts_10_ninths():
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)  # context independent: M_b(a), M_b(b)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    block_total = token_total = 0.0
    for x in itertools.product(range(2), repeat=2):
        prob = float(q[x[0]] * q[x[1]])
        _, h = block.block_weights(p.expand(1, 3, 2), torch.tensor([x]), q.expand(1, 2, 2), torch.tensor([2]))
        h = h[0]
        block_total += prob * (float(h[1] * (1 - h[2])) + 2 * float(h[2]))
        ratio = torch.clamp(p[list(x)] / q[list(x)], max=1.0)
        token_total += prob * float(torch.cumprod(ratio, 0).sum())
    assert block_total == pytest.approx(11 / 9) and token_total == pytest.approx(10 / 9)


# --- exactness -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("point_mass", [False, True], ids=["dense-q", "point-mass"])
def test_block_output_law_is_the_target_law_by_enumeration(k, point_mass):
    for seed in range(3):
        assert max_law_error(seed, k, point_mass) < 1e-12


def sampled_pvalue(k, point_mass, n=60_000, seed=0, lengths=None):
    p, q = markov(seed)
    g = torch.Generator().manual_seed(seed)
    prev = torch.full((n,), START)
    drafts, q_rows, p_rows = [], [], [p[prev]]
    for _ in range(k):
        q_rows.append(q[prev])
        prev = q[prev].argmax(-1) if point_mass else torch.multinomial(q[prev], 1, generator=g).squeeze(1)
        drafts.append(prev)
        p_rows.append(p[prev])
    out = verify_batch(torch.stack(p_rows, 1), torch.stack(drafts, 1), None if point_mass else torch.stack(q_rows, 1),
                       lengths, g, verification="block")
    code, last = torch.zeros(n, dtype=torch.long), torch.full((n,), START)
    for t in range(k + 1):  # continue each row by plain sampling up to k + 1 tokens
        fresh = torch.multinomial(p[last], 1, generator=g).squeeze(1)
        y = torch.where(t < out.num_emitted, out.tokens[:, t], fresh)
        code, last = code * V + y, y
    counts = dict(zip(*(c.tolist() for c in torch.unique(code, return_counts=True))))
    expected = {sum(y * V ** (k - t) for t, y in enumerate(ys)): w for ys, w in target_law(p, k + 1).items()}
    return chi_square_pvalue(counts, expected)


@pytest.mark.parametrize("point_mass", [False, True], ids=["dense-q", "point-mass"])
def test_block_sampling_through_verify_batch_follows_the_target(point_mass):
    assert sampled_pvalue(3, point_mass) > EXACTNESS_ALPHA


def test_block_sampling_with_per_row_lengths_follows_the_target():
    lengths = torch.arange(60_000) % 4  # 0..3 drafts per row
    assert sampled_pvalue(3, False, lengths=lengths) > EXACTNESS_ALPHA


def test_block_on_one_hot_p_is_greedy():
    g = torch.Generator().manual_seed(7)
    for _ in range(100):
        k = int(torch.randint(0, 5, (1,), generator=g))
        best = torch.randint(0, V, (k + 1,), generator=g)
        drafts = torch.where(torch.rand(k, generator=g) < 0.7, best[:k], torch.randint(0, V, (k,), generator=g))
        q = torch.softmax(torch.randn(k, V, generator=g), -1)
        p = torch.nn.functional.one_hot(best, V).float()
        got = verify(p, Proposal(drafts, q), torch.Generator().manual_seed(1), verification="block")
        assert got.tokens == verify_greedy(best, Proposal(drafts, q)).tokens


def test_unknown_verification_is_an_error():
    with pytest.raises(ValueError, match="verification must be one of"):
        verify(torch.full((1, V), 0.25), Proposal.empty(), verification="tokenwise")


# --- never worse than token-wise ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_block_accepts_at_least_as_many_tokens_as_token_wise_in_expectation(k):
    gains = []
    for seed in range(12):
        p, q = markov(100 + seed, sharpness=float(seed % 3))
        gains.append(expected_accepted_block(p, q, k) - expected_accepted_token_wise(p, q, k))
    assert min(gains) >= -1e-12 and max(gains) > 1e-3  # never worse, and strictly better somewhere


# --- mutants -----------------------------------------------------------------------------------------------------


def token_wise_ratio(p_prev, p_target_x, q_draft_x):
    """Mutant: block verification's acceptance using the token-wise ratio (the prefix weight forgotten)."""
    return torch.clamp(p_target_x / q_draft_x, max=1.0)


def test_exactness_check_rejects_acceptance_by_the_token_wise_ratio(monkeypatch):
    monkeypatch.setattr(block, "block_ratio", token_wise_ratio)
    assert max_law_error(0, 3, False) > 1e-3
    assert sampled_pvalue(3, False) < EXACTNESS_ALPHA


def test_exactness_check_rejects_swapped_p_and_q(monkeypatch):
    weights, residual = block.block_weights, block.block_residual
    monkeypatch.setattr(block, "block_weights", lambda p_target, tokens, q_draft, lengths: weights(
        torch.cat([q_draft, p_target[:, -1:]], 1), tokens, p_target[:, :-1], lengths))
    monkeypatch.setattr(block, "block_residual", lambda p_target_i, q_draft_i, p_i: residual(q_draft_i, p_target_i,
                                                                                              p_i))
    assert max_law_error(0, 3, False) > 1e-3
    assert sampled_pvalue(3, False) < EXACTNESS_ALPHA


@pytest.mark.parametrize("point_mass", [False, True], ids=["dense-q", "point-mass"])
def test_exactness_check_rejects_the_residual_replaced_by_p(point_mass, monkeypatch):
    monkeypatch.setattr(block, "block_residual", lambda p_target_i, q_draft_i, p_i: p_target_i.clone())
    assert max_law_error(0, 3, point_mass) > 1e-3
    assert sampled_pvalue(3, point_mass) < EXACTNESS_ALPHA
