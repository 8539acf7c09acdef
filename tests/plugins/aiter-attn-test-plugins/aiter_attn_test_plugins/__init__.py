"""Test-only plugins for aiter_attn's plugin loader (never install them for real use)."""
