"""Backend registry and ``auto`` selection: try the preferred backend, fall back to the
other when it cannot compile.

Backends load lazily (importing xgrammar or llguidance costs time and memory), so an
engine that never sees a constrained request never imports either.
"""

from __future__ import annotations

from importlib import import_module

from engine.structured_output.backend import StructuredOutputBackend
from engine.structured_output.params import BACKEND_NAMES, StructuredOutputsParams

# Preference order of ``auto``: xgrammar compiles ahead of time and fills masks fastest;
# llguidance covers JSON Schema features xgrammar rejects.
AUTO_ORDER = ("xgrammar", "llguidance")
# Best effort prefers llguidance: its lenient mode drops only the keywords it does not
# implement, while xgrammar also loses allOf, patternProperties and more.
LENIENT_ORDER = ("llguidance", "xgrammar")
_BACKEND_CLASSES = {
    "xgrammar": ("engine.structured_output.xgrammar_backend", "XgrammarBackend"),
    "llguidance": ("engine.structured_output.llguidance_backend", "LLGuidanceBackend"),
}


def backend_class(name: str) -> type[StructuredOutputBackend]:
    if name not in _BACKEND_CLASSES:
        raise ValueError(
            f"unknown structured output backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    module, cls = _BACKEND_CLASSES[name]
    try:
        return getattr(import_module(module), cls)
    except ImportError as exc:
        raise ValueError(
            f"structured output backend {name!r} is not installed ({exc}); pip install {name}"
        ) from None


def backend_order(params: StructuredOutputsParams, default: str = "auto") -> tuple[str, ...]:
    """The backends to try for ``params``, in order.

    ``auto`` tries every backend in :data:`AUTO_ORDER` (only the first with
    ``disable_fallback``); a named backend (on the request, else the engine default) is
    tried alone.
    """
    name = params.backend or default
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown structured output backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if name != "auto":
        return (name,)
    return AUTO_ORDER[:1] if params.disable_fallback else AUTO_ORDER


def compile_plan(params: StructuredOutputsParams, default: str = "auto") -> list[tuple[str, bool]]:
    """``(backend, lenient)`` attempts in order: every backend of :func:`backend_order`
    enforcing the whole constraint first, then best effort (``lenient``: JSON Schema
    keywords a backend cannot enforce, like ``uniqueItems``, are ignored rather than
    refused). Only a JSON schema has a best-effort tier."""
    names = backend_order(params, default)
    plan = [(name, False) for name in names]
    if params.kind == "json":
        plan += [(name, True) for name in LENIENT_ORDER if name in names]
    return plan


def check_compilable(params: StructuredOutputsParams, default: str = "auto") -> tuple[str, bool]:
    """``(backend, relaxed)`` of the constraint's
    :func:`~engine.structured_output.enforcement.plan_constraint`, checked without a
    tokenizer: ``relaxed`` when the backend enforces a relaxed JSON schema (or its own best
    effort). ValueError naming every backend's reason when none can compile it, and
    (NotEnforceableError) naming the unsupported keywords when ``params.strict`` asks for
    the schema in full and no backend enforces it."""
    from engine.structured_output.enforcement import check_strict, plan_constraint

    plan = plan_constraint(params, default, record=False)
    check_strict(plan, params)
    return plan.backend, not plan.enforced


def check_regex_syntax(regex: str, shown: str | None = None) -> None:
    """ValueError unless some installed backend parses ``regex`` (their dialects, which
    are close to ECMAScript/Rust, differ from Python's ``re``)."""
    errors = []
    for name in AUTO_ORDER:
        try:
            backend_class(name).check_regex(regex)
            return
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError(
        f"invalid structured_outputs.regex={shown if shown is not None else regex!r}: "
        + "; ".join(errors)
    )
