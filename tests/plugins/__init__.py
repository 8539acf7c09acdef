"""Tiny third-party plugin packages used by the plugin and conformance tests."""
