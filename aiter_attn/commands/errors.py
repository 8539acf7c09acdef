"""User mistakes on the command line: one line on stderr and exit code 2, never a traceback
(``aiter-attn -v`` prints the traceback too)."""

from __future__ import annotations

import sys
import traceback

__all__ = ["UsageError", "user_error_types", "report_user_error"]


class UsageError(Exception):
    """A mistake in how a command was called (a flag, a value, the environment)."""


def user_error_types() -> tuple:
    """Exception types that mean the user asked for something that cannot be done: a missing
    or broken model file, an unsupported architecture, a plugin that is not installed, a
    backend that cannot serve the model, a prompt past the trained context."""
    from ..kernels.registry import KernelSelectionError
    from ..plugins import PluginLoadError

    types = [UsageError, PluginLoadError, KernelSelectionError]
    try:
        from ..engine.loading import (ContextLengthError, InvalidModelFileError,
                                      ModelNotFoundError)
        from ..engine.model import UnsupportedArchitectureError

        types += [ContextLengthError, InvalidModelFileError, ModelNotFoundError,
                  UnsupportedArchitectureError]
    except ImportError:  # the engine extra is not installed: its errors cannot happen
        pass
    return tuple(types)


def report_user_error(command: str, exc: BaseException, *, verbose: bool) -> int:
    """Print ``aiter-attn COMMAND: error: MESSAGE`` (the message's first line) on stderr,
    the traceback before it with ``verbose``; return 2."""
    if verbose:
        traceback.print_exception(exc)
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    print(f"aiter-attn {command}: error: {lines[0]}", file=sys.stderr)
    return 2
