"""vLLM on the same target, prompts, temperatures and γ as ``specplug compare`` (``--peer vllm``).

``compare``: one engine per vLLM method and γ, started at the first prompt and kept for the whole run so that
its runs interleave with ours (prompt by prompt, as the HF peer's do). The load bench runs vLLM after all of
ours, one engine alive at a time (started, warmed up, run at every batch size and repeat, shut down): an idle
engine's processes slowed our cells by ~15% here. The matching methods:

========================  ==========================================  ====================
vLLM                      speculative_config                          ours
========================  ==========================================  ====================
``vllm-target-only``      none                                        target-only
``vllm-draft-model``      ``draft_model`` with the same draft          ``draft-model``
``vllm-ngram``            ``ngram``, same prompt_lookup_min/max        ``ngram`` (q=point)
``vllm-eagle3``           ``eagle3``: our head, speculators format     ``eagle3`` (``head=DIR``)
``vllm-specplug-NAME``    ``custom_class``: specplug's NAME inside     NAME (suffix, ngram with q=counts,
                          vLLM (:mod:`specplug.integrations.vllm`)     model-free plugins)
========================  ==========================================  ====================

τ is vLLM's own: 1 + accepted / drafts from the ``spec_decoding_stats`` its scheduler reports each step, tallied
per engine by a stat logger of ours (:class:`SpecDecodeTally`, with the methods of vLLM's ``StatLoggerBase``)
and read before and after each run. Not ``llm.get_metrics()``: each engine's Prometheus logger unregisters
the previous engines' metrics, so with several engines alive only the newest one's counters can be read.
The engine runs the products in the target's matmul dtype (float32 targets in
float32), one request at a time here; its worker's CPU threads follow vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
(default: vLLM's own choice, which keeps one core for its scheduler process). ``SPECPLUG_VLLM_EAGER=1``
skips vLLM's compilation (faster start, slower steps: for tests and quick looks).

In ``compare`` the engines live for the whole run, so a cross-request cache inside vLLM (``vllm-specplug-suffix``)
keeps learning across temperatures, workloads and repeats, where ours starts afresh per cell and repeat; the
load bench starts such an engine afresh for every run.
"""
from __future__ import annotations

import gc
import itertools
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from specplug import zoo
from specplug.integrations.vllm import engine_kwargs, require_vllm
from specplug.metrics import GenerationStats
from specplug.sampling import GREEDY
from specplug.plugins import get_proposer
from specplug.bench import agreement

PREFIX = "vllm-"
# how long vLLM's idle worker keeps spinning on its message queue after a request (shm_broadcast's busy
# loop, 1 s): waited out after each run so that the spin never overlaps our next measured run
IDLE_SPIN_S = 1.1
DEFAULT_KV_GIB = "1"
LOAD_MARKS = {None: "", agreement.EQUAL: "", agreement.TIES: " ties", agreement.DIFFER: " NOT EQUAL"}
WARM_UP_PROMPT = "def f(x):\n"  # an engine's first steps, on no request of the bench


@dataclass(frozen=True)
class Method:
    """A vLLM engine configuration and which of our cells it is measured against."""

    label: str
    ours: str
    speculative: dict | None = None  # speculative_config without num_speculative_tokens
    additional: dict | None = None
    exported: str | None = None  # a temporary speculators-format export of our head, deleted on close

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
    proposer = get_proposer(spec.name, target=target, **opts)
    if proposer.needs_features:  # a feature head: vLLM serves EAGLE-3 heads in the speculators format
        head, exported = _speculators_head(target, spec, getattr(proposer, "head_path", None))
        return Method(PREFIX + "eagle3", spec.label, {"method": "eagle3", "model": head}, exported=exported)
    kwargs = engine_kwargs(spec.name, 1, **opts)
    spec_cfg = {k: v for k, v in kwargs["speculative_config"].items() if k != "num_speculative_tokens"}
    return Method(f"{PREFIX}specplug-{spec.label}", spec.label, spec_cfg, kwargs["additional_config"])


def _speculators_head(target, spec, head_path=None) -> tuple[str, str | None]:
    """(directory vLLM loads, the temporary export to delete afterwards or None) for a feature-head spec: its
    ``head=`` option, else the head the proposer loaded (``head_path``: a bundled default)."""
    head = spec.options.get("head") or head_path
    hint = (f"to serve {spec.label!r} on vLLM give it an EAGLE-3 head in the speculators format "
            f"(-p {spec.name}:head=DIR; `specplug export HEAD --format speculators --out DIR` writes one)")
    if head is None:
        raise ValueError(hint)
    try:
        from specplug.speculators_format import export_eagle3, is_speculators_dir
    except ImportError as exc:
        raise ValueError(f"{hint}: {exc}") from exc
    if is_speculators_dir(head):
        return str(head), None
    out = tempfile.mkdtemp(prefix="specplug-eagle3-")
    try:
        export_eagle3(head, out, target=target)
    except (ValueError, OSError, ImportError) as exc:
        shutil.rmtree(out, ignore_errors=True)
        raise ValueError(f"{hint}: {exc}") from exc
    return out, out


def _quiet_stdout() -> None:
    """vLLM logs to stdout unless told otherwise; the bench's stdout is its report (--json)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def start_engine(model: str, *, dtype: str = "float32", max_num_seqs: int = 1, max_model_len: int = 2048,
                 enforce_eager: bool = False, seed: int = 0, **options):
    """A ``vllm.LLM`` for ``model`` with vLLM's statistics on and a :class:`SpecDecodeTally` of its own (read by
    :func:`counters`); this process keeps its torch thread count."""
    _quiet_stdout()
    vllm = require_vllm()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_GIB)  # GiB; vLLM's default takes far more
    threads = torch.get_num_threads()  # vLLM drops the caller's torch threads to 1 "for serving"
    try:
        llm = vllm.LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, seed=seed, disable_log_stats=False, **options)
    finally:
        torch.set_num_threads(threads)
    tally = SpecDecodeTally()
    llm.llm_engine.logger_manager.stat_loggers.append(tally)  # the manager calls each of its loggers every step
    llm.specplug_tally = tally
    return llm


class SpecDecodeTally:
    """One engine's speculative-decoding counts, summed from the stats its scheduler reports every step: a
    stat logger with the methods of vLLM's ``StatLoggerBase`` that its ``StatLoggerManager`` calls."""

    def __init__(self):
        self.counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0}

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is not None:
            self.counts["drafts"] += spec.num_drafts
            self.counts["draft_tokens"] += spec.num_draft_tokens
            self.counts["accepted"] += spec.num_accepted_tokens

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass


def shutdown(llm) -> None:
    """Stop an engine's processes now (they would otherwise live until garbage collection)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def counters(llm) -> dict[str, int]:
    """This engine's cumulative speculative-decoding counts (drafts, draft tokens, accepted tokens)."""
    return dict(llm.specplug_tally.counts)


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


def run_capped(llm, prompts: Sequence[Sequence[int]], params: Sequence, max_batch: int
               ) -> tuple[list[list[int]], float, dict]:
    """Decode token-id prompts with at most ``max_batch`` in flight, the next joining as one finishes (the
    continuous batching of :func:`specplug.batch.generate_batch`); (tokens per prompt, wall s, counters)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    run_id = next(_RUN_IDS)
    pending = list(range(len(prompts)))
    tokens: dict[int, list[int]] = {}
    in_flight = 0
    before = counters(llm)
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < max_batch:
            i = pending.pop(0)
            engine.add_request(f"specplug-{run_id}-{i}", TokensPrompt(prompt_token_ids=list(prompts[i])), params[i])
            in_flight += 1
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
                in_flight -= 1
    wall = time.perf_counter() - t0
    after = counters(llm)
    return [tokens[i] for i in range(len(prompts))], wall, {k: after[k] - before[k] for k in after}


_RUN_IDS = itertools.count()


def _median(values):
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def render_load(rows: list[dict], console=None) -> None:
    """The load bench's vLLM rows: goodput (ours over vLLM, τ) per method and batch size."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    sizes = sorted({r["batch_size"] for r in rows})
    by = {(r["peer"], r["gamma"], r["batch_size"]): r for r in rows}
    table = Table(title="vLLM on the same requests: goodput tokens/s (ours over vLLM, vLLM's τ); greedy cells "
                        "equal ours target-only token for token unless marked: 'ties' where rows part only at "
                        "rounding ties of the target's logits, NOT EQUAL elsewhere")
    table.add_column("vLLM")
    for B in sizes:
        table.add_column(f"B={B}", justify="right")
    for label, g in dict.fromkeys((r["peer"], r["gamma"]) for r in rows):
        cells = []
        for B in sizes:
            r = by[(label, g, B)]
            fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
            equal = LOAD_MARKS[r.get("greedy_agreement")]
            cells.append(f"{fmt(r['goodput_tokens_per_s'], '.1f')} ({fmt(r['ours_over_peer'], '.2f')}× "
                         f"{r['ours']}, τ {fmt(r['mean_acceptance_length'], '.2f')}){equal}")
        table.add_row(f"{label} γ={g}" if g else label, *cells)
    console.print(table)


class VLLMPeer:
    """The ``--peer vllm`` runner: ``peer(prompt, sampling, max_new_tokens, gammas)`` yields
    ``((label, γ), PeerRun)`` for every vLLM method, as :class:`specplug.bench.peer_hf.HFPeer` does;
    :meth:`load_runs` runs the load bench's requests one engine at a time."""

    def __init__(self, target, specs, gammas: Iterable[int], *, enforce_eager: bool | None = None,
                 max_num_seqs: int = 1):
        _quiet_stdout()
        require_vllm()
        if enforce_eager is None:  # SPECPLUG_VLLM_EAGER=1: skip vLLM's compilation (tests, quick looks)
            enforce_eager = os.environ.get("SPECPLUG_VLLM_EAGER") == "1"
        self.target = target
        self.model = model_dir(target)
        self.dtype = str(target.matmul_dtype or target.dtype).replace("torch.", "")
        self.methods, self.skipped = methods_for(target, specs)
        self.ours = {m.label: m.ours for m in self.methods}
        self.enforce_eager, self.max_num_seqs = enforce_eager, max_num_seqs
        self.options = {(m.label, g): m.engine_options(g)
                        for m in self.methods for g in ([0] if m.speculative is None else list(gammas))}
        self.engines: dict[tuple[str, int], object] = {}  # compare's, alive from its first prompt to close()

    def _start(self, key: tuple[str, int]):
        return start_engine(self.model, dtype=self.dtype, enforce_eager=self.enforce_eager,
                            max_num_seqs=self.max_num_seqs, **self.options[key])

    @property
    def runs_per_prompt(self) -> int:
        return len(self.options)

    def __call__(self, prompt, sampling, max_new_tokens, gammas):
        if not self.engines:
            self.engines = {key: self._start(key) for key in self.options}
        ids = self.target.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = sampling_params(sampling, max_new_tokens)
        for (label, g), llm in self.engines.items():
            (tokens,), wall, c = run_requests(llm, [ids], params)
            time.sleep(IDLE_SPIN_S)
            stats = GenerationStats(wall_time=wall, prompt_tokens=len(ids))
            stats.record_step(0, 0, 0, len(tokens), wall)
            yield (label, g), PeerRun(stats, tokens, c["drafts"], c["draft_tokens"], c["accepted"])

    def load_runs(self, work: Sequence[tuple[int, Sequence[str], Sequence]], max_new_tokens: int):
        """The load bench's runs, one engine alive at a time: for each engine, started and warmed up, every
        ``(B, prompts, samplings)`` of ``work`` in order, then shut down; a specplug proposer inside vLLM gets a
        fresh engine per run, as ours gets a fresh proposer (a suffix cache kept across runs would have seen
        the very requests before). Yields ``(label, γ, B, run dict)`` with goodput, tokens per row and the
        engine's counters, the fields :mod:`specplug.bench.load` reports."""
        ids_of = {p: self.target.encode(p) for _, prompts, _ in work for p in prompts}  # each prompt once
        encoded = [(B, [ids_of[p] for p in prompts], [sampling_params(s, max_new_tokens) for s in samplings])
                   for B, prompts, samplings in work]
        for key in self.options:
            stateful = key[0].startswith(PREFIX + "specplug-")
            llm = None
            try:
                for B, ids, params in encoded:
                    if llm is None:
                        llm = self._start(key)
                        run_requests(llm, [self.target.encode(WARM_UP_PROMPT)], sampling_params(GREEDY, 8))
                    tokens, wall, c = run_capped(llm, ids, params, B)
                    n = sum(map(len, tokens))
                    yield (*key, B, {"wall_s": wall, "tokens": n, "goodput": n / wall if wall else None,
                                     "tokens_by_row": tokens, "ids_by_row": ids, **c})
                    if stateful:
                        shutdown(llm)
                        llm = None
            finally:
                if llm is not None:
                    shutdown(llm)

    def load_rows(self, peer_runs: dict, runs: dict, temperature: float) -> list[dict]:
        """The load report's peer rows: per engine and batch size, goodput, vLLM's τ, ours over vLLM (paired
        by repeat against the matching variant) and whether greedy tokens equal our target-only run's, or part
        from them only at rounding ties (:mod:`specplug.bench.agreement`)."""
        rows = []
        for (label, g, B), entries in peer_runs.items():
            ours = "target-only" if self.ours[label] == "target-only" else f"{self.ours[label]} γ={g}"
            mine = runs.get((ours, B), [])
            base = runs.get(("target-only", B), [])
            drafts, drafted, accepted = (sum(e[k] for e in entries) for k in ("drafts", "draft_tokens", "accepted"))
            rows.append({
                "peer": label, "gamma": g, "batch_size": B, "runs": len(entries), "ours": ours,
                "goodput_tokens_per_s": _median([e["goodput"] for e in entries]),
                "ours_over_peer": _median([m["goodput"] / e["goodput"] for m, e in zip(mine, entries)
                                           if m["goodput"] and e["goodput"]]),
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "acceptance_rate": accepted / drafted if drafted else None,
                **agreement.report_fields(self._greedy_agreement(entries, base) if temperature == 0 else None)})
        return rows

    def _greedy_agreement(self, entries: list[dict], base: list[dict]) -> str:
        """How vLLM's greedy rows agree with our target-only rows of the same repeats."""
        return agreement.agreement(self.target, [
            (ids, ours, theirs) for e, b in zip(entries, base)
            for ids, ours, theirs in zip(e["ids_by_row"], b["tokens_by_row"], e["tokens_by_row"])])

    def close(self) -> None:
        for llm in self.engines.values():
            shutdown(llm)
        self.engines.clear()
        for method in self.methods:
            if method.exported:
                shutil.rmtree(method.exported, ignore_errors=True)
