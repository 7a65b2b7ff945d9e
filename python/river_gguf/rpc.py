"""Layers on other machines through ggml's RPC backend (ggml-rpc): the client's options.

The engine places layers on the servers' devices (native/placement.cpp) and guards the connections
(native/rpc_link.h); this module checks the options Model and the CLI take and turns them into the
engine's arguments. Servers are `river-gguf rpc-server` or llama.cpp's `rpc-server` of the same
ggml version. The protocol has no authentication: use it on trusted networks only.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Union

from ._loader import require_rpc
from .options import RPC_TIMEOUT, RPC_WEIGHTS, is_bool, is_int

# RPC_WEIGHTS: whose weights of a remote layer go with it (its KV cache always does): both
# models', only the backbone's (the river's layers then run locally on the remote cache), or only
# the river's. RPC_TIMEOUT: seconds a server may take to answer one request (a remote graph
# included) before the Model gives up on it with ConnectionError. Both are the engine's
# (native/engine_config.h).

Layers = Union[None, int, Sequence[int]]


def parse_endpoint(text) -> str:
    """host:port as ggml-rpc takes it (an IPv4 address or a host name, port 1-65535)."""
    if not isinstance(text, str):
        raise ValueError(f"an RPC server must be a 'host:port' string, got {text!r}")
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or "," in host:
        raise ValueError(f"RPC server {text!r} is not host:port (e.g. 192.168.1.10:50052)")
    return f"{host}:{int(port)}"


def parse_servers(servers) -> List[str]:
    """A list of host:port strings, or one string of them separated by commas (llama.cpp's --rpc)."""
    if servers is None:
        return []
    if isinstance(servers, str):
        servers = [s for s in servers.split(",") if s.strip()]
        if not servers:
            raise ValueError("rpc_servers is empty")
    elif not isinstance(servers, (list, tuple)):
        raise ValueError(f"rpc_servers must be a list of 'host:port' strings, got {servers!r}")
    out = [parse_endpoint(s) for s in servers]
    if len(set(out)) != len(out):
        raise ValueError(f"rpc_servers lists a server twice: {out}")
    return out


def parse_layers_spec(text: str) -> Layers:
    """The CLI's --rpc-layers: N (the last N layers, -1 all) or a list like 0-3,8,10-11."""
    text = text.strip()
    try:
        if "," not in text and "-" not in text.lstrip("-"):
            return int(text)
        layers: List[int] = []
        for part in text.split(","):
            a, sep, b = part.strip().partition("-")
            layers.extend(range(int(a), int(b) + 1) if sep else [int(a)])
        return layers
    except ValueError:
        raise ValueError(f"--rpc-layers {text!r}: give N (the last N layers) or a list such as 0-3,8") from None


def engine_kwargs(servers, layers: Layers = None, split: Optional[Sequence[float]] = None,
                  weights: str = "all", timeout: Optional[float] = RPC_TIMEOUT) -> dict:
    """native.Engine's rpc_* arguments; {} without servers (then the other options must be left
    at their defaults). ValueError for bad values; RuntimeError naming the fix when ggml has no RPC."""
    servers = parse_servers(servers)
    if not servers:
        given = [n for n, v, d in (("rpc_layers", layers, None), ("rpc_split", split, None),
                                   ("rpc_weights", weights, "all"), ("rpc_timeout", timeout, RPC_TIMEOUT))
                 if v != d]
        if given:
            raise ValueError(f"{', '.join(given)} given without rpc_servers")
        return {}
    kw: dict = {"rpc_servers": servers}
    if layers is None:
        kw["rpc_n_layers"] = -1
    elif is_int(layers):
        if layers == 0:
            raise ValueError("rpc_layers=0 puts no layer on the servers; leave rpc_servers out instead")
        kw["rpc_n_layers"] = -1 if layers < 0 else min(int(layers), 1 << 30)
    elif isinstance(layers, (list, tuple, range)) and len(layers) > 0 and all(is_int(x) for x in layers):
        kw["rpc_layers"] = [int(x) for x in layers]
    else:
        raise ValueError(f"rpc_layers must be an int (the last n layers; -1: all) or a non-empty list of layer "
                         f"indices, got {layers!r}")
    if split is not None:
        if not isinstance(split, (list, tuple)) or not split or not all(
                isinstance(x, (int, float)) and not is_bool(x) and math.isfinite(x) and x >= 0 for x in split) \
                or sum(split) <= 0:
            raise ValueError(f"rpc_split must be a list of shares >= 0 (one per remote device, not all 0), got {split!r}")
        kw["rpc_split"] = [float(x) for x in split]
    if weights not in RPC_WEIGHTS:
        raise ValueError(f"rpc_weights must be one of {', '.join(RPC_WEIGHTS)}, got {weights!r}")
    kw["rpc_weights"] = weights
    if timeout is None:
        kw["rpc_timeout"] = 0.0
    elif isinstance(timeout, (int, float)) and not is_bool(timeout) and math.isfinite(timeout) and timeout > 0:
        kw["rpc_timeout"] = float(timeout)
    else:
        raise ValueError(f"rpc_timeout must be seconds > 0 (None: no limit), got {timeout!r}")

    require_rpc("rpc_servers")
    return kw
