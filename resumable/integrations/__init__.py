"""Integrations with other training loops. Each is imported on its own (``resumable.integrations.transformers``
needs the ``resumable[hf]`` extra); importing this package imports none of them."""
