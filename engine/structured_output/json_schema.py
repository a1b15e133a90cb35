"""JSON Schema walks the backends share: find subschemas, close open objects."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

# Keywords whose value maps names to subschemas, and keywords whose value is data.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "definitions", "$defs", "dependentSchemas"}
)
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})
# Keywords that say nothing about which documents are valid.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$id",
        "id",
        "$schema",
        "definitions",
        "$defs",
        "deprecated",
        "readOnly",
        "writeOnly",
        "markdownDescription",
    }
)
_EXTRA_PROPERTY_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object inside ``schema`` (itself included), never data values
    (``enum``, ``const``, ``default`` ...) nor property names."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        yield node
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key not in _DATA_KEYWORDS:
                stack.append(value)


def used_keywords(schema: Any, keywords: frozenset[str]) -> set[str]:
    """Which of ``keywords`` appear in some subschema; ``$ref`` counts only when the
    reference leaves the document (e.g. ``https://...``)."""
    found: set[str] = set()
    for node in subschemas(schema):
        found.update(keywords.intersection(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            found.add("$ref")
    return found


def composed_with_siblings(schema: Any, keywords: frozenset[str]) -> set[str]:
    """Which of ``keywords`` (e.g. anyOf) appear in a subschema beside other constraints
    (e.g. ``properties``), whose meaning is the conjunction of both."""
    found: set[str] = set()
    for node in subschemas(schema):
        present = keywords.intersection(node)
        if present and set(node) - present - ANNOTATIONS:
            found.update(present)
    return found


def drop_remote_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy in which a ``$ref`` that leaves the document (``https://...``) is gone, so
    the subschema it named accepts anything (nothing here fetches URLs)."""
    if "$ref" not in used_keywords(schema, frozenset()):
        return schema
    copied = copy.deepcopy(schema)
    for node in subschemas(copied):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            del node["$ref"]
    return copied


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy in which an object that lists ``properties`` and says nothing about other
    properties allows no others (what xgrammar's strict mode and OpenAI's strict
    structured outputs do). Every output is still valid against the original schema,
    and a sampler is not invited to invent keys forever.

    Schemas that combine objects (``allOf``, or ``$ref`` beside ``properties``) come back
    unchanged: closing one part would forbid the other part's properties.
    """
    if any("allOf" in n or ("$ref" in n and "properties" in n) for n in subschemas(schema)):
        return schema
    closed = copy.deepcopy(schema)
    for node in subschemas(closed):
        if (
            isinstance(node.get("properties"), dict)
            and not any(k in node for k in _EXTRA_PROPERTY_KEYWORDS)
            and not _undeclared_required(node)
        ):
            node["additionalProperties"] = False
    return closed


def declare_required(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy in which every required property is declared in ``properties`` (with the
    ``additionalProperties`` schema, or "anything"). Same meaning, but a generator that
    only writes declared properties can now satisfy ``required``."""
    if not any(_undeclared_required(n) for n in subschemas(schema)):
        return schema
    declared = copy.deepcopy(schema)
    for node in subschemas(declared):
        missing = _undeclared_required(node)
        extra = node.get("additionalProperties", True)
        if not missing or extra is False:
            continue  # nothing to do, or unsatisfiable as written
        properties = node.setdefault("properties", {})
        for name in missing:
            properties[name] = extra if isinstance(extra, dict) else {}
    return declared


def _undeclared_required(node: dict[str, Any]) -> list[str]:
    required = node.get("required")
    if not isinstance(required, list):
        return []
    properties = node.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    return [name for name in required if isinstance(name, str) and name not in declared]
