"""OpenAI / vLLM request fields -> one :class:`StructuredOutputsParams` (or None).

Sources, at most one per request (two are a ValueError, as are unknown values):

- ``structured_outputs``: a dict of :class:`StructuredOutputsParams` fields (vLLM >= 0.10);
- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``,
  ``{"type": "structural_tag", "structures": [...], "triggers": [...]}``;
- vLLM's extras ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  (plus ``guided_decoding_backend``);
- ``tools`` + ``tool_choice`` ``"required"`` or a named function (see
  :mod:`engine.structured_output.tool_choice`), as compact JSON; ``"auto"`` / ``"none"``
  constrain nothing.

``strict``: ``response_format.json_schema.strict``, ``structured_outputs.strict`` and a
forced function's ``strict`` ask for the schema in full: one the backends cannot enforce
is then a 400 naming the unsupported keywords, where otherwise those keywords are relaxed
(and named in the ``x-structured-output-relaxed`` response header). Left out, the
server's ``--structured-outputs-config`` ``strict`` default applies
(:func:`apply_server_defaults`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.tool_choice import tool_choice_schema

# Response header naming the JSON Schema keywords a response's constraint relaxed.
RELAXED_HEADER = "x-structured-output-relaxed"

_GUIDED_KINDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_BACKEND_ALIASES = {
    "auto": "auto",
    "xgrammar": "xgrammar",
    "llguidance": "llguidance",
    "guidance": "llguidance",
}


def structured_outputs_from_request(request: Any) -> StructuredOutputsParams | None:
    """The constraint a chat/completion request asks for, validated (ValueError -> 400).

    ``request`` is a dict of the JSON body or a pydantic model (extra fields included).
    """
    body = _as_mapping(request)
    found: list[tuple[str, StructuredOutputsParams]] = []
    if body.get("structured_outputs") is not None:
        so = body["structured_outputs"]
        if not isinstance(so, Mapping):
            raise ValueError("structured_outputs must be an object")
        found.append(("structured_outputs", StructuredOutputsParams.from_dict(dict(so))))
    from_format = _from_response_format(body.get("response_format"))
    if from_format is not None:
        found.append(("response_format", from_format))
    guided = [name for name in _GUIDED_KINDS if body.get(name) is not None]
    if len(guided) > 1:
        raise ValueError(f"set at most one of {', '.join(_GUIDED_KINDS)}; got {', '.join(guided)}")
    if guided:
        found.append((guided[0], _from_guided(guided[0], body[guided[0]])))
    if body.get("guided_whitespace_pattern") is not None:
        raise ValueError("guided_whitespace_pattern is not supported")
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    tool_schema = None
    if tools or tool_choice is not None:
        tool_schema = tool_choice_schema(tools, tool_choice, body.get("parallel_tool_calls"))
    if tool_schema is not None:
        # Compact JSON: the call format is ours (the client sees tool_calls, not this
        # text), and free whitespace lets a weak model pad forever.
        so = StructuredOutputsParams(json=tool_schema, disable_any_whitespace=True,
                                     strict=_forced_tools_strict(tools, tool_choice))
        found.append(("tool_choice", so))
    if len(found) > 1:
        raise ValueError(
            "a request may constrain its output in one way only; got "
            + ", ".join(name for name, _ in found)
        )
    if not found:
        if body.get("guided_decoding_backend") is not None:
            _backend(body["guided_decoding_backend"])  # still reject a bad name
        return None
    params = found[0][1]
    if body.get("guided_decoding_backend") is not None:
        params.backend = _backend(body["guided_decoding_backend"])
    return params


def _from_response_format(response_format: Any) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError("response_format must be an object with a 'type'")  # noqa: TRY004
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format json_schema needs a 'json_schema' object")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise ValueError("response_format.json_schema needs a 'schema'")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
        return StructuredOutputsParams(json=schema, strict=strict)
    if kind == "structural_tag":
        tag = {k: v for k, v in response_format.items() if k != "type"}
        return StructuredOutputsParams(structural_tag=json.dumps(tag))
    raise ValueError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object', "
        "'json_schema' or 'structural_tag'"
    )


def _forced_tools_strict(tools: Any, tool_choice: Any) -> bool | None:
    """True when a function the request forces says ``strict: true``; else None."""
    functions = [t.get("function") for t in tools or () if isinstance(t, Mapping)]
    functions = [f for f in functions if isinstance(f, Mapping)]
    if isinstance(tool_choice, Mapping):
        wanted = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f.get("name") == wanted]
    return True if any(f.get("strict") is True for f in functions) else None


def apply_server_defaults(params: StructuredOutputsParams | None,
                          config: Any) -> StructuredOutputsParams | None:
    """``params`` with the server's ``--structured-outputs-config`` defaults (a
    :class:`~engine.core.config.StructuredOutputsConfig`, or None) filling what the
    request left unset: backend, disable_any_whitespace, strict, disable_fallback."""
    if params is None or config is None:
        return params
    from engine.structured_output.params import with_defaults

    params = with_defaults(
        params,
        backend=getattr(config, "backend", None),
        disable_any_whitespace=getattr(config, "disable_any_whitespace", None),
        strict=getattr(config, "strict", None),
    )
    if getattr(config, "disable_fallback", False) and not params.disable_fallback:
        params = params.derive(disable_fallback=True)
    return params


def relaxed_headers(keywords: tuple[str, ...] | None) -> dict[str, str]:
    """The response headers for a constraint that relaxed ``keywords`` (none if none)."""
    return {RELAXED_HEADER: ",".join(keywords)} if keywords else {}


def _from_guided(name: str, value: Any) -> StructuredOutputsParams:
    kind = _GUIDED_KINDS[name]
    if kind == "json" and hasattr(value, "model_json_schema"):
        value = value.model_json_schema()  # a pydantic model class
    if kind == "choice" and not isinstance(value, list):
        raise ValueError(f"{name} must be a list of strings")
    return StructuredOutputsParams(**{kind: value})


def _backend(name: Any) -> str:
    if not isinstance(name, str) or name not in _BACKEND_ALIASES:
        raise ValueError(
            f"guided_decoding_backend={name!r} must be one of {', '.join(_BACKEND_ALIASES)}"
        )
    return _BACKEND_ALIASES[name]


def _as_mapping(request: Any) -> Mapping[str, Any]:
    if isinstance(request, Mapping):
        return request
    if hasattr(request, "model_dump"):
        return request.model_dump()
    raise ValueError(f"expected a request dict or pydantic model, got {type(request).__name__}")
