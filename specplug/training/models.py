"""Architectures of the zoo models (Llama-style, tied embeddings)."""
from __future__ import annotations

PRESETS = {
    # name: (layers, hidden, heads, kv_heads, intermediate)
    "pycode": dict(num_hidden_layers=6, hidden_size=512, num_attention_heads=8,
                   num_key_value_heads=8, intermediate_size=1536),
    "pycode-draft": dict(num_hidden_layers=1, hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=768),
}


def make_config(preset: str | None = None, *, vocab_size: int, bos_token_id: int, eos_token_id: int,
                pad_token_id: int, max_position_embeddings: int = 2048, **overrides):
    from transformers import LlamaConfig

    kw = dict(PRESETS[preset]) if preset else {}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        **kw,
    )


def build_model(config, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.tie_weights()
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
