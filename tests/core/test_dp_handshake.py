"""Multi-node data parallelism without a model: the flags' rules and the head <-> node
handshake (registration, refusal, exit reports, heartbeats, goodbye)."""

from __future__ import annotations

import re
import socket
import time

import pytest

from engine.core import dp_handshake
from engine.core.config import ParallelConfig
from engine.core.dp_handshake import (
    HeadRegistry,
    NodeLink,
    RankAddresses,
    RankExited,
    Register,
    Welcome,
)
from engine.core.dp_placement import check_placement, node_plan
from engine.core.engine_args import EngineArgs
from engine.core.errors import EngineStartupError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("kwargs, message", [
    ({"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 3,
          "headless": True, "data_parallel_address": "10.0.0.1"},
     "start-rank (3) + --data-parallel-size-local (2) is more than"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 1, "data_parallel_start_rank": 1,
          "headless": True}, "--headless needs --data-parallel-address"),
    ({"data_parallel_size": 2, "data_parallel_start_rank": 1, "headless": True,
          "data_parallel_address": "10.0.0.1"}, "--headless needs --data-parallel-size-local"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 1, "headless": True,
          "data_parallel_address": "10.0.0.1"}, "--data-parallel-start-rank >= 1"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 1},
     "ranks 1..1 run on other nodes"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 1, "data_parallel_start_rank": 1,
          "data_parallel_address": "10.0.0.1"}, "without --headless"),
    ({"data_parallel_size": 2, "data_parallel_backend": "ray", "data_parallel_size_local": 1},
     "places every rank itself"),
    ({"data_parallel_size": 2, "data_parallel_backend": "slurm"}, "'mp' or 'ray'"),
    ({"data_parallel_size": 2, "data_parallel_rpc_port": 0}, "data_parallel_rpc_port"),
])
def test_engine_args_refuse_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**kwargs)._check_data_parallel(False)


def test_good_layouts_and_plans():
    EngineArgs(data_parallel_size=4, data_parallel_size_local=2,
               data_parallel_address="10.0.0.1")._check_data_parallel(False)
    EngineArgs(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
               headless=True, data_parallel_address="10.0.0.1")._check_data_parallel(False)
    EngineArgs(data_parallel_size=2, data_parallel_backend="ray")._check_data_parallel(False)
    assert node_plan(4, 2, 0, "mp").remote_ranks == (2, 3)
    assert not node_plan(2, None, 0, "mp").multi_node
    assert node_plan(2, None, 0, "ray").remote_ranks == (0, 1)
    # A config (role unknown) keeps the shared rules only; node slots count per node.
    parallel = ParallelConfig(data_parallel_size=4, data_parallel_size_local=2,
                              data_parallel_start_rank=2, data_parallel_rank=3)
    assert parallel.node_share(0) == (1, 2)
    with pytest.raises(ValueError, match="do not exist"):
        check_placement(2, 2, 1, "h", "mp")


@pytest.fixture
def registry():
    port = _free_port()
    ranks = {r: RankAddresses(r, f"tcp://127.0.0.1:{_free_port()}",
                              f"tcp://127.0.0.1:{_free_port()}") for r in (1, 2)}
    head = HeadRegistry("127.0.0.1", port, '{"fake": "config"}', ranks, 3,
                        register_timeout_s=30, node_timeout_s=1.0)
    yield head, port, ranks
    head.close()


def test_handshake_welcomes_and_tracks_liveness(registry, monkeypatch):
    head, port, ranks = registry
    assert head.rank_gone(1) is None  # may still register
    link = NodeLink("127.0.0.1", port)
    try:
        welcome = link.register(Register(3, 1, 2, "node-b", 1234), timeout_s=10)
        assert isinstance(welcome, Welcome)
        assert welcome.config_json == '{"fake": "config"}'
        assert welcome.ranks == [ranks[1], ranks[2]]
        # A second node for taken ranks is refused, with the reason.
        other = NodeLink("127.0.0.1", port)
        try:
            with pytest.raises(EngineStartupError, match="already registered"):
                other.register(Register(3, 2, 1, "node-c", 99), timeout_s=10)
        finally:
            other.close()
        # An exit report marks that rank (only) gone, within a heartbeat.
        assert link.tick([RankExited(2, "exited with signal SIGKILL")]) is None
        deadline = time.monotonic() + 5
        while head.rank_gone(2) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "signal SIGKILL" in head.rank_gone(2)
        assert head.rank_gone(1) is None
        # A silent node counts as gone after node_timeout_s.
        time.sleep(1.5)
        assert "sent nothing" in head.rank_gone(1)
        # The head's shutdown reaches the node as a Goodbye.
        head.close("test over")
        deadline = time.monotonic() + 5
        why = None
        while why is None and time.monotonic() < deadline:
            why = link.tick([])
            time.sleep(0.05)
        assert why is not None and "test over" in why
    finally:
        link.close()


def test_handshake_refuses_a_mismatched_node(registry):
    _head, port, _ = registry
    link = NodeLink("127.0.0.1", port)
    try:
        with pytest.raises(EngineStartupError, match="--data-parallel-size 4"):
            link.register(Register(4, 1, 1, "node-b", 1), timeout_s=10)
        with pytest.raises(EngineStartupError, match="not all ones the head waits for"):
            link.register(Register(3, 0, 1, "node-b", 1), timeout_s=10)
    finally:
        link.close()


def test_unregistered_rank_times_out_and_silent_head_is_noticed(monkeypatch):
    port = _free_port()
    head = HeadRegistry("127.0.0.1", port, "{}", {1: RankAddresses(1, "a", "b")}, 2,
                        register_timeout_s=0.2)
    try:
        time.sleep(0.3)
        assert "no node registered data-parallel rank 1" in head.rank_gone(1)
    finally:
        head.close()
    monkeypatch.setattr(dp_handshake, "NODE_TIMEOUT_S", 0.3)
    link = NodeLink("127.0.0.1", _free_port())  # nobody listens there
    try:
        with pytest.raises(EngineStartupError, match="no data-parallel head answered"):
            link.register(Register(2, 1, 1, "n", 1), timeout_s=0.3)
        time.sleep(0.4)
        assert "sent nothing" in link.tick([])
    finally:
        link.close()
