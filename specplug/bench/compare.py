"""The side-by-side bench: proposers x temperatures x γ x workloads on one target, target-only always in the
same run, runs interleaved (baseline, cell, cell, ..., baseline, ...) so machine drift hits all alike.

Speed-up of a cell = median over paired runs (same prompt, sample, repeat, temperature) of
(baseline seconds per token) / (cell seconds per token), with a bootstrap interval over prompts and repeats.
c = drafting time per drafted token / the baseline's target step time, so the predicted speed-up uses
Leviathan's definitions. Repeats decode the same work again (same seeds), so they time the machine, not
the sampling; ``samples`` draws new outputs. A cell whose figures a busy machine explains better than the
decoder does is flagged (:mod:`specplug.bench.confidence`).
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch

from specplug.decode import generate
from specplug.engine import prompt_ids
from specplug.machine import machine_choices
from specplug.metrics import GenerationStats, aggregate, predicted_speedup
from specplug.plugins import get_proposer, list_proposers
from specplug.sampling import SamplingParams
from specplug.target import Target

from . import agreement, confidence
from .workloads import Workload

SCHEMA = "specplug.compare/1"
# the Target's flag saying whether its verify passes equal one-token steps bit for bit on this machine
BIT_IDENTITY = "verify_bit_identical"


# options of a spec that go to the decoder, not to the proposer (e.g. ``draft-model:verification=block``)
DECODE_OPTIONS = ("verification",)


@dataclass(frozen=True)
class ProposerSpec:
    """``name`` or ``name:key=value,key=value`` as given on the command line; keys in :data:`DECODE_OPTIONS`
    are the decoder's (``decode``), the others the proposer's (``options``)."""

    label: str
    name: str
    options: dict = field(default_factory=dict, hash=False, compare=False)
    decode: dict = field(default_factory=dict, hash=False, compare=False)

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
        decode = {key: options.pop(key) for key in DECODE_OPTIONS if key in options}
        return cls(text, name, options, decode)


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
class Run:
    """One request's stats and new tokens, from our decoder or a peer's."""

    stats: GenerationStats
    tokens: list[int]

    @property
    def seconds_per_token(self) -> float:
        return self.stats.wall_time / max(self.stats.new_tokens, 1)


PeerRunner = Callable[..., Iterator[tuple[tuple[str, int], Run]]]


@dataclass(frozen=True)
class Peer:
    """Another engine measured on the same target, prompts and sampling, interleaved with our runs.

    ``build(target, specs, gammas)`` returns a runner ``(prompt, sampling, max_new_tokens, gammas)`` yielding
    ``((run name, γ), Run)``; ``ours`` names, per run name, the proposer of ours it is measured against
    (``"target-only"``: our baseline); ``runs_per_prompt(specs, gammas)`` counts its runs for the progress bar.
    A runner may also have ``ours`` (run name -> our cell's label, for runs named only once built), ``skipped``
    (methods it could not run, with the reason) and ``close()`` (its engines' processes).
    """

    build: Callable[[Target, Sequence[ProposerSpec], Sequence[int]], PeerRunner]
    ours: Mapping[str, str]
    runs_per_prompt: Callable[[Sequence[ProposerSpec], Sequence[int]], int]


PEERS: dict[str, Peer] = {}


def register_peer(name: str, peer: Peer) -> None:
    """Make ``specplug compare --peer NAME`` run ``peer``."""
    PEERS[name] = peer


def get_peer(name: str) -> Peer:
    """The peer registered as ``name``; a ValueError naming the known ones otherwise."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(sorted(PEERS))}")
    return PEERS[name]


def _hf_runner(target: Target, specs: Sequence[ProposerSpec], gammas: Sequence[int]) -> PeerRunner:
    from .peer_hf import HFPeer

    draft = next((s for s in specs if s.name == "draft-model"), None)
    draft_model = get_proposer("draft-model", target=target, **draft.options).draft.model if draft else None
    return HFPeer(target, draft_model)


register_peer("hf", Peer(
    _hf_runner, {"hf-assisted": "draft-model", "hf-prompt-lookup": "ngram", "hf-target-only": "target-only"},
    lambda specs, gammas: 1 + (2 if any(s.name == "draft-model" for s in specs) else 1) * len(gammas)))


def _vllm_runner(target: Target, specs: Sequence[ProposerSpec], gammas: Sequence[int]) -> PeerRunner:
    from .peer_vllm import VLLMPeer

    return VLLMPeer(target, specs, gammas)


# at most one vLLM engine per proposer and γ, plus target-only; the matching is made once vLLM's methods are known
register_peer("vllm", Peer(_vllm_runner, {}, lambda specs, gammas: 1 + len(specs) * len(gammas)))


def run_compare(target: Target, specs: Sequence[ProposerSpec], workloads: Sequence[Workload], *,
                gammas: Sequence[int] = (4,), temperatures: Sequence[float] = (0.0, 1.0),
                max_new_tokens: int = 64, repeats: int = 2, warmup: bool = True, peer: str | None = None,
                progress: Callable[[int, str], None] | None = None) -> dict:
    """Run the matrix and return the report dict (schema ``specplug.compare/1``: compare.schema.json)."""
    started = time.perf_counter()
    peer_spec = get_peer(peer) if peer else None
    specs, skipped = attachable(target, specs)
    runner = peer_spec.build(target, specs, gammas) if peer_spec else None
    if warmup:
        _warm_up(target, specs)
    runs, memory = _measure(target, specs, workloads, gammas, temperatures, max_new_tokens, repeats, runner,
                            progress or (lambda n, note: None))
    # which of our cells each peer run is measured against: the first spec of the matching proposer
    ours = {}
    for run_name, name in (peer_spec.ours.items() if peer_spec else ()):
        mine = next((s.label for s in specs if s.name == name), None)
        ours[run_name] = "target-only" if name == "target-only" else mine
    if hasattr(runner, "close"):
        runner.close()
        ours.update(runner.ours)
        skipped = list(skipped) + list(runner.skipped)
    settings = {"max_new_tokens": max_new_tokens, "repeats": repeats, "gammas": list(gammas),
                "temperatures": list(temperatures), "peer": peer,
                "workloads": [{"name": w.name, "prompts": len(w.prompts), "samples": w.samples} for w in workloads]}
    ids = {(w.name, i): prompt_ids(target, p) for w in workloads for i, p in enumerate(w.prompts)}
    report = summarise(runs, target=target_info(target), settings=settings, skipped=skipped, memory=memory, ours=ours,
                       agree=lambda pairs: agreement.agreement(target, [(ids[p[:2]], a, b) for p, a, b in pairs]))
    report["machine"]["wall_time_s"] = time.perf_counter() - started
    return report


def _warm_up(target, specs) -> None:
    generate(target, None, "def f(x):\n", max_new_tokens=8)
    for spec in specs:
        generate(target, get_proposer(spec.name, target=target, **spec.options), "def f(x):\n", max_new_tokens=8)


def _measure(target, specs, workloads, gammas, temperatures, max_new_tokens, repeats, runner, step):
    """Every run, keyed by cell, each with its pair (workload, prompt, sample, repeat, temperature)."""
    cells = [(s, g) for s in specs for g in gammas]
    runs: dict[tuple, list[tuple[tuple, Run]]] = {}
    memory: dict[str, int] = {}
    for rep in range(repeats):
        for wl in workloads:
            # a fresh proposer per cell and repeat: cross-request caches learn within their cell only, and
            # every repeat decodes the same work
            live = {(s.label, g, t): get_proposer(s.name, target=target, **s.options)
                    for s, g in cells for t in temperatures}
            for (label, _, _), proposer in live.items():
                memory.setdefault(label, int(proposer.memory_bytes()))
            for pi, prompt in enumerate(wl.prompts):
                for sample in range(wl.samples):
                    for t in temperatures:
                        sampling = SamplingParams(temperature=t, seed=sample)
                        pair = (wl.name, pi, sample, rep, t)
                        runs.setdefault(("baseline", wl.name, t), []).append(
                            (pair, _one(target, None, prompt, sampling, max_new_tokens, 0)))
                        step(1, f"{wl.name} T={t} target-only")
                        for spec, g in cells:
                            r = _one(target, live[(spec.label, g, t)], prompt, sampling, max_new_tokens, g,
                                     spec.decode)
                            runs.setdefault((spec.label, wl.name, t, g), []).append((pair, r))
                            step(1, f"{wl.name} T={t} {spec.label} γ={g}")
                        for key, r in (runner(prompt, sampling, max_new_tokens, gammas) if runner else ()):
                            runs.setdefault(key + (wl.name, t), []).append((pair, r))
                            step(1, f"{wl.name} T={t} {key[0]}")
    return runs, memory


def _one(target, proposer, prompt, sampling, max_new_tokens, gamma, decode=None) -> Run:
    result = generate(target, proposer, prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                      num_speculative_tokens=gamma, **(decode or {}))
    return Run(result.stats, result.tokens)


def count_runs(specs, workloads, gammas, temperatures, repeats, peer_runs_per_prompt: int = 0) -> int:
    per_prompt = len(temperatures) * (1 + len(specs) * len(gammas) + peer_runs_per_prompt)
    return repeats * sum(len(w.prompts) * w.samples for w in workloads) * per_prompt


def _median(values):
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def target_info(target) -> dict:
    """The report's description of the target (shared with the load bench)."""
    return {"name": target.name, "parameters": sum(p.numel() for p in target.model.parameters()),
            "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
            "matmul_dtype": str(target.matmul_dtype or target.dtype).replace("torch.", ""),
            BIT_IDENTITY: getattr(target, BIT_IDENTITY, None),
            "lean": getattr(target, "lean", None) is not None, "lean_note": getattr(target, "lean_note", "")}


def _same_work(pair: tuple) -> tuple:
    return pair[:3] + pair[4:]  # the pair without its repeat


def summarise(runs: Mapping[tuple, list[tuple[tuple, Run]]], *, target: dict, settings: dict, skipped=(),
              memory: Mapping[str, int] | None = None, ours: Mapping[str, str] | None = None,
              agree: Callable[[list[tuple[tuple, list[int], list[int]]]], str] | None = None) -> dict:
    """The report (schema ``specplug.compare/1``) from the runs, keyed ``("baseline", workload, T)``,
    ``(proposer, workload, T, γ)`` or ``(peer run, γ, workload, T)``, each a list of (pair, Run). ``agree``
    tells a peer's greedy agreement from its (pair, our tokens, its tokens) (see
    :func:`specplug.bench.agreement.agreement`); without it only token-for-token equality counts."""
    report = {
        "schema": SCHEMA, "target": target, "settings": settings,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                    "choices": [c.as_dict() for c in machine_choices()]},
        "skipped": list(skipped), "baseline": [], "cells": [], "peer": [],
    }
    base_by_pair = {pair: r for key, entries in runs.items() if key[0] == "baseline" for pair, r in entries}
    base_slow = confidence.slowness({p: r.seconds_per_token for p, r in base_by_pair.items()},
                                    {p: _same_work(p) for p in base_by_pair})
    base_step = {}
    for key, entries in runs.items():
        if key[0] == "baseline":
            row = _baseline_row(key, entries, base_slow, settings.get("repeats", 1) > 1)
            base_step[(row["workload"], row["temperature"])] = row["target_step_time_s"]
            report["baseline"].append(row)
    for key, entries in runs.items():
        if key[0] == "baseline":
            continue
        if key[0] in (ours or {}):
            report["peer"].append(_peer_row(key, entries, base_by_pair, runs, ours, agree))
        else:
            report["cells"].append(_cell_row(key, entries, base_by_pair, base_slow, base_step[key[1:3]],
                                             (memory or {}).get(key[0])))
    return report


def _baseline_row(key, entries, slow, repeated: bool) -> dict:
    _, wl, t = key
    pooled = aggregate([r.stats for _, r in entries])
    return {
        "workload": wl, "temperature": t, "runs": len(entries),
        "tokens_per_second": _median([r.stats.tokens_per_second for _, r in entries]),
        "target_step_time_s": _median([r.stats.target_time / r.stats.target_calls for _, r in entries]),
        "step_time_spread": max(slow[p] for p, _ in entries) if repeated else None,
        "token_latency_p50_s": pooled["token_latency_p50_s"], "token_latency_p99_s": pooled["token_latency_p99_s"],
        "time_to_finish_p50_s": pooled["time_to_finish_p50_s"], "time_to_finish_p90_s": pooled["time_to_finish_p90_s"],
    }


def _cell_row(key, entries, base_by_pair, base_slow, base_step, memory_bytes) -> dict:
    label, wl, t, g = key
    pooled = aggregate([r.stats for _, r in entries])
    speedup_of = {pair: base_by_pair[pair].seconds_per_token / r.seconds_per_token for pair, r in entries}
    alpha, gamma, tau = pooled["alpha"], pooled["mean_gamma"], pooled["mean_acceptance_length"]
    c = _ratio(_ratio(pooled["draft_time_s"], pooled["draft_tokens"]), base_step)
    # the verify pass scores γ + 1 tokens: its cost in baseline steps, measured in this very cell
    v = _ratio(_ratio(pooled["target_time_s"], pooled["target_calls"]), base_step)
    predicted = predicted_speedup(alpha, gamma, c) if alpha is not None and c is not None else None
    predicted_v = predicted_speedup(alpha, gamma, c, v) if predicted is not None and v is not None else None
    # what this cell's own tokens per call, c and v allow (no assumption on how acceptance spreads over positions)
    accounted = _ratio(tau, gamma * c + v) if c is not None and v else None
    measured = _median(speedup_of.values())
    groups: dict[tuple, list[float]] = {}
    for pair, s in speedup_of.items():
        groups.setdefault(_same_work(pair), []).append(s)
    interval = confidence.speedup_interval(list(groups.values()))
    own_slow = confidence.slowness({p: r.seconds_per_token for p, r in entries}, {p: _same_work(p) for p, _ in entries})
    slow_runs = sum(1 for p, _ in entries if max(own_slow[p], base_slow[p]) >= confidence.SLOW)
    by_sample: dict[int, list[float]] = {}
    for pair, s in speedup_of.items():
        by_sample.setdefault(pair[2], []).append(s)
    spec = ProposerSpec.parse(label)
    return {
        "proposer": label, "workload": wl, "temperature": t, "gamma": g, "runs": len(entries),
        "tree": spec.options.get("tree") or None, "verification": spec.decode.get("verification", "token"),
        "nodes_scored_per_step": pooled["nodes_scored_per_step"],
        "acceptance_rate": pooled["acceptance_rate"], "alpha": alpha, "mean_acceptance_length": tau,
        "per_position_acceptance": pooled["per_position_acceptance"], "draft_cost_ratio": c,
        "tokens_per_second": _median([r.stats.tokens_per_second for _, r in entries]),
        "speedup": measured, "speedup_interval": interval and list(interval),
        "predicted_speedup": predicted, "measured_over_predicted": _ratio(measured, predicted),
        "verify_cost": v, "predicted_speedup_with_verify_cost": predicted_v,
        "measured_over_predicted_with_verify_cost": _ratio(measured, predicted_v),
        "accounted_speedup": accounted, "measured_over_accounted": _ratio(measured, accounted),
        "slow_runs": slow_runs,
        "flags": confidence.inconsistencies(measured, confidence.speedup_bound(tau, gamma, c, v), slow_runs,
                                            len(entries)),
        "speedup_by_sample": [_median(by_sample[i]) for i in sorted(by_sample)],
        "token_latency_p50_s": pooled["token_latency_p50_s"], "token_latency_p99_s": pooled["token_latency_p99_s"],
        "time_to_finish_p50_s": pooled["time_to_finish_p50_s"], "time_to_finish_p90_s": pooled["time_to_finish_p90_s"],
        "fallback_steps": pooled["fallback_steps"],
        "greedy_equal_to_target_only": (all(r.tokens == base_by_pair[p].tokens for p, r in entries)
                                        if t == 0 else None),
        "memory_bytes": memory_bytes,
    }


def _peer_row(key, entries, base_by_pair, runs, ours_labels, agree) -> dict:
    from .peer_vllm import pooled_acceptance  # τ from a peer's own counters (None for the HF peer)

    name, g, wl, t = key
    ours_key = (ours_labels[name], wl, t, g)
    if ours_labels[name] == "target-only":  # against our own target-only decoding
        ours = {pair: r for pair, r in runs[("baseline", wl, t)]}
    else:
        ours = {pair: r for pair, r in runs.get(ours_key, [])}
    speedups = [base_by_pair[pair].seconds_per_token / r.seconds_per_token for pair, r in entries]
    ours_over_peer = [r.seconds_per_token / ours[pair].seconds_per_token for pair, r in entries if pair in ours]
    found = None
    if t == 0 and ours:
        pairs = [(pair, ours[pair].tokens, r.tokens) for pair, r in entries if pair in ours]
        found = (agree(pairs) if agree else
                 agreement.EQUAL if all(a == b for _, a, b in pairs) else agreement.DIFFER)
    return {"peer": name, "workload": wl, "temperature": t, "gamma": g, "runs": len(entries),
            "tokens_per_second": _median([r.stats.tokens_per_second for _, r in entries]),
            "speedup": _median(speedups), "ours": ours_key[0],
            "ours_over_peer": _median(ours_over_peer), **agreement.report_fields(found),
            **pooled_acceptance([r for _, r in entries])}
