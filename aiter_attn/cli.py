"""The ``aiter-attn`` command: ``info``, ``generate``, ``verify``.

Subcommands live in ``aiter_attn/commands/<name>.py``; each has ``add_parser(subparsers)``
which sets ``func`` on its parser. A missing subcommand module is skipped. A user mistake
(:func:`aiter_attn.commands.errors.user_error_types`) ends in one line on stderr and exit code
2; ``-v`` prints the traceback too. Output cut short by its reader (``aiter-attn info | head``)
ends quietly with exit code 141 (128 + SIGPIPE, what a shell reports for a command killed by a
closed pipe), never a ``BrokenPipeError`` traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

__all__ = ["main", "SUBCOMMANDS", "EXIT_BROKEN_PIPE"]

SUBCOMMANDS = ("info", "generate", "verify")
#: exit code when the reader of stdout went away (128 + SIGPIPE)
EXIT_BROKEN_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``aiter-attn generate: error: ...``), exit code 2; ``-h``
    shows the usage. Subcommand parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="aiter-attn",
        description="Attention backend for LLM inference over a paged KV cache.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"aiter_attn.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"aiter_attn.commands.{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .commands.errors import report_user_error, user_error_types

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        return _reader_gone()
    except user_error_types() as exc:  # a user mistake: one line, exit 2 (-v: traceback too)
        return report_user_error(args.command, exc, verbose=args.verbose)


def _reader_gone() -> int:
    """stdout's reader closed the pipe: point stdout at /dev/null so that the interpreter's
    final flush of what is still buffered cannot fail again, and end quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (a test's capture)
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
