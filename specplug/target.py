"""The target model: an HF causal LM, its tokenizer, and a KV cache that can be rolled back."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from . import argmax_kernel, few_rows, zoo
from .hf_compat import cache_kwargs, output_cache
from .lean_llama import LeanCache, lean_or_reason
from .rows import LeanRows, PaddedRows, TargetRows, feature_layer
from .sampling import SamplingParams, processed_probs


@dataclass
class KVState:
    """One sequence's cache. ``length`` tokens have keys/values in it (all but the newest token)."""

    cache: object | None = None
    length: int = 0


@dataclass
class Scores:
    """Logits [n, V] for n scored positions, plus the hidden features a proposer asked for."""

    logits: torch.Tensor
    features: dict[str, torch.Tensor] = field(default_factory=dict)


def _model_location(path_or_id: str | os.PathLike) -> tuple[str | os.PathLike, bool]:
    """(``path_or_id`` with ``~`` expanded, whether it is a local directory). Something that reads as a path
    but is no directory is refused saying so, not with the hub's rules for repo ids ('org/name')."""
    text = str(path_or_id)
    if text.startswith("~"):
        path_or_id = text = str(Path(text).expanduser())
    local = Path(path_or_id).is_dir()
    if not local and (Path(text).exists() or text.startswith(("/", ".")) or text.count("/") > 1):
        found = "is a file" if Path(text).exists() else "does not exist"
        raise OSError(f"{text!r} {found}; a local model is a directory holding config.json and *.safetensors "
                      "(a hub id reads 'org/name')")
    return path_or_id, local


def load_causal_lm(path_or_id: str | os.PathLike, *, device="cpu", dtype=None, trust_remote_code: bool = False):
    """Load an HF causal LM from safetensors only (a pickled .bin is refused) and put it in eval mode."""
    from transformers import AutoModelForCausalLM

    path_or_id, local = _model_location(path_or_id)
    if local and not any(Path(path_or_id).glob("*.safetensors")):
        if any(Path(path_or_id).glob("*.bin")) or any(Path(path_or_id).glob("*.pt")):
            raise ValueError(f"{path_or_id}: only pickled weights (.bin/.pt) found; specplug loads safetensors "
                             "only, because unpickling can run arbitrary code. Convert the weights to safetensors.")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path_or_id), dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code,
            local_files_only=local or None)
    except OSError as exc:
        raise OSError(f"cannot load a causal LM from {str(path_or_id)!r}: {exc}") from exc
    return model.to(device).eval()


def load_tokenizer(path_or_id: str | os.PathLike, *, trust_remote_code: bool = False):
    """The model's tokenizer, or None when the directory has none (prompts must then be token ids)."""
    from transformers import AutoTokenizer

    path_or_id, local = _model_location(path_or_id)
    if local and not any((Path(path_or_id) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=trust_remote_code,
                                         local_files_only=local or None)


def auto_matmul_dtype(model: torch.nn.Module, *, bundled: bool) -> torch.dtype | None:
    """bfloat16 for a bundled (bf16-trained) float32 model on a CPU whose BLAS has native bf16 products.

    Other models keep their own dtype unless asked; where the CPU lacks native bf16, its products are
    emulated and slower than float32. Where no bf16 product of the model's shapes has rows bit-identical to
    one-row products (:func:`specplug.few_rows.identical_rows`) but float32 products do, float32 is kept, so
    greedy speculative output stays equal to target-only output."""
    param = next(model.parameters())
    if not bundled or param.dtype != torch.float32 or param.device.type != "cpu":
        return None
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    if not native:
        return None
    # keep a path whose verify passes give a one-token step's bits where one exists (see few_rows.identical_rows)
    shapes = {(m.weight.shape, m.bias is not None) for m in model.modules() if type(m) is torch.nn.Linear}

    def rows(dtype: torch.dtype) -> int:
        return min((few_rows.identical_rows(torch.empty(shape, dtype=dtype), torch.empty(0) if bias else None)
                    for shape, bias in shapes), default=few_rows.PROBE_ROWS)

    return torch.bfloat16 if rows(torch.bfloat16) >= 2 or rows(torch.float32) < 2 else None


_PROBE_FED = 9  # the probe scores [last, x1..x8]
_PROBE_PROMPT = 6  # the single-sequence probe's prompt length
# the prompt lengths of the probe's batched passes, one pass per layout: ragged, as real prompts are. A padded
# forward can round by its batch's shape, and short prompts of near-equal length hid that (HF's forward, bf16)
_PROBE_LAYOUTS = ((6, 7, 8, 9), (17, 50, 93, 130), (6, 45, 100, 160))


class Target:
    """The model whose distribution the output follows. Device-agnostic: tensors follow the model."""

    def __init__(self, model, tokenizer=None, name: str | None = None, few_rows_linear: bool = True,
                 lean: bool = True, matmul_dtype: torch.dtype | str | None = None, probe: bool = True):
        """``few_rows_linear``: route the model's float32 linear layers through :mod:`specplug.few_rows`: each
        row of a verify pass's product equal to a one-token step's where the probe finds such a row count
        (``identical_rows`` says what it found), and on CPU fast on 1-16 rows, where a BLAS quirk otherwise
        makes scoring 3 tokens cost 1.6 one-token steps. It changes the given model's modules in place.

        ``lean``: run single-sequence forwards (target-only decoding and speculative scoring alike) through
        :mod:`specplug.lean_llama` when the model is a Llama it reproduces — the same arithmetic without HF's
        per-call machinery (a 6-layer target: 4.3 -> 3.3 ms a step), for batches too (ragged rows, see
        :mod:`specplug.rows`). ``lean_note`` says why it is off; ``lean=False`` keeps HF's forward (padded and
        masked in a batch), e.g. to compare the two.

        ``matmul_dtype`` (e.g. ``torch.bfloat16``) keeps a float32 model's linear weights in that dtype and
        multiplies in it, everything else staying float32 (:func:`specplug.few_rows.install`): the arithmetic
        of bf16-autocast training (the bundled models were trained so). It changes the given model in place;
        ``matmul_dtype`` says what is in force. On the 2-core CPU it makes scoring 5 tokens cost 1.2-1.3
        one-token steps instead of 1.6.

        ``probe``: find out, on this machine, whether a verified position gets the very logits a one-token step
        gives, for one sequence and for rows of a batch (:meth:`probe_bit_identity`; ``bit_identity`` holds the
        answer). Only then does greedy speculative output equal target-only greedy output token for token (in
        distribution the two are equal either way). Where narrower products fail it and float32 ones pass, the
        float32 ones are chosen; ``verify_bit_identical`` says whether the path in force passed (None when not
        probed), ``lean_note`` why not."""
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.path: Path | None = None
        if isinstance(matmul_dtype, str):
            if matmul_dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"matmul_dtype={matmul_dtype!r}: expected 'float32', 'bfloat16' or 'float16'")
            matmul_dtype = getattr(torch, matmul_dtype)
        self.matmul_dtype: torch.dtype | None = None
        if matmul_dtype is not None and matmul_dtype != torch.float32 and self.dtype == torch.float32:
            few_rows.install(model, weight_dtype=matmul_dtype)
            self.matmul_dtype = matmul_dtype
        elif few_rows_linear:
            few_rows.install(model)
        # probed now, not in the first timed step: rows a product may have and keep one-row products' bits
        self.identical_rows: int = few_rows.warm(model)
        # greedy ids' form, chosen with the target's other forms (a compile the first time on a machine)
        self.greedy_form = argmax_kernel.chosen() if self.device.type == "cpu" else None
        self.lean, self.lean_note = lean_or_reason(model) if lean else (None, "lean=False")
        self.bit_identity: dict[str, bool] = {}
        self.verify_bit_identical: bool | None = None  # None: not probed (probe=False)
        if probe:
            self._choose_products()

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str | None = None, trust_remote_code: bool = False,
                        few_rows_linear: bool = True, lean: bool = True,
                        matmul_dtype: torch.dtype | str | None = "auto", probe: bool = True) -> "Target":
        """Load a target from a directory, a hub id, or a bundled ``zoo:`` name.

        ``matmul_dtype`` (see ``__init__``): ``"auto"`` means bfloat16 products for a bundled target — trained
        under bf16 autocast — on a CPU with native bf16 products, and the model's own dtype otherwise."""
        name = str(path_or_id)
        path = zoo.resolve(name) if zoo.is_zoo_name(name) else path_or_id
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        model = load_causal_lm(path, device=device, dtype=dtype or torch.float32, trust_remote_code=trust_remote_code)
        if matmul_dtype == "auto":
            matmul_dtype = auto_matmul_dtype(model, bundled=zoo.is_zoo_name(name))
        target = cls(model, load_tokenizer(path, trust_remote_code=trust_remote_code), name=name,
                     few_rows_linear=few_rows_linear, lean=lean, matmul_dtype=matmul_dtype, probe=probe)
        target.path = Path(path) if Path(path).is_dir() else None
        return target

    # --- which product path keeps verify passes equal to one-token steps ---------------------------------------
    def probe_bit_identity(self, rows: int = 16) -> dict[str, bool]:
        """Whether scoring ``[last, x1..x8]`` in one pass gives each position the very logits (bit for bit) that
        feeding the tokens one at a time to that sequence alone gives: ``"single"`` for one sequence,
        ``"batched"`` for passes of ``rows`` rows, each row scoring 1..9 tokens after a prompt of its own length
        (the products then run over ~5 × rows rows, and a padded forward pads the shorter rows)."""
        gen = torch.Generator().manual_seed(0)
        room = (self.max_positions or 1 << 62) - _PROBE_FED
        layouts = [[min(layout[b % len(layout)], room) for b in range(rows)] for layout in _PROBE_LAYOUTS]
        ids = torch.randint(0, self.vocab_size, (max(map(max, layouts)) + _PROBE_FED,), generator=gen).tolist()
        want = {n: self._one_token_steps(ids[:n], ids[n - 1:n - 1 + _PROBE_FED])
                for n in {_PROBE_PROMPT}.union(*layouts)}
        one, n = self.new_rows(), _PROBE_PROMPT
        one.add([ids[:n]])
        found = {"single": torch.equal(one.score([ids[n - 1:n - 1 + _PROBE_FED]]).logits, want[n])}
        counts = [1 + (3 * b) % _PROBE_FED for b in range(rows)]
        found["batched"] = True
        for lengths in layouts:
            many = self.new_rows()
            try:
                many.add([ids[:n] for n in lengths])
                scores = many.score([ids[n - 1:n - 1 + c] for n, c in zip(lengths, counts)])
            except NotImplementedError:  # a fallback that cannot batch this model at all
                found["batched"] = False
                break
            found["batched"] &= all(torch.equal(scores.logits[scores.span(b)], want[n][:c])
                                    for b, (n, c) in enumerate(zip(lengths, counts)))
        return found

    def _one_token_steps(self, prompt: list[int], fed: list[int]) -> torch.Tensor:
        """The logits [len(fed), V] of feeding ``fed`` one token at a time after ``prompt`` (its last token is
        ``fed[0]``), one sequence alone: what target-only decoding computes."""
        steps = self.new_rows()
        steps.add([prompt])
        want = []
        for i, token in enumerate(fed):
            want.append(steps.score([[token]]).logits[0])
            steps.keep([len(prompt) + i])
        return torch.stack(want)

    def _choose_products(self) -> None:
        """Probe the product path in force; where narrower products fail and float32 ones pass (or pass for
        more), switch to float32 products (the weights converted back exactly). Say what was found."""
        found = self.probe_bit_identity()
        chosen = self.matmul_dtype
        if not all(found.values()) and chosen is not None:
            self._set_products(None)
            wide = self.probe_bit_identity()
            if sum(wide.values()) > sum(found.values()):
                self.lean_note = _join(self.lean_note, f"{_failed(found)} with {_dtype_name(chosen)} products; "
                                                       "float32 products chosen")
                found = wide
            else:
                self._set_products(chosen)  # lossless: the float32 weights hold the narrow values
        self.bit_identity = found
        self.verify_bit_identical = all(found.values())
        if not self.verify_bit_identical:
            self.lean_note = _join(self.lean_note, f"{_failed(found)} on this machine: greedy speculative output "
                                                   "may part from target-only output at a near-tie")

    def _set_products(self, dtype: torch.dtype | None) -> None:
        """Multiply in ``dtype`` (None: float32) from now on, rebuilding the lean forward on the converted weights."""
        if dtype is None:
            for module in self.model.modules():
                if type(module) is torch.nn.Linear and module.weight.dtype != torch.float32:
                    module.weight = torch.nn.Parameter(module.weight.detach().float(), requires_grad=False)
                    if module.bias is not None:
                        module.bias = torch.nn.Parameter(module.bias.detach().float(), requires_grad=False)
            few_rows.install(self.model)
        else:
            few_rows.install(self.model, weight_dtype=dtype)
        self.matmul_dtype = dtype
        if self.lean is not None:
            self.lean, note = lean_or_reason(self.model)
            self.lean_note = _join(self.lean_note, note)

    # --- what proposers may read -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding's); linear weights may be narrower (``matmul_dtype``)."""
        return self.model.get_input_embeddings().weight.dtype

    @property
    def vocab_size(self) -> int:
        """Size of the distributions p (the LM head's output), which may exceed the tokenizer's size."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def embedding(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def head_product(self):
        """The LM head as this target's own forward multiplies by it: the lean path's product (on its bf16 or
        rows kernel, shared, no copy) where the lean path runs, else the model's module. For drafters that
        project onto the whole vocabulary (HF's module runs oneDNN's one-row product, several times slower)."""
        return self.lean.head if self.lean is not None else self.lm_head

    @property
    def final_norm(self) -> torch.nn.Module | None:
        return getattr(getattr(self.model, "model", None), "norm", None)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return ids

    # --- text ----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer: pass the prompt as a list of token ids")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # --- the caches ----------------------------------------------------------------------------------
    def new_rows(self) -> TargetRows:
        """An empty set of per-request caches for the decode engine (any batch size): ragged on the lean path,
        HF's padded batch otherwise (see :mod:`specplug.rows`)."""
        if self.lean is not None:
            return LeanRows(self.lean, self.model.config.num_hidden_layers)
        return PaddedRows(self.model, self.device, self.max_positions)

    def forward(self, state: KVState, tokens: Sequence[int] | torch.Tensor, features: Sequence[str] = (),
                logits_to_keep: int = 0) -> Scores:
        """Run ``tokens`` after the cached ones, append them to the cache, return their logits."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        if self.lean is not None:
            if state.cache is None:
                state.cache = self.lean.new_cache()
            layers = {name: feature_layer(name, self.model.config.num_hidden_layers) for name in features}
            logits, hidden = self.lean.run(state.cache, ids[0], keep=logits_to_keep, hidden=tuple(layers.values()))
            state.length += n
            return Scores(logits=logits, features={name: hidden[i] for name, i in layers.items()})
        positions = torch.arange(state.length, state.length + n, device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=positions, **cache_kwargs(state.cache), use_cache=True,
                             output_hidden_states=bool(features), logits_to_keep=logits_to_keep)
        state.cache = output_cache(out)
        state.length += n
        top = self.model.config.num_hidden_layers
        return Scores(logits=out.logits[0],
                      features={name: out.hidden_states[feature_layer(name, top)][0] for name in features})

    def prefill(self, prompt_ids: Sequence[int], state: KVState | None = None) -> KVState:
        """Cache every prompt token but the last, which the first ``score`` feeds as ``last``."""
        state = state or KVState()
        if len(prompt_ids) > 1:
            self.forward(state, list(prompt_ids[:-1]), logits_to_keep=1)
        return state

    def score(self, state: KVState, tokens: Sequence[int] | torch.Tensor, sampling: SamplingParams,
              features: Sequence[str] = ()) -> tuple[torch.Tensor, Scores]:
        """Score ``[last, x1..xk]`` in one forward: p_target [k+1, V] (processed) and the raw scores."""
        scores = self.forward(state, tokens, features)
        return processed_probs(scores.logits, sampling), scores

    def rollback(self, state: KVState, length: int) -> None:
        """Crop the cache to its first ``length`` tokens (drop the rejected drafts)."""
        drop = state.length - length
        if drop < 0:
            raise ValueError(f"cannot roll back a cache of {state.length} tokens to {length}")
        if drop:
            if isinstance(state.cache, LeanCache):
                state.cache.crop(length)
            else:
                state.cache.crop(-drop)  # transformers 5.x: a negative count removes that many tokens
            state.length = length


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note and more else note or more


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _failed(found: dict[str, bool]) -> str:
    """What a probe found, in words: which verify passes are not bit-identical to one-token steps."""
    which = [{"single": "single-sequence", "batched": "batched"}[k] for k, ok in found.items() if not ok]
    return f"{' and '.join(which)} verify passes not bit-identical to one-token steps" if which else ""
