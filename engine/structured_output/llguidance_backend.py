"""llguidance backend: an Earley parser over the token trie, no ahead-of-time compile.

Covers JSON Schema features xgrammar lacks (and the other way round), which is why
``auto`` falls back from one to the other. Grammars are llguidance's JSON-wrapped
grammar text; each request gets its own ``LLMatcher``, and a step's bitmasks are
computed by one ``LLExecutor`` call over all llguidance matchers in parallel.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import llguidance as llg
import llguidance.hf
import torch

from engine.structured_output import ecma_regex
from engine.structured_output.backend import Grammar, StructuredOutputBackend
from engine.structured_output.json_schema import close_objects, drop_remote_refs
from engine.structured_output.params import StructuredOutputsParams


@lru_cache(maxsize=4096)
def regex_problem(pattern: str) -> str | None:
    """Why llguidance cannot enforce the JSON Schema ``pattern`` (ECMA-262), or None."""
    problem = ecma_regex.enforcement_problem(pattern)
    if problem is not None:
        return problem
    error = llg.LLMatcher.validate_grammar(
        llg.LLMatcher.grammar_from_regex(ecma_regex.to_backend(pattern))
    )
    return f"a regex llguidance cannot parse ({_describe(error)})" if error else None


def grammar_text(params: StructuredOutputsParams, lenient: bool = False) -> str:
    """The llguidance grammar for ``params`` (not yet validated); ``lenient`` ignores the
    JSON Schema keywords llguidance does not implement and references to other documents."""
    kind = params.kind
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if lenient:
        options["lenient"] = True
    try:
        if kind == "json":
            schema = close_objects(params.json)
            if lenient:
                schema = drop_remote_refs(schema)
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(params.choice))
        if kind == "grammar":
            return llg.grammar_from("grammar", params.grammar)
        if kind == "structural_tag":
            return _structural_tag_grammar(json.loads(params.structural_tag))
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise ValueError(f"llguidance cannot check the {kind}: {exc}") from None
    raise ValueError(f"llguidance does not support structured output kind {kind!r}")


def _structural_tag_grammar(tag: dict[str, Any]) -> str:
    """vLLM's structural tag format ({"structures": [{begin, schema, end}], "triggers"})."""
    if "structures" not in tag:
        raise ValueError("only the {'structures': [...], 'triggers': [...]} format is supported")
    triggers = list(tag.get("triggers", []))
    tags = []
    for s in tag["structures"]:
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger is a prefix of the structure begin {s['begin']!r}")
        tags.append(
            llg.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"])
        )
    return llg.StructTag.to_grammar(tags)


class LLGuidanceGrammar(Grammar):
    def __init__(self, matcher: llg.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        token_ids = list(token_ids)
        # try_consume_tokens never puts the matcher into its (permanent) error state.
        return self.matcher.try_consume_tokens(token_ids) == len(token_ids)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return self.matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _check_bitmask(bitmask)
        words = bitmask.shape[1]
        self.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)

    def is_terminated(self) -> bool:
        # Stopped: no token but EOS can follow (or EOS was consumed).
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def reset(self) -> None:
        self.matcher.reset()


class LLGuidanceBackend(StructuredOutputBackend):
    name = "llguidance"

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int
    ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, num_threads)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
        )
        self._executor = llg.LLExecutor(num_threads=num_threads)

    @classmethod
    def check(cls, params: StructuredOutputsParams, lenient: bool = False) -> None:
        error = llg.LLMatcher.validate_grammar(grammar_text(params, lenient))
        if error:
            raise ValueError(f"llguidance cannot check the {params.kind}: {_describe(error)}")

    @classmethod
    def check_regex(cls, regex: str) -> None:
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_regex(regex))
        if error:
            raise ValueError(f"llguidance: {_describe(error)}")

    def compile(self, params: StructuredOutputsParams, lenient: bool = False) -> LLGuidanceGrammar:
        return self.instantiate(self.build(params, lenient))

    def build(self, params: StructuredOutputsParams, lenient: bool = False) -> tuple[str, str]:
        """(kind, grammar text): llguidance parses lazily, per matcher."""
        return params.kind, grammar_text(params, lenient)

    def instantiate(self, artifact: tuple[str, str]) -> LLGuidanceGrammar:
        kind, text = artifact
        matcher = llg.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance cannot compile the {kind}: {_describe(matcher.get_error())}")
        return LLGuidanceGrammar(matcher)

    def fill_bitmasks(
        self, grammars: Sequence[Grammar], rows: Sequence[int], bitmask: torch.Tensor
    ) -> None:
        _check_bitmask(bitmask)
        pairs = []
        for grammar, row in zip(grammars, rows):
            assert isinstance(grammar, LLGuidanceGrammar)
            pairs.append((grammar.matcher, int(row)))
        words = bitmask.shape[1]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), words * 4, bitmask.shape[0]
        )


def _check_bitmask(bitmask: torch.Tensor) -> None:
    """The native call writes through a raw pointer: insist on the layout it assumes."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("the grammar bitmask must be a contiguous int32 CPU tensor")


def _describe(message: str) -> str:
    """First line of an llguidance error, plus the parser's own ``error:`` line (regex
    errors put the reason there, after a caret diagram)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines:
        return message
    detail = next((ln for ln in lines[1:] if ln.startswith("error:")), None)
    return f"{lines[0]} ({detail})" if detail else lines[0]
