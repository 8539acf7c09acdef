"""A plugin with a misspelt hook name: validation rejects it instead of ignoring it."""

from aiter_attn.hookspecs import hookimpl


@hookimpl
def aiter_attn_register_kernel(register):  # typo: the hook is aiter_attn_register_kernels
    raise AssertionError("never called")
