"""The cost-model policy's node budget: whether a tree-drafting proposer drafts a tree this step, and how big.

A proposer built with ``tree=N`` may be asked for a smaller tree or a chain (``seq.scratch[NODE_BUDGET]``). The
policy weighs each candidate budget as it weighs k: expected tokens of the step over its seconds, with the
scoring pass priced by the positions a tree of that budget actually puts in it (nodes + 1, measured in the
same table as chains' passes) and the drafting by the seconds a tree level cost. A tree's acceptance is kept
per budget as a chain's α is kept: the share of depths passed, a step trying levels until its path stops
(accepted + 1 if the path ended before the tree's depth), so ``expected_tokens(α_b, depth)`` prices it; a
request's α for a budget is its own chain α moved by the budget's gain over the chain (:meth:`NodeBudgets.alpha`).

Each budget, the chain among them, is tried a few steps before its α counts (``TREE_TRIALS``, per proposer,
so later requests start from what earlier ones learnt), and again after ``TREE_RETRY`` steps not chosen (twice
as long after each retry that lost, up to 16×); a budget that could not beat the chain even if every level
were accepted, at the level cost measured for trees, is never tried. A tree must beat the
best chain by ``TREE_MARGIN`` to be chosen: measured costs are noisy and a tree that buys nothing should lose
the tie.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import expected_tokens

TREE_TRIALS = 3  # steps a budget drafts before its measured α decides
TREE_RETRY = 128  # steps without a budget after which it is tried again (acceptance drifts within a request)
MAX_RETRY = 16 * TREE_RETRY  # the longest wait a budget that keeps losing reaches
TREE_MARGIN = 1.02  # a tree's predicted rate must beat the best chain's by this factor
DECAY = 0.9  # weight of older tree steps in a budget's sums


def candidate_budgets(max_budget: int) -> list[int]:
    """Budgets worth weighing below a proposer's ``tree`` option: 8, 16, 32, 64 under it, and it."""
    if max_budget <= 0:
        return []
    return sorted({b for b in (8, 16, 32, 64) if b < max_budget} | {max_budget})


@dataclass
class BudgetRecord:
    """A budget's decayed sums for one proposer: depths passed and tried, nodes drafted, seconds a tree level
    cost a row to draft; ``steps`` it drafted and steps since it last did."""

    successes: float = 0.0
    trials: float = 0.0
    nodes: float = 0.0
    level_seconds: float = 0.0
    weight: float = 0.0
    steps: int = 0
    since: int = 0
    wait: int = TREE_RETRY  # steps unchosen before the next retry: doubled by each retry that did not win

    @property
    def due(self) -> bool:
        """Still to be tried, or unchosen long enough to be tried again."""
        return self.steps < TREE_TRIALS or self.since > self.wait

    def add(self, accepted: int, nodes: int, depth: int, draft_seconds: float) -> None:
        tried = accepted + (accepted < depth)
        self.successes = DECAY * self.successes + accepted
        self.trials = DECAY * self.trials + tried
        self.weight = DECAY * self.weight + 1
        self.nodes = DECAY * self.nodes + nodes
        self.level_seconds = DECAY * self.level_seconds + draft_seconds / max(depth, 1)
        self.steps, self.since = self.steps + 1, 0

    @property
    def alpha(self) -> float:
        return self.successes / self.trials if self.trials else 0.0

    @property
    def mean_nodes(self) -> float:
        return self.nodes / self.weight if self.weight else 0.0

    @property
    def mean_level_seconds(self) -> float:
        return self.level_seconds / self.weight if self.weight else 0.0


@dataclass
class NodeBudgets:
    """Per proposer and budget (0: the chain), what its steps earned and cost. A request's α for a budget is its
    own chain α with the budget's rejection rate relative to the chain's applied: a tree is judged by how much
    it gains over the chain across requests, so an easy or hard request does not make a tree look better than
    the chain it is compared with."""

    records: dict[tuple[str, int], BudgetRecord] = field(default_factory=dict)

    def record(self, proposer: str, budget: int) -> BudgetRecord:
        return self.records.setdefault((proposer, budget), BudgetRecord())

    def alpha(self, proposer: str, budget: int, chain_alpha: float) -> float:
        """A request's α for trees of ``budget``, from its chain α: 1 − (1 − α_chain)·(1 − α_b)/(1 − α_0),
        α_b and α_0 the proposer's for the budget and for the chain."""
        chain, tree = self.record(proposer, 0).alpha, self.record(proposer, budget).alpha
        ratio = (1 - tree) / max(1 - chain, 1e-3)
        return min(max(1 - (1 - chain_alpha) * ratio, 0.0), 0.999)

    def observe(self, seq, budget: int, accepted: int, nodes: int, depth: int, draft_seconds: float) -> None:
        """A step of this request drafted ``nodes`` nodes ``depth`` levels deep under ``budget`` (0: a chain)."""
        self.record(seq.scratch.get("proposer", ""), budget).add(accepted, nodes, depth, draft_seconds)

    def choose(self, seqs, chain_alphas: list[float], max_ks: list[int], batch_size: int, chain_k: int,
               chain_rate: float, costs, chain_draft) -> tuple[int, int]:
        """(budget, depth) for this step, budget 0 meaning the chain of ``chain_k``: the candidate budget whose
        predicted tokens per second beat ``chain_rate`` by TREE_MARGIN, or one still to be tried. ``costs``
        prices scoring (``verify_time(n, B)``); ``chain_draft(k, rows)`` a chain's drafting, the price of an
        unmeasured tree level."""
        max_budget = min((s.scratch.get("max_node_budget", 0) for s in seqs), default=0)
        budgets = candidate_budgets(max_budget)
        if not budgets or chain_k <= 0:
            return 0, chain_k
        proposer = seqs[0].scratch.get("proposer", "")
        chain = self.record(proposer, 0)  # the chain's α must be measured too (a tree winning from the start)
        chain.since += 1
        if chain.due:
            return 0, chain_k
        rows = sum(1 for m in max_ks if m > 0)
        cap = max(max_ks)
        best, choice = chain_rate * TREE_MARGIN, (0, chain_k)
        for budget in budgets:
            rec = self.record(proposer, budget)
            rec.since += 1
            trying = rec.due
            alphas = [1.0] * len(seqs) if trying else [self.alpha(proposer, budget, a) for a in chain_alphas]
            nodes = budget if rec.steps == 0 else max(1.0, rec.mean_nodes)
            scoring = costs.verify_time(int(round(nodes)) + 1, batch_size)
            if scoring is None:
                continue
            level = self._level_seconds(proposer, budget, budgets, chain_draft(1, rows)) * rows
            for depth in range(1, cap + 1):
                tokens = sum(expected_tokens(a, min(depth, m)) for a, m in zip(alphas, max_ks))
                rate = tokens / (level * depth + scoring)
                if trying and rate > chain_rate:  # it could pay even if every level were accepted: try it
                    if rec.steps >= TREE_TRIALS:  # a retry: the next one waits longer unless this budget wins
                        rec.wait = min(2 * rec.wait, MAX_RETRY)
                    return budget, chain_k
                if not trying and rate > best:
                    best, choice = rate, (budget, depth)
        if choice[0]:
            self.record(proposer, choice[0]).wait = TREE_RETRY
        return choice

    def _level_seconds(self, proposer: str, budget: int, budgets: list[int], chain_token: float | None) -> float:
        """Seconds a row drafts one level of a tree of ``budget``: measured; else as the nearest measured
        budget's levels (a level's cost follows the tree's width more than its budget); else a chain token's."""
        measured = [b for b in budgets if self.record(proposer, b).steps]
        if not measured:
            return chain_token or 0.0
        nearest = min(measured, key=lambda b: (abs(b - budget), b))
        return self.record(proposer, nearest).mean_level_seconds
