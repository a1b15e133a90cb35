"""``watch_engine`` on a fake engine (no model, no server): a dead core is restarted while
restarts are left, then the server is stopped with exit code 1; a restart that fails
stops it too; with exit_on_engine_death off the server stays up."""

from __future__ import annotations

import asyncio

from engine.core.errors import EngineDeadError, EngineStartupError
from engine.entrypoints.openai.serving_base import ServerSettings, ServerState, watch_engine


class FakeEngine:
    def __init__(self, restart_fails: bool = False) -> None:
        self.errored = False
        self.closed = False
        self.restarts = 0
        self.failed = 0
        self.restart_fails = restart_fails

    def fail_in_flight(self):
        if not self.errored:
            return None
        self.failed += 1
        return EngineDeadError("engine core process exited unexpectedly with signal SIGKILL")

    async def restart_core(self) -> int:
        await asyncio.sleep(0)
        if self.restart_fails:
            raise EngineStartupError("engine core failed to start: out of memory")
        self.restarts += 1
        self.errored = False
        return 1000 + self.restarts


def _run(engine: FakeEngine, deaths: int, **settings) -> ServerState:
    state = ServerState(engine, ServerSettings(**settings), metrics=None)
    stopped = []
    state.stop_server = lambda: stopped.append(True)

    async def main() -> None:
        watcher = asyncio.create_task(watch_engine(state))
        for _ in range(deaths):
            engine.errored = True
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not engine.errored or watcher.done():
                    break
        await asyncio.wait_for(asyncio.shield(watcher), 2) if deaths else None
        watcher.cancel()

    asyncio.run(main())
    state.stopped = bool(stopped)  # type: ignore[attr-defined]
    return state


def test_restarts_then_exits(caplog):
    engine = FakeEngine()
    state = _run(engine, deaths=3, restart_engine_core=2)
    assert engine.restarts == 2 and engine.failed == 3
    assert state.exit_code == 1 and state.stopped
    assert "restart 2 of 2" in caplog.text and "all 2 restart(s) are used" in caplog.text


def test_failed_restart_exits():
    engine = FakeEngine(restart_fails=True)
    state = _run(engine, deaths=1, restart_engine_core=5)
    assert state.exit_code == 1 and state.stopped


def test_keep_alive_on_engine_death():
    engine = FakeEngine()
    state = _run(engine, deaths=1, exit_on_engine_death=False)
    assert state.exit_code == 0 and not state.stopped and engine.failed == 1


def test_no_restart_during_shutdown():
    engine = FakeEngine()
    state = ServerState(engine, ServerSettings(restart_engine_core=1), metrics=None)
    state.shutting_down = True

    async def main() -> None:
        watcher = asyncio.create_task(watch_engine(state))
        engine.errored = True
        await asyncio.sleep(0.3)
        watcher.cancel()

    asyncio.run(main())
    assert engine.restarts == 0 and engine.failed == 0 and state.exit_code == 0
