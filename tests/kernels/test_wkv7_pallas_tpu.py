"""WKV7 Pallas TPU kernels against the token-by-token reference, in the TPU interpreter on CPU:
outputs, final state and the gradients of r, w_log, k, v, a, b and initial_state (float32, rel err
< 1e-4) on ragged T with 8-token chunks, packed documents (one of one token, one starting at a chunk
boundary), T = 1, two head dims, fast and slow decays together; bfloat16 inputs; lowering to Mosaic TPU
with the default blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.wkv7.pallas_tpu import BlockSizes, wkv7_pallas_tpu
from kernels.wkv7.reference import wkv7_recurrent
from tests.kernels.test_wkv7 import make_inputs
from tests.util import assert_close, unchecked

NAMES = ("r", "w_log", "k", "v", "a", "b", "initial_state")
BS = BlockSizes(block_t=8)


def _packed(T):
    """Row 0: documents start at t = 5, 6 (a one-token document) and 16 (a chunk boundary); row 1 at 11."""
    rows = [np.repeat([4, 5, 6, 7], [5, 1, 10, T - 16]), np.repeat([2, 3], [11, T - 11])]
    return jnp.asarray(np.stack(rows), jnp.int32)


def _outputs_and_grads(x, seg, pallas):
    """(o, S_T) and the gradients of a random projection of both w.r.t. every input, under one jit."""
    rng = np.random.default_rng(7)
    wo = jnp.asarray(rng.standard_normal(x["v"].shape), jnp.float32)
    ws = jnp.asarray(rng.standard_normal(x["initial_state"].shape), jnp.float32)

    def loss(x):
        if pallas:
            o, s = wkv7_pallas_tpu(**x, segment_ids=seg, block_sizes=BS, interpret=True)
        else:
            o, s = wkv7_recurrent(**x, segment_ids=seg)
        return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)
    return jax.jit(jax.grad(loss, has_aux=True))(x)


@pytest.mark.parametrize("B,T,H,K,V,packed,decay_scale", [
    (2, 21, 1, 16, 8, True, 2.5),  # 3 chunks, ragged tail; log w from ~-1e-4 to ~-e^5 (e^{-G} would overflow)
    (1, 1, 2, 8, 16, False, 0.0),  # one token, two heads; the model's decay range
])
def test_matches_reference(B, T, H, K, V, packed, decay_scale):
    x = make_inputs(0, B, T, H, K, V, decay_scale)
    seg = _packed(T) if packed else None
    g_ref, (o_ref, s_ref) = _outputs_and_grads(x, seg, pallas=False)
    g, (o, s) = _outputs_and_grads(x, seg, pallas=True)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert_close(o, o_ref, 1e-4, "o")
    assert_close(s, s_ref, 1e-4, "final state")
    for name in NAMES:
        assert_close(g[name], g_ref[name], 1e-4, f"d/d{name}")


def test_bfloat16_inputs():
    x = make_inputs(3, 2, 21, 1, 16, 16, 1.0)
    seg = _packed(21)
    xb = {n: a.astype(jnp.bfloat16) if n != "initial_state" else a for n, a in x.items()}
    o, s = jax.jit(lambda x: wkv7_pallas_tpu(**x, segment_ids=seg, block_sizes=BlockSizes(16),
                                                       interpret=True))(xb)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    up = {n: a.astype(jnp.float32) for n, a in xb.items()}
    o_ref, s_ref = jax.jit(lambda x: wkv7_recurrent(**x, segment_ids=seg))(up)
    assert_close(o.astype(jnp.float32), o_ref, 2e-2, "bf16 o")
    assert_close(s, s_ref, 2e-2, "bf16 final state")


@pytest.mark.parametrize("D", [64, 128])
def test_lowers_to_mosaic_tpu(D):
    """Forward and gradient lower for TPU with the default blocks at a realistic shape, bfloat16."""
    B, T, H = 1, 256, 2
    tok = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    s0 = jax.ShapeDtypeStruct((B, H, D, D), jnp.float32)
    f = lambda r, w, k, v, a, b, seg, s0: wkv7_pallas_tpu(r, w, k, v, a, b, segment_ids=seg, initial_state=s0,
                                                         interpret=False)

    def loss(*args):
        o, s = f(*args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
    args = (tok,) * 6 + (seg, s0)
    fwd = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert fwd.count("tpu_custom_call") == 1
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5, 7))).trace(*args).lower(lowering_platforms=("tpu",))
    assert grad.as_text().count("tpu_custom_call") == 3  # forward, per-chunk states, backward


def test_errors():
    with pytest.raises(ValueError, match="block_t"):
        BlockSizes(block_t=12)
    x = make_inputs(0, 1, 4, 1, 8, 8)
    with pytest.raises(ValueError, match="wkv7_pallas_tpu"), unchecked():  # the kernel's own check
        wkv7_pallas_tpu(**{**x, "a": x["a"][..., :4]})
