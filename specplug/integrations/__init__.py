"""Bridges from specplug to serving engines (``specplug.integrations.vllm``)."""
