"""OpenAI-style error bodies and the exceptions the serving layer raises to produce them.

Every error response is ``{"object": "error", "error": {"message", "type", "param",
"code"}}``: the ``error`` object is what the ``openai`` client parses; the top-level
``object`` matches vLLM. ``type`` follows vLLM's names (``BadRequestError`` ...) and
``code`` is the HTTP status.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# SamplingParams' and the Processor's ValueErrors name the field; recover it for `param`.
_PARAM_PATTERNS = (
    re.compile(r"invalid sampling parameter (\w+)="),
    re.compile(r"^(\w+)=\S+ exceeds"),
    re.compile(r"^(\w+) contains token id"),
    re.compile(r"^(\w+) must "),
)


class APIError(Exception):
    """An error the HTTP layer turns into an OpenAI-style JSON response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.error_type = error_type or error_type_for(self.status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.error_type)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_type_for(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def error_body(status: int, message: str, param: str | None = None,
               error_type: str | None = None) -> dict[str, Any]:
    return {
        "object": "error",
        "error": {
            "message": message,
            "type": error_type or error_type_for(status),
            "param": param,
            "code": status,
        },
    }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_value_error(exc: ValueError, param: str | None = None) -> APIError:
    """A 400 for bad input the engine rejected, naming the field when the message does."""
    message = str(exc)
    if param is None:
        for pattern in _PARAM_PATTERNS:
            match = pattern.search(message)
            if match:
                param = match.group(1)
                break
    return APIError(400, message, param)


def engine_dead(exc: BaseException) -> APIError:
    return APIError(503, f"The engine is not running: {exc}")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "model")
