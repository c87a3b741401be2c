"""The side-by-side bench: proposers x temperatures x γ x workloads on one target, target-only always in the
same run, runs interleaved (baseline, cell, cell, ..., baseline, ...) so machine drift hits all alike.

Speed-up of a cell = median over paired runs (same prompt, sample, repeat, temperature) of
(baseline seconds per token) / (cell seconds per token). c = drafting time per drafted token / the
baseline's target step time, so the predicted speed-up uses Leviathan's definitions.
"""
from __future__ import annotations

import platform
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from specplug.decode import generate
from specplug.metrics import GenerationStats, aggregate, predicted_speedup
from specplug.plugins import get_proposer, list_proposers
from specplug.sampling import SamplingParams
from specplug.target import Target

from .workloads import Workload

SCHEMA = "specplug.compare/1"


@dataclass(frozen=True)
class ProposerSpec:
    """``name`` or ``name:key=value,key=value`` as given on the command line."""

    label: str
    name: str
    options: dict = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def parse(cls, text: str) -> "ProposerSpec":
        import json

        name, _, rest = text.partition(":")
        options = {}
        for pair in filter(None, rest.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"proposer spec {text!r}: {pair!r} is not key=value")
            try:
                options[key] = json.loads(value)
            except json.JSONDecodeError:
                options[key] = value
        return cls(text, name, options)


def attachable(target: Target, specs: Sequence[ProposerSpec]) -> tuple[list[ProposerSpec], list[dict]]:
    """Keep the proposers that can be built for ``target``; the others are skipped with the reason."""
    ok, skipped = [], []
    for spec in specs:
        try:
            get_proposer(spec.name, target=target, **spec.options)
        except Exception as exc:  # any failure to attach is a reason to skip, shown in the report
            skipped.append({"proposer": spec.label, "reason": f"{type(exc).__name__}: {exc}"})
        else:
            ok.append(spec)
    return ok, skipped


def all_proposer_specs() -> list[ProposerSpec]:
    return [ProposerSpec(name, name) for name in list_proposers()]


@dataclass
class _Run:
    stats: GenerationStats
    tokens: list[int]

    @property
    def seconds_per_token(self) -> float:
        return self.stats.wall_time / max(self.stats.new_tokens, 1)


def run_compare(target: Target, specs: Sequence[ProposerSpec], workloads: Sequence[Workload], *,
                gammas: Sequence[int] = (2, 4, 6), temperatures: Sequence[float] = (0.0, 1.0),
                max_new_tokens: int = 128, repeats: int = 1, warmup: bool = True, peer: str | None = None,
                progress: Callable[[int, str], None] | None = None) -> dict:
    """Run the matrix and return the report dict (schema ``specplug.compare/1``, see docs in README)."""
    specs, skipped = attachable(target, specs)
    cells = [(s, g) for s in specs for g in gammas]
    runs: dict[tuple, list[tuple[tuple, _Run]]] = {}
    memory: dict[str, int] = {}
    peer_runner = _peer(peer, target, specs, gammas) if peer else None

    def step(note: str) -> None:
        if progress is not None:
            progress(1, note)

    if warmup:
        generate(target, None, "def f(x):\n", max_new_tokens=8)
        for spec in specs:
            generate(target, get_proposer(spec.name, target=target, **spec.options), "def f(x):\n", max_new_tokens=8)
    for rep in range(repeats):
        for wl in workloads:
            # a fresh proposer per cell and repeat: cross-request caches learn within their cell only
            live = {(s.label, g, t): get_proposer(s.name, target=target, **s.options)
                    for s, g in cells for t in temperatures}
            for (label, _, _), proposer in live.items():
                memory.setdefault(label, int(proposer.memory_bytes()))
            for pi, prompt in enumerate(wl.prompts):
                for sample in range(wl.samples):
                    for t in temperatures:
                        sampling = SamplingParams(temperature=t, seed=1000 * rep + sample)
                        pair = (wl.name, pi, sample, rep, t)
                        base = _one(target, None, prompt, sampling, max_new_tokens, 0)
                        runs.setdefault(("baseline", wl.name, t), []).append((pair, base))
                        step(f"{wl.name} T={t} target-only")
                        for spec, g in cells:
                            r = _one(target, live[(spec.label, g, t)], prompt, sampling, max_new_tokens, g)
                            runs.setdefault((spec.label, wl.name, t, g), []).append((pair, r))
                            step(f"{wl.name} T={t} {spec.label} γ={g}")
                        if peer_runner is not None:
                            for key, r in peer_runner(prompt, sampling, max_new_tokens, gammas):
                                runs.setdefault(key + (wl.name, t), []).append((pair, r))
                                step(f"{wl.name} T={t} {key[0]}")
    # which of our cells each peer is measured against: the first spec of the matching proposer
    ours = {peer_name: next((s.label for s in specs if s.name == name), None)
            for peer_name, name in (("hf-assisted", "draft-model"), ("hf-prompt-lookup", "ngram"))}
    ours["hf-target-only"] = "target-only"
    if peer_runner is not None and hasattr(peer_runner, "close"):  # vLLM: its engines' processes
        peer_runner.close()
        ours.update(peer_runner.ours)
        skipped += peer_runner.skipped
    return _report(target, runs, ours, skipped, memory, workloads, gammas, temperatures, max_new_tokens,
                   repeats, peer)


def _one(target, proposer, prompt, sampling, max_new_tokens, gamma) -> _Run:
    result = generate(target, proposer, prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                      num_speculative_tokens=gamma)
    return _Run(result.stats, result.tokens)


def count_runs(specs, workloads, gammas, temperatures, repeats, peer_runs_per_prompt: int = 0) -> int:
    per_prompt = len(temperatures) * (1 + len(specs) * len(gammas) + peer_runs_per_prompt)
    return repeats * sum(len(w.prompts) * w.samples for w in workloads) * per_prompt


def _median(values):
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def target_info(target) -> dict:
    """The report's description of the target (shared with the load bench)."""
    return {"name": target.name, "parameters": sum(p.numel() for p in target.model.parameters()),
            "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
            "matmul_dtype": str(target.matmul_dtype or target.dtype).replace("torch.", "")}


def _report(target, runs, ours, skipped, memory, workloads, gammas, temperatures, max_new_tokens, repeats, peer):
    report = {
        "schema": SCHEMA,
        "target": target_info(target),
        "settings": {"max_new_tokens": max_new_tokens, "repeats": repeats, "gammas": list(gammas),
                     "temperatures": list(temperatures), "peer": peer,
                     "workloads": [{"name": w.name, "prompts": len(w.prompts), "samples": w.samples}
                                   for w in workloads]},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "platform": platform.platform()},
        "skipped": skipped, "baseline": [], "cells": [], "peer": [],
    }
    base_by_pair, base_step = {}, {}
    for (kind, *rest), entries in runs.items():
        if kind != "baseline":
            continue
        wl, t = rest
        base_by_pair.update({pair: r for pair, r in entries})
        pooled = aggregate([r.stats for _, r in entries])
        base_step[(wl, t)] = _median([r.stats.target_time / r.stats.target_calls for _, r in entries])
        report["baseline"].append({
            "workload": wl, "temperature": t, "runs": len(entries),
            "tokens_per_second": _median([r.stats.tokens_per_second for _, r in entries]),
            "target_step_time_s": base_step[(wl, t)],
            "token_latency_p50_s": pooled["token_latency_p50_s"], "token_latency_p99_s": pooled["token_latency_p99_s"],
            "time_to_finish_p50_s": pooled["time_to_finish_p50_s"], "time_to_finish_p90_s": pooled["time_to_finish_p90_s"],
        })
    for key, entries in runs.items():
        if key[0] == "baseline":
            continue
        if key[0].startswith(PEER_PREFIXES):
            report["peer"].append(_peer_row(key, entries, base_by_pair, runs, ours))
            continue
        label, wl, t, g = key
        pooled = aggregate([r.stats for _, r in entries])
        speedups = [base_by_pair[pair].seconds_per_token / r.seconds_per_token for pair, r in entries]
        alpha = pooled["alpha"]  # per-position, as the formula means it
        draft_per_token = pooled["draft_time_s"] / pooled["draft_tokens"] if pooled["draft_tokens"] else None
        c = draft_per_token / base_step[(wl, t)] if draft_per_token is not None and base_step[(wl, t)] else None
        predicted = predicted_speedup(alpha, pooled["mean_gamma"], c) if alpha is not None and c is not None else None
        # the verify pass scores γ + 1 tokens: its cost in baseline steps, measured in this very cell
        verify_cost = (pooled["target_time_s"] / pooled["target_calls"] / base_step[(wl, t)]
                       if pooled["target_calls"] and base_step[(wl, t)] else None)
        predicted_v = (predicted_speedup(alpha, pooled["mean_gamma"], c, verify_cost)
                       if predicted is not None and verify_cost is not None else None)
        # the speed-up this cell's own tokens per call, c and v allow: what is left is the loop's overhead
        # (Leviathan's formula also assumes each position is accepted independently with one α)
        accounted = (pooled["mean_acceptance_length"] / (pooled["mean_gamma"] * c + verify_cost)
                     if c is not None and verify_cost and pooled["mean_acceptance_length"] else None)
        measured = _median(speedups)
        greedy_equal = (all(r.tokens == base_by_pair[pair].tokens for pair, r in entries) if t == 0 else None)
        by_sample = {}
        for pair, r in entries:
            by_sample.setdefault(pair[2], []).append(base_by_pair[pair].seconds_per_token / r.seconds_per_token)
        report["cells"].append({
            "proposer": label, "workload": wl, "temperature": t, "gamma": g, "runs": len(entries),
            "acceptance_rate": pooled["acceptance_rate"], "alpha": alpha,
            "mean_acceptance_length": pooled["mean_acceptance_length"],
            "per_position_acceptance": pooled["per_position_acceptance"], "draft_cost_ratio": c,
            "tokens_per_second": _median([r.stats.tokens_per_second for _, r in entries]),
            "speedup": measured, "predicted_speedup": predicted,
            "measured_over_predicted": measured / predicted if measured and predicted else None,
            "verify_cost": verify_cost, "predicted_speedup_with_verify_cost": predicted_v,
            "measured_over_predicted_with_verify_cost": measured / predicted_v if measured and predicted_v else None,
            "accounted_speedup": accounted,
            "measured_over_accounted": measured / accounted if measured and accounted else None,
            "speedup_by_sample": [_median(by_sample[i]) for i in sorted(by_sample)],
            "token_latency_p50_s": pooled["token_latency_p50_s"], "token_latency_p99_s": pooled["token_latency_p99_s"],
            "time_to_finish_p50_s": pooled["time_to_finish_p50_s"], "time_to_finish_p90_s": pooled["time_to_finish_p90_s"],
            "fallback_steps": pooled["fallback_steps"], "greedy_equal_to_target_only": greedy_equal,
            "memory_bytes": memory.get(label),
        })
    return report


# --- the peers: Hugging Face's assisted generation, vLLM (specplug.bench.peer_vllm) ----------------------

PEERS = ("hf", "vllm")
PEER_PREFIXES = ("hf-", "vllm-")


def _peer(peer: str, target: Target, specs, gammas):
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    if peer == "vllm":
        from .peer_vllm import VLLMPeer

        return VLLMPeer(target, specs, gammas)
    from .peer_hf import HFPeer

    draft = next((s for s in specs if s.name == "draft-model"), None)
    draft_model = get_proposer("draft-model", target=target, **draft.options).draft.model if draft else None
    return HFPeer(target, draft_model)


def _peer_row(key, entries, base_by_pair, runs, ours_labels):
    from .peer_vllm import pooled_acceptance

    name, g, wl, t = key
    ours_key = (ours_labels[name], wl, t, g)
    if ours_labels[name] == "target-only":  # against our own target-only decoding
        ours = {pair: r for pair, r in runs[("baseline", wl, t)]}
    else:
        ours = {pair: r for pair, r in runs.get(ours_key, [])}
    speedups = [base_by_pair[pair].seconds_per_token / r.seconds_per_token for pair, r in entries]
    ours_over_peer = [r.seconds_per_token / ours[pair].seconds_per_token for pair, r in entries if pair in ours]
    equal = None
    if t == 0 and ours:
        equal = all(r.tokens == ours[pair].tokens for pair, r in entries if pair in ours)
    return {"peer": name, "workload": wl, "temperature": t, "gamma": g, "runs": len(entries),
            "tokens_per_second": _median([r.stats.tokens_per_second for _, r in entries]),
            "speedup": _median(speedups), "ours": ours_key[0],
            "ours_over_peer": _median(ours_over_peer), "greedy_equal_to_ours": equal,
            **pooled_acceptance([r for _, r in entries])}
