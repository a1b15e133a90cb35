"""JSON Schema walks the backends share: find subschemas, close open objects, and the
meaning-preserving rewrites the enforcement planner uses (merge ``allOf``, inline
``$ref`` beside other keywords, copy a composition's siblings into its branches, hoist
references that point inside other subschemas)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

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
    exclusive = _under_exclusive_compositions(closed)
    for node in subschemas(closed):
        if id(node) in exclusive:
            continue
        if (
            isinstance(node.get("properties"), dict)
            and not any(k in node for k in _EXTRA_PROPERTY_KEYWORDS)
            and not _undeclared_required(node)
        ):
            node["additionalProperties"] = False
    return closed


def _under_exclusive_compositions(root: Any) -> set[int]:
    """ids of the schema objects inside a ``oneOf`` branch or a ``not`` (and of what their
    local references reach): closing an object there would not narrow the whole schema
    (a document matching two ``oneOf`` branches would then match one, and be accepted)."""
    found: set[int] = set()
    stack: list[Any] = []
    for node in subschemas(root):
        branches = node.get("oneOf")
        if isinstance(branches, list):
            stack.extend(branches)
        if isinstance(node.get("not"), dict):
            stack.append(node["not"])
    while stack:
        for node in subschemas(stack.pop()):
            if id(node) in found:
                continue
            found.add(id(node))
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = resolve_local_ref(root, ref)
                if isinstance(target, dict) and id(target) not in found:
                    stack.append(target)
    return found


def restrict_enums(schema: Any) -> Any:
    """A copy in which an ``enum`` / ``const`` beside other constraints keeps only the
    values those constraints accept, and stands alone (``{"anyOf": []}``, which nothing
    matches, when no value is left): xgrammar enforces an ``enum`` / ``const`` alone and
    ignores the rest of its subschema (``{"type": "integer", "const": "x"}`` took
    ``"x"``). Same meaning; ``schema`` itself when there is nothing to restrict."""
    if not isinstance(schema, dict) or not any(
        _enum_with_siblings(n) for n in subschemas(schema)
    ):
        return schema
    import jsonschema

    root = copy.deepcopy(schema)
    defs = {k: root[k] for k in ("definitions", "$defs") if isinstance(root.get(k), dict)}
    for node in list(subschemas(root)):
        if not _enum_with_siblings(node):
            continue
        values = [node["const"]] if "const" in node else node.get("enum")
        if not isinstance(values, list):
            continue
        rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
        try:
            check = jsonschema.validators.validator_for(root)({**defs, **rest})
            kept = [v for v in values if check.is_valid(v)]
            if "const" in node and "enum" in node:
                kept = [v for v in kept if v in node["enum"]]
        except Exception:  # an unresolvable reference ...: left as it is
            logger.debug("could not check an enum against its siblings", exc_info=True)
            continue
        kept_defs = {k: node[k] for k in _NOT_MERGED if k in node}  # refs point there
        node.clear()
        node.update({"enum": kept} if kept else {"anyOf": []}, **kept_defs)
    _prune_never_branches(root)
    return root


def whole_integer_bounds(schema: Any) -> Any:
    """A copy in which the bounds of an ``integer`` are whole numbers (``minimum: 0.5`` ->
    ``1``, ``exclusiveMaximum: 2.5`` -> ``maximum: 2``): same meaning, and what xgrammar
    compiles (it refuses a fractional bound, which merging ``allOf`` / ``anyOf`` branches
    can produce). ``schema`` itself when there is nothing to change."""
    if not isinstance(schema, dict) or not any(
        _fractional_integer_bound(n) for n in subschemas(schema)
    ):
        return schema
    import math

    root = copy.deepcopy(schema)
    for node in subschemas(root):
        if not _fractional_integer_bound(node):
            continue
        for key, lower in (("minimum", True), ("maximum", False),
                           ("exclusiveMinimum", True), ("exclusiveMaximum", False)):
            value = node.get(key)
            if not _numbers(value) or (isinstance(value, float) and value.is_integer()
                                       and not key.startswith("exclusive")):
                if _numbers(value) and isinstance(value, float):
                    node[key] = int(value)
                continue
            if key.startswith("exclusive"):
                if isinstance(value, float) and not value.is_integer():
                    bound = math.ceil(value) if lower else math.floor(value)
                else:
                    bound = int(value) + (1 if lower else -1)
                del node[key]
                plain = "minimum" if lower else "maximum"
                old = node.get(plain)
                if _numbers(old):
                    old = math.ceil(old) if lower else math.floor(old)
                    bound = max(bound, old) if lower else min(bound, old)
                node[plain] = bound
            else:
                node[key] = math.ceil(value) if lower else math.floor(value)
    return root


def _fractional_integer_bound(node: dict[str, Any]) -> bool:
    if node.get("type") != "integer":
        return False
    return any(
        isinstance(node.get(k), float)
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    )


# A schema no value matches, in a form xgrammar compiles to nothing: it reads an empty
# ``anyOf`` as the empty string (``[, ]`` was accepted for ``items: {"anyOf": []}``).
NEVER = {"type": "string", "pattern": "[^\\s\\S]"}


def never_as_pattern(schema: Any) -> Any:
    """A copy in which every empty ``anyOf`` / ``oneOf`` (nothing matches) is dropped
    from the compositions it is a branch of, and is :data:`NEVER` elsewhere; ``schema``
    itself when it has none."""
    if not isinstance(schema, dict) or not any(
        _is_never(n) or n.get("oneOf") == [] for n in subschemas(schema)
    ):
        return schema
    root = copy.deepcopy(schema)
    for node in subschemas(root):
        if node.get("oneOf") == []:
            node["anyOf"] = node.pop("oneOf")
    _prune_never_branches(root)
    for node in subschemas(root):
        if _is_never(node):
            kept_defs = {k: node[k] for k in _NOT_MERGED if k in node}
            node.clear()
            node.update(NEVER, **kept_defs)
    return root


def _is_never(node: Any) -> bool:
    return node is False or isinstance(node, dict) and node.get("anyOf") == []


def _prune_never_branches(root: Any) -> None:
    """Drop the branches nothing matches from every ``anyOf`` / ``oneOf`` (same meaning):
    xgrammar reads an empty ``anyOf`` that is itself a branch as the empty string."""
    for _ in range(16):
        changed = False
        for node in subschemas(root):
            for key in ("anyOf", "oneOf"):
                branches = node.get(key)
                if isinstance(branches, list) and any(_is_never(b) for b in branches):
                    node[key] = [b for b in branches if not _is_never(b)]
                    changed = True
        if not changed:
            return


def _enum_with_siblings(node: dict[str, Any]) -> bool:
    return ("enum" in node or "const" in node) and bool(
        set(node) - {"enum", "const"} - ANNOTATIONS
    )


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


# -- lowering compositions (for a backend that enforces allOf / anyOf-with-siblings badly) --
_MIN_KEYWORDS = frozenset(
    {"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"}
)
_MAX_KEYWORDS = frozenset(
    {"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"}
)
_NOT_MERGED = frozenset({"definitions", "$defs"})  # stay where they are (refs point there)
_LOWERING_BUDGET = 20_000  # merges per schema before the rest is left as it is


def resolve_local_ref(root: Any, ref: str) -> Any:
    """The subschema a ``#...`` JSON pointer names in ``root``, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    from urllib.parse import unquote

    pointer = unquote(ref[1:])
    node = root
    if pointer in ("", "/"):
        return node
    if not pointer.startswith("/"):
        return None  # an anchor name: not resolved here
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _types(value: Any) -> set[str] | None:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return set(value)
    return None


def _merge_types(a: Any, b: Any) -> Any:
    ta, tb = _types(a), _types(b)
    if ta is None or tb is None:
        return None
    both = ta & tb
    if "integer" in ta and "number" in tb or "number" in ta and "integer" in tb:
        both.add("integer")
    if not both:
        return None
    order = [t for t in (a if isinstance(a, list) else [a]) if t in both]
    order += sorted(both - set(order))
    return order[0] if len(order) == 1 else order


def _json_key(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def merge_schemas(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``a`` and ``b`` as one schema (what ``allOf: [a, b]`` means), and the keywords whose
    two values could not be combined (``a``'s value is kept for those: the result may then
    accept more than ``allOf`` does). Neither input is modified."""
    merged = copy.deepcopy(a)
    lost: set[str] = set()
    for key, value in b.items():
        if key not in merged:
            merged[key] = copy.deepcopy(value)
            continue
        mine = merged[key]
        if key in ANNOTATIONS or key in _NOT_MERGED or key == "format":
            continue
        if _json_key(mine) == _json_key(value):
            continue
        if key == "type":
            both = _merge_types(mine, value)
            if both is None:
                lost.add(key)
            else:
                merged[key] = both
        elif key == "required" and isinstance(mine, list) and isinstance(value, list):
            merged[key] = mine + [n for n in value if n not in mine]
        elif key == "enum" and isinstance(mine, list) and isinstance(value, list):
            keys = {_json_key(v) for v in value}
            common = [v for v in mine if _json_key(v) in keys]
            if common:
                merged[key] = common
            else:
                lost.add(key)
        elif key in _MIN_KEYWORDS and _numbers(mine, value):
            merged[key] = max(mine, value)
        elif key in _MAX_KEYWORDS and _numbers(mine, value):
            merged[key] = min(mine, value)
        elif key == "allOf" and isinstance(mine, list) and isinstance(value, list):
            merged[key] = mine + copy.deepcopy(value)
        elif key in ("items", "additionalProperties", "additionalItems", "contains",
                     "propertyNames", "unevaluatedProperties", "unevaluatedItems"):
            combined = _merge_subschema(mine, value, lost)
            if combined is not None:
                merged[key] = combined
        elif key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
            continue  # below, with additionalProperties in view
        else:
            lost.add(key)
    if isinstance(a.get("properties"), dict) or isinstance(b.get("properties"), dict):
        merged["properties"] = _merge_properties(a, b, lost)
    return merged, lost


def _numbers(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _merge_subschema(a: Any, b: Any, lost: set[str]) -> Any:
    """Two values of a keyword that holds one subschema (``items`` ...), as one; None to
    keep ``a``'s (the keyword is then added to ``lost``)."""
    if a is False or b is False:
        return False
    if a is True or a == {}:
        return copy.deepcopy(b)
    if b is True or b == {}:
        return copy.deepcopy(a)
    if isinstance(a, dict) and isinstance(b, dict):
        merged, inner = merge_schemas(a, b)
        lost.update(inner)
        return merged
    lost.add("items" if isinstance(a, list) or isinstance(b, list) else "additionalProperties")
    return None


def _merge_properties(a: dict[str, Any], b: dict[str, Any], lost: set[str]) -> dict[str, Any]:
    """``properties`` of ``allOf: [a, b]``: a name one side declares and the other does not
    must also pass the other side's ``additionalProperties`` (so ``false`` drops it)."""
    pa = a.get("properties") if isinstance(a.get("properties"), dict) else {}
    pb = b.get("properties") if isinstance(b.get("properties"), dict) else {}
    out: dict[str, Any] = {}
    for name in list(pa) + [n for n in pb if n not in pa]:
        parts = []
        for side, props in ((a, pa), (b, pb)):
            if name in props:
                parts.append(props[name])
            elif not _pattern_property_may_match(side):
                extra = side.get("additionalProperties", True)
                parts.append(extra)
        if any(p is False for p in parts):
            continue  # one side forbids it: leave it out (additionalProperties decides)
        schema: Any = True
        for part in parts:
            schema = _merge_subschema(schema, part, lost)
            if schema is None:
                schema = parts[0]
        out[name] = {} if schema is True else schema
    return out


def _pattern_property_may_match(side: dict[str, Any]) -> bool:
    return bool(side.get("patternProperties"))


def _deref(root: Any, node: Any, lost: set[str], depth: int = 0) -> Any:
    """``node`` with a local ``$ref`` at its top replaced by its target merged with the
    node's other keywords (what ``$ref`` beside siblings means since draft 2019-09)."""
    if not isinstance(node, dict) or "$ref" not in node or depth > 8:
        return node
    target = resolve_local_ref(root, node["$ref"])
    if not isinstance(target, dict):
        return node
    target = _deref(root, target, lost, depth + 1)
    if "$ref" in target:
        return node  # a cycle of bare references: leave it to the backend
    rest = {k: v for k, v in node.items() if k != "$ref"}
    merged, inner = merge_schemas(target, rest)
    lost.update(inner)
    return merged


class _RefGraph:
    """Which local references lie on a cycle of references (inlining one of those could
    go on forever); each reference's edges are computed once per schema."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._edges: dict[str, set[str]] = {}
        self._memo: dict[str, bool] = {}

    def edges(self, ref: str) -> set[str]:
        if ref not in self._edges:
            found = set()
            for node in subschemas(resolve_local_ref(self.root, ref)):
                inner = node.get("$ref")
                if isinstance(inner, str) and inner.startswith("#"):
                    found.add(inner)
            self._edges[ref] = found
        return self._edges[ref]

    def recursive(self, ref: str) -> bool:
        if ref not in self._memo:
            seen: set[str] = set()
            stack = list(self.edges(ref))
            while stack and ref not in seen:
                current = stack.pop()
                if current not in seen:
                    seen.add(current)
                    stack.extend(self.edges(current))
            self._memo[ref] = ref in seen
        return self._memo[ref]


def lower_compositions(schema: Any) -> tuple[Any, set[str]]:
    """A copy of ``schema`` without ``allOf``, without ``$ref`` beside other keywords,
    with every ``anyOf`` / ``oneOf`` standing alone (the other keywords of its subschema
    copied into each branch) and tuple ``items`` written as ``prefixItems``: the same
    meaning in the subset of JSON Schema xgrammar enforces. Also returns the keywords that could not be lowered exactly (``allOf`` when
    two branches disagree on a keyword ...); the copy keeps the outer value for those.
    ``oneOf`` is left as it is (only its siblings move)."""
    if not isinstance(schema, dict):
        return schema, set()
    root = copy.deepcopy(schema)
    lost: set[str] = set()
    budget = [_LOWERING_BUDGET]
    refs = _RefGraph(root)
    for node in subschemas(root):
        if budget[0] <= 0:
            break
        _lower_node(root, node, lost, budget, refs)
    return root, lost


def _lower_node(
    root: Any, node: dict[str, Any], lost: set[str], budget: list[int], refs: _RefGraph
) -> None:
    if isinstance(node.get("items"), list):  # draft 4-2019-09 tuples, as 2020-12 writes them
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    for _ in range(16):  # merged branches may bring compositions of their own
        budget[0] -= 1
        ref = node.get("$ref")
        if (
            isinstance(ref, str)
            and ref.startswith("#")
            and set(node) - {"$ref"} - ANNOTATIONS
            and not refs.recursive(ref)
        ):
            inner: set[str] = set()
            replaced = _deref(root, node, inner)
            if inner:
                lost.add("$ref")
            _replace(node, replaced)
            continue
        branches = node.get("allOf")
        if isinstance(branches, list):
            base = {k: v for k, v in node.items() if k != "allOf"}
            inner = set()
            for branch in branches:
                if isinstance(branch, dict):
                    ref = branch.get("$ref")
                    if not (isinstance(ref, str) and refs.recursive(ref)):
                        branch = _deref(root, branch, inner)
                    base, more = merge_schemas(base, branch)
                    inner |= more
                elif branch is False:
                    base = {"not": {}}
                    inner.add("allOf")
            if inner:
                lost.add("allOf")
            _replace(node, base)
            continue
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            siblings = {
                k: v for k, v in node.items()
                if k != key and k not in ANNOTATIONS and k not in _NOT_MERGED
            }
            if not isinstance(branches, list) or not siblings:
                continue
            if "anyOf" in siblings or "oneOf" in siblings:
                continue  # both at once: left to the backend's audit
            new_branches = []
            inner = set()
            for branch in branches:
                if isinstance(branch, dict):
                    ref = branch.get("$ref")
                    if not (isinstance(ref, str) and refs.recursive(ref)):
                        branch = _deref(root, branch, inner)
                    if _disjoint_types(siblings, branch):
                        continue  # nothing matches both: the branch goes (same meaning)
                    merged, more = merge_schemas(siblings, branch)
                    inner |= more
                    new_branches.append(merged)
                elif branch is True:
                    new_branches.append(copy.deepcopy(siblings))
            if inner:
                lost.add(key)
            kept = {k: v for k, v in node.items() if k not in siblings and k != key}
            kept[key] = new_branches
            _replace(node, kept)
            break
        else:
            return
        continue


def inline_recursive_refs(schema: Any) -> tuple[Any, set[str]]:
    """A copy in which every local ``$ref`` that lies on a cycle of references and stands
    beside other keywords (``{"type": "object", "$ref": "#/definitions/node"}``) is
    replaced, once, by its target merged with those keywords (the references inside the
    copy still point to the definition, which stands alone: the recursion is kept).
    :func:`lower_compositions` leaves those references as they are, and a backend that
    then took the reference alone lost the keywords beside it (the root ``type``).
    Also returns the keywords that could not be merged exactly."""
    if not isinstance(schema, dict):
        return schema, set()
    root = copy.deepcopy(schema)
    refs = _RefGraph(root)
    lost: set[str] = set()
    for node in list(subschemas(root)):
        ref = node.get("$ref")
        if (
            isinstance(ref, str)
            and ref.startswith("#")
            and set(node) - {"$ref"} - ANNOTATIONS - _NOT_MERGED
            and refs.recursive(ref)
        ):
            inner: set[str] = set()
            replaced = _deref(root, node, inner)
            if inner:
                lost.add("$ref")
            _replace(node, replaced)
    return root, lost


def _disjoint_types(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a`` and ``b`` both name types, and no value has a type of each."""
    if "type" not in a or "type" not in b or "$ref" in b:
        return False
    ta, tb = _types(a["type"]), _types(b["type"])
    return ta is not None and tb is not None and _merge_types(ta and list(ta), list(tb)) is None


def _replace(node: dict[str, Any], new: dict[str, Any]) -> None:
    if new is node:
        return
    new = dict(new)
    node.clear()
    node.update(new)


_HOISTED = "engine-ref-"  # names of the $defs entries hoist_deep_refs makes


def hoist_deep_refs(schema: Any) -> Any:
    """A copy in which every local ``$ref`` that points deeper than a definition
    (``#/properties/a``, ``#/definitions/x/if``) points to a copy of its target under the
    root's ``$defs`` instead: rewriting a schema (relaxing a keyword, lowering a
    composition) then never leaves such a reference dangling. Same meaning; ``schema``
    itself when it has no such reference."""
    if not isinstance(schema, dict) or not any(
        _is_deep(n.get("$ref")) for n in subschemas(schema)
    ):
        return schema
    root = copy.deepcopy(schema)
    names: dict[str, str] = {}
    defs = root.get("$defs")
    if not isinstance(defs, dict):
        defs = root["$defs"] = {}
    for _ in range(8):  # hoisted targets may hold deep references of their own
        changed = False
        for node in list(subschemas(root)):
            ref = node.get("$ref")
            if not _is_deep(ref):
                continue
            if ref not in names:
                target = resolve_local_ref(schema, ref)
                if not isinstance(target, (dict, bool)):
                    continue  # dangling, or no schema: the backend will say so
                names[ref] = f"{_HOISTED}{len(names)}"
                defs[names[ref]] = copy.deepcopy(target)
            node["$ref"] = f"#/$defs/{names[ref]}"
            changed = True
        if not changed:
            break
    return root


def _is_deep(ref: Any) -> bool:
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return False
    parts = ref[2:].split("/")
    return not (len(parts) == 2 and parts[0] in ("definitions", "$defs"))
