"""The rejection rule on hand-made distributions: each numbered line of the rule (docs/design.md, "The
rule") as a specification."""
import pytest
import torch

from specplug.verifier import Proposal, ProposalError, verify, verify_batch, verify_greedy

V = 5


def one_hot(i, v=V):
    return torch.nn.functional.one_hot(torch.tensor(i), v).float()


def test_accepted_draft_is_kept_and_followed_by_one_more_token():
    p = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.1]])  # p(1)/q(1) > 1: always accepted
    verdict = verify(p, Proposal(torch.tensor([1]), q), uniforms=torch.tensor([0.99, 0.5]))
    assert verdict.accepted == 1 and verdict.tokens[0] == 1 and len(verdict.tokens) == 2


def test_rejected_draft_is_replaced_by_residual_sample():
    p = torch.tensor([[0.5, 0.1, 0.4, 0.0, 0.0], [0.2] * 5])
    q = torch.tensor([[0.0, 0.9, 0.1, 0.0, 0.0]])  # residual max(0, p - q) = [0.5, 0, 0.3, 0, 0]
    outcomes = set()
    for u in torch.linspace(0.0, 0.999, 50):
        verdict = verify(p, Proposal(torch.tensor([1]), q), uniforms=torch.tensor([0.5, float(u)]))
        assert verdict.accepted == 0 and len(verdict.tokens) == 1  # 0.5 >= p(1)/q(1) = 0.111: rejected
        outcomes.add(verdict.tokens[0])
    assert outcomes == {0, 2}  # only where p exceeds q; never the rejected token


def test_residual_sample_follows_normalised_positive_part_of_p_minus_q():
    n = 200_000
    p = torch.tensor([0.5, 0.1, 0.4, 0.0, 0.0])
    q = torch.tensor([0.0, 0.9, 0.1, 0.0, 0.0])
    p_b = torch.stack([p, torch.full((V,), 0.2)]).expand(n, 2, V)
    uniforms = torch.rand(n, 2, generator=torch.Generator().manual_seed(0))
    uniforms[:, 0] = 0.999  # force rejection
    out = verify_batch(p_b, torch.ones(n, 1, dtype=torch.long), q.expand(n, 1, V), uniforms=uniforms)
    freq = torch.bincount(out.tokens[:, 0], minlength=V).float() / n
    assert torch.allclose(freq, torch.tensor([0.625, 0.0, 0.375, 0.0, 0.0]), atol=0.005)


def test_bonus_token_comes_from_the_last_distribution_when_all_are_accepted():
    p = torch.stack([one_hot(2), one_hot(3), one_hot(4)])
    verdict = verify(p, Proposal(torch.tensor([2, 3]), torch.stack([one_hot(2), one_hot(3)])))
    assert verdict.accepted == 2 and verdict.tokens == [2, 3, 4]


def test_greedy_reduces_to_accepting_while_draft_equals_argmax_then_emitting_argmax():
    p = torch.stack([one_hot(1), one_hot(2), one_hot(3), one_hot(4)])
    q = torch.stack([one_hot(1), one_hot(0), one_hot(3)])
    for seed in range(5):
        verdict = verify(p, Proposal(torch.tensor([1, 0, 3]), q), torch.Generator().manual_seed(seed))
        assert verdict.accepted == 1 and verdict.tokens == [1, 2]


@pytest.mark.parametrize("q_kind", ["point", "one-hot", "dense"])
def test_greedy_shortcut_gives_the_general_rule_verdict_on_one_hot_p(q_kind):
    gen = torch.Generator().manual_seed(7)
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        best = torch.randint(0, V, (k + 1,), generator=gen)
        # drafts agree with the argmax often enough that every accepted length occurs
        drafts = torch.where(torch.rand(k, generator=gen) < 0.7, best[:k], torch.randint(0, V, (k,), generator=gen))
        q = None
        if q_kind == "one-hot":
            q = torch.stack([one_hot(int(x)) for x in drafts]) if k else torch.zeros(0, V)
        elif q_kind == "dense":  # any q the drafts could have been drawn from
            q = torch.softmax(torch.randn(k, V, generator=gen), -1)
        proposal = Proposal(drafts, q)
        p = torch.stack([one_hot(int(b)) for b in best])
        want = verify(p, proposal, torch.Generator().manual_seed(1))
        got = verify_greedy(best, proposal)
        assert (got.accepted, got.tokens, got.proposed) == (want.accepted, want.tokens, want.proposed)


def test_a_proposals_ids_follow_its_tokens_when_they_are_replaced():
    """The loop reads ``ids`` (the tokens as ints, read once) to score, verify and count: a proposal whose tokens
    are replaced after it was made must not verify its old ones."""
    proposal = Proposal(torch.tensor([3, 1]))
    assert proposal.ids == [3, 1] and proposal.k == 2
    proposal.tokens = torch.tensor([2])
    assert proposal.ids == [2] and proposal.k == 1
    assert verify_greedy([2, 0], proposal).tokens == [2, 0]


def test_point_mass_draft_is_accepted_with_probability_p_of_the_token():
    n = 100_000
    p = torch.tensor([[0.3, 0.7, 0.0, 0.0, 0.0], [0.2] * 5]).expand(n, 2, V)
    out = verify_batch(p, torch.ones(n, 1, dtype=torch.long), None, generator=torch.Generator().manual_seed(1))
    assert abs(out.accepted.float().mean().item() - 0.7) < 0.01
    rejected = out.tokens[out.accepted == 0, 0]
    assert set(rejected.tolist()) == {0}  # p with the drafted token removed, renormalised


def test_first_emitted_token_follows_p_for_any_q():
    n = 200_000
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g).unsqueeze(1)
    out = verify_batch(p.expand(n, 2, V), drafts, q.expand(n, 1, V), generator=g)
    freq = torch.bincount(out.tokens[:, 0], minlength=V).float() / n
    assert torch.allclose(freq, p[0], atol=0.006)


def test_zero_mass_residual_falls_back_to_p():
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [0.2] * 5])
    q = p[:1].clone()  # identical: rejection only by rounding, residual is empty
    verdict = verify(p, Proposal(torch.tensor([2]), q), uniforms=torch.tensor([1.0, 0.0]))
    assert verdict.accepted == 0 and verdict.tokens[0] in (0, 1, 2)


def test_k_zero_is_a_plain_target_step():
    p = one_hot(4).unsqueeze(0)
    assert verify(p, Proposal.empty()).tokens == [4]


@pytest.mark.parametrize("verification", ["token", "block"])
def test_batched_path_equals_unbatched_row_by_row(verification):
    g = torch.Generator().manual_seed(5)
    B, K = 16, 4
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    lengths = torch.randint(0, K + 1, (B,), generator=g)
    u = torch.rand(B, K + 1, generator=g)
    batch = verify_batch(p, drafts, q, lengths, uniforms=u, verification=verification)
    for b in range(B):
        L = int(lengths[b])
        row_u = torch.cat([u[b, :L], u[b, K:]])
        alone = verify(p[b, : L + 1], Proposal(drafts[b, :L], q[b, :L]), uniforms=row_u, verification=verification)
        assert batch.row(b) == alone.tokens and int(batch.accepted[b]) == alone.accepted


def test_same_generator_seed_gives_same_verdict():
    p = torch.softmax(torch.randn(3, V), -1)
    q = torch.softmax(torch.randn(2, V), -1)
    prop = Proposal(torch.tensor([0, 1]), q)
    a = verify(p, prop, torch.Generator().manual_seed(9))
    b = verify(p, prop, torch.Generator().manual_seed(9))
    assert a == b


@pytest.mark.parametrize("q, tokens, message", [
    (torch.tensor([[0.5, 0.5, 0.5, 0.0, 0.0]]), [0], "not a distribution"),
    (torch.tensor([[-0.1, 1.1, 0.0, 0.0, 0.0]]), [1], "not a distribution"),
    (torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]]), [0], "q = 0"),
    (torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]]), [7], "outside the target vocabulary"),
    (torch.tensor([[0.5, 0.5]]), [0], "shape"),
    (torch.tensor([[0.2] * 5, [0.2] * 5]), [0], "rows"),
])
def test_bad_proposals_are_clear_errors(q, tokens, message):
    p = torch.full((2, V), 0.2)
    with pytest.raises(ProposalError, match=message):
        verify(p, Proposal(torch.tensor(tokens), q))


def test_p_with_wrong_number_of_rows_is_an_error():
    with pytest.raises(ProposalError, match=r"\[k\+1, V\]"):
        verify(torch.full((3, V), 0.2), Proposal(torch.tensor([0]), None))
