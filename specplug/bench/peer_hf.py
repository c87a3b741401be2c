"""Hugging Face transformers' own assisted generation on the same target, draft and prompts."""
from __future__ import annotations

import time

import torch

from specplug.metrics import GenerationStats


class HFPeer:
    """Runs ``model.generate(assistant_model=draft)`` and ``generate(prompt_lookup_num_tokens=γ)``, and plain
    ``generate()`` once per prompt (γ = 0): it shows how much of the difference is the forward, not the loop.

    HF reads its drafting knobs from the *draft's* generation_config, so they are set there: a constant
    γ and no confidence threshold, to match a fixed-γ specplug run.
    """

    def __init__(self, target, draft_model=None):
        self.target, self.draft = target, draft_model

    def __call__(self, prompt, sampling, max_new_tokens, gammas):
        ids = torch.tensor([self.target.encode(prompt)], device=self.target.device)
        yield ("hf-target-only", 0), self._run(ids, sampling, max_new_tokens)
        for g in gammas:
            if self.draft is not None:
                cfg = self.draft.generation_config
                cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = g, "constant"
                cfg.assistant_confidence_threshold = 0.0
                yield ("hf-assisted", g), self._run(ids, sampling, max_new_tokens, assistant_model=self.draft)
            yield ("hf-prompt-lookup", g), self._run(ids, sampling, max_new_tokens, prompt_lookup_num_tokens=g)

    def _run(self, ids, sampling, max_new_tokens, **extra):
        from .compare import Run

        eos = sorted(self.target.eos_token_ids)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                      eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
            torch.manual_seed(sampling.seed or 0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, **extra)
        wall = time.perf_counter() - t0
        tokens = out[0, ids.shape[1]:].tolist()
        stats = GenerationStats(wall_time=wall, prompt_tokens=ids.shape[1])
        stats.record_step(0, 0, 0, len(tokens), wall)
        return Run(stats, tokens)
