"""Lightning attention: what is specific to it (the protocol runs in test_conformance.py): the layer against
MiniMax-01's block-wise algorithm written here in numpy from its description (intra-block quadratic with the
decay matrix, inter-block through the state, as transformers' MiniMaxLightningAttention), the decay schedule
by depth, and constructor errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.lightning import LightningAttention
from tests.util import assert_close


def minimax_blocks(x, w_qkv, w_gate, w_out, norm_w, slope, H, Dh, block=5, eps=1e-6):
    """x (T, D) one sequence; the block-wise form, float64."""
    silu = lambda a: a / (1 + np.exp(-a))
    T = x.shape[0]
    qkv = silu(x @ w_qkv).reshape(T, H, 3, Dh)
    q, k, v = (qkv[:, :, i].transpose(1, 0, 2) for i in range(3))  # (H, T, Dh)
    s = slope[:, None, None]
    kv, out = np.zeros((H, Dh, Dh)), []
    for start in range(0, T, block):
        qb, kb, vb = q[:, start:start + block], k[:, start:start + block], v[:, start:start + block]
        n = qb.shape[1]
        i = np.arange(1, n + 1)
        diag = np.where(i[:, None] >= i[None, :], np.exp(-s * (i[:, None] - i[None, :])), 0.0)  # (H, n, n)
        intra = ((qb @ kb.transpose(0, 2, 1)) * diag) @ vb
        inter = (qb * np.exp(-s * i[:, None])) @ kv
        out.append(intra + inter)
        kv = kv * np.exp(-s * n) + (kb * np.exp(-s * (n - i[:, None]))).transpose(0, 2, 1) @ vb
    o = np.concatenate(out, axis=1).transpose(1, 0, 2).reshape(T, H * Dh)
    o = o / np.sqrt(np.mean(o ** 2, -1, keepdims=True) + eps) * norm_w
    return (o / (1 + np.exp(-(x @ w_gate)))) @ w_out


@pytest.mark.parametrize("layer_id", [0, 2])
def test_layer_matches_minimax_block_algorithm(layer_id):  # layer 2 of 3: the last, which barely decays
    H, Dh, D, T = 2, 8, 12, 13
    m = LightningAttention(D, num_heads=H, head_dim=Dh, layer_id=layer_id, num_layers=3, rngs=nnx.Rngs(0))
    m.norm.weight[...] = np.random.default_rng(1).uniform(0.5, 1.5, H * Dh).astype(np.float32)
    x = np.random.default_rng(0).standard_normal((2, T, D)).astype(np.float32)
    want = np.stack([minimax_blocks(xb.astype(np.float64), *(np.asarray(p[...], np.float64) for p in (
        m.qkv_proj.kernel, m.gate_proj.kernel, m.o_proj.kernel, m.norm.weight)), m.slope, H, Dh) for xb in x])
    assert_close(nnx.jit(lambda m, x: m(x))(m, jnp.asarray(x)), want, what="lightning against the block-wise form")
    assert_close(m.slope[0], 2 ** (-8 / H) * (1 - layer_id / (2 + 1e-5) + 1e-5), what="the first head's slope")


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_heads=3 does not divide d_model=16"):
        LightningAttention(16, num_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer_id=2"):
        LightningAttention(16, layer_id=2, num_layers=2, rngs=nnx.Rngs(0))
