"""Errors as OpenAI sends them: `APIError` (what a route raises), and the app's handlers that turn it, FastAPI's
and Starlette's own errors (an unknown route, a malformed body, a body over the limit) and any failure of the
server into OpenAI-style error objects with the right status, the field at fault in ``param``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import ServerMetrics
from .protocol import error_body, error_field, error_tag

ROUTES = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (or a WebSocket), GET and DELETE "
          "/v1/responses/{id}, POST /v1/responses/compact, GET /v1/models, /health and /metrics")


class APIError(Exception):
    """An HTTP error as OpenAI sends them: the status, the message, its type, code and the field at fault.

    Example:
        >>> exc = APIError(404, "model 'x' is not served here", code="model_not_found", param="model")
        >>> exc.status, exc.kind, exc.param
        (404, 'invalid_request_error', 'model')
    """

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.headers = status, kind, code, param, headers


class BodyTooLarge(StarletteHTTPException):
    """A request body over `RequestLimits.body_bytes` (raised while it is read: FastAPI passes it on).

    Example:
        >>> BodyTooLarge(1024).status_code
        413
    """

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes: send fewer or shorter messages")


class BodyLimit:
    """ASGI middleware: a request body longer than `limit` bytes is refused (413) as soon as it is known to be:
    from its Content-Length, or while it is read (a chunked body), never held whole in memory.

    Example:
        >>> app = FastAPI()
        >>> app.add_middleware(BodyLimit, limit=1 << 20)
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        seen = 0

        async def limited():
            nonlocal seen
            if declared.isdigit() and int(declared) > self.limit:
                raise BodyTooLarge(self.limit)
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        return await self.app(scope, limited, send)


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Makes every error `app` answers an OpenAI-style error object (counted in `metrics` by status): an
    `APIError` as it says; Starlette's and FastAPI's own errors (unknown route, wrong method, an unreadable or
    invalid body) with what to change; any other exception a 500.

    Example:
        >>> add_error_handlers(app, ServerMetrics(None, lambda: 0))  # doctest: +SKIP
    """

    def error(exc: APIError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(error_body(str(exc), exc.kind, exc.param, exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        status, param, code = exc.status_code, None, None
        cause = exc.__cause__
        if isinstance(exc, BodyTooLarge):
            message, param, code = str(exc.detail), "messages", "request_too_large"
        elif status == 400 and isinstance(cause, UnicodeDecodeError):
            message = (f"the request body is not valid UTF-8 (byte {cause.start}: {cause.reason}): send JSON "
                       "encoded as UTF-8")
        elif status == 400 and cause is not None:
            message = f"the request body could not be parsed ({type(cause).__name__}): send a JSON object"
        elif status == 404:
            message = f"Invalid URL ({request.method} {request.url.path}): this server serves {ROUTES}"
            code = "not_found"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return error(APIError(status, message, kind=kind, code=code, param=param, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A failure of the server itself, as an OpenAI error too (Starlette logs it and re-raises it after this).
        return error(APIError(500, f"the server failed: {type(exc).__name__}", kind="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})"))
        if tuple(first.get("loc", ())) == ("body",):
            return error(APIError(400, "the request body must be a JSON object (Content-Type: application/json)"))
        message, param = validation_message(exc.errors())
        return error(APIError(400, message, param=param))


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A request's validation errors as an OpenAI error: its message and the field at fault (``param``). A
    field of several accepted types that matches none names each type's complaint.

    Example:
        >>> validation_message([{"loc": ("body", "stream"), "msg": "Input should be a valid boolean"}])
        ('invalid request: stream: Input should be a valid boolean', 'stream')
    """
    def located(e: dict) -> tuple:
        return tuple(part for part in e.get("loc", ()) if part != "body")

    def what(e: dict) -> str:
        return str(e.get("msg", "invalid request")).removeprefix("Value error, ")

    where, alternatives = error_field(located(errors[0]))
    if alternatives:
        depth = len(where.split(".")) if where else 0
        first: dict[str, str] = {}  # each accepted type (its tag) and the first complaint of it
        for e in errors:
            loc = located(e)
            if error_field(loc)[0] != where:
                continue
            tag = str(loc[depth])
            inner = [str(p) for p in loc[depth + 1:] if not error_tag(p)]
            shown = tag if len(tag) <= 24 else tag.split("[")[0] + "[...]"
            first.setdefault(tag, f"{shown}{' at ' + '.'.join(inner) if inner else ''}: {what(e)}")
        message = "matches none of its accepted types (" + "; ".join(first.values()) + ")"
    else:
        message = what(errors[0])
    return f"invalid request: {where}: {message}" if where else f"invalid request: {message}", where
