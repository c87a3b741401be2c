"""The target model: an HF causal LM, its tokenizer, and a KV cache that can be rolled back."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from . import few_rows, zoo
from .hf_compat import cache_kwargs, output_cache
from .lean_llama import LeanCache, lean_or_reason
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


def load_causal_lm(path_or_id: str | os.PathLike, *, device="cpu", dtype=None, trust_remote_code: bool = False):
    """Load an HF causal LM from safetensors only (a pickled .bin is refused) and put it in eval mode."""
    from transformers import AutoModelForCausalLM

    local = Path(path_or_id).is_dir()
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

    local = Path(path_or_id).is_dir()
    if local and not any((Path(path_or_id) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=trust_remote_code,
                                         local_files_only=local or None)


def auto_matmul_dtype(model: torch.nn.Module, *, bundled: bool) -> torch.dtype | None:
    """bfloat16 for a bundled (bf16-trained) float32 model on a CPU whose BLAS has native bf16 products.

    Other models keep their own dtype unless asked; where the CPU lacks native bf16, its products are
    emulated and slower than float32."""
    param = next(model.parameters())
    if not bundled or param.dtype != torch.float32 or param.device.type != "cpu":
        return None
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return torch.bfloat16 if native else None


class Target:
    """The model whose distribution the output follows. Device-agnostic: tensors follow the model."""

    def __init__(self, model, tokenizer=None, name: str | None = None, few_rows_linear: bool = True,
                 lean: bool = True, matmul_dtype: torch.dtype | str | None = None):
        """``few_rows_linear``: on CPU in float32, route the model's linear layers through
        :mod:`specplug.few_rows` for 1-16 rows (a decoding step, a verify pass): a BLAS quirk otherwise makes
        scoring 3 tokens cost 1.6 one-token steps. It changes the given model's modules in place.

        ``lean``: run single-sequence forwards (target-only decoding and speculative scoring alike) through
        :mod:`specplug.lean_llama` when the model is a Llama it reproduces — the same arithmetic without HF's
        per-call machinery (a 6-layer target: 4.3 -> 3.3 ms a step). ``lean_note`` says why it is off.
        Batched decoding keeps HF's forward (padding and per-row masks).

        ``matmul_dtype`` (e.g. ``torch.bfloat16``) keeps a float32 model's linear weights in that dtype and
        multiplies in it, everything else staying float32 (:func:`specplug.few_rows.install`): the arithmetic
        of bf16-autocast training (the bundled models were trained so). It changes the given model in place;
        ``matmul_dtype`` says what is in force. On the 2-core CPU it makes scoring 5 tokens cost 1.2-1.3
        one-token steps instead of 1.6. On the lean path a verify pass then scores every position bit for bit
        as a one-token step would (one-row products are padded to two, attention runs query by query), so
        greedy speculative output equals target-only greedy output exactly; in float32 the two agree to ~1e-6."""
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
        self.lean, self.lean_note = lean_or_reason(model) if lean else (None, "lean=False")

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str | None = None, trust_remote_code: bool = False,
                        few_rows_linear: bool = True, lean: bool = True,
                        matmul_dtype: torch.dtype | str | None = "auto") -> "Target":
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
                     few_rows_linear=few_rows_linear, lean=lean, matmul_dtype=matmul_dtype)
        target.path = Path(path) if Path(path).is_dir() else None
        return target

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

    # --- the cache -----------------------------------------------------------------------------------
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


def feature_layer(name: str, num_layers: int) -> int:
    """Index into HF's ``hidden_states`` of a target feature: ``"last"`` is the final-normed last hidden state
    (lm_head(last) == logits), ``"layer:N"`` the output of layer N (0: the embeddings; N < 0 counts back)."""
    if name == "last":
        return num_layers
    if name.startswith("layer:"):
        i = int(name.split(":", 1)[1])
        if -num_layers - 1 <= i <= num_layers:
            return i % (num_layers + 1)
    raise ValueError(f"unknown target feature {name!r}; known: 'last', 'layer:N' (0 <= N <= {num_layers})")
