"""A stand-in RL trainer for weight-update tests: rank 0 of a weight sync group that
broadcasts a checkpoint's tensors (run in its own process)."""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_tensors(model_dir: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a model directory's safetensors files, HF names, file order."""
    from safetensors.torch import load_file

    tensors: list[tuple[str, torch.Tensor]] = []
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors += list(load_file(str(file)).items())
    return tensors


def specs(model_dir: str | Path) -> tuple[list[str], list[str], list[list[int]]]:
    """``names, dtypes, shapes`` of ``update_weights_from_distributed`` for a directory."""
    tensors = checkpoint_tensors(model_dir)
    return ([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors])


def broadcast_checkpoint(port: int, world_size: int, model_dir: str, rounds: int = 1,
                         packed: bool = False) -> None:
    """Join as rank 0 on 127.0.0.1:``port``, then broadcast the directory's tensors
    ``rounds`` times (``packed``: in byte buckets)."""
    from engine.distributed.weight_sync import broadcast_named_tensors, create_weight_sync_group

    group = create_weight_sync_group("127.0.0.1", port, 0, world_size, timeout_s=120)
    tensors = checkpoint_tensors(model_dir)
    for _ in range(rounds):
        broadcast_named_tensors(group, tensors, packed=packed)
