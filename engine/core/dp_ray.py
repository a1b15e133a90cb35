"""``--data-parallel-backend ray``: Ray places one launcher per data-parallel rank.

The head joins the cluster (``RAY_ADDRESS``, or the one ``ray start`` left here; as the
TP/PP Ray executor does), reserves a placement group with one bundle per rank (the rank's
devices: ``GPU`` x its TP x PP workers on GPU platforms, else ``CPU`` x workers), and
starts a :class:`_NodeActorImpl` in each bundle. The actor runs the same node launcher as
``--headless`` (``python -m engine.core.dp_headless``, one rank, the actor as its parent):
it registers with the head's registry and its core connects back over tcp. So liveness is
the registry's (launcher heartbeats and exit reports); killing an actor stops its launcher
and so its core. ``stop`` kills every actor and removes the placement group.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.core.config import EngineConfig

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 10.0  # a launcher's SIGTERM -> its core's 5 s grace, then SIGKILL


def ray_node_address() -> str:
    """This node's address in the Ray cluster (joining the cluster first)."""
    from engine.model_executor.ray_executor import connect_ray

    return connect_ray().util.get_node_ip_address()


class _NodeActorImpl:
    """Body of a rank's actor (wrapped by ``ray.remote`` when Ray is imported)."""

    def __init__(self) -> None:
        self.proc: Any = None

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self, address: str, rpc_port: int, size: int, rank: int) -> int:
        """Start the rank's launcher (it outlives no actor: it checks its parent)."""
        import os
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.core.dp_headless", "--address", address,
             "--rpc-port", str(rpc_port), "--data-parallel-size", str(size),
             "--start-rank", str(rank), "--size-local", "1",
             "--parent-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, env=_launcher_env())
        return self.proc.pid


    def stop(self, timeout_s: float) -> None:
        """Stop the launcher gracefully (it stops its core and removes its run dirs)
        before Ray kills this actor and, with it, the actor's children."""
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _launcher_env() -> dict[str, str]:
    """The actor's environment, importing the same ``engine`` package."""
    import os
    from pathlib import Path

    import engine

    env = dict(os.environ)
    root = str(Path(engine.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def rank_bundle(config: EngineConfig) -> dict[str, float]:
    """One rank's resources: its workers' devices (GPUs), else one CPU per worker."""
    from engine.core.plugins import resolve_platform

    workers = config.parallel.world_size
    key = getattr(resolve_platform(config.device.device), "ray_device_key", None)
    return {key: float(workers)} if key else {"CPU": float(workers)}


class RayRankPlacer:
    """The placement group and one launcher actor per rank."""

    def __init__(self, config: EngineConfig, head: str, rpc_port: int) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from engine.model_executor.ray_executor import connect_ray

        ray = self._ray = connect_ray()
        size = config.parallel.data_parallel_size
        bundle = rank_bundle(config)
        self._actors: list[Any] = []
        self._pg = placement_group([dict(bundle) for _ in range(size)], strategy="SPREAD")
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError (ray's own class)
            self.stop()
            raise ValueError(
                f"the Ray cluster cannot place {size} data-parallel ranks of {bundle} "
                f"(available: {ray.available_resources()}): {exc}") from None
        actor_cls = ray.remote(_NodeActorImpl)
        try:
            for rank in range(size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank)
                options: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": strategy}
                if "GPU" in bundle:  # the core (its workers) sees the bundle's GPUs
                    options["num_gpus"] = bundle["GPU"]
                self._actors.append(actor_cls.options(**options).remote())
            nodes = ray.get([a.node_address.remote() for a in self._actors])
            ray.get([a.start.remote(head, rpc_port, size, rank)
                     for rank, a in enumerate(self._actors)])
        except BaseException:
            self.stop()
            raise
        logger.info("ray: data-parallel ranks on nodes %s, registering at %s:%d", nodes,
                    head, rpc_port)

    def stop(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._actors:
            try:
                self._ray.get([a.stop.remote(SHUTDOWN_GRACE_S) for a in self._actors],
                              timeout=SHUTDOWN_GRACE_S + 5)
            except Exception as exc:  # noqa: BLE001 - a dead actor: killed below anyway
                logger.debug("stopping the rank launchers: %s", exc)
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already gone
                logger.debug("ray.kill: %s", exc)
        self._actors = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # noqa: BLE001
                logger.debug("remove_placement_group: %s", exc)
            self._pg = None
