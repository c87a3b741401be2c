"""The conformance kit: prove a proposer honest before trusting it.

The verifier is exact for any proposer *that really draws its tokens from the q it reports*. These checks
test that, and the rest of the contract, on a tiny enumerable target built on the fly:

- q-honesty[T]: in fixed contexts, the first drafted token's empirical frequencies match the mean of the
  q rows reported with it (chi-square), and no drafted token has q = 0; for a proposer that drafts trees,
  every branch's nodes follow the law they declare (:func:`~specplug.tree_conformance.check_tree_q_honesty`);
- exactness[setting]: speculative output over 3 tokens matches the target's enumerated distribution
  (temperature 1, top-k, top-p), through the engine (trees scored with their mask and verified by the tree
  rule; ``verification="block"`` checks block verification of the proposer's chains);
- greedy-equality: greedy output equals target-only greedy output token for token;
- determinism: two fresh instances with the same seed give the same output;
- rollback-residue: after a run full of rejections, the proposer's next proposal equals the one it makes for a
  new sequence holding the same tokens (same rng): rollbacks leave nothing behind.

A check fails when its p-value is below ``EXACTNESS_ALPHA`` (1e-3) or its equality does not hold.
"""
from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specplug.verifier import ProposalError, TreeProposal

from .decode import generate
from .engine import SpeculationError
from .sampling import GREEDY, SamplingParams
from .target import Target
from .testing import (EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution,
                      tiny_llama)
from .tree_conformance import check_tree_q_honesty
from .types import Proposer, SequenceState

VOCAB = 6
# the last ends in a context seen with two continuations, so frequency-based proposers report a spread q
PROMPTS = ([1, 2, 3, 4, 5, 0, 1, 2], [0, 0, 1, 0, 0, 1, 0], [5, 4, 3, 2, 1, 5, 4, 3, 2], [1, 2, 3, 1, 2, 4, 1, 2])
SETTINGS = {"temperature-1": SamplingParams(temperature=1.0), "top-k-3": SamplingParams(temperature=1.0, top_k=3),
            "top-p-0.8": SamplingParams(temperature=0.7, top_p=0.8)}

ProposerFactory = Callable[[Target, Path], Proposer]  # (target, directory of the kit's tiny draft) -> proposer


@dataclass
class CheckResult:
    name: str
    status: str  # "pass", "fail" or "skip" (the property was not exercised)
    evidence: str

    @property
    def passed(self) -> bool:
        return self.status != "fail"


class ConformanceKit:
    """A tiny target (6 tokens, no EOS) and a tiny draft for it, saved and loaded through from_pretrained."""

    def __init__(self, workdir: str | Path | None = None, samples: int = 2000, verification: str = "token"):
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="specplug-check-")
        root = Path(workdir or self._tmp.name)
        self.draft_dir = root / "draft"
        if not (root / "target" / "config.json").is_file():
            tiny_llama(root / "target", VOCAB, hidden=32, layers=2, seed=0, init=0.3)
            tiny_llama(self.draft_dir, VOCAB, hidden=16, layers=1, seed=7, init=0.2)
        self.target = Target.from_pretrained(root / "target")
        self.samples, self.verification = samples, verification

    def run(self, factory: ProposerFactory) -> list[CheckResult]:
        make = lambda: factory(self.target, self.draft_dir)  # noqa: E731
        results = [self.q_honesty(make(), SamplingParams(temperature=1.0), "q-honesty[T=1]"),
                   self.q_honesty(make(), GREEDY, "q-honesty[T=0]")]
        results += [self.exactness(make(), name, params) for name, params in SETTINGS.items()]
        results += [self.greedy_equality(make()), self.determinism(make), self.rollback_residue(make())]
        return results

    # --- the properties ------------------------------------------------------------------------------
    def q_honesty(self, proposer: Proposer, sampling: SamplingParams, name: str) -> CheckResult:
        if isinstance(self._propose(proposer, PROMPTS[0], sampling, 0), TreeProposal):
            return self.tree_q_honesty(proposer, sampling, name)
        worst, exercised = 1.0, 0
        for prompt in PROMPTS:
            counts: Counter = Counter()
            q_sum = torch.zeros(self.target.vocab_size, dtype=torch.float64)
            for i in range(self.samples):
                seq = self._sequence(prompt, sampling, seed=i)
                proposer.begin(seq)
                proposal = proposer.propose(seq, 2)
                proposer.end(seq)
                if proposal.k == 0:
                    continue
                x = int(proposal.tokens[0])
                q0 = (torch.nn.functional.one_hot(torch.tensor(x), self.target.vocab_size).double()
                      if proposal.q is None else proposal.q[0].double().cpu())
                if q0[x] <= 0:
                    return CheckResult(name, "fail", f"drafted token {x} has q = 0 (context {prompt})")
                counts[(x,)] += 1
                q_sum += q0
            n = sum(counts.values())
            if n < 50:
                continue
            exercised += 1
            expected = {(v,): float(q_sum[v] / n) for v in range(len(q_sum)) if q_sum[v] > 0}
            worst = min(worst, chi_square_pvalue(counts, expected))
        if not exercised:
            return CheckResult(name, "skip", "the proposer drafted (almost) nothing in the test contexts")
        status = "pass" if worst > EXACTNESS_ALPHA else "fail"
        return CheckResult(name, status, f"drafted-token frequencies vs mean reported q over {exercised} contexts: "
                                         f"min chi-square p = {worst:.3g} (fail below {EXACTNESS_ALPHA:g})")

    def tree_q_honesty(self, proposer: Proposer, sampling: SamplingParams, name: str) -> CheckResult:
        """Per branch (depth, rank among siblings): each node's PIT under its declared law is uniform."""
        worst, nodes = None, 0
        for prompt in PROMPTS:
            seeds = iter(range(self.samples))
            try:
                honesty = check_tree_q_honesty(lambda: self._propose(proposer, prompt, sampling, next(seeds)),
                                               self.target.vocab_size, samples=self.samples)
            except ProposalError as exc:
                return CheckResult(name, "fail", f"context {prompt}: {exc}")
            nodes += honesty.nodes
            if honesty.by_branch and (worst is None or honesty.p_value < worst.p_value):
                worst = honesty
        if worst is None:
            return CheckResult(name, "skip", "the proposer drafted (almost) no tree nodes in the test contexts")
        status = "pass" if worst.passed else "fail"
        return CheckResult(name, status, f"tree nodes' PIT under their declared laws, per branch, over {nodes} "
                                         f"nodes; worst context: {worst.evidence} (fail below {EXACTNESS_ALPHA:g})")

    def _propose(self, proposer: Proposer, prompt, sampling: SamplingParams, seed: int):
        """One proposal (k = 2) for a fresh sequence holding ``prompt``."""
        seq = self._sequence(prompt, sampling, seed=seed)
        proposer.begin(seq)
        try:
            return proposer.propose(seq, 2)
        finally:
            proposer.end(seq)

    def exactness(self, proposer: Proposer, name: str, sampling: SamplingParams) -> CheckResult:
        prompt = PROMPTS[0]
        expected = exact_distribution(self.target, prompt, 3, sampling)
        try:
            counts = sampled_distribution(self.target, proposer, prompt, 3, sampling, self.samples,
                                          verification=self.verification)
        except SpeculationError as exc:  # e.g. a tree that repeats a token it declares drawn without replacement
            return CheckResult(f"exactness[{name}]", "fail", str(exc))
        p = chi_square_pvalue(counts, expected)
        status = "pass" if p > EXACTNESS_ALPHA else "fail"
        how = "" if self.verification == "token" else f" ({self.verification} verification)"
        return CheckResult(f"exactness[{name}]", status,
                           f"{self.samples} speculative 3-token samples{how} vs the enumerated target distribution: "
                           f"chi-square p = {p:.3g} (fail below {EXACTNESS_ALPHA:g})")

    def greedy_equality(self, proposer: Proposer) -> CheckResult:
        for prompt in PROMPTS:
            base = generate(self.target, None, prompt, max_new_tokens=100, sampling=GREEDY)
            spec = generate(self.target, proposer, prompt, max_new_tokens=100, sampling=GREEDY, strict=True)
            if spec.tokens != base.tokens:
                at = next(i for i, (a, b) in enumerate(zip(spec.tokens, base.tokens)) if a != b)
                return CheckResult("greedy-equality", "fail", f"prompt {prompt}: first difference at token {at}")
        return CheckResult("greedy-equality", "pass", f"{len(PROMPTS)} prompts x 100 tokens identical to target-only")

    def determinism(self, make: Callable[[], Proposer]) -> CheckResult:
        params = SamplingParams(temperature=1.0, seed=1234)
        runs = [generate(self.target, make(), PROMPTS[1], max_new_tokens=40, sampling=params, strict=True).tokens
                for _ in range(2)]
        ok = runs[0] == runs[1]
        return CheckResult("determinism", "pass" if ok else "fail",
                           "two fresh instances, same seed: " + ("same 40 tokens" if ok else "outputs differ"))

    def rollback_residue(self, proposer: Proposer) -> CheckResult:
        probe = _ResidueProbe(proposer, self)
        generate(self.target, probe, PROMPTS[2], max_new_tokens=40, num_speculative_tokens=4, strict=True,
                 sampling=SamplingParams(temperature=1.0, seed=99))
        return probe.result or CheckResult("rollback-residue", "skip", "the run ended before the probe")

    def _sequence(self, prompt, sampling, seed) -> SequenceState:
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        return SequenceState(ids=list(prompt), num_prompt=len(prompt), sampling=params,
                             rng=params.generator(self.target.device), target=self.target)


class _ResidueProbe(Proposer):
    """Wraps a proposer; at the end of a run compares its proposal with a fresh sequence's."""

    def __init__(self, inner: Proposer, kit: ConformanceKit):
        self.inner, self.kit, self.result = inner, kit, None
        self.name, self.needs_features = getattr(inner, "name", "proposer"), inner.needs_features
        self.rejections = 0

    def begin(self, seq):
        self.inner.begin(seq)

    def propose(self, seq, k):
        return self.inner.propose(seq, k)

    def observe(self, seq, verdict):
        self.rejections += verdict.accepted < verdict.proposed
        self.inner.observe(seq, verdict)

    def end(self, seq):
        rng_state = torch.Generator().manual_seed(7).get_state()
        seq.rng.set_state(rng_state)
        continued = self.inner.propose(seq, 3)
        fresh = self.kit._sequence(seq.ids, seq.sampling, seed=0)
        fresh.num_prompt = len(seq.ids)
        fresh.rng.set_state(rng_state)
        self.inner.begin(fresh)
        clean = self.inner.propose(fresh, 3)
        self.inner.end(fresh)
        self.inner.end(seq)
        same_tokens = continued.tokens.tolist() == clean.tokens.tolist() and (
            getattr(continued, "parents", torch.empty(0)).tolist() == getattr(clean, "parents", torch.empty(0)).tolist())
        same_q = ((continued.q is None) == (clean.q is None)) and (
            continued.q is None or torch.allclose(continued.q.cpu(), clean.q.cpu(), atol=1e-4))
        if same_tokens and same_q:
            evidence, status = "equals a fresh sequence's (tokens and q)", "pass"
        else:
            evidence, status = (f"differs from a fresh sequence's: tokens {continued.tokens.tolist()} vs "
                                f"{clean.tokens.tolist()}" + ("" if same_q else ", q differs")), "fail"
        self.result = CheckResult("rollback-residue", status, f"after {self.rejections} rejected steps the next "
                                                              f"proposal {evidence}")


def registry_factory(name: str, options: dict) -> ProposerFactory:
    """A factory for a registered proposer. A proposer class may declare ``conformance_options``: defaults
    the kit applies under the user's options (the value ``"@kit-draft"`` means the kit's tiny draft model)."""
    from specplug.plugins import get_proposer, list_proposers

    info = list_proposers().get(name)
    defaults = dict(getattr(info.factory, "conformance_options", {})) if info else {}

    def factory(target: Target, draft_dir: Path) -> Proposer:
        return get_proposer(name, target=target, **_with_kit_draft({**defaults, **options}, draft_dir))

    return factory


def _with_kit_draft(options: dict, draft_dir: Path) -> dict:
    """``options`` with every ``"@kit-draft"`` value, also inside nested option dicts (a composite proposer's),
    replaced by the kit's draft directory."""
    return {k: draft_dir if v == "@kit-draft" else _with_kit_draft(v, draft_dir) if isinstance(v, dict) else v
            for k, v in options.items()}
