"""The ASGI app: OpenAI's completion, chat, embedding and model-list endpoints over one model's
slots, and llama-server's /health and /slots."""
import time
from contextlib import asynccontextmanager
from typing import Any, Dict, List

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..results import json_safe
from . import errors, params, sse
from .auth import BearerAuth
from .protocol import check_model
from .schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, TokenizeRequest
from .settings import ServerSettings
from .worker import ClientGone, ModelWorker, shutdown


def create_app(slots, settings: ServerSettings) -> FastAPI:
    """An app serving `slots` under the name settings.model_id: a list of slot objects that share
    one model, each with its own KV sequence (calls on different slots may run at once in
    different threads, never two on one slot), or one model object, served as one slot. A slot
    is river_gguf.Llama, or any class with its create_completion / create_chat_completion /
    tokenize (see protocol.py)."""
    models: List[Any] = list(slots) if isinstance(slots, (list, tuple)) else [slots]
    if not models:
        raise ValueError("create_app needs at least one slot")
    for m in models:
        check_model(m)
    model = models[0]  # whose signatures the requests are checked against, and who tokenizes
    worker = ModelWorker(models)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        shutdown(worker)

    app = FastAPI(title="river_gguf", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # the docs pages load scripts from a CDN
    app.state.worker = worker
    app.state.settings = settings
    errors.install(app)
    app.add_middleware(BearerAuth, api_key=settings.api_key)

    def prepare(d: Dict[str, Any]) -> Dict[str, Any]:
        d = json_safe(d)  # NaN statistics -> null: the body stays strict JSON
        if isinstance(d, dict) and "model" in d:
            d["model"] = settings.model_id  # the served name, not a file path
        return d

    async def answer(request: Request, method: str, kwargs: Dict[str, Any], stream: bool):
        try:
            if stream:
                lease, first = await worker.open_stream(method, kwargs, gone=request.is_disconnected)
                return sse.stream_response(lease, first, prepare)
            result = await worker.call(method, kwargs, gone=request.is_disconnected)
            return JSONResponse(prepare(result))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the access log shows why
        except errors.APIError:
            raise
        except Exception as e:
            raise errors.from_model_error(e) from e

    @app.get("/health")
    async def health():
        # Made once the model has loaded: before that, serve.loading answers 503 "Loading model".
        processing = worker.slots_processing
        return {"status": "ok", "model": settings.model_id, "slots_idle": len(worker.slots) - processing,
                "slots_processing": processing, "busy": processing > 0, "waiting": worker.waiting}

    @app.get("/slots")
    async def slots_state(fail_on_no_slot: bool = False):
        if fail_on_no_slot and worker.slots_processing == len(worker.slots):
            raise errors.APIError(503, "no slot available", code="unavailable", type="unavailable_error")
        return [s.to_json() for s in worker.slots]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": settings.model_id, "object": "model", "created": created, "owned_by": "river_gguf",
             "permissions": []}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        kwargs = params.completion_kwargs(req, model.create_completion)
        return await answer(request, "create_completion", kwargs, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        kwargs = params.chat_kwargs(req, model.create_chat_completion)
        return await answer(request, "create_chat_completion", kwargs, req.stream)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        if getattr(model, "create_embedding", None) is None:
            raise errors.APIError(404, "this model serves no embeddings")
        return await answer(request, "create_embedding", {"input": req.input}, False)

    async def tokens_of(req: TokenizeRequest):
        try:
            # Outside the queue: tokenizing reads only the vocabulary (protocol.ServedModel).
            return await run_in_threadpool(model.tokenize, req.input.encode("utf-8"))
        except Exception as e:
            raise errors.from_model_error(e) from e

    @app.post("/extras/tokenize")
    async def tokenize(req: TokenizeRequest):
        return {"tokens": list(await tokens_of(req))}

    @app.post("/extras/tokenize/count")
    async def tokenize_count(req: TokenizeRequest):
        return {"count": len(await tokens_of(req))}

    return app
