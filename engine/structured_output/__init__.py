"""Structured outputs: constrain generation to a JSON schema, regex, choice or grammar.

Light on import (no torch, no backend): xgrammar and llguidance load only when a
constrained request is checked or compiled. ``StructuredOutputsParams`` is the
user-facing type; the engine core owns a
:class:`~engine.structured_output.manager.StructuredOutputManager`.
"""

from __future__ import annotations

from engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "check_compilable"]


def check_compilable(params: StructuredOutputsParams, default: str = "auto") -> tuple[str, bool]:
    """See :func:`engine.structured_output.selection.check_compilable`."""
    from engine.structured_output.selection import check_compilable as check

    return check(params, default)
