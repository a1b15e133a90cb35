"""The CPU ops agree with transformers' own reference functions (the models' future check).

Batched transformers calls ([batch, seq, ...], equal lengths) are compared with the same
requests packed varlen here, each continuing from a state where transformers allows one.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import ssm

pytest.importorskip("transformers")

TOL = {"rtol": 2e-4, "atol": 2e-4}


def _packed(batch: int, seq: int):
    qsl = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    idx = torch.arange(batch, dtype=torch.int32).flip(0)  # slots in another order
    return qsl, idx


def test_conv1d_matches_transformers():
    from transformers.models.mamba.modeling_mamba import causal_conv1d_update

    torch.manual_seed(0)
    batch, seq, dim, width = 2, 9, 6, 4
    x = torch.randn(batch, dim, seq)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    state = torch.randn(batch, dim, width - 1)
    qsl, idx = _packed(batch, seq)
    pool = torch.empty_like(state)
    pool[idx.long()] = state
    want_state = state.clone()
    want = causal_conv1d_update(x, want_state, weight, bias, activation="silu")
    got = ssm.causal_conv1d_prefill(
        x.transpose(1, 2).reshape(-1, dim), weight, pool, qsl, idx,
        torch.ones(batch, dtype=torch.bool), bias=bias, activation="silu",
    )
    torch.testing.assert_close(got.view(batch, seq, dim).transpose(1, 2), want, **TOL)
    torch.testing.assert_close(pool[idx.long()], want_state, **TOL)


def test_mamba2_matches_transformers():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    torch.manual_seed(1)
    batch, seq, H, G, P, N = 2, 21, 4, 2, 8, 16
    x, dt = torch.randn(batch, seq, H, P), torch.randn(batch, seq, H) - 1
    A, D, dt_bias = -torch.rand(H) - 0.5, torch.randn(H), torch.randn(H) * 0.2
    B, C = torch.randn(batch, seq, G, N), torch.randn(batch, seq, G, N)
    init = torch.randn(batch, H, P, N)
    want, want_state = mamba2_chunk_scan(
        x, dt, A, B, C, chunk_size=8, D=D, dt_bias=dt_bias, initial_states=init,
        dt_softplus=True, dt_limit=(0.0, 4.0), return_final_states=True,
    )
    qsl, idx = _packed(batch, seq)
    pool = torch.empty_like(init)
    pool[idx.long()] = init
    got = ssm.mamba2_ssd_prefill(
        x.reshape(-1, H, P), dt.reshape(-1, H), A, B.reshape(-1, G, N), C.reshape(-1, G, N),
        pool, qsl, idx, torch.ones(batch, dtype=torch.bool), D=D, dt_bias=dt_bias,
        dt_limit=(0.0, 4.0), chunk_size=16,
    )
    torch.testing.assert_close(got.view(batch, seq, H, P), want, **TOL)
    torch.testing.assert_close(pool[idx.long()], want_state, **TOL)


def test_mamba1_matches_transformers():
    from transformers.models.mamba.modeling_mamba import (
        mamba_selective_scan,
        mamba_selective_state_update,
    )

    torch.manual_seed(2)
    batch, seq, dim, N = 2, 13, 8, 16
    x, dt, z = torch.randn(batch, dim, seq), torch.randn(batch, dim, seq) - 1, torch.randn(
        batch, dim, seq
    )
    A, D, dt_bias = -torch.rand(dim, N) - 0.5, torch.randn(dim), torch.randn(dim) * 0.2
    B, C = torch.randn(batch, N, seq), torch.randn(batch, N, seq)
    want, want_state = mamba_selective_scan(
        x, dt, A, B, C, D, z=z, delta_bias=dt_bias, delta_softplus=True, return_last_state=True
    )
    qsl, idx = _packed(batch, seq)
    pool = torch.randn(batch, dim, N)

    def tok(t):  # [batch, c, seq] -> [batch * seq, c]
        return t.transpose(1, 2).reshape(batch * seq, -1)

    got = ssm.selective_scan_prefill(
        tok(x), tok(dt), A, tok(B), tok(C), pool, qsl, idx,
        torch.zeros(batch, dtype=torch.bool), D=D, z=tok(z), dt_bias=dt_bias,
    )
    torch.testing.assert_close(got.view(batch, seq, dim).transpose(1, 2), want, **TOL)
    torch.testing.assert_close(pool[idx.long()], want_state, **TOL)
    # one decode step from there
    x1, dt1, z1 = torch.randn(batch, dim), torch.randn(batch, dim), torch.randn(batch, dim)
    B1, C1 = torch.randn(batch, N), torch.randn(batch, N)
    want_state = want_state.clone()
    want1 = mamba_selective_state_update(
        want_state, x1, dt1, A, B1, C1, D, dt_bias=dt_bias, dt_softplus=True, z=z1
    )
    got1 = ssm.selective_scan_decode(x1, dt1, A, B1, C1, pool, idx, D=D, z=z1, dt_bias=dt_bias)
    torch.testing.assert_close(got1, want1, **TOL)
    torch.testing.assert_close(pool[idx.long()], want_state, **TOL)


def test_gated_delta_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    torch.manual_seed(3)
    batch, seq, Hk, Hv, K, V = 2, 70, 2, 4, 16, 8
    q, k = torch.randn(batch, seq, Hk, K), torch.randn(batch, seq, Hk, K)
    v = torch.randn(batch, seq, Hv, V)
    g = -torch.nn.functional.softplus(torch.randn(batch, seq, Hv)) * 0.3
    beta = torch.rand(batch, seq, Hv)
    init = torch.randn(batch, Hv, K, V) * 0.5
    want, want_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=64, initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    qsl, idx = _packed(batch, seq)
    pool = torch.empty_like(init)
    pool[idx.long()] = init

    def tok(t):
        return t.reshape(batch * seq, *t.shape[2:])

    got = ssm.gated_delta_prefill(
        tok(q), tok(k), tok(v), tok(g), tok(beta), pool, qsl, idx,
        torch.ones(batch, dtype=torch.bool), use_qk_l2norm=True,
    )
    torch.testing.assert_close(got.view(batch, seq, Hv, V), want, **TOL)
    torch.testing.assert_close(pool[idx.long()], want_state, **TOL)
    step = [t[:, :1] for t in (q, k, v, g, beta)]
    want1, want_state = torch_recurrent_gated_delta_rule(
        *step, initial_state=want_state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    got1 = ssm.gated_delta_decode(*[t[:, 0] for t in step], pool, idx, use_qk_l2norm=True)
    torch.testing.assert_close(got1, want1[:, 0], **TOL)
    torch.testing.assert_close(pool[idx.long()], want_state, **TOL)
