"""Request bodies: JSON parsed with limits, then validated as a protocol model.

``parse_body`` is what every POST route calls, so every failure is an OpenAI-style 400
(never a 5xx): a body nested deeper than ``max_depth`` levels is refused before it is
parsed (the parser, pydantic and the schema compilers all recurse); a number that is not
finite (``NaN``, ``Infinity``, ``1e309``), or an integer too long to convert, is refused
wherever it is, naming the field; then the model validates strictly (see protocol). The
size limit is ``BodySizeLimitMiddleware``'s (a 413), before any of this.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError

from engine.entrypoints.openai.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)

# Deeper JSON is a 400 before it is parsed: Python's parser, pydantic and the schema
# compilers all recurse, and a 2 KB body of brackets would otherwise be a RecursionError.
DEFAULT_MAX_JSON_DEPTH = 64

# A JSON string with its escapes. An unterminated one runs to the end of the body, so the
# pattern always matches where it starts and the scan stays linear.
_JSON_STRING = re.compile(rb'"(?:[^"\\]+|\\.?)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8


def json_nesting_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in the JSON text ``body``, found without parsing
    it (strings are skipped, brackets counted), in milliseconds for a body of megabytes."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.translate(_BRACKET_STEPS), dtype=np.int8)
    return max(int(steps.cumsum(dtype=np.int64).max()), 0)


# Python's own limit on int(str) (sys.get_int_max_str_digits), fixed here so that a longer
# integer is always the same clear 400.
_MAX_INT_DIGITS = 4300


class _RefusedNumber(ValueError):
    """A JSON number the server does not accept: NaN, Infinity, one Python reads as inf
    (``1e309``), or an integer too long to convert."""


_REFUSED = object()  # marks where a refused number was, on a second, lenient parse


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _RefusedNumber(f"{text} is not a finite number (NaN, Infinity and numbers "
                             "beyond the float range are not accepted)")
    return value


def _reject_constant(text: str) -> Any:
    raise _RefusedNumber(f"{text} is not a finite number (NaN, Infinity and numbers beyond "
                         "the float range are not accepted)")


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > _MAX_INT_DIGITS:
        raise _RefusedNumber(f"an integer of {digits} digits is out of range (at most "
                             f"{_MAX_INT_DIGITS} digits)")
    return int(text)


def _refused_path(data: Any, path: tuple = ()) -> tuple | None:
    """Where ``_REFUSED`` is in ``data`` (a path of keys and indexes)."""
    if data is _REFUSED:
        return path
    items = (data.items() if isinstance(data, dict)
             else enumerate(data) if isinstance(data, list) else ())
    for key, value in items:
        found = _refused_path(value, (*path, key))
        if found is not None:
            return found
    return None


def _locate_refused_number(body: bytes) -> tuple | None:
    def lenient(check: Any) -> Any:
        def parse(text: str) -> Any:
            try:
                return check(text)
            except _RefusedNumber:
                return _REFUSED
        return parse

    try:
        data = json.loads(body, parse_float=lenient(_finite_float),
                          parse_int=lenient(_bounded_int), parse_constant=lambda _: _REFUSED)
    except ValueError:
        return None
    return _refused_path(data)


def load_json_body(body: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Any:
    """``body`` parsed as JSON, or a 400: invalid JSON, nesting deeper than ``max_depth``,
    or a number that is not finite (NaN, Infinity, or beyond the float range: 1e309)."""
    too_deep = bad_request(f"The request body has JSON nesting deeper than {max_depth} levels")
    if body.count(b"[") + body.count(b"{") > max_depth and json_nesting_depth(body) > max_depth:
        raise too_deep
    try:
        return json.loads(body, parse_float=_finite_float, parse_int=_bounded_int,
                          parse_constant=_reject_constant)
    except _RefusedNumber as exc:
        where = _locate_refused_number(body)
        param = where[0] if where and isinstance(where[0], str) else None
        field = ".".join(str(part) for part in where) if where else "body"
        raise bad_request(f"Invalid request: {field}: {exc}", param) from None
    except RecursionError:  # not reached under the depth check; never a 500 all the same
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None


async def parse_body(request: Request, model: type[M],
                     max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> M:
    """The JSON body validated as ``model`` (strictly: see protocol); a 400 naming the
    offending field otherwise."""
    data = load_json_body(await request.body(), max_depth)
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except RecursionError:
        raise bad_request(
            f"The request body has JSON nesting deeper than {max_depth} levels") from None


_JSON_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                    list: "an array", dict: "an object", type(None): "null"}


def validation_error(errors: list[Any]) -> APIError:
    def where(error: Any) -> str:
        return ".".join(str(part) for part in error.get("loc", ())) or "body"

    def what(error: Any) -> str:
        message = error.get("msg", "invalid")
        got = _JSON_TYPE_NAMES.get(type(error.get("input", ...)))
        if str(error.get("type", "")).endswith("_type") and got:  # a wrong type: say which
            message += f", got {got}"
        return message

    details = "; ".join(f"{where(e)}: {what(e)}" for e in errors[:5])
    first_loc = errors[0].get("loc", ()) if errors else ()
    param = str(first_loc[0]) if first_loc else None
    if param == "body" and len(first_loc) > 1:  # FastAPI's own locations start with "body"
        param = str(first_loc[1])
    return bad_request(f"Invalid request: {details}", param)
