"""Forward graphs of the CPU plugin (cpu.graphs): capture, arena planning, replay."""

from __future__ import annotations

import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.core.interfaces import GraphCaptureError
from engine.plugins.cpu import native
from engine.plugins.cpu.graphs import ALIGN, CPUGraphCapturer, plan_graph
from engine.plugins.cpu.platform import CPUPlatform


@pytest.fixture
def capturer(kernels):
    return CPUGraphCapturer(kernels)


def test_the_cpu_platform_offers_a_capturer(engine_kernels):
    assert isinstance(CPUPlatform().forward_graph_capturer(), CPUGraphCapturer)


def _norm_mlp(kernels, x, residual, norm_w, up, down):
    """A decoder-like chain of C kernels: norm(x + residual) -> up -> silu*mul -> down."""
    hidden = kernels.rms_norm(x, norm_w, 1e-5, residual)
    return kernels.gemm(down, kernels.silu_and_mul(kernels.gemm(up, hidden)))


def _mlp_weights(kernels, gen, act, wdt, hidden=64, inter=96):
    up = (torch.randn(2 * inter, hidden, generator=gen) * 0.1).to(wdt)
    down = (torch.randn(hidden, inter, generator=gen) * 0.1).to(wdt)
    norm_w = (torch.rand(hidden, generator=gen) + 0.5).to(act)
    return norm_w, kernels.pack(up, act), kernels.pack(down, act)


@pytest.mark.parametrize(("act", "wdt"), [(torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16),
                                          (torch.float32, torch.float32)])
def test_replays_read_their_inputs_at_replay_time_and_match_eager_calls(kernels, capturer,
                                                                        act, wdt):
    """Every level replays its GEMMs, bf16 weights under float32 activations included."""
    gen = torch.Generator().manual_seed(0)
    norm_w, up, down = _mlp_weights(kernels, gen, act, wdt)
    x, residual = torch.zeros(3, 64, dtype=act), torch.zeros(3, 64, dtype=act)
    graph = capturer.capture(lambda: _norm_mlp(kernels, x, residual, norm_w, up, down))
    for _ in range(3):  # new values in the same buffers, as the runner writes each step
        x.copy_(torch.randn(3, 64, generator=gen))
        residual.copy_(torch.randn(3, 64, generator=gen))
        x_eager, res_eager = x.clone(), residual.clone()
        expected = _norm_mlp(kernels, x_eager, res_eager, norm_w, up, down)
        got = graph.replay()
        assert torch.equal(got, expected)  # the same kernels on the same values: bit-exact
        assert torch.equal(residual, res_eager)  # in-place updates of inputs replay too


def test_capture_records_without_computing(kernels, capturer):
    x = torch.randn(2, 32)
    weight = torch.ones(32)
    residual = torch.zeros(2, 32)
    capturer.capture(lambda: kernels.rms_norm(x, weight, 1e-6, residual))
    assert torch.count_nonzero(residual) == 0  # the residual add did not run


@pytest.mark.parametrize(
    "forward",
    [
        pytest.param(lambda x: x + 1, id="torch arithmetic"),
        pytest.param(lambda x: torch.zeros(3) if float(x.sum()) > 0 else x, id="value read"),
        pytest.param(lambda x: x.clone(), id="copy"),
        # A reshape reaches the dispatch mode as a view op even when it has to copy.
        pytest.param(lambda x: x[:, :4].reshape(-1), id="reshape that copies"),
    ],
)
def test_torch_ops_that_compute_refuse_the_capture(capturer, forward):
    x = torch.ones(4, 8)
    with torch.inference_mode(), pytest.raises(GraphCaptureError, match="torch op"):
        capturer.capture(lambda: forward(x))


def test_an_output_no_kernel_wrote_refuses_the_capture(kernels, capturer):
    x = torch.ones(2, 16)
    with pytest.raises(GraphCaptureError, match="output"):
        capturer.capture(lambda: x[:1])  # a view of an input: nothing to replay


def test_kernels_outside_the_replay_table_refuse_the_capture(kernels, capturer):
    logits = torch.randn(2, 10)
    with pytest.raises(GraphCaptureError, match="argmax_rows"):
        capturer.capture(lambda: kernels.argmax(logits))


def test_captures_do_not_nest(kernels, capturer):
    x, w = torch.ones(1, 16), torch.ones(16)

    def nested():
        capturer.capture(lambda: kernels.rms_norm(x, w, 1e-6))
        return kernels.rms_norm(x, w, 1e-6)

    with pytest.raises(GraphCaptureError, match="already"):
        capturer.capture(nested)
    kernels.rms_norm(x, w, 1e-6)  # recording ended with the failed capture


def test_earlier_graphs_survive_the_arena_growing(kernels, capturer):
    """A bigger graph moves the shared arena; older graphs rebind on their next replay."""
    weight = torch.ones(256)
    small_x, big_x = torch.randn(1, 256), torch.randn(64, 256)

    def norm_twice(x):
        return kernels.rms_norm(kernels.rms_norm(x, weight, 1e-6), weight, 1e-6)

    small = capturer.capture(lambda: norm_twice(small_x))
    first = small.replay().clone()
    big = capturer.capture(lambda: norm_twice(big_x))
    assert torch.equal(big.replay(), norm_twice(big_x))
    assert torch.equal(small.replay(), first)
    assert torch.equal(first, norm_twice(small_x))


def test_value_errors_surface_from_a_replay(kernels, capturer):
    table = torch.randn(10, 16)
    cos_sin = torch.randn(8, 16)
    ids, positions = torch.tensor([1, 2]), torch.tensor([0, 7])

    def forward():
        hidden = kernels.embedding(ids, table)
        kernels.rotary_neox_(hidden, positions, cos_sin, 16)
        return hidden

    graph = capturer.capture(forward)
    graph.replay()
    ids[1] = 10
    with pytest.raises(ValueError, match="embedding_shard_rows: a token id is outside the vocab"):
        graph.replay()
    ids[1], positions[1] = 3, 8
    with pytest.raises(ValueError, match="rotary_neox: a position is beyond the rotary table"):
        graph.replay()


# -- arena planning (no kernels run) ------------------------------------------------------


def _fake_op(pointer_args: tuple[int, ...]) -> SimpleNamespace:
    return SimpleNamespace(name="fake", graph_id=0, pointer_args=pointer_args, float_args=())


def test_buffers_with_overlapping_lives_never_share_bytes():
    """Random chains of calls over random buffers: any two buffers touched by a common
    span of calls get disjoint arena ranges, and addresses keep their offset inside
    their buffer."""
    rng = random.Random(0)
    for _ in range(20):
        buffers = [torch.empty(rng.randrange(1, 5000), dtype=torch.uint8) for _ in range(12)]
        calls = []
        for _ in range(30):
            picks = rng.sample(buffers, 3)
            offsets = [rng.randrange(b.numel()) for b in picks]
            args = tuple(b.data_ptr() + o for b, o in zip(picks, offsets))
            calls.append(native.NativeCall(_fake_op((0, 1, 2)), args))
        output = calls[-1].args[0]
        out_buf = next(b for b in buffers if b.data_ptr() <= output < b.data_ptr() + b.numel())
        plan = plan_graph(calls, buffers, out_buf, words=4)
        # Recover each buffer's arena range and life from the table.
        life, start = {}, {}
        for index, call in enumerate(calls):
            for i, address in enumerate(call.args):
                buf = next(b for b in buffers if b.data_ptr() <= address < b.data_ptr() + b.numel())
                assert plan.relative[index, 1 + i]
                base = int(plan.table[index, 1 + i]) - (address - buf.data_ptr())
                assert base % ALIGN == 0
                assert start.setdefault(id(buf), base) == base  # one place per buffer
                first, _ = life.get(id(buf), (index, index))
                life[id(buf)] = (first, index)
        life[id(out_buf)] = (life[id(out_buf)][0], len(calls))
        sizes = {id(b): b.numel() for b in buffers}
        for a in life:
            for b in life:
                if a < b and not (life[a][1] < life[b][0] or life[b][1] < life[a][0]):
                    assert (start[a] + sizes[a] <= start[b] or start[b] + sizes[b] <= start[a])
        assert plan.arena_bytes <= sum(-(-s // ALIGN) * ALIGN for s in sizes.values())
        assert plan.output_offset == start[id(out_buf)]


def test_a_chain_reuses_the_bytes_of_dead_buffers():
    """a -> b -> c -> d, each buffer read by the next call only: two slots suffice."""
    bufs = [torch.empty(1000, dtype=torch.uint8) for _ in range(4)]
    calls = [
        native.NativeCall(_fake_op((0, 1)), (bufs[i].data_ptr(), bufs[i + 1].data_ptr()))
        for i in range(3)
    ]
    plan = plan_graph(calls, bufs, bufs[3], words=3)
    assert plan.arena_bytes == 2 * 1024
    pointers = {int(plan.table[i, 1 + j]) for i in range(3) for j in range(2)}
    assert pointers == {0, 1024}
    # External addresses (not allocated by the forward) stay absolute.
    external = torch.empty(8, dtype=torch.uint8)
    calls.append(native.NativeCall(_fake_op((0, 1)), (bufs[3].data_ptr(), external.data_ptr())))
    plan = plan_graph(calls, bufs, bufs[3], words=3)
    assert plan.table[3, 2] == external.data_ptr() and not plan.relative[3, 2]


def test_capturing_does_not_import_torch_compile(engine_kernels):
    """torch wraps dispatch modes to keep dynamo out, importing it on first use (~0.5 s,
    on the first decode step); the guard opts out, since nothing compiles in a capture."""
    code = (
        "import sys, torch\n"
        "from engine.plugins.cpu.graphs import CPUGraphCapturer\n"
        "from engine.plugins.cpu.native import load_kernels\n"
        "k = load_kernels()\n"
        "x, w = torch.ones(2, 16), torch.ones(16)\n"
        "CPUGraphCapturer(k).capture(lambda: k.rms_norm(x, w, 1e-6)).replay()\n"
        "assert 'torch._dynamo' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_capture_records_only_its_own_thread(kernels, capturer):
    """Another thread's kernels run (not recorded) while this thread captures."""
    import threading

    x, w = torch.randn(2, 16), torch.ones(16)
    other_result = []

    def forward():
        thread = threading.Thread(target=lambda: other_result.append(kernels.rms_norm(x, w, 1e-6)))
        thread.start()
        thread.join()
        return kernels.rms_norm(x, w, 1e-6)

    graph = capturer.capture(forward)
    assert graph.num_calls == 1
    assert torch.equal(other_result[0], graph.replay())  # the other thread really computed
