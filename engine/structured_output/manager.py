"""The engine core's structured-output manager: compiles grammars, tracks matchers, fills
one step's bitmask.

Life of a constrained request in the core:

1. ``add_request`` submits its compile to a thread pool (off the step loop); the request
   waits in the scheduler as WAITING_FOR_GRAMMAR, and :meth:`is_ready` (the scheduler's
   ready check) lets it run once the matcher exists. A failed compile is reported by
   :meth:`pop_failures`, and the core finishes that request with an error.
2. Each step :meth:`grammar_bitmask` fills int32 ``[N, ceil(V/32)]`` for the step's
   constrained sampling requests in bulk: one native call per backend, over all of that
   backend's matchers (plus one row per draft token when speculative tokens are scheduled).
3. After the step, :meth:`accept_tokens` advances each matcher over its accepted tokens;
   :meth:`is_terminated` says when the grammar is complete.
4. :meth:`remove_request` forgets it (finished, aborted or failed).

With a reasoning parser (``reasoning_end_token_id``; vLLM's ``--reasoning-parser``) the
grammar constrains only what follows the reasoning: a request whose prompt does not end
past a reasoning part (:func:`reasoning_ended`) is :meth:`in_reasoning` -- the scheduler
leaves it out of the step's bitmask and :meth:`accept_tokens` feeds the matcher nothing --
until it generates the end token; the tokens after that one are constrained.

Compiles follow :func:`~engine.structured_output.enforcement.plan_constraint`: the
backend that enforces the constraint in full, else (a JSON schema) the one that enforces
a relaxed schema with the fewest keywords relaxed, which is logged; a ``strict``
constraint that would need relaxing fails instead. What a backend builds once per
constraint (xgrammar's ``CompiledGrammar``, llguidance's grammar text) is cached by the
normalized constraint; :attr:`StructuredOutputManager.stats` counts hits, misses and
compile time.

Engine-wide defaults (``--structured-outputs-config``: backend, disable_any_whitespace,
strict) fill what a request leaves unset.

Nothing here runs for unconstrained requests: no thread pool, tokenizer or backend
exists until the first constrained request arrives.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.structured_output.backend import Grammar, StructuredOutputBackend
from engine.structured_output.enforcement import (
    CompilePlan,
    check_strict,
    constraint_key,
    plan_constraint,
)
from engine.structured_output.params import BACKEND_NAMES, StructuredOutputsParams, with_defaults
from engine.structured_output.selection import backend_class
from engine.structured_output.stats import CompileStats

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.core.request import Request

logger = logging.getLogger(__name__)

# () -> (HF tokenizer, token ids that end a sequence); called once, in a worker thread.
TokenizerLoader = Callable[[], tuple[Any, Sequence[int]]]
COMPILE_CACHE_SIZE = 256  # compiled constraints kept (least recently used goes first)


@dataclass
class _Entry:
    params: StructuredOutputsParams
    future: Future | None
    grammar: Grammar | None = None
    backend: StructuredOutputBackend | None = None
    in_reasoning: bool = False  # no end-of-reasoning token generated yet: unconstrained


class StructuredOutputManager:
    def __init__(
        self,
        load_tokenizer: TokenizerLoader,
        vocab_size: int,
        *,
        backend: str = "auto",
        num_threads: int | None = None,
        disable_any_whitespace: bool = False,
        strict: bool = False,
        cache_size: int = COMPILE_CACHE_SIZE,
        reasoning_end_token_id: int | None = None,
        reasoning_start_token_id: int | None = None,
    ) -> None:
        if backend not in BACKEND_NAMES:
            raise ValueError(
                f"unknown structured output backend {backend!r}; "
                f"choose one of {', '.join(BACKEND_NAMES)}"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size  # the logits width
        self.default_backend = backend
        self.default_disable_any_whitespace = disable_any_whitespace
        self.default_strict = strict
        self.reasoning_end_token_id = reasoning_end_token_id
        self.reasoning_start_token_id = reasoning_start_token_id
        self.stats = CompileStats()  # compile time, compile cache hits / misses
        self._cache: OrderedDict[tuple[str, bool, str], Any] = OrderedDict()
        self._cache_size = max(0, cache_size)
        self._cache_lock = threading.Lock()
        self.num_threads = num_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._load_tokenizer = load_tokenizer
        self._tokenizer: tuple[Any, list[int]] | None = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._lock = threading.Lock()  # guards tokenizer and backend creation
        self._pool: ThreadPoolExecutor | None = None
        self._entries: dict[str, _Entry] = {}
        self._finished_compiles: list[str] = []  # appended from worker threads
        self._bitmask: torch.Tensor | None = None
        self._words_out = (vocab_size + 31) // 32
        self._words_in = self._words_out  # widened once the tokenizer is known

    # -- construction helpers -------------------------------------------------------------
    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> StructuredOutputManager:
        """For a tokenizer already in memory; stop ids default to its EOS token."""
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stop_token_ids = [] if eos is None else [eos]
        stops = list(stop_token_ids)
        return cls(lambda: (tokenizer, stops), vocab_size, **kwargs)

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, vocab_size: int, **kwargs: Any
    ) -> StructuredOutputManager:
        """The core's manager: the model's tokenizer and EOS ids load on first use; the
        engine's structured-outputs defaults apply."""
        so = getattr(config, "structured_outputs", None)
        if so is not None:
            kwargs.setdefault("backend", so.backend)
            kwargs.setdefault("disable_any_whitespace", so.disable_any_whitespace)
            kwargs.setdefault("strict", so.strict)
            if not so.enable_in_reasoning:
                kwargs.setdefault("reasoning_end_token_id", so.reasoning_end_token_id)
                kwargs.setdefault("reasoning_start_token_id", so.reasoning_start_token_id)

        def load() -> tuple[Any, list[int]]:
            from engine.core.tokenizer import get_eos_token_ids, load_tokenizer
            from engine.model_executor.model_loader import load_model_files

            tokenizer = load_tokenizer(config.model.tokenizer_path)
            generation_eos = list(load_model_files(config.model.model).eos_token_ids) or None
            eos, extra = get_eos_token_ids(tokenizer, generation_eos)
            return tokenizer, sorted(({eos} if eos is not None else set()) | extra)

        return cls(load, vocab_size, **kwargs)

    # -- requests in ----------------------------------------------------------------------
    def add_request(self, request_id: str, params: StructuredOutputsParams,
                    prompt_token_ids: Sequence[int] = ()) -> None:
        """Start compiling ``params`` for ``request_id`` in the background (with a
        reasoning parser the request starts in its reasoning unless its prompt ended it)."""
        if request_id in self._entries:
            raise ValueError(f"request id {request_id!r} already has a grammar")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.num_threads, thread_name_prefix="grammar-compile"
            )
        future = self._pool.submit(self._compile, params)
        in_reasoning = self.reasoning_end_token_id is not None and not reasoning_ended(
            prompt_token_ids, self.reasoning_end_token_id, self.reasoning_start_token_id)
        self._entries[request_id] = _Entry(params, future, in_reasoning=in_reasoning)
        future.add_done_callback(lambda _, rid=request_id: self._finished_compiles.append(rid))

    def is_ready(self, request: Request) -> bool:
        """The scheduler's WAITING_FOR_GRAMMAR check: True once the matcher exists."""
        entry = self._entries.get(request.request_id)
        if entry is None:
            return False
        if entry.grammar is not None:
            return True
        if entry.future is None or not entry.future.done() or entry.future.exception():
            return False
        entry.backend, entry.grammar = entry.future.result()
        entry.future = None
        return True

    def pop_failures(self) -> list[tuple[str, str]]:
        """``(request_id, error)`` for every compile that failed since the last call; those
        requests are forgotten here and must be finished by the caller."""
        if not self._finished_compiles:
            return []
        done, self._finished_compiles = self._finished_compiles, []
        failures = []
        for rid in done:
            entry = self._entries.get(rid)
            if entry is None or entry.future is None or entry.future.cancelled():
                continue
            exc = entry.future.exception()
            if exc is not None:
                del self._entries[rid]
                failures.append((rid, str(exc)))
        return failures

    def has_pending_compiles(self) -> bool:
        return any(e.grammar is None for e in self._entries.values())

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` s until some pending compile finishes (for a step loop
        that has nothing else to run)."""
        pending = [e.future for e in self._entries.values() if e.future is not None]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def remove_request(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.future is not None:
            entry.future.cancel()

    # -- per step -------------------------------------------------------------------------
    def grammar_bitmask(
        self,
        request_ids: Sequence[str],
        spec_token_ids: Mapping[str, Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """int32 ``[rows, ceil(vocab_size/32)]``: for each id in order, the mask of its next
        token, then (with drafts) one row per draft position, assuming the drafts before
        it were accepted (rows after a draft the grammar rejects allow everything)."""
        spec_token_ids = spec_token_ids or {}
        num_rows = sum(1 + len(spec_token_ids.get(rid, ())) for rid in request_ids)
        bitmask = self._bitmask_rows(num_rows)
        groups: dict[int, tuple[StructuredOutputBackend, list[Grammar], list[int]]] = {}
        drafted: list[tuple[Grammar, int, Sequence[int]]] = []
        row = 0
        for rid in request_ids:
            entry = self._entries.get(rid)
            if entry is None or entry.grammar is None or entry.backend is None:
                raise RuntimeError(f"request {rid!r} is scheduled but has no compiled grammar")
            group = groups.setdefault(id(entry.backend), (entry.backend, [], []))
            group[1].append(entry.grammar)
            group[2].append(row)
            drafts = spec_token_ids.get(rid, ())
            if drafts:
                drafted.append((entry.grammar, row, drafts))
            row += 1 + len(drafts)
        for backend, grammars, rows in groups.values():
            backend.fill_bitmasks(grammars, rows, bitmask)
        for grammar, row, drafts in drafted:
            _fill_draft_rows(grammar, row, drafts, bitmask)
        return bitmask[:num_rows, : self._words_out]

    def in_reasoning(self, request_id: str) -> bool:
        """True while the request is still in its reasoning (not masked this step)."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.in_reasoning

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance the request's matcher; False if the grammar rejects a token. In the
        reasoning, tokens up to and including the end token are not fed."""
        entry = self._entries.get(request_id)
        if entry is None or entry.grammar is None:
            return False
        if entry.in_reasoning:
            token_ids = list(token_ids)
            if self.reasoning_end_token_id not in token_ids:
                return True
            entry.in_reasoning = False
            token_ids = token_ids[token_ids.index(self.reasoning_end_token_id) + 1:]
            if not token_ids:
                return True
        return entry.grammar.accept_tokens(token_ids)

    def is_terminated(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.grammar is not None and entry.grammar.is_terminated()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._entries.clear()

    # -- internals ------------------------------------------------------------------------
    def _compile(self, params: StructuredOutputsParams) -> tuple[StructuredOutputBackend, Grammar]:
        """Runs in a worker thread: the plan's backend compiles the plan's constraint (a
        backend that cannot use this tokenizer is left out and the constraint planned
        again)."""
        start = time.perf_counter()
        params = with_defaults(
            params, disable_any_whitespace=self.default_disable_any_whitespace,
            strict=self.default_strict,
        )
        excluded: set[str] = set()
        while True:
            plan = plan_constraint(params, self.default_backend, excluded, record=False)
            check_strict(plan, params)
            try:
                backend = self._backend(plan.backend)
            except ValueError as exc:
                excluded.add(plan.backend)
                logger.warning("structured output backend %s left out: %s", plan.backend, exc)
                continue
            grammar = self._grammar(backend, plan)
            self.stats.observe(time.perf_counter() - start)
            return backend, grammar

    def _grammar(self, backend: StructuredOutputBackend, plan: CompilePlan) -> Grammar:
        """A matcher for ``plan``, from the compile cache when the constraint was seen."""
        key = (plan.backend, plan.lenient, constraint_key(plan.params))
        with self._cache_lock:
            artifact = self._cache.get(key)
            if artifact is not None:
                self._cache.move_to_end(key)
        if artifact is not None:
            self.stats.hit()
            return backend.instantiate(artifact)
        self.stats.miss()
        artifact = backend.build(plan.params, plan.lenient)
        grammar = backend.instantiate(artifact)
        if not plan.enforced:
            logger.warning(
                "JSON schema compiled by %s on a best-effort basis; not enforced: %s "
                "(relaxed keywords; the rest of the schema is enforced)%s",
                plan.backend,
                ", ".join(plan.relaxed),
                f"; why: {'; '.join(plan.reasons)}" if plan.reasons else "",
            )
        if self._cache_size:
            with self._cache_lock:
                self._cache[key] = artifact
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return grammar

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is not None:
                return backend
            tokenizer, stop_ids = self._tokenizer_and_stops()
            cls = backend_class(name)
            # The backends' vocabulary covers every tokenizer id and every logits column.
            vocab = max(self.vocab_size, len(tokenizer))
            try:
                backend = cls(tokenizer, vocab, stop_ids, self.num_threads)
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer the backend can't read
                raise ValueError(f"{name} cannot use this tokenizer: {exc}") from None
            self._backends[name] = backend
            return backend

    def _tokenizer_and_stops(self) -> tuple[Any, list[int]]:
        if self._tokenizer is None:
            tokenizer, stops = self._load_tokenizer()
            self._tokenizer = (tokenizer, list(stops))
            self._words_in = (max(self.vocab_size, len(tokenizer)) + 31) // 32
        return self._tokenizer

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        """A persistent int32 buffer of at least ``num_rows`` rows (grown by doubling)."""
        words = self._words_in
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            capacity = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]))
            self._bitmask = torch.full((max(capacity, 8), words), -1, dtype=torch.int32)
        return self._bitmask


def reasoning_ended(token_ids: Sequence[int], end_token_id: int,
                    start_token_id: int | None = None) -> bool:
    """vLLM's rule: the last start or end token in ``token_ids`` is the end token."""
    for token in reversed(token_ids):
        if token == start_token_id:
            return False
        if token == end_token_id:
            return True
    return False


def _fill_draft_rows(
    grammar: Grammar, row: int, drafts: Sequence[int], bitmask: torch.Tensor
) -> None:
    """Rows ``row+1 ..``: the mask after each accepted draft prefix; then undo the drafts."""
    accepted = 0
    for i, token in enumerate(drafts):
        if grammar.is_terminated() or not grammar.accept_tokens([token]):
            bitmask[row + 1 + i : row + 1 + len(drafts)] = -1
            break
        accepted += 1
        grammar.fill_bitmask(bitmask, row + 1 + i)
    grammar.rollback(accepted)
