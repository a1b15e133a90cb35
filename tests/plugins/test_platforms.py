"""The in-tree Platform classes: probes, memory, KV-cache sizing and components."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from engine.core.config import CPU_KVCACHE_ENV, CacheConfig
from engine.core.interfaces import ProbeResult
from engine.distributed import GlooCommunicator, NcclCommunicator
from engine.plugins.cpu.platform import CPUPlatform
from engine.plugins.cpu.threads import usable_core_count
from engine.plugins.cuda.platform import CUDAPlatform
from engine.plugins.gpu_memory import GIB, activation_margin, gpu_kv_cache_bytes
from engine.plugins.rocm.platform import ROCmPlatform
from engine.plugins.xpu.platform import XPUPlatform

GPU_PLATFORMS = [CUDAPlatform, ROCmPlatform, XPUPlatform]


def _meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


# -- CPU ----------------------------------------------------------------------------------
def test_cpu_identity_and_dtypes(monkeypatch) -> None:
    from engine.plugins.cpu.native import load_kernels
    from engine.plugins.cpu.shm_communicator import ShmCommunicator

    cpu = CPUPlatform()
    assert (cpu.name, cpu.device_type, cpu.priority, cpu.dist_backend) == ("cpu", "cpu", 0, "gloo")
    assert CPUPlatform.probe().available
    assert cpu.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert cpu.check_dtype(torch.float64) is not None
    assert cpu.device() == torch.device("cpu", 0)
    # Same-host groups reduce through shared memory (gloo underneath, and for groups that
    # span hosts); ENGINE_CPU_COMMUNICATOR=gloo forces plain gloo.
    want = ShmCommunicator if load_kernels() is not None else GlooCommunicator
    assert cpu.communicator_cls() is want and issubclass(want, GlooCommunicator)
    monkeypatch.setenv("ENGINE_CPU_COMMUNICATOR", "gloo")
    assert cpu.communicator_cls() is GlooCommunicator
    monkeypatch.setenv("ENGINE_CPU_COMMUNICATOR", "nccl")
    with pytest.raises(ValueError, match="ENGINE_CPU_COMMUNICATOR"):
        cpu.communicator_cls()


def test_cpu_memory_agrees_with_proc_meminfo() -> None:
    cpu = CPUPlatform()
    total, free = cpu.total_memory_bytes(), cpu.available_memory_bytes()
    mem_total = _meminfo_kib("MemTotal") * 1024
    assert 0 < total <= mem_total + (1 << 20)
    assert 0 < free <= total
    if total == mem_total:  # no container limit below physical RAM
        assert abs(free - _meminfo_kib("MemAvailable") * 1024) < 512 * (1 << 20)


def test_cpu_kv_cache_bytes_from_config_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = CPUPlatform()
    monkeypatch.delenv(CPU_KVCACHE_ENV, raising=False)
    assert cpu.kv_cache_bytes(CacheConfig(cpu_kvcache_space_gib=0.5), 0) == GIB // 2
    assert cpu.kv_cache_bytes(CacheConfig(), 0) == 4 * GIB  # the config default
    monkeypatch.setenv(CPU_KVCACHE_ENV, "0.25")
    assert cpu.kv_cache_bytes(CacheConfig(), weights_bytes=123) == GIB // 4
    with pytest.raises(ValueError, match="exceeds this machine's"):
        cpu.kv_cache_bytes(CacheConfig(cpu_kvcache_space_gib=1e6), 0)


def test_cpu_set_num_threads() -> None:
    before = torch.get_num_threads()
    cpu = CPUPlatform()
    try:
        cpu.set_num_threads(1)
        assert torch.get_num_threads() == 1
        cpu.set_num_threads(None)  # default: one thread per CPU the process may use
        assert torch.get_num_threads() == usable_core_count()
        with pytest.raises(ValueError, match="num_threads"):
            cpu.set_num_threads(0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("interpreted", [True, False])
def test_cpu_attention_backends_cpu_first(monkeypatch, interpreted) -> None:
    """The Triton backend is offered on the CPU only when its kernels run interpreted
    (compiled, they need a GPU)."""
    attention = pytest.importorskip("engine.plugins.cpu.attention")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    backends = CPUPlatform().attention_backends()
    assert backends[0] is attention.CPUAttentionBackend
    names = [b.__name__ for b in backends]
    try:
        from engine.kernels.triton_backend import TritonAttentionBackend  # noqa: F401

        triton_ok = importlib.util.find_spec("triton") is not None
    except Exception:  # noqa: BLE001
        triton_ok = False
    assert ("TritonAttentionBackend" in names) == (triton_ok and interpreted)


# -- GPU platforms on a machine without them ----------------------------------------------
def test_gpu_platform_identities() -> None:
    assert (CUDAPlatform.device_type, CUDAPlatform.dist_backend) == ("cuda", "nccl")
    assert (ROCmPlatform.device_type, ROCmPlatform.dist_backend) == ("cuda", "nccl")
    assert XPUPlatform.device_type == "xpu"
    assert all(p.priority > CPUPlatform.priority for p in GPU_PLATFORMS)
    assert CUDAPlatform().communicator_cls() is NcclCommunicator
    assert ROCmPlatform().communicator_cls() is NcclCommunicator
    assert XPUPlatform().communicator_cls().backend in ("xccl", "ccl")


@pytest.mark.parametrize("cls", GPU_PLATFORMS)
def test_gpu_probes_never_raise_without_torch(cls, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # "import torch" now raises ImportError
    result = cls.probe()
    assert isinstance(result, ProbeResult) and not result.available
    assert result.reason.startswith("torch is not importable")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA/ROCm device is present")
def test_cuda_probe_without_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert CUDAPlatform.probe() == ProbeResult.unavailable(
        "no CUDA device visible (CUDA_VISIBLE_DEVICES='')"
    )
    monkeypatch.setattr(torch.version, "hip", "6.3")
    assert "is a ROCm build" in CUDAPlatform.probe().reason
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    assert ROCmPlatform.probe() == ProbeResult.unavailable("no ROCm (HIP) device visible")


def test_xpu_probe_detects_ipex_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "intel_extension_for_pytorch.py").write_text("raise SystemExit('imported!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = XPUPlatform.probe()
    assert "intel_extension_for_pytorch" not in sys.modules
    if not result.available:
        assert "intel-extension-for-pytorch installed" in result.reason


# -- shared GPU KV sizing -----------------------------------------------------------------
def test_gpu_kv_cache_bytes_hand_computed() -> None:
    total = 80 * GIB
    got = gpu_kv_cache_bytes(
        total_bytes=total,
        free_bytes=60 * GIB,
        torch_reserved_bytes=18 * GIB,  # weights (16) + cached blocks (2)
        weights_bytes=16 * GIB,
        utilization=0.9,
        platform="test",
    )
    # 72 GiB budget - 16 weights - 2 outside torch (80 - 60 - 18) - 1 margin (min(1, 4))
    assert got == int(total * 0.9) - 16 * GIB - 2 * GIB - GIB
    assert activation_margin(8 * GIB) == 8 * GIB // 20


def test_gpu_kv_cache_bytes_refuses_when_nothing_is_left() -> None:
    with pytest.raises(ValueError, match="no memory left for the KV cache on test"):
        gpu_kv_cache_bytes(
            total_bytes=8 * GIB,
            free_bytes=1 * GIB,
            torch_reserved_bytes=7 * GIB,
            weights_bytes=7 * GIB,
            utilization=0.9,
            platform="test",
        )
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        gpu_kv_cache_bytes(
            total_bytes=GIB,
            free_bytes=GIB,
            torch_reserved_bytes=0,
            weights_bytes=0,
            utilization=1.5,
            platform="test",
        )
