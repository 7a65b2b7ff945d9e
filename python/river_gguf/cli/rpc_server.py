"""`river-gguf rpc-server`: serve this machine's devices to other machines' Models through ggml's
own RPC server (ggml_backend_rpc_start_server, as llama.cpp's rpc-server).

The protocol has no authentication and no encryption: anyone who can reach the port can run
code on the served device and read or write its memory. It binds to 127.0.0.1 by default; bind
to another address only on a trusted network. A server serves one client (Model) at a time.
"""
import ipaddress
import os
import signal
import socket
import sys
import threading

from .._loader import HAS_RPC, RPC_FIX, native
from ..model import default_threads, max_threads
from .common import PROG

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default


def register(sub, common) -> None:
    p = sub.add_parser("rpc-server", help="serve this machine's CPU/GPU to other machines' models (ggml RPC)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; others only on trusted networks: no authentication)")
    p.add_argument("-p", "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: half the CPUs)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="keep large tensors here by hash, so a client that loads the same model again sends less")
    p.add_argument("--device", action="append", default=None, metavar="NAME",
                   help="ggml device to serve (repeatable; default: every GPU, else the CPU)")
    p.set_defaults(func=_cmd_rpc_server)


# Errors are ValueError: the CLI reports them (exit 2), as it does river_gguf's own.
def _check_address(host: str, port: int) -> None:
    """A clear error now for an address that cannot be bound (ggml's own message is bare)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {port}")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"--host must be an IPv4 address (ggml's RPC server takes no host names), got {host!r}") from None
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml's server
    try:
        s.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    finally:
        s.close()


def _cmd_rpc_server(args) -> int:
    # SIGTERM ends the server as Ctrl-C does (exit 143 rather than 130).
    stop = {"code": 0}

    def on_term(signum, frame):
        stop["code"] = 128 + signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        if not HAS_RPC:
            raise ValueError(f"rpc-server needs ggml's RPC backend, which this installation lacks: {RPC_FIX}")
        threads = default_threads() if args.threads is None else args.threads
        if not 1 <= threads <= max_threads():
            raise ValueError(f"--threads must be in [1, {max_threads()}], got {threads}")
        _check_address(args.host, args.port)
        cache = ""
        if args.cache:
            cache = os.path.abspath(args.cache)
            os.makedirs(cache, exist_ok=True)

        print(f"{PROG} rpc-server: ggml RPC protocol {native.RPC_PROTOCOL}, {threads} threads, listening on "
              f"{args.host}:{args.port}" + (f", cache {cache}" if cache else ""), file=sys.stderr)
        if not ipaddress.ip_address(args.host).is_loopback:
            print(f"{PROG} rpc-server: WARNING: no authentication; anyone who reaches {args.host}:{args.port} "
                  "can use this machine's device memory. Trusted networks only.", file=sys.stderr)
        sys.stderr.flush()

        # ggml's server blocks for good; it runs in a thread (GIL released) so that this thread
        # stays free to take Ctrl-C / SIGTERM and end the process.
        result = []

        def serve():
            try:
                result.append(native.rpc_serve(args.host, args.port, threads, cache, args.device or []))
            except (ValueError, RuntimeError) as e:  # an unknown --device
                result.append(f"error: {e}")

        server = threading.Thread(target=serve, name="ggml-rpc-server", daemon=True)
        server.start()
        while server.is_alive():
            server.join(0.5)
    except KeyboardInterrupt:
        print(f"\n{PROG} rpc-server: stopped", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        # The server thread is inside ggml's accept/serve loop and cannot be joined; end the
        # process now rather than run interpreter teardown under it.
        os._exit(stop["code"] or 130)
    print(f"{PROG} rpc-server: {result[0] if result else 'stopped'}", file=sys.stderr)
    return 2 if result and result[0].startswith("error:") else 1
