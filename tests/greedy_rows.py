"""The check every form of the lean forward must pass: batched speculative greedy rows equal target-only output."""
from __future__ import annotations

import contextlib

import pytest

import specplug
from specplug import machine

PROMPTS = ("def add(a, b):", "hello hello hello", "for i in range(10):")


@contextlib.contextmanager
def pinned_forms(monkeypatch, setting: str):
    """``SPECPLUG_CHOICES=setting`` for targets loaded inside, with no machine choice remembered before or after."""
    monkeypatch.setenv(machine.OVERRIDE_ENV, setting)
    machine.forget()
    try:
        yield
    finally:
        machine.forget()


@contextlib.contextmanager
def kernel_form_pinned(monkeypatch, choice: str, form: str, load):
    """:func:`pinned_forms` for ``choice=form``, skipped where the form is "kernel" and ``load()`` finds none."""
    if form == "kernel" and load()[0] is None:
        pytest.skip(load()[1])
    with pinned_forms(monkeypatch, f"{choice}={form}"):
        yield


def assert_batched_greedy_rows_equal_target_only(target, proposer, prompts=PROMPTS, max_new_tokens: int = 40) -> None:
    batch = specplug.generate_batch(target, proposer, list(prompts), max_new_tokens=max_new_tokens,
                                    sampling=specplug.GREEDY, num_speculative_tokens=4, strict=True)
    for prompt, got in zip(prompts, batch):
        want = specplug.generate(target, None, prompt, max_new_tokens=max_new_tokens, sampling=specplug.GREEDY)
        assert got.tokens == want.tokens, prompt
