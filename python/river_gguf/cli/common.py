"""What every subcommand shares: the program name, the usage error, the parent parsers of the
model / exit / sampling options, and the loaders of a Model or a Llama from parsed options.
Models load only when a handler runs."""
import argparse
import math
import os
import sys
from dataclasses import dataclass, fields
from typing import Optional

from .. import rpc
from .._loader import HAS_RPC, require_rpc
from ..default_model import default_model_path, default_river_path
from ..llama import Llama
from ..model import Model
from ..options import RiverOptions
from ..results import json_safe

PROG = "river-gguf"


class UsageError(Exception):
    """Bad invocation found after parsing; reported like an argparse error (exit 2)."""


@dataclass
class Common:
    model: argparse.ArgumentParser
    exit: argparse.ArgumentParser
    sampling_gen: argparse.ArgumentParser   # -n 128, greedy
    sampling_chat: argparse.ArgumentParser  # until end of turn, temp 0.2 (as create_chat_completion)


def _parent(add, *a) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add(p, *a)
    return p


def common_parents() -> Common:
    return Common(_parent(add_model_args), _parent(add_exit_args), _parent(add_sampling_args, 128, 0.0),
                  _parent(add_sampling_args, None, 0.2))


# ----- shared option groups -------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file (plain or River GGUF); default: SmolLM2-135M-Instruct Q4_1")
    p.add_argument("-c", "--ctx", type=int, default=2048, help="context size in tokens (default 2048)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: half the CPUs)")
    p.add_argument("--ngl", type=int, default=0, metavar="N", help="layers to offload to the GPU (-1: all)")
    p.add_argument("--main-gpu", type=int, default=0, metavar="I",
                   help="which GPU (river-gguf info --devices lists them; default 0: the first discrete one)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp/ggml log output")
    _add_river_fields(p, exit=False)


def add_exit_args(p: argparse.ArgumentParser) -> None:
    _add_river_fields(p, exit=True)


def _add_river_fields(p: argparse.ArgumentParser, exit: bool) -> None:
    """One flag per RiverOptions field of the group (the exit setting, or where things run),
    from the field's metadata: the options are declared once, in river_gguf.options."""
    for f in fields(RiverOptions):
        if f.metadata["exit"] != exit:
            continue
        kw = dict(f.metadata["argparse"])
        if f.metadata["bool_flag"]:
            kw["action"] = argparse.BooleanOptionalAction
        p.add_argument(*f.metadata["flags"], dest=f.name, default=None, help=f.metadata["help"], **kw)


def river_options(args) -> RiverOptions:
    """The RiverOptions given on the command line (a flag left out: the file's or the engine's
    default). ValueError for a value that does not parse."""
    given = {}
    for f in fields(RiverOptions):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        parse = f.metadata["parse"]
        if parse == "layers":
            v = rpc.parse_layers_spec(v)
        elif parse == "floats":
            try:
                v = [float(x) for x in v.split(",")]
            except ValueError:
                raise ValueError(f"{f.metadata['flags'][0]} {v!r}: give numbers separated by commas") from None
        given[f.name] = v
    if given.get("rpc_servers") is not None and not HAS_RPC:
        try:  # a ValueError, reported as a usage error (Model raises RuntimeError)
            require_rpc("--rpc")
        except RuntimeError as e:
            raise ValueError(str(e)) from None
    return RiverOptions.of(**given)


def add_sampling_args(p: argparse.ArgumentParser, n_default: Optional[int], temp_default: float) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=n_default, metavar="N",
                   help=f"tokens to generate (default {n_default or 'until end of turn'})")
    p.add_argument("--temp", type=float, default=temp_default, help=f"temperature; 0 = greedy (default {temp_default})")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, metavar="S", help="stop string (repeatable)")


def default_model_for_cli() -> str:
    """The default River GGUF once `river-gguf convert` made it, else the shipped Q4_1 file."""

    river = default_river_path()
    if os.path.exists(river):
        return river
    print("river-gguf: no River GGUF yet (run `river-gguf convert`); using the plain default model",
          file=sys.stderr)
    return default_model_path()


def _model_kwargs(args) -> dict:
    """Model/Llama keyword arguments of the options add_model_args defines."""
    return dict(n_ctx=args.ctx, n_threads=args.threads, n_gpu_layers=args.ngl, main_gpu=args.main_gpu,
                verbose=args.verbose, river_options=river_options(args))


def load_model(args):
    """The River-level Model (river_gguf.Model) for a subcommand that evaluates or inspects."""
    return Model(args.model or default_model_for_cli(), **_model_kwargs(args))


def load_llama(args, model_class=None, **kw):
    """The text model (river_gguf.Llama, or `model_class` with its interface) for generate, chat
    and serve: one class, so the same prompt, seed and settings give the same text in each."""
    path = args.model or default_model_for_cli()
    for p in (path, args.river):
        if p is not None and not os.path.exists(p):
            raise FileNotFoundError(f"model file not found: {p}")  # as `info` and Model say it
    # Flash attention: faster, and the setting the benchmarks compare llama.cpp at (Llama's own
    # default is llama_cpp's, off).
    return (model_class or Llama)(path, flash_attn=True, **_model_kwargs(args), **kw)


def sampling_kwargs(args) -> dict:
    """Arguments of Llama.create_completion / create_chat_completion from the sampling and
    per-call exit options."""
    if not args.temp >= 0:  # llama_cpp reads a negative temperature as greedy; on a command line it is a typo
        raise UsageError(f"--temp must be a temperature >= 0 (0: greedy), got {args.temp}")
    return dict(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop or [])


# ----- output --------------------------------------------------------------------------
def summary_line(stats: dict, llm) -> str:
    """One line for stderr from Llama.last_stats: speeds, length, finish reason and, with a
    river, the exit profile."""
    s = stats
    parts = [f"prefill {s['prefill_tokens']} tok @ {s['prefill_tok_s']:.1f} tok/s",
             f"decode {s['decode_tokens']} tok @ {s['decode_tok_s']:.1f} tok/s",
             f"{s['completion_tokens']} tokens, finish={s['finish_reason']}"]
    m = llm.river_model
    if s.get("mode") == "lossless":
        rate = s["acceptance_rate"]
        parts.append(f"mode=lossless drafted={s['drafted']} accepted={s['accepted']} "
                     f"({'-' if math.isnan(rate) else f'{100 * rate:.0f}%'}) "
                     f"mean_accepted={s['mean_accepted']:.2f}/{s['draft_max']} "
                     f"draft {s['draft_s']:.2f}s verify {s['verify_s']:.2f}s")
    elif m.has_river:
        hist = " ".join(f"{k}:{v}" for k, v in s["exit_histogram"].items())
        mean = s["mean_exit_layer"]
        parts.append(f"mode={s['mode']}" + (f" tau={s['threshold']:g}" if s["mode"] == "river" else "")
                     + f" tail={s.get('tail', 0)} "
                     f"mean_exit={'-' if math.isnan(mean) else f'{mean:.1f}'}/{m.n_layer - 1} "
                     f"river_share={100 * s['river_layer_share']:.1f}% exits{{{hist}}}")
    return "[" + " | ".join(parts) + "]"




def stream_to_stdout(chunks, chat: bool) -> str:
    """Write each streamed piece as it comes (flushed, even when stdout is a pipe); the text."""
    out, parts = sys.stdout, []
    for c in chunks:
        ch = c["choices"][0]
        piece = (ch["delta"].get("content") if chat else ch["text"]) or ""
        if piece:
            out.write(piece)
            out.flush()
            parts.append(piece)
    return "".join(parts)


