"""The Platform contract (``engine.core.interfaces.platform``).

Clauses: ``[platform.probe]`` probe() never raises and answers a ProbeResult;
``[platform.device]``; ``[platform.dtypes]`` supported_dtypes / check_dtype;
``[platform.memory]``; ``[platform.kv_cache_bytes]``; ``[platform.seed]``
seed_everything / make_generator make device randomness reproducible.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.config import CacheConfig
from engine.core.interfaces import ProbeResult


@pytest.mark.conformance("platform.probe")
def test_probe_never_raises(engine_platform):
    """[platform.probe] probe() is a cheap classmethod that returns a ProbeResult."""
    try:
        result = type(engine_platform).probe()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"[platform.probe] probe() raised {type(exc).__name__}: {exc}")
    assert isinstance(result, ProbeResult), f"[platform.probe] probe() returned {result!r}"
    assert result.available, f"[platform.probe] resolved platform probes unavailable: {result}"
    assert isinstance(result.reason, str), "[platform.probe] ProbeResult.reason must be a str"


@pytest.mark.conformance("platform.device")
def test_device(engine_platform):
    """[platform.device] device() is a torch.device of the platform's device_type that
    tensors can be created on."""
    device = engine_platform.device()
    assert isinstance(device, torch.device), f"[platform.device] device() returned {device!r}"
    assert device.type == engine_platform.device_type, (
        f"[platform.device] device() is {device}, device_type is {engine_platform.device_type}")
    x = torch.ones(3, device=device) * 2
    engine_platform.synchronize()
    assert x.sum().item() == 6.0, "[platform.device] arithmetic on device() is wrong"


@pytest.mark.conformance("platform.dtypes")
def test_dtypes(engine_platform):
    """[platform.dtypes] supported_dtypes() is non-empty; check_dtype answers None for
    each of them and a reason (str) for one it does not list."""
    dtypes = engine_platform.supported_dtypes()
    assert dtypes, "[platform.dtypes] supported_dtypes() is empty"
    for dtype in dtypes:
        assert isinstance(dtype, torch.dtype), f"[platform.dtypes] {dtype!r} is not a dtype"
        assert engine_platform.check_dtype(dtype) is None, (
            f"[platform.dtypes] check_dtype({dtype}) refuses a supported dtype: "
            f"{engine_platform.check_dtype(dtype)}")
    unsupported = next(d for d in (torch.int8, torch.complex64, torch.uint8) if d not in dtypes)
    why = engine_platform.check_dtype(unsupported)
    assert isinstance(why, str) and why, (
        f"[platform.dtypes] check_dtype({unsupported}) must give a reason, got {why!r}")


@pytest.mark.conformance("platform.memory")
def test_memory_queries(engine_platform):
    """[platform.memory] total/available memory are positive ints, available <= total."""
    total = engine_platform.total_memory_bytes()
    free = engine_platform.available_memory_bytes()
    for what, value in (("total_memory_bytes", total), ("available_memory_bytes", free)):
        assert isinstance(value, int) and value > 0, f"[platform.memory] {what}() = {value!r}"
    assert free <= total, f"[platform.memory] available {free} > total {total}"


@pytest.mark.conformance("platform.kv_cache_bytes")
def test_kv_cache_bytes(engine_platform):
    """[platform.kv_cache_bytes] a small cache config gives a positive int of bytes."""
    config = CacheConfig(block_size=16, cpu_kvcache_space_gib=0.0625,
                         gpu_memory_utilization=0.5)
    value = engine_platform.kv_cache_bytes(config, 1 << 20)
    assert isinstance(value, int) and value > 0, f"[platform.kv_cache_bytes] got {value!r}"


@pytest.mark.conformance("platform.seed")
def test_seed_everything_and_generators(engine_platform):
    """[platform.seed] seed_everything(s) makes torch.randn on the device reproducible;
    make_generator(s) gives generators that draw the same numbers for the same seed."""
    device = engine_platform.device()
    draws = []
    for _ in range(2):
        engine_platform.seed_everything(1234)
        draws.append(torch.randn(16, device=device).cpu())
    assert torch.equal(draws[0], draws[1]), "[platform.seed] seed_everything is not reproducible"
    gens = [engine_platform.make_generator(7) for _ in range(2)]
    assert all(isinstance(g, torch.Generator) for g in gens), "[platform.seed] not a Generator"
    a, b = (torch.randn(16, device=device, generator=g).cpu() for g in gens)
    assert torch.equal(a, b), "[platform.seed] make_generator(seed) is not deterministic"
    c = torch.randn(16, device=device, generator=engine_platform.make_generator(8)).cpu()
    assert not torch.equal(a, c), "[platform.seed] different seeds drew the same numbers"
