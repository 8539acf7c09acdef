"""Subcommands of the ``aiter-attn`` CLI (one module each)."""
