"""`river-gguf serve` (river_gguf.serve): parse, listen (503 "Loading model" while the model loads), serve."""
import argparse
import copy
import sys
import threading
from dataclasses import replace

from ..serve import served_model
from ..serve.settings import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, ServerSettings, api_key_from
from .common import UsageError, load_llama


def register(sub, common) -> None:
    p = sub.add_parser("serve", parents=[common.model, common.exit],
                       help="serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                            "/v1/chat/completions, /v1/models)")
    p.add_argument("--n-ctx", dest="ctx", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="same as -c/--ctx")
    p.add_argument("-np", "--parallel", type=int, default=None, metavar="N",
                   help=f"number of slots: requests decoded at once, each with its own KV sequence (default: "
                        f"{served_model.DEFAULT_SLOTS}, as llama-server's auto, sharing one KV pool of -c positions; "
                        "with N given, each slot gets -c/N positions unless --kv-unified)")
    p.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="every slot may use the whole context (one shared KV pool of -c positions)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else no key)")
    p.add_argument("--alias", default=None, metavar="NAME",
                   help="model name shown in /v1/models and in responses (default: the file name)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info: one line per request)")
    p.set_defaults(func=run)


def _with_ctx(args, n_ctx: int):
    """args with -c set to n_ctx (the other options as given)."""
    out = copy.copy(args)
    out.ctx = n_ctx
    return out


def _web_stack():
    try:
        import fastapi  # noqa: F401
        import pydantic  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UsageError(f"the server needs {e.name or 'its web libraries'}: "
                         "pip install 'river_gguf[server]' (fastapi, uvicorn, sse-starlette, pydantic)") from None
    return uvicorn


def run(args) -> int:
    uvicorn = _web_stack()
    # The server's own modules import the web stack, an optional extra: only when it runs.
    from ..serve.loading import LoadingGate
    from ..serve.worker import shutdown

    # Checked before the model spends time loading; the name comes from the loaded model.
    settings = ServerSettings(args.alias or "-", host=args.host, port=args.port, api_key=api_key_from(args.api_key))
    n_slots, unified = _slot_count(args)
    slot_n_ctx, pool_n_ctx = served_model.slot_context(args.ctx, n_slots, unified)
    if not settings.is_local and settings.api_key is None:
        print(f"river-gguf: warning: listening on {settings.host} without an API key; anyone who can reach "
              f"this port can use the model (set --api-key or ${API_KEY_ENV})", file=sys.stderr)
    # The server listens while the model loads, answering 503 "Loading model" as llama-server
    # does, so a supervisor polling /health sees it start.
    gate = LoadingGate()
    # timeout_graceful_shutdown: Ctrl-C ends open streams after 5 s instead of waiting on them.
    server = uvicorn.Server(uvicorn.Config(gate, host=settings.host, port=settings.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5, lifespan="off"))
    failed = []

    def load():
        try:
            gate.open(_served_app(args, settings, n_slots, slot_n_ctx, pool_n_ctx))
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread
            failed.append(e)
            server.should_exit = True

    # A daemon: Ctrl-C during a load ends the process without waiting for it.
    threading.Thread(target=load, name="river-gguf-load", daemon=True).start()
    server.run()
    if failed:
        raise failed[0]
    if gate.is_open:
        shutdown(gate.app.state.worker)
    return 0


def _served_app(args, settings, n_slots: int, slot_n_ctx: int, pool_n_ctx: int):
    """Load the model, make its slots, and the app that serves them."""
    from ..serve.app import create_app

    model = _load_model(args, pool_n_ctx)
    settings = replace(settings, model_id=served_model.model_id(model, args.alias))
    app = create_app(_make_slots(model, n_slots, slot_n_ctx), settings)
    print(f"river-gguf: serving {model.model_path} as {settings.model_id!r} on "
          f"http://{settings.host}:{settings.port}/v1 with {n_slots} slot{'s' if n_slots > 1 else ''} of "
          f"{slot_n_ctx} tokens" + (" (API key required)" if settings.api_key else ""),
          file=sys.stderr, flush=True)
    return app


def _slot_count(args):
    """(slots, whether they share one KV pool): --parallel N splits the context, as llama-server's
    -np N does; without it, llama-server's auto (4 slots, one shared pool)."""
    if args.parallel is None:
        return served_model.DEFAULT_SLOTS, True
    if args.parallel < 1:
        raise UsageError(f"--parallel must be at least 1, got {args.parallel}")
    return args.parallel, args.kv_unified


def _load_model(args, n_ctx: int):
    """The model for `river-gguf serve`'s arguments, in the class serve.served_model names, with
    a KV cache of n_ctx positions (the pool its slots share)."""

    # embedding=True: /v1/embeddings works (in this engine it costs nothing until called).
    return load_llama(_with_ctx(args, n_ctx), model_class=served_model.model_class(), embedding=True)


def _make_slots(llama, n_slots: int, slot_n_ctx: int) -> list:
    """The slots the server runs requests on: one is the Llama itself; more share its model."""
    if n_slots == 1:
        return [llama]
    return served_model.make_slots(llama, n_slots, slot_n_ctx)
