"""Trees and block verification through the real engine: a proposer may hand over a TreeProposal, which the
target scores in its one pass (lean rows and HF's forward with a 4-D mask), the tree rule verifies, and the
cache keeps only the accepted path of. Exactness with power by the enumerated tiny-model harness; greedy output
equal to target-only; the mutants (residual not updated, a mask that shows a node its sibling) caught."""
import pytest
import torch

import specplug
import specplug.verifier.tree_rule as tree_rule
from specplug import SamplingParams
from specplug.engine import SpeculationError
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.verifier import Proposal, TreeProposal, earlier_siblings
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
N_TOKENS = 3
N_SAMPLES = 1500  # the subtlest mutant here (the residual not updated) fails at this size
SETTINGS = {
    "temperature-1": SamplingParams(temperature=1.0),
    "top-k-3": SamplingParams(temperature=1.0, top_k=3),
    "top-p-0.8-temp-0.7": SamplingParams(temperature=0.7, top_p=0.8),
}


class RandomTreeProposer(specplug.Proposer):
    """A tree of sibling branches drawn from an honest dense q: model-free (q depends on the parent token only),
    or with ``target`` the target's own distribution at the node's context, flattened (temperature 2), so that
    first children are often rejected and later siblings and their subtrees decide the output (power for the
    mutants). Shape (depth <= k): the root gets ``width`` children, the first ``width`` more, the second one.
    ``without_replacement``: each sibling set by ``multinomial(q, m, replacement=False)``, declared so."""

    name = "random-tree"

    def __init__(self, vocab: int, width: int = 2, without_replacement: bool = False, seed: int = 0, target=None):
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.softmax(2.0 * torch.randn(vocab, vocab, generator=gen), -1)  # q given the parent token
        self.width, self.without, self.model = width, without_replacement, target and target.model
        self.verdicts = []
        self._laws: dict[tuple[int, ...], torch.Tensor] = {}  # by context: the harness revisits a few thousand times

    def _law(self, context: list[int]) -> torch.Tensor:
        if self.model is None:
            return self.table[context[-1]]
        key = tuple(context)
        if key not in self._laws:
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([context])).logits[0, -1]
            self._laws[key] = torch.softmax(logits.float() / 2.0, -1)
        return self._laws[key]

    def begin(self, seq):
        seq.scratch[self.name] = torch.Generator().manual_seed(1000 + (seq.sampling.seed or 0))

    def _children(self, context: list[int], m: int, gen) -> tuple[list[int], torch.Tensor]:
        q = self._law(context)
        m = min(m, int((q > 0).sum())) if self.without else m
        return torch.multinomial(q, m, replacement=not self.without, generator=gen).tolist(), q

    def propose(self, seq, k):
        gen = seq.scratch[self.name]
        tokens, parents, qs = [], [], []

        def add(parent: int, context: list[int], m: int) -> None:
            kids, q = self._children(context, m, gen)
            for x in kids:
                tokens.append(x), parents.append(parent), qs.append(q)

        add(-1, list(seq.ids), self.width)
        if k >= 2:
            first, second = tokens[0], tokens[1] if len(tokens) > 1 else None
            add(0, list(seq.ids) + [first], self.width)
            if second is not None:
                add(1, list(seq.ids) + [second], 1)
        return TreeProposal(tokens, parents, torch.stack(qs), without_replacement=self.without)

    def observe(self, seq, verdict):
        self.verdicts.append(verdict)


class OracleTreeProposer(specplug.Proposer):
    """Point masses: the target's own top-2 tokens at the root and under the first child, its top-1 under the
    second (computed by HF's forward on the side), so greedy paths run deep. ``chain_for``: rows whose prompt
    starts with one of these tokens get the chain of the first children instead (a batch mixing both)."""

    name = "oracle-tree"
    needs_features = ("last",)

    def __init__(self, target, chain_for=()):
        self.model, self.chain_for = target.model, set(chain_for)
        self.verdicts = []

    def _top(self, ids, m):
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([ids])).logits[0, -1].topk(m).indices.tolist()

    def propose(self, seq, k):
        ids = list(seq.ids)
        first = self._top(ids, 2)
        if seq.ids[0] in self.chain_for or k < 2:
            return Proposal(torch.tensor(first[:1] + self._top(ids + first[:1], 1)[: k - 1]), None)
        under_first, under_second = self._top(ids + first[:1], 2), self._top(ids + first[1:2], 1)
        return TreeProposal(first + under_first + under_second, [-1, -1, 0, 0, 1])

    def observe(self, seq, verdict):
        self.verdicts.append(verdict)


def pvalue(target, proposer, sampling, n=N_SAMPLES, **options):
    expected = exact_distribution(target, PROMPT, N_TOKENS, sampling)
    counts = sampled_distribution(target, proposer, PROMPT, N_TOKENS, sampling, n, **options)
    return chi_square_pvalue(counts, expected)


@pytest.fixture(scope="module")
def hf_small_target(small_vocab_dirs):
    return specplug.Target.from_pretrained(small_vocab_dirs["target"], lean=False)


@pytest.mark.parametrize("setting", SETTINGS)
def test_tree_speculative_sampling_matches_target_distribution(setting, small_target):
    proposer = RandomTreeProposer(small_target.vocab_size)
    assert pvalue(small_target, proposer, SETTINGS[setting]) > EXACTNESS_ALPHA
    assert any(len(getattr(v, "path", ())) == 2 for v in proposer.verdicts)  # deep paths were accepted too


@pytest.mark.parametrize("setting", SETTINGS)
def test_tree_drawn_from_the_targets_flattened_law_matches_target_distribution(setting, small_target):
    proposer = RandomTreeProposer(small_target.vocab_size, width=3, target=small_target)
    assert pvalue(small_target, proposer, SETTINGS[setting]) > EXACTNESS_ALPHA
    assert any(getattr(v, "path", [0])[0] > 0 for v in proposer.verdicts)  # later siblings were accepted


def test_tree_drawn_without_replacement_matches_target_distribution(small_target):
    proposer = RandomTreeProposer(small_target.vocab_size, width=3, without_replacement=True)
    assert pvalue(small_target, proposer, SETTINGS["temperature-1"]) > EXACTNESS_ALPHA


@pytest.mark.parametrize("without", [False, True])
def test_tree_on_hf_forward_with_a_4d_mask_matches_target_distribution(without, hf_small_target):
    proposer = RandomTreeProposer(hf_small_target.vocab_size, width=2, without_replacement=without)
    assert pvalue(hf_small_target, proposer, SETTINGS["temperature-1"]) > EXACTNESS_ALPHA


def test_exactness_check_rejects_the_residual_not_updated_after_a_rejected_sibling(small_target, monkeypatch):
    monkeypatch.setattr(tree_rule, "next_residual", lambda residual, q_sibling: residual)
    proposer = RandomTreeProposer(small_target.vocab_size, width=3, target=small_target)
    assert pvalue(small_target, proposer, SETTINGS["temperature-1"]) < EXACTNESS_ALPHA


def _leaky_mask(self):
    """The mutant: each node also sees its siblings (those drafted before it and after)."""
    mask = torch.zeros(self.n + 1, self.n + 1, dtype=torch.bool)
    mask[:, 0] = True
    siblings = earlier_siblings(self.parents)
    mask[1:, 1:] = tree_rule.ancestors(self.parents) | siblings | siblings.T
    return mask


@pytest.mark.parametrize("lean", [True, False])
def test_exactness_check_rejects_a_mask_that_lets_a_node_see_its_sibling(lean, small_target, hf_small_target,
                                                                         monkeypatch):
    monkeypatch.setattr(TreeProposal, "attention_mask", _leaky_mask)
    target = small_target if lean else hf_small_target
    proposer = RandomTreeProposer(target.vocab_size, width=3, target=target)
    assert pvalue(target, proposer, SETTINGS["temperature-1"]) < EXACTNESS_ALPHA


@pytest.mark.parametrize("setting", ["temperature-1", "top-k-3"])
@pytest.mark.parametrize("name", ["draft-model", "ngram"])
def test_block_verification_through_the_engine_matches_target_distribution(name, setting, small_vocab_dirs,
                                                                           small_target):
    options = {"model": small_vocab_dirs["draft"]} if name == "draft-model" else {}
    proposer = specplug.get_proposer(name, target=small_target, **options)
    assert pvalue(small_target, proposer, SETTINGS[setting], verification="block") > EXACTNESS_ALPHA


@pytest.mark.parametrize("lean", [True, False])
def test_greedy_tree_decoding_equals_target_only(lean, tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"], lean=lean)
    proposer = OracleTreeProposer(target)
    greedy = SamplingParams(temperature=0)
    want = specplug.generate(target, None, "def add(a, b):", max_new_tokens=40, sampling=greedy)
    got = specplug.generate(target, proposer, "def add(a, b):", max_new_tokens=40, sampling=greedy,
                            num_speculative_tokens=3, strict=True)
    assert got.tokens == want.tokens
    assert got.stats.target_calls < want.stats.target_calls  # the oracle's paths were accepted
    assert got.stats.nodes_scored_per_step > 3  # trees of 5 nodes (+ the last token) were scored
    trees = [v for v in proposer.verdicts if hasattr(v, "path")]
    assert trees and any(len(v.path) == 2 for v in trees)
    for v in proposer.verdicts:  # the features of [last, accepted path], as for a chain
        assert v.features["last"].shape[0] == v.accepted + 1 == len(getattr(v, "path", v.tokens[:-1])) + 1


def test_a_batch_mixing_chains_and_trees_decodes_each_row_as_target_only(tiny_target):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 12, 13, 14, 15], [20, 21]]
    greedy = SamplingParams(temperature=0)
    want = [specplug.generate(tiny_target, None, p, max_new_tokens=24, sampling=greedy).tokens for p in prompts]
    proposer = OracleTreeProposer(tiny_target, chain_for={5})
    got = specplug.generate_batch(tiny_target, proposer, prompts, max_new_tokens=24, sampling=greedy,
                                  num_speculative_tokens=3, strict=True)
    assert [r.tokens for r in got] == want
    kinds = {type(v).__name__ for v in proposer.verdicts}
    assert kinds == {"Verdict", "TreeVerdict"}


def test_sampled_batch_rows_emit_what_they_emit_decoded_alone(tiny_target):
    """Each tree row draws its uniforms from its own generator: the batch does not change a row's tokens."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    samplings = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    alone = [specplug.generate(tiny_target, RandomTreeProposer(tiny_target.vocab_size), p, max_new_tokens=16,
                               sampling=s, num_speculative_tokens=3).tokens for p, s in zip(prompts, samplings)]
    batch = specplug.generate_batch(tiny_target, RandomTreeProposer(tiny_target.vocab_size), prompts,
                                    max_new_tokens=16, sampling=samplings, num_speculative_tokens=3)
    assert [r.tokens for r in batch] == alone


@pytest.mark.parametrize("lean", [True, False])
def test_cache_after_a_tree_step_is_the_cache_of_its_accepted_chain(lean, tiny_dirs):
    """Score a tree, keep path a -> c -> e: the next step's logits are those after scoring [last, a, c, e] as
    a chain (bit for bit on the lean rows; within rounding on HF's padded forward, whose mask differs)."""
    target = specplug.Target.from_pretrained(tiny_dirs["target"], lean=lean)
    tree = TreeProposal([30, 31, 32, 33, 34, 35], [-1, -1, 0, 0, 2, 1])
    path = [0, 2, 4]
    prompts = [[1, 2, 3, 4, 9], [5, 6, 7]]
    rows, chain = target.new_rows(), target.new_rows()
    rows.add(prompts), chain.add(prompts)
    tree_scores = rows.score([[9] + tree.tokens.tolist(), [7, 11, 12]], trees=[tree, None])
    chain_scores = chain.score([[9] + tree.tokens[path].tolist(), [7, 11, 12]])
    rows.keep([8, 6], [tree.kept_block_indices(path), None])
    chain.keep([8, 6])
    assert rows.view(0).length == chain.view(0).length == 8
    close = torch.equal if lean else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=0))
    assert close(tree_scores.logits[tree_scores.span(0)][tree.kept_block_indices(path)],
                 chain_scores.logits[chain_scores.span(0)])
    assert close(rows.score([[21], [13]]).logits, chain.score([[21], [13]]).logits)


class TooDeep(RandomTreeProposer):
    def propose(self, seq, k):
        return TreeProposal([1, 2, 3], [-1, 0, 1], None)  # three deep, whatever k


def test_a_tree_deeper_than_k_is_an_error_naming_the_proposer(small_target):
    with pytest.raises(SpeculationError, match="random-tree.*3 deep when asked for at most 2"):
        specplug.generate(small_target, TooDeep(small_target.vocab_size), PROMPT, max_new_tokens=4,
                          num_speculative_tokens=2)


def test_a_tree_with_a_bad_parent_is_an_error_naming_the_proposer(small_target):
    class BadParent(RandomTreeProposer):
        def propose(self, seq, k):
            return TreeProposal([1, 2], [-1, 1], None)  # node 1 its own parent

    with pytest.raises(SpeculationError, match="random-tree.*node 1 has parent 1"):
        specplug.generate(small_target, BadParent(small_target.vocab_size), PROMPT, max_new_tokens=4)


def test_block_verification_of_a_tree_is_a_clear_error(small_target):
    with pytest.raises(SpeculationError, match="random-tree.*verification='block' verifies chains only"):
        specplug.generate(small_target, RandomTreeProposer(small_target.vocab_size), PROMPT, max_new_tokens=4,
                          verification="block")


def test_unknown_verification_is_an_error(small_target):
    with pytest.raises(ValueError, match="verification must be one of"):
        specplug.generate(small_target, None, PROMPT, max_new_tokens=2, verification="tree")
