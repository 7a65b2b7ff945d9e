"""What every subcommand shares: the program name, the usage error, the parent parsers of the
model / exit / sampling options, and the loaders of a Model or a Llama from parsed options.
Models load only when a handler runs."""
import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

from ..options import DRAFT_MODES, MODES, RIVER_ATTENTION

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
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="the most the GPU placement may use, e.g. 6GiB (default: its free memory); with --ngl -1, "
                        "a River model that does not fit puts its river, head and KV cache there first")
    p.add_argument("--river", default=None, metavar="PATH", help="separate lower-precision GGUF used as river")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp/ggml log output")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="put layers on these RPC servers (river-gguf rpc-server; trusted networks only)")
    p.add_argument("--rpc-layers", default=None, metavar="N|LIST",
                   help="layers on the RPC servers: N (the last N, -1: all; default all) or a list like 0-3,8")
    p.add_argument("--rpc-split", default=None, metavar="S1,S2,...",
                   help="each remote device's share of those layers (default: by free memory)")
    p.add_argument("--rpc-weights", choices=("all", "backbone", "river"), default="all",
                   help="whose weights of a remote layer go with it (default all; its KV cache always does)")
    p.add_argument("--rpc-timeout", type=float, default=None, metavar="S",
                   help="seconds an RPC server may take to answer (default 120)")


def rpc_model_kwargs(args) -> dict:
    """Model's rpc_* arguments from --rpc and friends (ValueError when ggml has no RPC)."""
    from .. import rpc

    kw = {}
    if getattr(args, "rpc", None) is not None:
        from .._loader import HAS_RPC, require_rpc

        if not HAS_RPC:  # a ValueError, reported as a usage error (Model raises RuntimeError)
            try:
                require_rpc("--rpc")
            except RuntimeError as e:
                raise ValueError(str(e)) from None
        kw["rpc_servers"] = args.rpc
    if getattr(args, "rpc_layers", None) is not None:
        kw["rpc_layers"] = rpc.parse_layers_spec(args.rpc_layers)
    if getattr(args, "rpc_split", None) is not None:
        try:
            kw["rpc_split"] = [float(x) for x in args.rpc_split.split(",")]
        except ValueError:
            raise ValueError(f"--rpc-split {args.rpc_split!r}: give numbers separated by commas") from None
    if getattr(args, "rpc_weights", "all") != "all":
        kw["rpc_weights"] = args.rpc_weights
    if getattr(args, "rpc_timeout", None) is not None:
        kw["rpc_timeout"] = args.rpc_timeout
    return kw


def add_exit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default=None,
                   help="exit mode (default: the file's own); lossless: the river drafts, the backbone verifies, "
                        "and the text is the backbone's")
    p.add_argument("--draft-max", type=int, default=None, metavar="N",
                   help="lossless: at most N drafts a round (default 4)")
    p.add_argument("--draft-p-min", type=float, default=None, metavar="P",
                   help="lossless: stop drafting at a draft whose probability is below P (default 0)")
    p.add_argument("--draft-mode", choices=DRAFT_MODES, default=None,
                   help="lossless: draft with every layer from the river (river-only, default) or with River's "
                        "exit rule (river: backbone layers until cos > TAU)")
    p.add_argument("--threshold", "--tau", dest="threshold", type=float, default=None, metavar="TAU",
                   help="exit when cos(h_in, h_out) >= TAU (> 1: never)")
    p.add_argument("--exit-layer", type=int, default=None, metavar="K",
                   help="force every decoded token out after backbone layer K")
    p.add_argument("--river-head", action=argparse.BooleanOptionalAction, default=None,
                   help="use the river's own output head for exited tokens")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="one of the River GGUF's stored settings: fast, balanced, quality (default: the file's "
                        "default, balanced); the options above override it")
    p.add_argument("--tail", type=int, default=None, metavar="T",
                   help="exited tokens rejoin the backbone for the last T layers")
    p.add_argument("--river-attention", choices=RIVER_ATTENTION, default=None,
                   help="whose attention weights river layers run: their own, or the backbone's (with the "
                        "river's FFN)")


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
    from ..default_model import default_model_path, default_river_path

    river = default_river_path()
    if os.path.exists(river):
        return river
    print("river-gguf: no River GGUF yet (run `river-gguf convert`); using the plain default model",
          file=sys.stderr)
    return default_model_path()


def gpu_model_kwargs(args) -> dict:
    """Model/Llama keyword arguments of the GPU options add_model_args defines."""
    return dict(n_gpu_layers=args.ngl, main_gpu=args.main_gpu, gpu_memory=args.gpu_memory)


def load_model(args):
    """The River-level Model (river_gguf.Model) for a subcommand that evaluates or inspects."""
    from ..model import Model

    return Model(args.model or default_model_for_cli(), river=args.river, n_ctx=args.ctx, n_threads=args.threads,
                 verbose=args.verbose, **gpu_model_kwargs(args), **river_model_kwargs(args),
                 **rpc_model_kwargs(args))


def load_llama(args):
    """The text model (river_gguf.Llama) for generate and chat: the same one the server runs."""
    from ..llama import Llama

    path = args.model or default_model_for_cli()
    for p in (path, args.river):
        if p is not None and not os.path.exists(p):
            raise FileNotFoundError(f"model file not found: {p}")  # as `info` and Model say it
    # Flash attention: faster, and the setting the benchmarks compare llama.cpp at (Llama's own
    # default is llama_cpp's, off).
    return Llama(path, river=args.river, n_ctx=args.ctx, n_threads=args.threads, flash_attn=True,
                 verbose=args.verbose, **gpu_model_kwargs(args), **river_model_kwargs(args),
                 **rpc_model_kwargs(args))


def river_model_kwargs(args) -> dict:
    """The exit options given on the command line (None: the file's own)."""
    return {k: getattr(args, k, None) for k in ("mode", "threshold", "river_head", "preset", "tail",
                                                "river_attention", "draft_max", "draft_p_min", "draft_mode")}


def sampling_kwargs(args) -> dict:
    """Arguments of Llama.create_completion / create_chat_completion from the sampling and
    per-call exit options."""
    if not args.temp >= 0:  # llama_cpp reads a negative temperature as greedy; on a command line it is a typo
        raise UsageError(f"--temp must be a temperature >= 0 (0: greedy), got {args.temp}")
    kw = dict(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop or [])
    if getattr(args, "exit_layer", None) is not None:
        kw["exit_layer"] = args.exit_layer
    return kw


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


def json_safe(x):
    from ..results import json_safe  # imported here: keeps numpy off the CLI's start-up path

    return json_safe(x)


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


