"""OpenAI-style errors: every failure answers {"error": {"message", "type", "param", "code"}}."""
import logging
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._loader import native

log = logging.getLogger("river_gguf.serve")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered to the client as it is (status, message, param, code)."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or (INVALID_REQUEST if status < 500 else SERVER_ERROR)
        self.headers = headers

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = INVALID_REQUEST, param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_model_error(e: BaseException) -> APIError:
    """What a model call's exception means to the client. The model checks its own arguments:
    ValueError/TypeError are the request's fault (400); anything else is the server's (500)."""

    if isinstance(e, APIError):
        return e
    if isinstance(e, native.ContextOverflowError):
        return APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e) or type(e).__name__)
    log.error("model call failed", exc_info=e)
    return APIError(500, f"the model failed: {type(e).__name__}: {e}")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg', '')}".rstrip(": "),
                        code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if not loc and kind in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object", code="invalid_value")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: {param}", param=param, code="missing_required_parameter")
    where = f"{param}: " if param else ""
    return APIError(400, f"Invalid request: {where}{first.get('msg', 'invalid value')}", param=param,
                    code="invalid_value")


def install(app: FastAPI) -> None:
    """Route every error through the OpenAI shape, so clients always get JSON they can parse."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
