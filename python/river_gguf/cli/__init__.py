"""The `river-gguf` command line.

Each subcommand is a module here with a `register(subparsers, common)` that adds its parser
(`common` holds the shared parent parsers of the model, exit and sampling options, see
common.py) and sets `func`, a handler `args -> exit status`. The list below is the order in
--help. Registration is static: it imports `Llama` (common.py), and with it the native module,
llama_cpp and numpy; a handler imports what only it needs (the web stack for `serve`) when it
runs.
"""
import argparse
import os
import sys
from typing import List, Optional

from . import convert_cmd, evaluate, info, rpc_server, serve_cmd, text, tune_cmd
from .common import PROG, UsageError, common_parents

__all__ = ["main", "build_parser", "UsageError", "PROG"]

SUBCOMMANDS = [
    text.register_generate,
    text.register_chat,
    info.register,
    convert_cmd.register,
    convert_cmd.register_upgrade,
    evaluate.register_eval,
    evaluate.register_calibrate,
    tune_cmd.register,
    serve_cmd.register,
    rpc_server.register,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="River-LLM early exit on GGUF models")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = common_parents()
    for register in SUBCOMMANDS:
        register(sub, common)
    return parser


def _user_errors():
    # River_gguf's own errors (GGUFFormatError, ContextOverflowError, ...) subclass ValueError,
    # as do its argument checks; OSError covers missing / unreadable files.
    return (UsageError, ValueError, OSError)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C: one line on stderr and the shell's status for SIGINT (128 + 2), no traceback.
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`); point stdout at /dev/null so the exit flush is quiet.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except _user_errors() as e:
        if os.environ.get("RIVER_GGUF_DEBUG"):
            raise
        msg = str(e) or type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
