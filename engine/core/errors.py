"""Errors a front end sees when its engine-core process fails."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process died (crashed, was killed, or hit an error in its step
    loop); every in-flight and future request on that engine fails with this."""


class EngineStartupError(RuntimeError):
    """The engine core process failed before it was ready (e.g. the model would not
    load); the message carries the child's own error text."""


class EngineSleepingError(RuntimeError):
    """The engine is in sleep mode (its KV cache, maybe its weights, are freed): wake it
    up before sending requests. The server answers 503."""
