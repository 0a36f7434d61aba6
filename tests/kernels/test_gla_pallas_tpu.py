"""GLA Pallas TPU kernels (kernels/gla/pallas_tpu.py) against the token-by-token reference, in the
TPU interpreter on CPU: outputs, final state and gradients w.r.t. q, k, v, g and initial_state for
per-channel and scalar gates, shared q/k heads, ragged T, T = 1, documents and bfloat16; SSD and
WKV6 on the TPU kernel; lowering to Mosaic TPU with the default block sizes.

Small blocks (8- and 16-token chunks, 8-token sub-chunks, 8-column value blocks) make tiny shapes
cross chunks, sub-chunks, value blocks and a ragged tail. The inputs (tests/kernels/
test_gla_pallas.py) give one channel g = -40 per token: e^{-b} overflows inside a chunk.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gla.pallas_tpu import BlockSizes, gla_pallas_tpu
from kernels.segments import document_starts
from kernels.ssd.pallas import ssd_pallas
from kernels.ssd.reference import ssd_recurrent
from kernels.wkv6.pallas import wkv6_pallas
from kernels.wkv6.reference import wkv6_recurrent
from tests.kernels.test_gla_pallas import _inputs, _reference
from tests.kernels.test_wkv6 import make_inputs
from tests.util import assert_close

# Packed rows of 21 tokens: one-token documents (at 5 and 12) and documents that start inside a
# chunk and run on into the next (8- and 16-token chunks), so the carried state must hold only them.
SEG = jnp.array([[0] * 5 + [1] + [2] * 12 + [3] * 3, [0] * 3 + [1] * 9 + [2] + [3] * 8], jnp.int32)


@functools.partial(jax.jit, static_argnames=("pallas", "block_sizes"))
def _outputs_and_grads(q, k, v, g, S0, wo, ws, seg, *, pallas, block_sizes=None):
    """(o, S) and the gradients of sum(o wo) + sum(S ws) w.r.t. q, k, v, g, S0."""
    def loss(q, k, v, g, S0):
        if pallas:
            o, S = gla_pallas_tpu(q, k, v, g, scale=0.5, segment_ids=seg, initial_state=S0,
                                  block_sizes=block_sizes, interpret=True)
        else:
            o, S = _reference(q, k, v, g, S0, seg, 0.5)
        return jnp.sum(o * wo) + jnp.sum(S * ws), (o, S)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, S0)


# (B, T, G, H, K, V, scalar gate, packed, blocks). Per channel: T = 21 in 16-token chunks (a ragged
# second), two 8-token sub-chunks per chunk, two value blocks, one q/k head for two value heads.
# Scalar: three 8-token chunks, B = 1, K = 8. T = 1: one padded chunk.
CASES = {
    "channel-ragged-packed-G1": (2, 21, 1, 2, 16, 16, False, True, BlockSizes(16, 8, 8)),
    "scalar-ragged-packed-K8": (1, 21, 2, 2, 8, 16, True, True, BlockSizes(8, 8, 8)),
    "channel-T1": (1, 1, 1, 1, 8, 8, False, False, BlockSizes(8, 8, 8)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    B, T, G, H, K, V, scalar, packed, bs = CASES[case]
    q, k, v, g, S0, wo, ws = _inputs(B, T, G, H, K, V, scalar, seed=T)
    seg = SEG[:B] if packed else None
    grads, (o, S) = _outputs_and_grads(q, k, v, g, S0, wo, ws, seg, pallas=True, block_sizes=bs)
    want_grads, (want_o, want_S) = _outputs_and_grads(q, k, v, g, S0, wo, ws, seg, pallas=False)
    assert S.dtype == jnp.float32
    assert_close(o, want_o, 1e-4, "o")
    assert_close(S, want_S, 1e-4, "final state")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dS0"), grads, want_grads):
        assert a.shape == b.shape, name
        assert np.isfinite(np.asarray(a)).all(), f"{name} not finite"
        assert_close(a, b, 1e-4, name)


def test_bfloat16_within_bf16_tolerance():
    B, T, G, H, K, V, scalar, _, bs = CASES["channel-ragged-packed-G1"]
    q, k, v, g, S0, _, _ = _inputs(B, T, G, H, K, V, scalar, seed=3)
    seg = SEG
    lo = [x.astype(jnp.bfloat16) for x in (q, k, v, g)]
    o, S = jax.jit(functools.partial(gla_pallas_tpu, scale=0.5, segment_ids=seg, initial_state=S0,
                                     block_sizes=bs, interpret=True))(*lo)
    want_o, want_S = _reference(*(x.astype(jnp.float32) for x in lo), S0, seg, 0.5)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert_close(o, want_o, 2e-2, "o")
    assert_close(S, want_S, 2e-2, "final state")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU always runs the GPU kernels")
def test_ssd_and_wkv6_run_the_tpu_kernel(monkeypatch):
    """With ZOO_PALLAS_PLATFORM=tpu, ssd_pallas and wkv6_pallas call gla_pallas_tpu (its forward
    kernel is in the jaxpr) and equal their token-by-token references."""
    monkeypatch.setenv("ZOO_PALLAS_PLATFORM", "tpu")
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    Bsz, T, H, P, G, N = 1, 21, 2, 8, 1, 8
    dt = jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, H)))), jnp.float32)
    args = (f(Bsz, T, H, P), dt, jnp.array([-0.5, -8.0]), f(Bsz, T, G, N), f(Bsz, T, G, N), f(H))
    seg, h0 = SEG[:1], f(Bsz, H, P, N)
    run = functools.partial(ssd_pallas, segment_ids=seg, initial_state=h0, block_sizes=BlockSizes(8, 8, 8),
                            interpret=True)
    assert "gla_tpu_fwd" in str(jax.make_jaxpr(run)(*args))
    y, h = jax.jit(run)(*args)
    want_y, want_h = ssd_recurrent(*args, document_starts(seg), h0)
    assert_close(y, want_y, 1e-4, "ssd y")
    assert_close(h, want_h, 1e-4, "ssd state")

    x = make_inputs(3, 2, T, 2, 8, 8)
    seg = SEG
    run = functools.partial(wkv6_pallas, segment_ids=seg)
    assert "gla_tpu_fwd" in str(jax.make_jaxpr(run)(**x))
    o, S = jax.jit(run)(**x)
    want_o, want_S = wkv6_recurrent(**x, segment_ids=seg)
    assert_close(o, want_o, 1e-4, "wkv6 o")
    assert_close(S, want_S, 1e-4, "wkv6 state")


def test_validation():
    with pytest.raises(ValueError, match="block_t"):
        BlockSizes(block_t=12)
    with pytest.raises(ValueError, match="block_sub"):
        BlockSizes(block_t=48, block_sub=24)
    q = jnp.zeros((1, 4, 3, 8))
    with pytest.raises(ValueError, match="G dividing H"):
        gla_pallas_tpu(q, q, jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 4, 4)))


def test_lowers_for_tpu_through_mosaic():
    """Without a TPU: the forward, dQ and dK/dV kernels lower to Mosaic TPU with the default block
    sizes, bf16, both gate kinds, documents, an initial state and shared q/k heads."""
    B, T, H, K = 1, 256, 2, 128
    seg = jnp.zeros((B, T), jnp.int32)
    for g_shape, G in (((B, T, H, K), H), ((B, T, H), 1)):
        def fwd(q, k, v, g, s0):
            o, S = gla_pallas_tpu(q, k, v, g, segment_ids=seg, initial_state=s0, interpret=False)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
        q, v = jnp.zeros((B, T, G, K), jnp.bfloat16), jnp.zeros((B, T, H, K), jnp.bfloat16)
        args = (q, q, v, jnp.zeros(g_shape, jnp.bfloat16), jnp.zeros((B, H, K, K)))
        lower = lambda f, args=args: jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert lower(fwd).count("tpu_custom_call") == 1
        assert lower(jax.grad(fwd, argnums=(0, 1, 2, 3, 4))).count("tpu_custom_call") == 3
