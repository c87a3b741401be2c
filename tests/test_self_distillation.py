"""Self-distillation data: corpus prefixes continued by the target itself, and heads trained on them."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import specplug
from specplug.cli import main
from specplug.heads import HeadMismatchError
from specplug.training.continuations import META, generate_continuations, read_continuations

EOS = 0  # the tiny tokenizer's <|endoftext|>


def corpus(target, n=300, seed=0):
    """A token stream without document boundaries, so each prefix is its whole window."""
    vocab = target.model.config.vocab_size
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_greedy_continuations_are_the_targets_own_greedy_decoding_of_corpus_windows(tiny_target, tmp_path):
    stream = corpus(tiny_target)
    out = generate_continuations(tiny_target, stream, EOS, tmp_path / "c", sequences=3, prefix_tokens=10,
                                 new_tokens=6, temperatures=(0.0,), proposer="ngram", gamma=2, batch_size=2,
                                 seed=5, log=lambda *a: None)
    starts = torch.randint(0, stream.numel() - 11, (3,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = []
    for s in starts:
        window = stream[s:s + 10].tolist()
        alone = specplug.generate(tiny_target, None, window, max_new_tokens=6, sampling=specplug.GREEDY)
        expected += [EOS, *window, *alone.tokens]
    assert read_continuations(out, tiny_target).tolist() == expected


def test_sampled_rows_alternate_with_greedy_ones_and_are_reproducible(tiny_target, tmp_path):
    stream = corpus(tiny_target)
    runs = [generate_continuations(tiny_target, stream, EOS, tmp_path / name, sequences=4, prefix_tokens=8,
                                   new_tokens=5, temperatures=(0.0, 1.0), proposer=None, log=lambda *a: None)
            for name in ("a", "b")]
    assert torch.equal(read_continuations(runs[0], tiny_target), read_continuations(runs[1], tiny_target))
    assert json.loads((runs[0] / META).read_text())["temperatures"] == [0.0, 1.0]


def test_continuations_resume_from_finished_chunks_and_refuse_other_settings(tiny_target, tmp_path):
    stream = corpus(tiny_target)
    settings = dict(sequences=2, prefix_tokens=8, new_tokens=4, proposer=None, log=lambda *a: None)
    out = generate_continuations(tiny_target, stream, EOS, tmp_path / "c", **settings)
    chunk = out / "chunk00000.safetensors"
    save_file({"ids": torch.tensor([EOS, 7, 7, 7], dtype=torch.int32)}, str(chunk))  # marks the finished chunk
    generate_continuations(tiny_target, stream, EOS, out, **settings)
    assert load_file(str(chunk))["ids"].tolist() == [EOS, 7, 7, 7]  # kept, not decoded again
    with pytest.raises(ValueError, match="other settings \\(new_tokens\\)"):
        generate_continuations(tiny_target, stream, EOS, out, **{**settings, "new_tokens": 5})


def test_continuations_of_one_target_are_refused_for_another(tiny_target, small_target, tmp_path):
    out = generate_continuations(tiny_target, corpus(tiny_target), EOS, tmp_path / "c", sequences=1,
                                 prefix_tokens=8, new_tokens=2, proposer=None, log=lambda *a: None)
    with pytest.raises(HeadMismatchError, match="--data .*continuations of target"):
        read_continuations(out, small_target)
    (out / "chunk00000.safetensors").unlink()
    with pytest.raises(ValueError, match="--data .*unfinished"):
        read_continuations(out, tiny_target)
    with pytest.raises(ValueError, match="--data .*no continuations.json"):
        read_continuations(tmp_path, tiny_target)


def test_head_training_reads_its_windows_from_the_continuations(tiny_dirs, tiny_target, tmp_path):
    from specplug.training.eagle import HeadTrainArgs, prepare_run

    out = generate_continuations(tiny_target, corpus(tiny_target), EOS, tmp_path / "c", sequences=4,
                                 prefix_tokens=10, new_tokens=8, proposer=None, log=lambda *a: None)
    stream = read_continuations(out, tiny_target).tolist()
    args = HeadTrainArgs(target=str(tiny_dirs["target"]), work_dir=str(tmp_path / "w" / "eagle"), tokens=48,
                         seq_len=8, batch_size=2, threads=1, data=str(out))
    _, data, _, _ = prepare_run(args, log=lambda *a: None)
    windows = data["tokens"].tolist()
    assert len(windows) == 6
    text = ",".join(map(str, stream))
    assert all(",".join(map(str, w)) in text for w in windows)  # every window is a run of the continuations


def test_continuations_command_runs_and_names_a_bad_temperature(tiny_dirs, tmp_path):
    from specplug.training.data import _tok_fingerprint

    cache = tmp_path / "cache"  # a corpus stream already tokenized, as `train` commands cache it
    cache.mkdir()
    ids = torch.randint(1, 200, (200,), generator=torch.Generator().manual_seed(1)).to(torch.int32)
    save_file({"ids": ids}, str(cache / f"tokens-train-{_tok_fingerprint(tiny_dirs['target'])}.safetensors"))
    args = ["train", "continuations", "--target", str(tiny_dirs["target"]), "--out", str(tmp_path / "c"),
            "--sequences", "2", "--prefix-tokens", "8", "--new-tokens", "3", "--proposer", "ngram", "-k", "2",
            "--cache-dir", str(cache)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "c" / "chunk00000.safetensors").is_file()
    bad = CliRunner().invoke(main, [*args[:4], "--out", str(tmp_path / "d"), "--temperatures", "0,hot"])
    assert bad.exit_code == 2 and "--temperatures" in bad.output and "'0,hot'" in bad.output
