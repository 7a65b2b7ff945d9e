"""What the server answers while the model loads: llama-server's 503 "Loading model" on every
path, /health included, until the served app takes over."""
import json
from typing import Any, Optional

#: llama-server's body for a request that arrives before its model has loaded.
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


class LoadingGate:
    """An ASGI app that answers 503 LOADING until open(app), and is `app` from then on. It takes
    no lifespan events (run it with uvicorn's lifespan="off"): the app it opens to is made while
    the server already runs, after those events would have been sent."""

    def __init__(self):
        self.app: Optional[Any] = None

    @property
    def is_open(self) -> bool:
        return self.app is not None

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        app = self.app
        if app is not None:
            return await app(scope, receive, send)
        if scope["type"] != "http":
            return  # a websocket or lifespan scope: nothing is served before the model
        body = json.dumps(LOADING).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
