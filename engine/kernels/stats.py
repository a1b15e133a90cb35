"""Launch counters for the Triton kernels.

End-to-end tests read these to prove the Triton kernels really ran (no silent fallback
to another attention path). Incrementing a Python int per launch costs nothing next to
the launch itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class KernelLaunchStats:
    reshape_and_cache: int = 0
    unified_attention: int = 0  # single-pass launches
    split_kv_attention: int = 0  # split-KV partial launches
    split_kv_reduce: int = 0  # split-KV reduce launches

    def reset(self) -> None:
        for name in asdict(self):
            setattr(self, name, 0)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


launches = KernelLaunchStats()
