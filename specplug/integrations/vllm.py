"""Run a model-free specplug proposer inside vLLM, through vLLM's ``custom_class`` speculative method.

vLLM (0.32) builds ``SpecplugProposer(vllm_config)`` in its worker process and calls its ``propose`` once per
engine step with the token ids of every request in the batch; it verifies the returned drafts itself. The
proposer is chosen by name and options in ``additional_config["specplug"]``::

    from vllm import LLM
    from specplug.integrations.vllm import engine_kwargs

    llm = LLM(model=TARGET, **engine_kwargs("suffix", num_speculative_tokens=4, max_depth=32))

or, for a server, ``vllm serve TARGET --speculative-config '{"method": "custom_class", "model":
"specplug.integrations.vllm.SpecplugProposer", "num_speculative_tokens": 4}' --additional-config
'{"specplug": {"proposer": "suffix", "options": {"max_depth": 32}}}'``.

Any registered proposer that drafts from token ids alone works: ``ngram``, ``ngram`` with ``q="counts"``,
``suffix``, and third-party plugins of that kind. One with ``needs_features`` is refused (vLLM passes no
target features to a custom class); one that loads a model of its own is not meant for this (use vLLM's
``draft_model`` / ``eagle3`` methods, which run the model on vLLM's side).

What is preserved:

* **Exactness.** vLLM verifies each draft token as a point mass against the request's own processed
  target distribution (accept x with probability p(x); on rejection sample p with x removed) — exact for any
  drafter, whatever it drew its tokens from.
* **The proposer's view of a request:** ``begin`` with prompt + first token, ``propose(seq, k)`` on prompt +
  every accepted token, ``observe`` after each step with the accepted count and the emitted tokens, ``end``
  once the request has left the batch. Rejected drafts are never shown to the proposer.
* **Cross-request state.** One proposer instance lives as long as the engine (one per worker process), so
  ``suffix``'s global cache of finished outputs serves every later request, as it does in specplug.
* γ: ``num_speculative_tokens`` is the ``k`` each ``propose`` gets (capped by the room left in the context).

What is not:

* **q is not passed.** The custom_class interface returns token ids only, so every draft is verified as a
  point mass: a token drawn from a spread q is accepted with p(x) instead of min(1, p(x)/q(x)). Outputs stay
  exact; acceptance is what a sampled drafter loses. That is why the proposer always sees greedy sampling
  parameters here: it drafts its most likely continuation (``counts``/``suffix`` take their argmax), which is
  what a point-mass check rewards. The request's own temperature, top-k/top-p and seed are not visible to it.
* **No target:** proposers get a stand-in (``TokenOnlyTarget``: vocabulary size, EOS ids, device) instead of
  a :class:`specplug.Target`; no features, no scoring, no γ policies (vLLM fixes γ per engine).
* **Request identity is inferred**, since vLLM passes no request ids: a row continues a request when the
  request's known tokens are a prefix of the row and at most k + 1 tokens were added since. A request that
  is preempted and later resumed therefore looks finished (``end``: its partial output enters the cache) and
  then new (``begin`` with everything so far as its prompt). ``end`` runs at the first step a request is
  missing from, before that step drafts: a finished output serves the next step's drafts onwards.

A proposer that raises is not fatal: that row gets no draft for the step (counted in ``stats()``), as in
specplug's non-strict loop.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from specplug.plugins import get_proposer
from specplug.sampling import SamplingParams
from specplug.types import Proposer, SequenceState, Verdict

__all__ = ["SpecplugProposer", "TokenOnlyTarget", "engine_kwargs", "require_vllm", "CLASS_PATH", "CONFIG_KEY",
           "INSTALL_HINT"]

CLASS_PATH = "specplug.integrations.vllm.SpecplugProposer"
CONFIG_KEY = "specplug"  # the key of additional_config that names the proposer
INSTALL_HINT = "pip install 'specplug[vllm]'"
GREEDY = SamplingParams(temperature=0.0)
log = logging.getLogger(__name__)


def require_vllm():
    """Import vLLM, or raise one ImportError that says how to get a working one."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"vLLM is not installed; install specplug's vllm extra: {INSTALL_HINT}") from exc
    except RuntimeError as exc:  # e.g. a CUDA torchvision wheel next to the CPU torch
        raise ImportError(f"vLLM failed to import ({exc}). On a CPU machine the torchvision/torchaudio/"
                          "torchcodec wheels pip pulls in for vLLM do not load against the CPU torch: "
                          "pip uninstall -y torchvision torchaudio torchcodec") from exc
    return vllm


def engine_kwargs(proposer: str, num_speculative_tokens: int = 4, **options: Any) -> dict:
    """Keyword arguments for ``vllm.LLM(model, **engine_kwargs(...))`` that draft with specplug's ``proposer``.

    The proposer is built once here, so a bad name or option fails in the caller, not in vLLM's worker."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1 for vLLM, got {num_speculative_tokens}")
    check_model_free(build(proposer, options, TokenOnlyTarget(vocab_size=1)))
    return {"speculative_config": {"method": "custom_class", "model": CLASS_PATH,
                                   "num_speculative_tokens": int(num_speculative_tokens)},
            "additional_config": {CONFIG_KEY: {"proposer": proposer, "options": dict(options)}}}


@dataclass(frozen=True)
class TokenOnlyTarget:
    """What a proposer may read of the target inside vLLM: no model, only its vocabulary and EOS ids."""

    vocab_size: int
    eos_token_ids: frozenset = frozenset()
    device: torch.device = torch.device("cpu")
    name: str = "vllm"


def build(name: str, options: dict, target: TokenOnlyTarget) -> Proposer:
    try:
        return get_proposer(name, target=target, **options)
    except KeyError as exc:  # UnknownProposerError lists what is registered
        raise ValueError(str(exc.args[0]) if exc.args else str(exc)) from exc


def check_model_free(proposer: Proposer) -> Proposer:
    if proposer.needs_features:
        raise ValueError(f"proposer {proposer.name!r} needs target features {tuple(proposer.needs_features)}, "
                         "which vLLM's custom_class interface does not pass; serve feature heads with vLLM's "
                         "own eagle3 method instead")
    return proposer


@dataclass
class _Request:
    seq: SequenceState
    proposed: int = 0  # length of the last draft returned for it


@dataclass
class _Counters:
    steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    fallbacks: int = 0
    requests: int = 0
    errors: list = field(default_factory=list)


class SpecplugProposer:
    """vLLM's custom_class proposer: a specplug proposer, its requests tracked across engine steps."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        conf = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        if not isinstance(conf, dict) or "proposer" not in conf:
            raise ValueError(f"{CLASS_PATH} needs additional_config={{'{CONFIG_KEY}': {{'proposer': NAME, "
                             "'options': {...}}}}}; build the engine arguments with "
                             "specplug.integrations.vllm.engine_kwargs(NAME, ...)")
        model_config = vllm_config.model_config
        eos = getattr(model_config.hf_config, "eos_token_id", None)
        self.target = TokenOnlyTarget(
            vocab_size=int(model_config.get_vocab_size()),
            eos_token_ids=frozenset([eos] if isinstance(eos, int) else (eos or ())))
        self.name = conf["proposer"]
        self.proposer = check_model_free(build(self.name, dict(conf.get("options") or {}), self.target))
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(model_config.max_model_len)
        self.live: list[_Request] = []
        self.by_row: dict[int, _Request] = {}
        self.counters = _Counters()
        self._ids = itertools.count()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM hands every drafter the target model; a model-free proposer has nothing to load."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """One engine step: the draft for every row of the batch (an empty list where there is none)."""
        self.counters.steps += 1
        rows = len(sampled_token_ids)
        lengths = [int(num_tokens_no_spec[i]) for i in range(rows)]
        claimed = self._claim(rows, lengths, token_ids_cpu)
        self._end_missing({id(r) for r in claimed.values()})  # first, so their outputs serve this step's drafts
        drafts: list[list[int]] = []
        for i in range(rows):
            n, sampled = lengths[i], sampled_token_ids[i]
            request = claimed.get(i)
            if not sampled:  # still prefilling: nothing to draft from yet
                drafts.append([])
                continue
            ids = token_ids_cpu[i, :n].tolist()
            if request is None:
                request = self._begin(ids, n - len(sampled))
            else:
                self._observe(request, ids, sampled)
            self.by_row[i] = request
            room = min(self.k, self.max_model_len - n)
            drafts.append(self._draft(request, room) if room > 0 else [])
        return drafts

    def stats(self) -> dict:
        """Counters of this worker's adapter: steps, drafts, fallbacks, live requests, the proposer's own."""
        c = self.counters
        out = {"proposer": self.name, "steps": c.steps, "drafts": c.drafts, "draft_tokens": c.draft_tokens,
               "fallbacks": c.fallbacks, "requests": c.requests, "live_requests": len(self.live)}
        if hasattr(self.proposer, "stats"):
            out["proposer_stats"] = self.proposer.stats()
        return out

    # --- which request each row holds ----------------------------------------------------------------
    def _claim(self, rows: int, lengths: Sequence[int], token_ids_cpu) -> dict[int, _Request]:
        """Row -> the live request it continues. A row's previous request is tried first (vLLM moves rows
        only when others finish); the rest are matched by prefix."""
        claimed: dict[int, _Request] = {}
        free = list(self.live)
        for i in range(rows):
            prev = self.by_row.get(i)
            if prev is not None and prev in free and self._continues(prev, token_ids_cpu[i], lengths[i]):
                claimed[i] = prev
                free.remove(prev)
        for i in range(rows):
            if i in claimed:
                continue
            match = next((r for r in free if self._continues(r, token_ids_cpu[i], lengths[i])), None)
            if match is not None:
                claimed[i] = match
                free.remove(match)
        self.by_row = {i: r for i, r in claimed.items()}
        return claimed

    def _continues(self, request: _Request, row, n: int) -> bool:
        m = len(request.seq.ids)
        return m <= n <= m + self.k + 1 and row[:m].tolist() == request.seq.ids

    # --- the proposer's life cycle -------------------------------------------------------------------
    def _begin(self, ids: list[int], num_prompt: int) -> _Request:
        rid = next(self._ids)
        seq = SequenceState(ids=ids, num_prompt=num_prompt, sampling=GREEDY,
                            rng=torch.Generator().manual_seed(rid), target=self.target, request_id=rid)
        request = _Request(seq)
        self._call("begin", self.proposer.begin, seq)
        self.live.append(request)
        self.counters.requests += 1
        return request

    def _observe(self, request: _Request, ids: list[int], sampled: list[int]) -> None:
        seq = request.seq
        seq.ids = ids
        accepted = min(max(len(sampled) - 1, 0), request.proposed)
        self._call("observe", self.proposer.observe, seq,
                   Verdict(accepted=accepted, proposed=request.proposed, tokens=list(sampled)))

    def _draft(self, request: _Request, k: int) -> list[int]:
        proposal = self._call("propose", self.proposer.propose, request.seq, k)
        tokens = [] if proposal is None else proposal.tokens.reshape(-1).tolist()[:k]
        if any(not 0 <= t < self.target.vocab_size for t in tokens):
            self._fail("propose", ValueError(f"token ids outside the vocabulary: {tokens}"))
            tokens = []
        request.proposed = len(tokens)
        if tokens:
            self.counters.drafts += 1
            self.counters.draft_tokens += len(tokens)
        return tokens

    def _end_missing(self, present: set[int]) -> None:
        """Live requests no row continues have finished (or were preempted): end them."""
        still = []
        for request in self.live:
            if id(request) in present:
                still.append(request)
            else:
                self._call("end", self.proposer.end, request.seq)
        self.live = still

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # a broken proposer costs drafts, never the engine
            self._fail(what, exc)
            return None

    def _fail(self, what: str, exc: BaseException) -> None:
        self.counters.fallbacks += 1
        if len(self.counters.errors) < 5:
            self.counters.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            log.warning("specplug proposer %r failed in %s (no draft this step): %r", self.name, what, exc)
