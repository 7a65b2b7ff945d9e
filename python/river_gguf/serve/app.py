"""The ASGI app: OpenAI's completion, chat, embedding and model-list endpoints over one model."""
import time
from contextlib import asynccontextmanager
from typing import Any, Dict

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


def create_app(model, settings: ServerSettings) -> FastAPI:
    """An app serving `model` (river_gguf.Llama, or any class with its create_completion /
    create_chat_completion / tokenize: see protocol.py) under the name settings.model_id."""
    check_model(model)
    worker = ModelWorker(model)
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

    async def answer(request: Request, method, kwargs: Dict[str, Any], stream: bool):
        try:
            if stream:
                lease, first = await worker.open_stream(method, kwargs, gone=request.is_disconnected)
                return sse.stream_response(lease, first, prepare)
            return JSONResponse(prepare(await worker.call(method, kwargs, gone=request.is_disconnected)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the access log shows why
        except errors.APIError:
            raise
        except Exception as e:
            raise errors.from_model_error(e) from e

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_id, "busy": worker.busy, "waiting": worker.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": settings.model_id, "object": "model", "created": created, "owned_by": "river_gguf",
             "permissions": []}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        method = model.create_completion
        return await answer(request, method, params.completion_kwargs(req, method), req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        method = model.create_chat_completion
        return await answer(request, method, params.chat_kwargs(req, method), req.stream)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        method = getattr(model, "create_embedding", None)
        if method is None:
            raise errors.APIError(404, "this model serves no embeddings")
        return await answer(request, method, {"input": req.input}, False)

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
