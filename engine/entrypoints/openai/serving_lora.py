"""The server's LoRA adapters: the names a request's ``model`` may give besides the base
model (vLLM's ``OpenAIServingModels``).

* ``--lora-modules``: the adapters served from startup, in vLLM's forms: ``name=path`` and
  JSON ``{"name": ..., "path": ..., "base_model_name": ...}`` (:func:`parse_lora_modules`).
  Each gets a unique integer id and is checked and loaded with ``AsyncLLM.add_lora`` before
  the server listens (:func:`load_lora_modules`): a bad one stops the startup.
* ``--allow-runtime-lora-updating`` (or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` /
  ``ENGINE_ALLOW_RUNTIME_LORA_UPDATING`` set to ``1`` / ``true``): ``POST
  /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (:func:`add_lora_routes`).
  A runtime adapter gets a fresh id (ids are never reused, so the engine's caches cannot
  mix two adapters that once shared a name).
* ``/v1/models`` lists every adapter with ``parent`` (its base model) and ``root`` (its
  directory), as vLLM does.

Unloading takes the name away at once (new requests naming it get the model-not-found
404), while requests already running under the adapter finish normally: the adapter is
removed from the engine (``AsyncLLM.remove_lora``) only when the last of them ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from engine.entrypoints.openai.errors import APIError, bad_request, model_not_found
from engine.entrypoints.openai.openapi import error_responses, json_body
from engine.entrypoints.openai.protocol import ModelCard
from engine.entrypoints.openai.request_body import parse_body
from engine.lora.request import LoRARequest

logger = logging.getLogger("engine.server")

RUNTIME_UPDATING_ENVVARS = ("ENGINE_ALLOW_RUNTIME_LORA_UPDATING",
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def runtime_updating_from_env(environ: dict[str, str] | None = None) -> bool:
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or this engine's name for it): on when
    set to ``1`` or ``true`` (any case)."""
    environ = os.environ if environ is None else environ
    return any(environ.get(name, "").strip().lower() in ("1", "true")
               for name in RUNTIME_UPDATING_ENVVARS)


def parse_lora_module(item: str) -> LoRAModulePath:
    """``name=path`` or a JSON object with ``name``, ``path`` and optionally
    ``base_model_name``; ValueError says what is wrong."""
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON {item!r}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{item!r} must be a JSON object")
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{item!r}: unknown field(s) {', '.join(unknown)} (expected "
                             "name, path and optionally base_model_name)")
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{item!r}: 'name' must be a non-empty string")
        if not isinstance(path, str) or not path.strip():
            raise ValueError(f"{item!r}: 'path' must be a non-empty string")
        if base is not None and (not isinstance(base, str) or not base):
            raise ValueError(f"{item!r}: 'base_model_name' must be a non-empty string")
        return LoRAModulePath(name.strip(), path.strip(), base)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{item!r} is neither name=path nor a JSON object with name and "
                         "path")
    return LoRAModulePath(name.strip(), path.strip())


def parse_lora_modules(items: Iterable[str],
                       base_model_name: str | None = None) -> list[LoRAModulePath]:
    """Every ``--lora-modules`` value, in order; a repeated name, or one equal to the base
    model's served name, is a ValueError."""
    modules: list[LoRAModulePath] = []
    seen: set[str] = set()
    for item in items:
        if not item or not item.strip():
            continue
        module = parse_lora_module(item)
        if module.name in seen:
            raise ValueError(f"the adapter name {module.name!r} is given twice")
        if base_model_name is not None and module.name == base_model_name:
            raise ValueError(f"the adapter name {module.name!r} is the base model's served "
                             "name; give the adapter another name")
        seen.add(module.name)
        modules.append(module)
    return modules


def lora_requests_for(modules: Iterable[LoRAModulePath], first_id: int = 1,
                      base_model_name: str | None = None) -> list[LoRARequest]:
    """One LoRARequest per module, ids ``first_id, first_id + 1, ...``."""
    return [LoRARequest(lora_name=m.name, lora_int_id=first_id + i, lora_path=m.path,
                        base_model_name=m.base_model_name or base_model_name)
            for i, m in enumerate(modules)]


async def load_lora_modules(engine: Any, requests: Iterable[LoRARequest]) -> None:
    """Add each adapter to the engine (checked, then loaded into the workers' host cache);
    the first that fails raises ValueError naming it."""
    for lora in requests:
        try:
            await engine.add_lora(lora)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}) could not "
                             f"be loaded: {exc}") from exc
        logger.info("Loaded LoRA adapter %r from %s (id %d)", lora.lora_name, lora.lora_path,
                    lora.lora_int_id)


# -- the registry -------------------------------------------------------------------------
class ServedLoRAs:
    """name -> LoRARequest of the adapters this server serves, and the bookkeeping that
    lets an unloaded adapter's running requests finish before the engine drops it."""

    def __init__(self, engine: Any, base_model_name: str,
                 static: Iterable[LoRARequest] = ()) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.by_name: dict[str, LoRARequest] = {}
        for lora in static:
            if lora.lora_name in self.by_name or lora.lora_name == base_model_name:
                raise ValueError(f"the adapter name {lora.lora_name!r} is given twice")
            self.by_name[lora.lora_name] = lora
        self._next_id = max((lora.lora_int_id for lora in self.by_name.values()), default=0) + 1
        self._in_flight: dict[int, int] = {}  # lora_int_id -> requests now generating
        self._retired: dict[int, LoRARequest] = {}  # unloaded, waiting for their requests
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()
        self._restarts = self._core_restarts()

    @property
    def enabled(self) -> bool:
        """Whether the engine runs LoRA adapters at all (``--enable-lora``)."""
        config = getattr(self.engine, "config", None)
        return getattr(config, "lora", None) is not None

    def _core_restarts(self) -> int:
        return int(getattr(self.engine, "num_core_restarts", 0) or 0)

    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # -- resolving ------------------------------------------------------------------------
    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no name);
        the model-not-found error for any other name."""
        if not name or name == self.base_model_name:
            return None
        lora = self.by_name.get(name)
        if lora is None:
            raise model_not_found(name)
        return lora

    def model_cards(self, max_model_len: int | None = None) -> list[ModelCard]:
        return [self.model_card(lora, max_model_len) for lora in self.by_name.values()]

    def model_card(self, lora: LoRARequest, max_model_len: int | None = None) -> ModelCard:
        return ModelCard(id=lora.lora_name, root=lora.lora_path,
                         parent=lora.base_model_name or self.base_model_name,
                         max_model_len=max_model_len)

    # -- running requests -----------------------------------------------------------------
    async def acquire(self, lora: LoRARequest) -> None:
        """Before a request runs under ``lora``: refuse an adapter unloaded meanwhile (the
        model-not-found error), and load the adapters again into an engine core that was
        restarted since they were added."""
        if self.by_name.get(lora.lora_name) != lora:
            raise model_not_found(lora.lora_name)
        if self._core_restarts() != self._restarts:
            await self._reload_after_restart()
            if self.by_name.get(lora.lora_name) != lora:
                raise model_not_found(lora.lora_name)
        self._in_flight[lora.lora_int_id] = self._in_flight.get(lora.lora_int_id, 0) + 1

    def release(self, lora: LoRARequest) -> None:
        """After a request that ran under ``lora`` ended (however it ended)."""
        lora_id = lora.lora_int_id
        left = self._in_flight.get(lora_id, 0) - 1
        if left > 0:
            self._in_flight[lora_id] = left
            return
        self._in_flight.pop(lora_id, None)
        retired = self._retired.pop(lora_id, None)
        if retired is not None:  # unloaded while it ran: drop it from the engine now
            self._spawn(self._remove_from_engine(retired))

    async def _reload_after_restart(self) -> None:
        async with self._get_lock():
            restarts = self._core_restarts()
            if restarts == self._restarts:
                return
            for lora in list(self.by_name.values()):
                try:
                    await self.engine.add_lora(lora)
                except Exception as exc:  # noqa: BLE001 - the adapter is dropped, not the server
                    logger.error("LoRA adapter %r could not be loaded into the restarted "
                                 "engine core; it is no longer served: %s", lora.lora_name, exc)
                    self.by_name.pop(lora.lora_name, None)
            self._restarts = restarts

    # -- loading and unloading ------------------------------------------------------------
    async def load(self, name: str | None, path: str | None,
                   base_model_name: str | None = None, load_inplace: bool = False
                   ) -> LoRARequest:
        """Add an adapter at runtime; an APIError (400, or 404 when the engine cannot find
        the adapter) says why not. ``load_inplace`` (vLLM's): a name already served is
        replaced by the new adapter (a new id; requests running under the old one finish
        with it)."""
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.",
                              "lora_name" if not name else "lora_path")
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled on this server: start it with "
                              "--enable-lora")
        async with self._get_lock():
            if name == self.base_model_name or (name in self.by_name and not load_inplace):
                raise bad_request(f"The lora adapter '{name}' has already been loaded.",
                                  "lora_name")
            old = self.by_name.get(name)
            lora = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path,
                               base_model_name=base_model_name or self.base_model_name)
            self._next_id += 1
            try:
                await self.engine.add_lora(lora)
            except ValueError as exc:
                message = str(exc)
                status = 404 if "No adapter found" in message else 400
                raise APIError(status, message, "lora_path") from exc
            except FileNotFoundError as exc:
                raise bad_request(f"No adapter found at {path}: {exc}", "lora_path") from exc
            self.by_name[name] = lora
            if old is not None and not self._retire(old):  # load_inplace: the old one goes
                await self._remove_from_engine(old)
        logger.info("Loaded new LoRA adapter: name %r, path %r (id %d)", name, path,
                    lora.lora_int_id)
        return lora

    async def unload(self, name: str | None, lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving an adapter (by name, else by id): new requests naming it get the
        model-not-found error; running ones finish, then the engine drops it."""
        if not name and lora_int_id is None:
            raise bad_request("either 'lora_name' or 'lora_int_id' needs to be provided.",
                              "lora_name")
        async with self._get_lock():
            lora = self.by_name.get(name) if name else next(
                (x for x in self.by_name.values() if x.lora_int_id == lora_int_id), None)
            if lora is None or (lora_int_id is not None and lora.lora_int_id != lora_int_id):
                what = f"'{name}'" if name else f"with id {lora_int_id}"
                raise APIError(404, f"The lora adapter {what} cannot be found.",
                               "lora_name" if name else "lora_int_id")
            del self.by_name[lora.lora_name]
            deferred = self._retire(lora)
        if not deferred:
            await self._remove_from_engine(lora)
        return lora

    def _retire(self, lora: LoRARequest) -> bool:
        """``lora`` is no longer served. True: requests run under it, the engine drops it
        when the last one ends; False: the caller drops it now."""
        running = self._in_flight.get(lora.lora_int_id, 0)
        if running:
            self._retired[lora.lora_int_id] = lora
            logger.info("Removed LoRA adapter: name %r, id %d (its %d running request(s) "
                        "finish first)", lora.lora_name, lora.lora_int_id, running)
            return True
        logger.info("Removed LoRA adapter: name %r, id %d", lora.lora_name, lora.lora_int_id)
        return False

    async def _remove_from_engine(self, lora: LoRARequest) -> None:
        remove = getattr(self.engine, "remove_lora", None)
        if remove is None:
            return
        try:
            await remove(lora.lora_int_id)
        except Exception as exc:  # noqa: BLE001 - a dead core has no adapters left anyway
            logger.warning("Could not remove LoRA adapter %r (id %d) from the engine: %s",
                           lora.lora_name, lora.lora_int_id, exc)

    def _spawn(self, work: Awaitable[None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)  # type: ignore[arg-type]
        except RuntimeError:  # no loop (shutting down): the engine goes away anyway
            work.close()  # type: ignore[attr-defined]
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def load_all_missing(self) -> None:
        """Add to the engine every registered adapter it does not hold (the app was built
        over adapters not loaded yet, e.g. by ``build_app`` callers other than ``engine
        serve``, which loads them before the server starts)."""
        if not self.by_name:
            return
        list_loras = getattr(self.engine, "list_loras", None)
        loaded: set[int] = set(await list_loras()) if list_loras is not None else set()
        missing = [lora for lora in self.by_name.values() if lora.lora_int_id not in loaded]
        await load_lora_modules(self.engine, missing)


# -- routes -------------------------------------------------------------------------------
class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="allow")

    lora_name: str | None = None
    lora_path: str | None = None
    base_model_name: str | None = None
    load_inplace: bool = False  # replace an adapter already served under lora_name


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="allow")

    lora_name: str | None = None
    lora_int_id: int | None = None


# Documented in /openapi.json when the routes exist.
LORA_REQUEST_MODELS = (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)


def add_lora_routes(app: FastAPI, loras: ServedLoRAs, max_depth: int,
                    guard: Callable[[Any], Awaitable[Any]]) -> None:
    """The runtime-updating routes (only with --allow-runtime-lora-updating). Success is
    vLLM's plain-text 200; failures are OpenAI-style error bodies."""

    @app.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest),
              response_class=PlainTextResponse, responses=error_responses(400, 401, 404, 500))
    async def load_lora_adapter(raw_request: Request) -> Response:
        request = await parse_body(raw_request, LoadLoRAAdapterRequest, max_depth)
        lora = await guard(loras.load(request.lora_name, request.lora_path,
                                      request.base_model_name, request.load_inplace))
        return PlainTextResponse(
            f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest),
              response_class=PlainTextResponse, responses=error_responses(400, 401, 404, 500))
    async def unload_lora_adapter(raw_request: Request) -> Response:
        request = await parse_body(raw_request, UnloadLoRAAdapterRequest, max_depth)
        lora = await guard(loras.unload(request.lora_name, request.lora_int_id))
        return PlainTextResponse(
            f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")
