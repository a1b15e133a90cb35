"""The data-parallel router and AsyncDPClient over fake per-core clients: load balance,
prefix affinity, abort routing, utilities, dead-rank handling (no processes)."""

from __future__ import annotations

import asyncio

import pytest

from engine.core.config import CacheConfig
from engine.core.core_protocol import EngineCoreStats, ReadyInfo
from engine.core.dp_async_client import AsyncDPClient
from engine.core.dp_client import RankDeadError
from engine.core.dp_router import AFFINITY_SLACK, DPRouter
from engine.core.engine_io import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from engine.core.errors import EngineDeadError
from engine.core.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokens, SamplingParams(max_tokens=4))


class _FakeCore:
    """An AsyncMPClient stand-in: records what it was sent; outputs come from a queue."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.calls: list[tuple] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.dead: EngineDeadError | None = None
        self.ready = ReadyInfo(100 + rank, 128, 1000 + rank)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def exited(self) -> bool:
        return self.dead is not None

    async def add_request(self, request: EngineCoreRequest) -> None:
        self.check_alive()
        self.added.append(request.request_id)

    def abort_requests_nowait(self, ids: list[str]) -> None:
        self.aborted.extend(ids)

    async def get_output(self) -> EngineCoreOutputs:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def call_utility(self, method: str, *args):
        self.calls.append((method, *args))
        return {"reset_prefix_cache": True, "abort_all_requests": 2,
                "list_loras": [self.rank]}.get(method)

    async def get_stats(self) -> EngineCoreStats:
        return EngineCoreStats(num_running=self.rank + 1, num_kv_blocks=100)

    def kill(self) -> None:
        self.dead = EngineDeadError(f"core {self.rank} exited")
        self.queue.put_nowait(self.dead)

    def shutdown(self) -> None:
        pass


class _Config:
    """The two config fields the client reads."""

    def __init__(self, policy: str) -> None:
        from engine.core.config import ParallelConfig

        self.cache = CacheConfig(block_size=BLOCK)
        self.parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                                       data_parallel_on_rank_failure=policy)


def _client(policy: str = "continue", ranks: int = 2) -> tuple[AsyncDPClient, list[_FakeCore]]:
    cores = [_FakeCore(r) for r in range(ranks)]
    return AsyncDPClient(cores, _Config(policy)), cores


# -- the rule ----------------------------------------------------------------------------
def test_least_loaded_rank_wins_and_ties_go_to_the_lowest():
    router = DPRouter(3, BLOCK)
    ranks = [router.route(_request(str(i), [i])) for i in range(6)]
    assert ranks == [0, 1, 2, 0, 1, 2]
    router.kv_usage[0] = 0.9  # a nearly full cache counts as more load
    router.forget(["0", "1", "2"])
    assert router.route(_request("x", [9])) == 1


def test_prefix_affinity_holds_until_the_rank_is_overloaded():
    router = DPRouter(2, BLOCK)
    shared = [7, 7, 7, 7]
    ranks = [router.route(_request(f"s{i}", shared + [i])) for i in range(5)]
    # The shared first block stays on rank 0 while its load <= least + slack.
    stay = int(AFFINITY_SLACK) + 1
    assert ranks[:stay] == [0] * stay and ranks[stay] == 1
    assert router.route(_request("short", [7, 7])) == 1  # under one block: no key
    # A different adapter or cache salt is a different prefix.
    salted = _request("salted", shared)
    salted.cache_salt = "other"
    assert router.prefix_key(salted) != router.prefix_key(_request("plain", shared))


def test_finished_and_dead_requests_leave_the_count():
    router = DPRouter(2, BLOCK)
    for i in range(4):
        router.route(_request(str(i), [i]))
    router.on_outputs(0, EngineCoreOutputs(
        outputs=[EngineCoreOutput("0", [1], finish_reason=0)], kv_cache_usage=0.5))
    assert router.in_flight[0] == {"2"} and router.kv_usage[0] == 0.5
    assert router.mark_dead(1) == ["1", "3"]
    assert router.mark_dead(1) is None  # once
    assert router.route(_request("n", [5])) == 0


# -- the client --------------------------------------------------------------------------
def test_abort_goes_to_the_owning_rank_and_outputs_merge():
    async def run():
        client, cores = _client()
        for i in range(4):
            await client.add_request(_request(str(i), [i]))
        assert cores[0].added == ["0", "2"] and cores[1].added == ["1", "3"]
        client.abort_requests_nowait(["3", "unknown"])
        assert cores[1].aborted == ["3"] and cores[0].aborted == []
        cores[1].queue.put_nowait(EngineCoreOutputs(
            outputs=[EngineCoreOutput("1", [5], finish_reason=0)]))
        step = await asyncio.wait_for(client.get_output(), 2)
        assert [o.request_id for o in step.outputs] == ["1"]
        assert client.router.owner == {"0": 0, "2": 0}
        client.shutdown()

    asyncio.run(run())


def test_utilities_run_on_every_rank_and_combine():
    async def run():
        client, cores = _client()
        assert await client.reset_prefix_cache() is True
        assert await client.call_utility("abort_all_requests") == 4
        assert await client.call_utility("list_loras") == [0, 1]
        await client.update_weights("init_weight_update_group", "h", 1, 1, 5)
        assert [c.calls[-1] for c in cores] == [  # each replica its own block of ranks
            ("init_weight_update_group", "h", 1, 1, 5),
            ("init_weight_update_group", "h", 1, 3, 5)]
        with pytest.raises(ValueError, match="no data-parallel rule"):
            await client.call_utility("made_up")
        with pytest.raises(ValueError, match="not built yet"):
            await client.update_weights("update_weights_from_tensors", [])
        stats = await client.get_stats()
        assert stats.num_running == 3 and stats.num_kv_blocks == 200
        assert client.pids == [1000, 1001] and client.ready.num_kv_blocks == 100
        client.shutdown()

    asyncio.run(run())


def test_continue_fails_only_the_dead_ranks_requests():
    async def run():
        client, cores = _client("continue")
        for i in range(4):
            await client.add_request(_request(str(i), [i]))
        cores[1].kill()
        with pytest.raises(RankDeadError) as info:
            await asyncio.wait_for(client.get_output(), 2)
        assert info.value.rank == 1 and info.value.request_ids == ["1", "3"]
        assert client.dead is None and not client.exited()
        client.check_alive()  # the client lives on
        await client.add_request(_request("new", [9]))
        assert cores[0].added[-1] == "new"  # the dead rank gets nothing new
        assert await client.get_engine_stats() == [EngineCoreStats(num_running=1,
                                                                   num_kv_blocks=100), None]
        cores[0].kill()  # the last rank: now the client is dead
        with pytest.raises(EngineDeadError, match="no rank is left"):
            await asyncio.wait_for(client.get_output(), 2)
        with pytest.raises(EngineDeadError):
            await client.add_request(_request("late", [1]))
        client.shutdown()

    asyncio.run(run())


def test_exit_policy_makes_one_death_fatal():
    async def run():
        client, cores = _client("exit")
        await client.add_request(_request("a", [1]))
        cores[0].dead = EngineDeadError("core 0 exited")  # noticed by check_alive
        assert client.exited()
        with pytest.raises(EngineDeadError, match="'exit'"):
            client.check_alive()
        assert not isinstance(client.dead, RankDeadError)
        with pytest.raises(EngineDeadError):
            await client.add_request(_request("b", [2]))
        client.shutdown()

    asyncio.run(run())


def test_send_to_a_dead_rank_reroutes_the_request():
    async def run():
        client, cores = _client("continue")
        cores[0].dead = EngineDeadError("core 0 exited")  # not noticed yet
        await client.add_request(_request("a", [1]))
        assert cores[1].added == ["a"] and client.router.live == [False, True]
        with pytest.raises(RankDeadError):  # its (empty) loss is still reported
            await asyncio.wait_for(client.get_output(), 2)
        client.shutdown()

    asyncio.run(run())
