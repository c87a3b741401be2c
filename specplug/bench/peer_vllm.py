"""vLLM on the same target, prompts, temperatures and γ as ``specplug compare`` (``--peer vllm``).

One engine per vLLM method and γ, started once and kept for the whole run so that its runs interleave with
ours (prompt by prompt, as the HF peer's do). The matching methods:

========================  ==========================================  ====================
vLLM                      speculative_config                          ours
========================  ==========================================  ====================
``vllm-target-only``      none                                        target-only
``vllm-draft-model``      ``draft_model`` with the same draft          ``draft-model``
``vllm-ngram``            ``ngram``, same prompt_lookup_min/max        ``ngram`` (q=point)
``vllm-eagle3``           ``eagle3`` with the head directory given     ``eagle3`` / ``eagle``
``vllm-specplug-NAME``    ``custom_class``: specplug's NAME inside     NAME (suffix, ngram with q=counts,
                          vLLM (:mod:`specplug.integrations.vllm`)     model-free plugins)
========================  ==========================================  ====================

τ is vLLM's own: 1 + accepted / drafts from its ``spec_decode`` counters (``llm.get_metrics()``), read
before and after each run. The engine runs the products in the target's matmul dtype (float32 targets in
float32), one request at a time here; its worker's CPU threads follow vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
(default: vLLM's own choice, which keeps one core for its scheduler process). ``SPECPLUG_VLLM_EAGER=1``
skips vLLM's compilation (faster start, slower steps: for tests and quick looks).

The engines live for the whole run, so a cross-request cache inside vLLM (``vllm-specplug-suffix``) keeps
learning across temperatures, workloads and repeats, where ours starts afresh per cell and repeat.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from specplug import zoo
from specplug.integrations.vllm import engine_kwargs, require_vllm
from specplug.metrics import GenerationStats
from specplug.plugins import get_proposer

PREFIX = "vllm-"
# how long vLLM's idle worker keeps spinning on its message queue after a request (shm_broadcast's busy
# loop, 1 s): waited out after each run so that the spin never overlaps our next measured run
IDLE_SPIN_S = 1.1
DEFAULT_KV_GIB = "1"


@dataclass(frozen=True)
class Method:
    """A vLLM engine configuration and which of our cells it is measured against."""

    label: str
    ours: str
    speculative: dict | None = None  # speculative_config without num_speculative_tokens
    additional: dict | None = None

    def engine_options(self, gamma: int) -> dict:
        if self.speculative is None:
            return {}
        out = {"speculative_config": dict(self.speculative, num_speculative_tokens=int(gamma))}
        if self.additional:
            out["additional_config"] = self.additional
        return out


@dataclass
class PeerRun:
    """One request decoded by vLLM: its tokens, wall time, and vLLM's acceptance counters for it."""

    stats: GenerationStats
    tokens: list[int]
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    @property
    def seconds_per_token(self) -> float:
        return self.stats.wall_time / max(self.stats.new_tokens, 1)


def pooled_acceptance(runs) -> dict:
    """τ (1 + accepted / drafts) and accepted / drafted over runs that carry a peer's own counters; None
    where none does (the HF peer keeps no counters)."""
    runs = [r for r in runs if isinstance(r, PeerRun)]
    drafts = sum(r.drafts for r in runs)
    drafted = sum(r.draft_tokens for r in runs)
    accepted = sum(r.accepted for r in runs)
    return {"mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None}


def model_dir(target) -> str:
    """The target's directory, which vLLM loads itself."""
    if target.path is None:
        raise ValueError(f"--peer vllm needs a target directory vLLM can load; {target.name!r} has none")
    return str(target.path)


def _draft_dir(target, options: dict) -> str:
    model = options.get("model")
    if model is None:
        short = target.name[len(zoo.PREFIX):] if zoo.is_zoo_name(target.name) else None
        if short not in zoo.DEFAULT_DRAFT:
            raise ValueError("draft-model needs model= (a directory) for vLLM's draft_model method")
        model = zoo.PREFIX + zoo.DEFAULT_DRAFT[short]
    return str(zoo.resolve(model) if zoo.is_zoo_name(str(model)) else Path(model))


def methods_for(target, specs) -> tuple[list[Method], list[dict]]:
    """vLLM's counterpart of each of our specs (target-only first); the specs without one, with the reason."""
    methods = [Method(PREFIX + "target-only", "target-only")]
    skipped = []
    for spec in specs:
        try:
            method = _method(target, spec)
        except (ValueError, TypeError) as exc:
            skipped.append({"proposer": f"{PREFIX}{spec.label}", "reason": str(exc)})
            continue
        if method is not None and method.label not in {m.label for m in methods}:
            methods.append(method)
    return methods, skipped


def _method(target, spec) -> Method | None:
    opts = spec.options
    if spec.name == "draft-model":
        return Method(PREFIX + "draft-model", spec.label, {"method": "draft_model", "model": _draft_dir(target, opts)})
    if spec.name == "ngram" and opts.get("q", "point") == "point":
        return Method(PREFIX + "ngram", spec.label, {"method": "ngram",
                                                      "prompt_lookup_min": int(opts.get("prompt_lookup_min", 1)),
                                                      "prompt_lookup_max": int(opts.get("prompt_lookup_max", 3))})
    if opts.get("speculators"):  # a feature head exported in the speculators format (EAGLE-3)
        return Method(PREFIX + "eagle3", spec.label, {"method": "eagle3", "model": str(opts["speculators"])})
    proposer = get_proposer(spec.name, target=target, **opts)
    if proposer.needs_features:
        raise ValueError(f"{spec.label} needs target features: give -p {spec.name}:speculators=DIR (an exported "
                         "EAGLE-3 head) to serve it with vLLM's eagle3 method")
    kwargs = engine_kwargs(spec.name, 1, **opts)
    spec_cfg = {k: v for k, v in kwargs["speculative_config"].items() if k != "num_speculative_tokens"}
    return Method(f"{PREFIX}specplug-{spec.label}", spec.label, spec_cfg, kwargs["additional_config"])


def start_engine(model: str, *, dtype: str = "float32", max_num_seqs: int = 1, max_model_len: int = 2048,
                 enforce_eager: bool = False, seed: int = 0, **options):
    """A ``vllm.LLM`` for ``model`` with vLLM's statistics on; this process keeps its torch thread count."""
    vllm = require_vllm()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_GIB)  # GiB; vLLM's default takes far more
    threads = torch.get_num_threads()  # vLLM drops the caller's torch threads to 1 "for serving"
    try:
        return vllm.LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        enforce_eager=enforce_eager, seed=seed, disable_log_stats=False, **options)
    finally:
        torch.set_num_threads(threads)


def shutdown(llm) -> None:
    """Stop an engine's processes now (they would otherwise live until garbage collection)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def counters(llm) -> dict[str, int]:
    """vLLM's cumulative speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
    return out


def sampling_params(sampling, max_new_tokens: int):
    """vLLM's SamplingParams for ours: same temperature, top-k/top-p, seed; EOS ends a request as ours."""
    vllm = require_vllm()
    if sampling.greedy:
        return vllm.SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    return vllm.SamplingParams(max_tokens=max_new_tokens, temperature=sampling.temperature,
                               top_k=sampling.top_k or 0, top_p=sampling.top_p, seed=sampling.seed)


def run_requests(llm, prompts: Sequence[Sequence[int]], params) -> tuple[list[list[int]], float, dict]:
    """Decode token-id prompts together; (token ids per prompt, wall seconds, counters' increase)."""
    from vllm.inputs import TokensPrompt

    before = counters(llm)
    t0 = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = counters(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], wall, {k: after[k] - before[k] for k in after}


class VLLMPeer:
    """The ``--peer vllm`` runner: ``peer(prompt, sampling, max_new_tokens, gammas)`` yields
    ``((label, γ), PeerRun)`` for every vLLM method, as :class:`specplug.bench.peer_hf.HFPeer` does."""

    def __init__(self, target, specs, gammas: Iterable[int], *, enforce_eager: bool | None = None):
        require_vllm()
        if enforce_eager is None:  # SPECPLUG_VLLM_EAGER=1: skip vLLM's compilation (tests, quick looks)
            enforce_eager = os.environ.get("SPECPLUG_VLLM_EAGER") == "1"
        self.target = target
        self.model = model_dir(target)
        self.dtype = str(target.matmul_dtype or target.dtype).replace("torch.", "")
        self.methods, self.skipped = methods_for(target, specs)
        self.ours = {m.label: m.ours for m in self.methods}
        self.enforce_eager = enforce_eager
        self.engines: dict[tuple[str, int], object] = {}
        for method in self.methods:
            for g in ([0] if method.speculative is None else list(gammas)):
                self.engines[(method.label, g)] = start_engine(self.model, dtype=self.dtype,
                                                               enforce_eager=enforce_eager,
                                                               **method.engine_options(g))

    @property
    def runs_per_prompt(self) -> int:
        return len(self.engines)

    def __call__(self, prompt, sampling, max_new_tokens, gammas):
        ids = self.target.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = sampling_params(sampling, max_new_tokens)
        for (label, g), llm in self.engines.items():
            (tokens,), wall, c = run_requests(llm, [ids], params)
            time.sleep(IDLE_SPIN_S)
            stats = GenerationStats(wall_time=wall, prompt_tokens=len(ids))
            stats.record_step(0, 0, 0, len(tokens), wall)
            yield (label, g), PeerRun(stats, tokens, c["drafts"], c["draft_tokens"], c["accepted"])

    def close(self) -> None:
        for llm in self.engines.values():
            shutdown(llm)
        self.engines.clear()
