"""The one transformers API difference specplug meets inside its supported range: the cache argument.

transformers 5.23 renamed forward's ``past_key_values=`` to ``cache=`` (outputs carry ``.cache``); vLLM's
CPU build pins transformers < 5.20, so with the ``vllm`` extra installed the old names are the live ones.
"""
from __future__ import annotations

import inspect

from transformers.models.llama.modeling_llama import LlamaForCausalLM

CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``model(..., **cache_kwargs(cache))``: the cache under this transformers' name for it."""
    return {CACHE_ARG: cache}


def output_cache(out):
    """The cache a forward returned."""
    return getattr(out, CACHE_ARG)
