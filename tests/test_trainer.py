"""The zoo's trainer: a stopped run resumes to the very weights of an unbroken one; distillation follows its teacher."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from specplug.training import trainer
from specplug.training.models import make_config

VOCAB = 48


def tiny_config(vocab_size: int = VOCAB):
    return make_config(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                       max_position_embeddings=64, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                       num_key_value_heads=2, intermediate_size=64)


def streams(vocab_size: int = VOCAB, stride: int = 1) -> dict[str, torch.Tensor]:
    """A learnable stream (counting by ``stride``, with some noise), and a held-out stretch of it."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(4000) * stride % vocab_size
    noisy = torch.rand(4000, generator=gen) < 0.1
    ids[noisy] = torch.randint(0, vocab_size, (int(noisy.sum()),), generator=gen)
    return {"train": ids[:3000], "heldout": ids[3000:]}


def args(work, **kw) -> trainer.TrainArgs:
    base = dict(work_dir=str(work), tokenizer_dir="unused", steps=6, batch_size=4, seq_len=16, lr=1e-2, warmup=2,
                ckpt_every=100, threads=1, eval_tokens=256)
    return trainer.TrainArgs(**{**base, **kw})


def quiet(*_):
    pass


def test_a_run_stopped_by_a_signal_resumes_to_the_weights_of_an_unbroken_run(tmp_path, monkeypatch):
    unbroken = trainer.train(args(tmp_path / "unbroken"), tiny_config(), log=quiet, streams=streams())
    assert unbroken["finished"]

    batches = trainer.batch_for_step

    def interrupted_at_step_2(stream, step, *rest):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C during the third step
        return batches(stream, step, *rest)

    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(trainer, "batch_for_step", interrupted_at_step_2)
    stopped = trainer.train(args(tmp_path / "broken"), tiny_config(), log=quiet, streams=streams())
    assert not stopped["finished"] and stopped["step"] == 3  # the step under way finishes, then it saves
    assert signal.getsignal(signal.SIGINT) is handler
    monkeypatch.undo()
    resumed = trainer.train(args(tmp_path / "broken"), log=quiet, streams=streams())  # config from the run
    assert resumed["finished"] and resumed["steps"] == 6 and resumed["tokens_seen"] == unbroken["tokens_seen"]

    want = load_file(str(tmp_path / "unbroken" / "ckpt" / "model.safetensors"))
    got = load_file(str(tmp_path / "broken" / "ckpt" / "model.safetensors"))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[name], got[name]) for name in want)
    assert resumed["val_loss"] == unbroken["val_loss"]
    logged = (tmp_path / "broken" / "log.tsv").read_text().splitlines()
    assert logged[0].startswith("step\t") and [line.split("\t")[0] for line in logged[1:]] == list("123456")


def test_distillation_moves_the_student_toward_its_teacher(tmp_path):
    # the teacher learnt to count by 5, the student's stream counts by 1: only the teacher can pull it its way
    trainer.train(args(tmp_path / "teacher", steps=30), tiny_config(), log=quiet, streams=streams(stride=5))
    teacher = trainer.load_trained(tmp_path / "teacher")
    student_args = args(tmp_path / "student", steps=30, seed=7, teacher=str(tmp_path / "teacher"))
    x = streams()["heldout"][:64].reshape(4, 16)

    def divergence(model) -> float:
        with torch.no_grad():
            return trainer._kd_loss(model(input_ids=x).logits, teacher(input_ids=x).logits, 1.0).item()

    before = divergence(trainer.build_model(tiny_config(), seed=7).eval())
    assert trainer.train(student_args, tiny_config(), log=quiet, streams=streams())["finished"]
    after = divergence(trainer.load_trained(tmp_path / "student"))
    assert after < 0.5 * before


def test_a_teacher_with_another_vocabulary_is_refused_by_name(tmp_path):
    trainer.train(args(tmp_path / "teacher", steps=1), tiny_config(VOCAB + 16), log=quiet,
                  streams=streams(VOCAB + 16))
    with pytest.raises(ValueError, match=r"teacher .*teacher has a vocabulary of 64 tokens, the student 48"):
        trainer.train(args(tmp_path / "student", teacher=str(tmp_path / "teacher")), tiny_config(), log=quiet,
                      streams=streams())


def test_a_fresh_run_without_a_config_says_so(tmp_path):
    with pytest.raises(ValueError, match="fresh run needs a model config"):
        trainer.train(args(tmp_path / "run"), log=quiet, streams=streams())
