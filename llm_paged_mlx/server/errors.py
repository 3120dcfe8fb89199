"""The server's errors as OpenAI's error body: what a client reads when its request is refused or fails."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from ..engine.loop import LoopStopped
from ..errors import one_line


class APIError(Exception):
    """An error for the client, in OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalidrequest_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error on ``app`` with OpenAI's error body: a 4xx for bad input, never a 500 for it."""

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, error: RequestValidationError):
        return invalid_body(request, error.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        response = APIError(error.status_code, str(error.detail)).response()
        response.headers.update(error.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return APIError(500, f"internal error: {one_line(error)}", type="server_error").response()


def invalid_body(request: Request, errors: list[dict]) -> APIError:
    """The first of pydantic's errors as a 400 that names the field (not pydantic's names for union branches)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['ctx']['error']} at character {first['loc'][-1]}")
    content_type = request.headers.get("content-type", "")
    if first["loc"] == ("body",) and not content_type.startswith("application/json"):
        return APIError(400, f"send the body as JSON with 'Content-Type: application/json' (not {content_type!r})")
    path = _field_path(first["loc"][1:])
    if not path:
        return APIError(400, "the body must be a JSON object")
    message = first["msg"]
    if first["loc"][-1] == "[key]":  # a mapping's key is wrong, not its value
        path, message = path[:-1], f"the key {path[-1]!r}: {message}"
    elif len(path) + 1 < len(first["loc"]):  # a union: report the branch that got furthest, else the forms
        union = [e for e in errors if e["loc"][1:len(path) + 1] == path]
        deepest = max(union, key=lambda e: len(e["loc"]))
        batch = first["input"]
        if path == ("prompt",) and isinstance(batch, list) and len(batch) > 1 and all(isinstance(p, (str, list)) for p in batch):
            return APIError(400, f"prompt: one prompt a request, not a batch of {len(batch)}", param="prompt")
        if len(deepest["loc"]) > len(path) + 2:
            path, message = path + _field_path(deepest["loc"][len(path) + 2:]), deepest["msg"]
        else:
            message = f"expected {_UNION_FORMS.get(path[-1], 'another kind of value')}"
    where = ".".join(str(part) for part in path)
    return APIError(400, f"{where}: {message}", param=where)


def _field_path(loc: tuple) -> tuple:
    """The fields, indexes and keys of ``loc`` up to the first union branch pydantic names."""
    path = []
    for index, part in enumerate(loc):
        is_key = index == 1 and loc[0] in _MAPPINGS  # whatever it spells
        if not is_key and isinstance(part, str) and (not part.isidentifier() or part in _BRANCH_NAMES):
            break
        path.append(part)
    return tuple(path)


# Union branches pydantic names after a type that is also a valid identifier.
_BRANCH_NAMES = {"str", "int", "float", "bool", "list", "dict", "TextPart"}
# The request's fields that map keys to values (a key follows the field in an error's location).
_MAPPINGS = {"logit_bias"}
# How the union fields' accepted forms read.
_UNION_FORMS = {
    "prompt": "a string, a list of token ids, or a list of one string or one list of token ids",
    "stop": "a string or a list of up to 4 non-empty strings",
    "content": "a string or a list of text parts",
}


def request_error(error: Exception) -> APIError:
    """What the client reads when its request cannot run: a 400, unless the server, not the request, failed."""
    if isinstance(error, TemplateError):
        return APIError(400, f"the chat template rejects these messages: {one_line(error)}", param="messages")
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, one_line(error))
    return server_error(error)


def server_error(error: Exception) -> APIError:
    """What the client reads when the server, not its request, failed."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, LoopStopped):
        return APIError(503, "the server is shutting down", type="server_error")
    return APIError(500, f"the engine failed: {one_line(error)}", type="server_error")
