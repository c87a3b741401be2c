"""The bad-input table (docs/design.md, "Bad input"), row by row: each is a clear error naming the culprit (or a
documented, counted fallback), and nothing already generated is lost."""
import json

import pytest
import torch

import specplug
from specplug.types import Proposal, Proposer


class Raising(Proposer):
    name = "raiser"

    def propose(self, seq, k):
        if len(seq.output_ids) >= 5:
            raise RuntimeError("boom")
        return Proposal.empty()


class TooMany(Proposer):
    name = "too-many"

    def propose(self, seq, k):
        return Proposal.point_mass([1] * (k + 1))


class BadAfterFive(Proposer):
    """Honest (empty proposals) for five tokens, then returns ``make(vocab_size)`` as its proposal."""

    def __init__(self, name, make):
        self.name, self.make = name, make

    def propose(self, seq, k):
        return self.make(seq.target.vocab_size) if len(seq.output_ids) >= 5 else Proposal.empty()


def _q_zero(V):
    q = torch.zeros(1, V)
    q[0, 2] = 1.0
    return Proposal(torch.tensor([1]), q)


@pytest.fixture(params=["single", "batched"])
def decode(request):
    """The same request alone (``generate``) or as row 0 of a batch beside a twin (``generate_batch``): one engine,
    one set of rules. Returns row 0's result."""
    if request.param == "single":
        return specplug.generate

    def batched(target, proposer, prompt, **options):
        return specplug.generate_batch(target, proposer, [prompt, prompt], **options)[0]
    return batched


BAD_PROPOSALS = [
    ("zero-q", _q_zero, "q = 0"),
    ("not-a-distribution", lambda V: Proposal(torch.tensor([1]), torch.full((1, V), 0.5)), "not a distribution"),
    ("out-of-range", lambda V: Proposal.point_mass([V + 3]), "outside the target vocabulary"),
    ("negative-id", lambda V: Proposal.point_mass([1, -2]), "id -2 at position 1 is outside the target vocabulary"),
    ("wrong-shape", lambda V: Proposal(torch.tensor([1]), torch.full((1, V - 1), 1 / (V - 1))), "shape"),
    ("extra-q-rows", lambda V: Proposal(torch.tensor([1]), torch.full((2, V), 1 / V)), "rows"),
]


def test_raising_proposer_falls_back_to_target_steps_counted_and_warned_once(tiny_target, decode):
    with pytest.warns(UserWarning, match="raiser") as caught:
        result = decode(tiny_target, Raising(), "def add(a, b):", max_new_tokens=20, sampling=specplug.GREEDY)
    base = specplug.generate(tiny_target, None, "def add(a, b):", max_new_tokens=20, sampling=specplug.GREEDY)
    assert result.tokens == base.tokens
    # steps 6..19 raise (the 20th asks for no draft: one token left)
    assert result.stats.fallback_steps == 14 and len([w for w in caught if "raiser" in str(w.message)]) == 1


def test_raising_proposer_in_strict_mode_is_an_error_naming_it_with_partial_output(tiny_target, decode):
    with pytest.raises(specplug.SpeculationError, match="proposer 'raiser'.*boom") as info:
        decode(tiny_target, Raising(), "def add(a, b):", max_new_tokens=20, strict=True,
               sampling=specplug.SamplingParams(seed=0))
    assert info.value.proposer == "raiser" and len(info.value.partial.tokens) == 5


def test_more_tokens_than_asked_is_an_error_naming_the_proposer(tiny_target, decode):
    with pytest.raises(specplug.SpeculationError, match="proposer 'too-many'.*proposed .* when asked for at most"):
        decode(tiny_target, TooMany(), "def add(a, b):", max_new_tokens=20)


@pytest.mark.parametrize("name, make, message", BAD_PROPOSALS, ids=[b[0] for b in BAD_PROPOSALS])
def test_invalid_proposal_is_an_error_naming_the_proposer_and_keeping_the_output(name, make, message, tiny_target,
                                                                                decode):
    with pytest.raises(specplug.SpeculationError, match=f"proposer '{name}'.*{message}") as info:
        decode(tiny_target, BadAfterFive(name, make), "def add(a, b):", max_new_tokens=20, sampling=specplug.GREEDY)
    base = specplug.generate(tiny_target, None, "def add(a, b):", max_new_tokens=5, sampling=specplug.GREEDY)
    assert info.value.partial.tokens == base.tokens  # the five tokens before the bad proposal survive


def test_empty_prompt_is_an_error(tiny_target, decode):
    for empty in ("", []):
        with pytest.raises(ValueError, match="empty prompt"):
            decode(tiny_target, None, empty)


def test_a_proposer_name_in_place_of_a_proposer_is_an_error_saying_how_to_build_one(tiny_target, decode):
    with pytest.raises(TypeError, match=r"got str 'ngram'; build a registered one with specplug.get_proposer\('ngram'\)"):
        decode(tiny_target, "ngram", [1, 2, 3])
    with pytest.raises(TypeError, match="proposer must be a Proposer"):
        decode(tiny_target, object(), [1, 2, 3])


def test_prompt_longer_than_positions_is_an_error(tiny_target, decode):
    with pytest.raises(ValueError, match="positions"):
        decode(tiny_target, None, [1] * 600)


def test_prompt_token_out_of_range_is_an_error(tiny_target, decode):
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        decode(tiny_target, None, [1, 10_000])


def test_draft_with_another_vocabulary_is_refused_when_composed(tiny_target, small_vocab_dirs):
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        specplug.get_proposer("draft-model", target=tiny_target, model=small_vocab_dirs["draft"])


def test_pickled_weights_are_refused(tmp_path, tiny_dirs):
    (tmp_path / "config.json").write_text((tiny_dirs["target"] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(ValueError, match="safetensors only"):
        specplug.Target.from_pretrained(tmp_path)


def test_unknown_proposer_lists_the_available_ones(tiny_target):
    with pytest.raises(specplug.UnknownProposerError, match="available: .*draft-model.*ngram"):
        specplug.get_proposer("nope", target=tiny_target)


def test_unknown_option_names_the_proposer(tiny_target):
    with pytest.raises(TypeError, match="proposer 'ngram'"):
        specplug.get_proposer("ngram", target=tiny_target, colour="blue")


def test_tokenizers_of_equal_size_but_different_ids_are_refused(tiny_dirs, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    for f in tiny_dirs["draft"].iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    target = specplug.Target.from_pretrained(tiny_dirs["target"])
    with pytest.raises(ValueError, match="different ids"):
        specplug.get_proposer("draft-model", target=target, model=draft)


def test_a_prompt_id_that_is_not_an_integer_is_refused_not_truncated(tiny_target, decode):
    with pytest.raises(TypeError, match="prompt token id must be an integer, got 1.5"):
        decode(tiny_target, None, [1.5, 2])
    assert decode(tiny_target, None, torch.tensor([1, 2]), max_new_tokens=2).tokens  # integer tensors are ids


def test_max_batch_size_zero_is_refused_not_read_as_all_at_once(tiny_target):
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="max_batch_size must be"):
            specplug.generate_batch(tiny_target, None, [[1, 2], [3, 4]], max_new_tokens=2, max_batch_size=bad)


def test_one_stop_string_is_one_stop_string_not_its_characters():
    from types import SimpleNamespace

    from specplug.stopping import Stopper
    from specplug.types import SequenceState

    letters = SimpleNamespace(eos_token_ids=set(), max_positions=None,
                              decode=lambda ids: "".join(chr(ord("a") + i) for i in ids))
    # the output "cafedb": read as characters, "fed" would stop at its "f"; as one string, after "fed"
    ended = {}
    for stop in ("fed", ["fed"]):
        seq = SequenceState(ids=[7], num_prompt=1, sampling=specplug.GREEDY, rng=torch.Generator(), target=letters)
        ended[str(stop)] = Stopper(letters, stop).emit(seq, [2, 0, 5, 4, 3, 1], remaining=10)
    assert ended["fed"] == ended["['fed']"] == ([2, 0, 5, 4, 3], "stop")


@pytest.mark.parametrize("stop, error", [([""], ValueError), ([3], TypeError), ("", ValueError)])
def test_an_empty_or_non_string_stop_is_refused(tiny_target, decode, stop, error):
    with pytest.raises(error, match="stop: each stop string must be a non-empty str"):
        decode(tiny_target, None, [1, 2, 3], max_new_tokens=2, stop=stop)


@pytest.mark.parametrize("option, value", [("temperature", "1"), ("top_k", 2.5), ("top_p", "x"), ("seed", "a"),
                                           ("top_k", True)])
def test_sampling_params_of_the_wrong_type_name_the_parameter(option, value):
    with pytest.raises(TypeError, match=f"SamplingParams: {option} must be"):
        specplug.SamplingParams(**{option: value})


def test_an_unknown_option_names_only_the_unknown_ones_and_what_the_proposer_takes(tiny_target):
    with pytest.raises(TypeError, match=r"proposer 'ngram': bad options \['colour'\]; it takes target, "
                                        r"prompt_lookup_min, prompt_lookup_max, q"):
        specplug.get_proposer("ngram", target=tiny_target, colour="blue")


def test_an_option_of_the_wrong_type_is_refused_by_name(tiny_target):
    with pytest.raises(TypeError, match="proposer 'ngram': option prompt_lookup_max takes an int, got 'abc'"):
        specplug.get_proposer("ngram", target=tiny_target, prompt_lookup_max="abc")
    with pytest.raises(TypeError, match="proposer 'suffix': option factor takes a float, got 'big'"):
        specplug.get_proposer("suffix", target=tiny_target, factor="big")
    assert specplug.get_proposer("suffix", target=tiny_target, factor=2)  # an int is a float here


@pytest.mark.parametrize("options, message", [({"max_gamma": -1}, "max_gamma must be an int >= 0"),
                                              ({"probe_every": 0}, "probe_every must be an int >= 1"),
                                              ({"decay": 1.5}, r"decay must lie in \(0, 1\)"),
                                              ({"prior_alpha": "high"}, r"prior_alpha must lie in \[0, 1\]"),
                                              ({"switch_on_margin": -0.1}, "switch_on_margin must be >= 0")])
def test_policy_options_out_of_range_name_the_policy_and_the_option(options, message):
    from specplug.policies import CostModelPolicy, HeuristicPolicy

    with pytest.raises(ValueError, match=f"cost-model: {message}"):
        CostModelPolicy(**options)
    with pytest.raises(ValueError, match="heuristic: gamma must be an int >= 0"):
        HeuristicPolicy(gamma=-2)


def test_a_target_path_that_does_not_exist_says_so(tmp_path):
    with pytest.raises(OSError, match="does not exist; a local model is a directory"):
        specplug.Target.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(OSError, match="is a file"):
        specplug.Target.from_pretrained(tmp_path / "weights.safetensors")


@pytest.mark.parametrize("prompts, what", [("def f():", "a string"), ([1, 2, 3], "a list of token ids")])
def test_one_prompt_given_where_a_list_of_prompts_goes_is_refused_not_split(tiny_target, prompts, what):
    with pytest.raises(TypeError, match=f"prompts must be a list of prompts, got {what}: for one prompt pass"):
        specplug.generate_batch(tiny_target, None, prompts, max_new_tokens=2)


def test_a_prompt_that_is_neither_text_nor_ids_is_a_clear_error(tiny_target, decode):
    with pytest.raises(TypeError, match="a prompt is a string or a sequence of token ids, got NoneType"):
        decode(tiny_target, None, None, max_new_tokens=2)


def test_sampling_that_is_not_sampling_params_is_a_clear_error(tiny_target, decode):
    with pytest.raises(TypeError, match="sampling must be a SamplingParams .*got dict"):
        decode(tiny_target, None, [1, 2], max_new_tokens=2, sampling={"temperature": 0})


def test_a_callback_that_cannot_be_called_is_refused_before_decoding(tiny_target):
    calls = []
    proposer = Raising()
    proposer.begin = lambda seq: calls.append("begin")
    with pytest.raises(TypeError, match="callback must be callable"):
        specplug.generate(tiny_target, proposer, [1, 2], max_new_tokens=2, callback=3)
    with pytest.raises(TypeError, match="callback must be callable"):
        specplug.generate_batch(tiny_target, proposer, [[1, 2]], max_new_tokens=2, callback=3)
    assert calls == []  # refused before any request began


@pytest.mark.parametrize("bad", [2.5, "8", True])
def test_a_max_new_tokens_that_is_not_an_integer_is_refused_not_truncated(tiny_target, decode, bad):
    with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
        decode(tiny_target, None, [1, 2, 3], max_new_tokens=bad)


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_strict_must_be_a_bool_not_any_truthy_value(tiny_target, decode, bad):
    with pytest.raises(TypeError, match="strict must be True or False"):
        decode(tiny_target, None, [1, 2, 3], max_new_tokens=2, strict=bad)
