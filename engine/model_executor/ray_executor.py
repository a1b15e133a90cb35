"""``--distributed-executor-backend ray``: one Ray actor per rank, anywhere in a cluster.

The engine joins the cluster named by ``RAY_ADDRESS`` (or the one ``ray start --head``
left on this machine; with none, Ray starts a local one), reserves a placement group of
one bundle per rank (one device each: ``GPU`` on GPU platforms, one ``CPU`` otherwise),
and starts a :class:`RankActor` in each bundle. Rank 0's actor reports its node's address
and a free port there: torch.distributed meets at that address. The actors then run the
same worker loop as local processes, connecting back to this executor's TCP sockets at
the address Ray reports for this node; ranks on one node get consecutive local ranks.

An actor that dies is seen through its loop's object ref (ready, with an error);
shutdown kills every actor and removes the placement group.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from engine.model_executor.worker_group import WorkerGroupExecutor

logger = logging.getLogger(__name__)

RAY_NOT_INSTALLED = ("the ray executor needs Ray: pip install 'ray[default]' (and a cluster: "
                     "`ray start --head` here, `ray start --address=HEAD:6379` on the others)")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ValueError(f"{RAY_NOT_INSTALLED} ({exc})") from None
    return ray


def connect_ray() -> Any:
    """Join the cluster at RAY_ADDRESS, else a local one ``ray start`` left, else a new
    local instance (the driver's own)."""
    ray = _import_ray()
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address or "auto", ignore_reinit_error=True,
                 log_to_driver=True, logging_level=logging.WARNING)
    except ConnectionError:
        if address:
            raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address!r}") from None
        logger.info("no running Ray cluster found: starting a local Ray instance")
        ray.init(ignore_reinit_error=True, logging_level=logging.WARNING)
    return ray


class _RankActorImpl:
    """The body of a rank's actor (wrapped by ``ray.remote`` when Ray is imported)."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from engine.model_executor.multiproc_executor import free_port

        return free_port("0.0.0.0")

    def run(self, spec_json: bytes) -> bool:
        import logging as _logging
        import sys

        from engine.model_executor import worker_proc

        _logging.basicConfig(
            level=os.environ.get("ENGINE_LOG_LEVEL", "INFO").upper(),
            format=f"(RayWorker pid={os.getpid()}) %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        return worker_proc.run_worker(worker_proc.spec_decoder.decode(spec_json))


class RayExecutor(WorkerGroupExecutor):
    backend_name = "ray"

    def __init__(self, config, platform) -> None:
        self._ray = connect_ray()
        host = self._ray.util.get_node_ip_address()
        super().__init__(config, platform, host)

    def _launch(self) -> None:
        import msgspec
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        device_key = getattr(self.platform, "ray_device_key", None)
        bundle = {device_key: 1} if device_key else {"CPU": 1}
        pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        actors: list[Any] = []
        self._actors, self._loops, self._pg = actors, [], pg

        def stop(graceful: bool) -> None:
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as exc:  # noqa: BLE001 - already gone
                    logger.debug("ray.kill: %s", exc)
            try:
                remove_placement_group(pg)
            except Exception as exc:  # noqa: BLE001
                logger.debug("remove_placement_group: %s", exc)

        self._on_release(stop)
        try:
            ray.get(pg.ready(), timeout=self.load_timeout_s)
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError (ray's own class)
            raise ValueError(
                f"the Ray cluster cannot place {self.world_size} ranks of {bundle} "
                f"(available: {ray.available_resources()}): {exc}") from None
        actor_cls = ray.remote(_RankActorImpl)
        options: dict[str, Any] = {"num_cpus": 0 if device_key else 1}
        if device_key == "GPU":
            options["num_gpus"] = 1
        elif device_key:
            options["resources"] = {device_key: 1}
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank)
            actors.append(actor_cls.options(scheduling_strategy=strategy, **options).remote())
        ips = ray.get([a.node_ip.remote() for a in actors])
        init_method = f"tcp://{ips[0]}:{ray.get(actors[0].free_port.remote())}"
        local_ranks, per_node = [], {}
        for ip in ips:
            local_ranks.append(per_node.get(ip, 0))
            per_node[ip] = per_node.get(ip, 0) + 1
        for rank, actor in enumerate(actors):
            spec = self.worker_spec(rank, init_method, local_rank=local_ranks[rank],
                                    local_world_size=per_node[ips[rank]], parent_pid=None)
            self._loops.append(actor.run.remote(msgspec.json.encode(spec)))
        logger.info("ray: %d ranks on nodes %s, rendezvous %s", self.world_size,
                    sorted(per_node), init_method)

    def _ended_ranks(self) -> list[tuple[int, str, bool]]:
        ray = self._ray
        done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        ended = []
        for ref in done:
            rank = self._loops.index(ref)
            try:
                ok = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - RayActorError and friends
                first = str(exc).splitlines()[0] if str(exc) else ""
                ended.append((rank, f"(Ray actor) died: {type(exc).__name__}: {first}", True))
                continue
            ended.append((rank, "(Ray actor) left its loop", not ok))
        return ended
