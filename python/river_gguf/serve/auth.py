"""The optional API key: `Authorization: Bearer <key>` on every path except the health check."""
import hmac
from typing import Iterable, Optional

from starlette.datastructures import Headers

from .errors import APIError

#: Paths answered without a key (a load balancer or supervisor has none).
OPEN_PATHS = ("/health",)


class BearerAuth:
    """Plain ASGI middleware (it runs before the body is read, so a request without the key
    gets 401 whatever its body; and it does not wrap streaming responses the way Starlette's
    BaseHTTPMiddleware would)."""

    def __init__(self, app, api_key: Optional[str], open_paths: Iterable[str] = OPEN_PATHS):
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self.key):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if scheme.lower() == "bearer" and token.strip() else
                   "Missing API key: send the header 'Authorization: Bearer <key>'.")
        err = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)
