"""xgrammar backend: grammars compiled to token-level automata with a compile cache.

Identical constraints share one ``CompiledGrammar`` (xgrammar caches by grammar text);
each request gets its own ``GrammarMatcher``. Bitmasks of a whole step are filled by one
``BatchGrammarMatcher`` call that runs on xgrammar's own threads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
import xgrammar as xgr

from engine.structured_output import ecma_regex
from engine.structured_output.backend import (
    Grammar,
    StructuredOutputBackend,
    describe_error,
    set_token_bits,
)
from engine.structured_output.json_schema import (
    ANNOTATIONS,
    composed_with_siblings,
    declare_required,
    never_as_pattern,
    restrict_enums,
    subschemas,
    used_keywords,
    whole_integer_bounds,
)
from engine.structured_output.params import StructuredOutputsParams

_CACHE_LIMIT_BYTES = 256 * 2**20

# JSON Schema keywords xgrammar accepts but does not enforce (or mis-enforces under its
# strict mode), found by compiling each one and feeding valid and invalid documents.
# A schema using any of them goes to llguidance under ``auto``, which either enforces the
# keyword or says plainly that it cannot.
UNENFORCED_KEYWORDS = frozenset(
    {
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "allOf",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "propertyNames",
        "patternProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "minProperties",
        "maxProperties",
        "oneOf",  # oneOf: exclusivity is not enforced (it acts as anyOf)
    }
)
# anyOf beside other constraints of the same subschema: xgrammar takes the branches alone.
_COMPOSITIONS = frozenset({"anyOf"})
# Length limits xgrammar drops when the same subschema has a pattern (it warns on stderr).
_LENGTHS_BESIDE_PATTERN = ("minLength", "maxLength")


def unenforced_features(schema: Any) -> set[str]:
    """What of ``schema`` xgrammar would accept without enforcing it (descriptions)."""
    return set(audit(schema).values())


def unenforced_keywords(schema: Any) -> set[str]:
    """The JSON Schema keywords of ``schema`` xgrammar would not enforce as written."""
    return set(audit(schema))


def audit(schema: Any) -> dict[str, str]:
    """keyword -> why xgrammar does not enforce it, for every such keyword of ``schema``."""
    found = {k: k for k in used_keywords(schema, UNENFORCED_KEYWORDS)}
    if "$ref" in found:
        found["$ref"] = "$ref to another document"
    for k in composed_with_siblings(schema, _COMPOSITIONS):
        found[k] = f"{k} beside other keywords"
    for node in subschemas(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and set(node) - {"$ref"} - ANNOTATIONS:
            found["$ref"] = "$ref beside other keywords"
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            problem = regex_problem(pattern)
            if problem:
                found["pattern"] = f"pattern with {problem}"
            for key in _LENGTHS_BESIDE_PATTERN:
                if key in node:
                    found[key] = f"{key} beside pattern"
    return found


@lru_cache(maxsize=4096)
def regex_problem(pattern: str) -> str | None:
    """Why xgrammar cannot enforce the JSON Schema ``pattern`` (ECMA-262), or None."""
    problem = ecma_regex.enforcement_problem(pattern)
    if problem is not None:
        return problem
    if ecma_regex.uses_properties(pattern):
        return ecma_regex.PROPERTY_ESCAPE  # xgrammar reads [\p{L}] as the letters p { L }
    try:
        xgr.Grammar.from_regex(ecma_regex.to_backend(pattern))
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for syntax
        return f"a regex xgrammar cannot parse ({describe_error(exc)})"
    return None


# Character classes of xgrammar's JSON strings, as its grammar printer writes them, and
# what we put in their place: its length-limited strings admit raw control characters
# (invalid JSON), and both admit UTF-8-encoded surrogates (invalid UTF-8).
_STRING_CHAR_FIXES = (
    ('[^\\"\\\\\\r\\n]', '[^\\"\\\\\\0-\\x1f\\ud800-\\udfff]'),
    ('[^\\0-\\x1f\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n\\ud800-\\udfff]'),
)


def json_schema_ebnf(schema: dict[str, Any], any_whitespace: bool) -> str:
    """xgrammar's EBNF for ``schema`` with its string character classes fixed."""
    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace))
    for broken, fixed in _STRING_CHAR_FIXES:
        text = text.replace(broken, fixed)
    return text


def is_ebnf(grammar: str) -> bool:
    """EBNF/GBNF rules use ``::=``; Lark rules use ``:``."""
    return "::=" in grammar


def choice_as_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"``; JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarGrammar(Grammar):
    def __init__(self, matcher: xgr.GrammarMatcher, stop_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in token_ids)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        n = 0
        for t in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():
            set_token_bits(bitmask, row, self.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int
    ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, num_threads)
        info = _tokenizer_info(tokenizer, vocab_size, list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=num_threads, cache_limit_bytes=_CACHE_LIMIT_BYTES
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=num_threads)

    # -- tokenizer-free check -------------------------------------------------------------
    @classmethod
    def check(cls, params: StructuredOutputsParams, lenient: bool = False) -> None:
        _convert(params, _TokenizerFreeCompiler(), "check", lenient)

    @classmethod
    def check_regex(cls, regex: str) -> None:
        _refuse_property_escapes(regex)
        try:
            xgr.Grammar.from_regex(regex)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for syntax
            raise ValueError(f"xgrammar: {describe_error(exc)}") from None

    # -- compile --------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams, lenient: bool = False) -> XgrammarGrammar:
        return self.instantiate(self.build(params, lenient))

    def build(self, params: StructuredOutputsParams, lenient: bool = False) -> Any:
        """The ``CompiledGrammar`` (token masks precomputed; shared by its matchers)."""
        return _convert(params, self.compiler, "compile", lenient)

    def instantiate(self, artifact: Any) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(artifact), self.stop_token_ids)

    def fill_bitmasks(
        self, grammars: Sequence[Grammar], rows: Sequence[int], bitmask: torch.Tensor
    ) -> None:
        live, live_rows = [], []
        for grammar, row in zip(grammars, rows):
            assert isinstance(grammar, XgrammarGrammar)
            if grammar.matcher.is_terminated():
                grammar.fill_bitmask(bitmask, row)
            else:
                live.append(grammar.matcher)
                live_rows.append(int(row))
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, indices=live_rows)


def _tokenizer_info(tokenizer: Any, vocab_size: int, stops: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with special tokens (``<|im_start|>``, pad...)
    blanked: xgrammar would otherwise treat them as their literal text and allow them
    inside strings, while detokenization drops them. Stop tokens stay allowed as stops."""
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops
    )
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special |= {
        i
        for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
        if getattr(t, "special", False)
    }
    if not special:
        return info
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            encoded[index] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=info.add_prefix_space,
    )


class _TokenizerFreeCompiler:
    """The compiler calls :func:`_convert` makes, answered by tokenizer-free parsing."""

    compile_regex = staticmethod(xgr.Grammar.from_regex)
    compile_grammar = staticmethod(xgr.Grammar.from_ebnf)
    compile_lark = staticmethod(xgr.Grammar.from_lark)
    compile_structural_tag = staticmethod(xgr.Grammar.from_structural_tag)


def _convert(params: StructuredOutputsParams, compiler: Any, verb: str, lenient: bool) -> Any:
    """Dispatch ``params`` to the compiler method for its kind; errors -> ValueError.

    Lenient, the keywords xgrammar does not enforce are left to it (it ignores them, and
    treats references to other documents as "anything")."""
    kind = params.kind
    if kind == "json" and not lenient:
        unenforced = unenforced_features(params.json)
        if unenforced:
            raise ValueError(f"xgrammar cannot enforce {', '.join(sorted(unenforced))}")
    try:
        if kind in ("json", "json_object"):
            # xgrammar writes only declared properties: declare the required ones.
            # It also takes an enum / const alone: keep only the values the rest allows.
            schema = (
                never_as_pattern(
                    restrict_enums(whole_integer_bounds(declare_required(params.json)))
                )
                if kind == "json"
                else {"type": "object"}
            )
            ebnf = json_schema_ebnf(schema, not params.disable_any_whitespace)
            return compiler.compile_grammar(ebnf)
        if kind == "regex":
            _refuse_property_escapes(params.regex)
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_as_ebnf(params.choice))
        if kind == "grammar":
            if is_ebnf(params.grammar):
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_lark(params.grammar)
        if kind == "structural_tag":
            tag = json.loads(params.structural_tag)
            if "structures" in tag:
                items = [
                    xgr.StructuralTagItem(
                        begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                    )
                    for s in tag["structures"]
                ]
                return compiler.compile_structural_tag(items, list(tag.get("triggers", [])))
            return compiler.compile_structural_tag(params.structural_tag)
    except ValueError as exc:
        raise ValueError(f"xgrammar cannot {verb} the {kind}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - native errors arrive as RuntimeError & co
        raise ValueError(f"xgrammar cannot {verb} the {kind}: {describe_error(exc)}") from None
    raise ValueError(f"xgrammar does not support structured output kind {kind!r}")


def _refuse_property_escapes(regex: str) -> None:
    """xgrammar refuses a bare ``\\p{L}`` but reads ``[\\p{L}]`` as the characters
    ``p { L }``: refuse both."""
    try:
        properties = ecma_regex.uses_properties(regex)
    except ValueError:
        properties = "\\p{" in regex or "\\P{" in regex
    if properties:
        raise ValueError("Unicode property escapes (\\p{...}) are not supported")
