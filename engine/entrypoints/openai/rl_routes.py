"""Routes for RL training loops, as vLLM serves them: sleep mode and pausing generation.

- ``POST /sleep?level=1|2``: free the KV cache (and, level 2, the weights); needs
  ``--enable-sleep-mode`` and no request in flight (400 otherwise);
- ``POST /wake_up[?tags=weights&tags=kv_cache]``: bring them back (no tags: both);
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``;
- ``POST /pause?mode=abort|wait|keep[&clear_cache=true]``: stop generating, with vLLM's
  modes for the requests in flight (abort them, let them finish, or hold them);
- ``POST /resume``; ``GET /is_paused``: ``{"is_paused": bool}``.

While the engine sleeps, the generation and pooling routes answer 503 with an
OpenAI-style error body. Like vLLM's development routes they take query parameters, no
JSON body, and are left out of the OpenAPI document (which lists the OpenAI API).

Weight updates, only with ``engine serve --enable-weight-updates`` (404 otherwise), each
taking a JSON body and refused (400) while a request is unfinished (``POST /pause``
first); each resets the prefix cache, and a refused update leaves the old weights serving
(see :mod:`engine.model_executor.weight_update`):

- ``POST /update_weights`` ``{"path": DIR}``: load the checkpoint directory ``DIR`` (the
  running architecture) on every rank;
- ``POST /init_weight_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size"}``: join the trainer's process group (gloo on the CPU, NCCL on GPUs; the
  trainer is rank 0 and hosts the store, engine rank ``i`` is ``rank_offset + i``); it
  answers once every rank has joined;
- ``POST /update_weights_from_distributed`` ``{"names", "dtypes", "shapes"[, "packed"]}``:
  receive those tensors (HF checkpoint names, full shapes; the model's full set) by
  broadcast from the trainer's rank 0, in that order (``packed``: in byte buckets,
  ``engine.distributed.weight_sync.packed_buckets``).

Bad input (a missing directory, another architecture, a wrong shape, an unknown or
missing tensor name, a malformed body) answers 400 with an OpenAI-style error body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.request_body import parse_body

# The routes that run the model: refused with 503 while the engine sleeps.
MODEL_PATHS = frozenset((
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
    "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
))
SLEEPING_MESSAGE = ("The engine is sleeping (its KV cache and maybe its weights are "
                    "freed): POST /wake_up before sending requests")


class SleepingMiddleware:
    """503 for the model routes while the engine sleeps (plain ASGI: streaming responses
    pass through untouched)."""

    def __init__(self, app: Any, engine: Any) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and getattr(self.engine, "sleeping", False)
                and scope["method"] == "POST" and scope["path"] in MODEL_PATHS):
            await APIError(503, SLEEPING_MESSAGE).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


_TAGS = Query(None)  # ?tags=weights&tags=kv_cache (none: both)


def add_rl_routes(app: FastAPI, engine: Any, guard: Any) -> None:
    """Register the sleep / wake-up / pause / resume routes over ``engine`` (AsyncLLM);
    the app also needs :class:`SleepingMiddleware` (``build_app`` adds it)."""

    @app.post("/sleep", include_in_schema=False)
    async def sleep(level: int = Query(1)) -> Response:
        await guard(engine.sleep(level))
        return Response(status_code=200)

    @app.post("/wake_up", include_in_schema=False)
    async def wake_up(tags: list[str] | None = _TAGS) -> Response:
        await guard(engine.wake_up(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping", include_in_schema=False)
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await guard(engine.is_sleeping())})

    @app.post("/pause", include_in_schema=False)
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)) -> Response:
        await guard(engine.pause_generation(mode=mode, clear_cache=clear_cache))
        return JSONResponse({"status": "paused", "mode": mode})

    @app.post("/resume", include_in_schema=False)
    async def resume() -> Response:
        await guard(engine.resume_generation())
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused", include_in_schema=False)
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": engine.paused})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class UpdateWeightsRequest(_Body):
    path: str = Field(min_length=1)


class InitWeightUpdateGroupRequest(_Body):
    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)


class UpdateWeightsFromDistributedRequest(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    packed: bool = False


def add_weight_update_routes(app: FastAPI, engine: Any, guard: Any) -> None:
    """Register the weight-update routes over ``engine`` (AsyncLLM); ``build_app`` does
    only when the engine was started with ``--enable-weight-updates``."""

    @app.post("/update_weights", include_in_schema=False)
    async def update_weights(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightsRequest)
        await guard(engine.update_weights(body.path))
        return JSONResponse({"status": "updated", "path": body.path})

    @app.post("/init_weight_update_group", include_in_schema=False)
    async def init_weight_update_group(request: Request) -> JSONResponse:
        body = await parse_body(request, InitWeightUpdateGroupRequest)
        await guard(engine.init_weight_update_group(
            body.master_address, body.master_port, body.rank_offset, body.world_size))
        return JSONResponse({"status": "joined"})

    @app.post("/update_weights_from_distributed", include_in_schema=False)
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightsFromDistributedRequest)
        await guard(engine.update_weights_from_distributed(body.names, body.dtypes,
                                                           body.shapes, body.packed))
        return JSONResponse({"status": "updated", "num_tensors": len(body.names)})
