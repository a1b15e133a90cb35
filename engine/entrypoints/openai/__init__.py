"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

``build_app(engine, settings)`` returns the ASGI app; ``run_server`` serves it;
``engine serve`` is the command-line entry point.
"""

from engine.entrypoints.openai.api_server import build_app, run_server
from engine.entrypoints.openai.serving_base import ServerSettings

__all__ = ["ServerSettings", "build_app", "run_server"]
