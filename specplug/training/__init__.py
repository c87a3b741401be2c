"""Training pipeline for specplug's bundled model zoo (tokenizer, target, draft).

Kept import-light: the heavy modules (torch, transformers, tokenizers) are only
imported by the submodules that need them.
"""
