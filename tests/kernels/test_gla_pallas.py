"""GLA Pallas kernels against the token-by-token reference: outputs, final state and gradients
w.r.t. q, k, v, g and initial_state, for per-channel and scalar (per-head) gates, q/k heads shared
by several value heads, ragged T, document resets and bfloat16; the retention and linear-attention
routes; dispatch; lowering to Triton.

On CPU the kernels run in interpret mode with 16-token chunks and 16-column value blocks, so tiny
shapes cross chunks, ragged tails and value blocks. Tests marked `gpu` run the compiled kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gla import gla
from kernels.gla.pallas import BlockSizes, default_block_sizes, gla_pallas
from kernels.gla.reference import gla_reference
from kernels.linear_attention import linear_attention
from kernels.retention import retention
from tests.util import assert_close

BS = BlockSizes(block_t=16, block_v=16)
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels)")


def _inputs(B, T, G, H, K, V, scalar, seed=0):
    """q, k (B, T, G, K), v, g, S0 and the weights of a random projection of (o, S); numpy draws.
    One channel forgets at once (g = -40): e^{-b} would overflow inside a chunk."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    g = -np.logaddexp(0, -(3 * rng.standard_normal((B, T, H) if scalar else (B, T, H, K)) + 3))
    if not scalar:
        g[..., 0] = -40.0
    return (f(B, T, G, K), f(B, T, G, K), f(B, T, H, V), jnp.asarray(g, jnp.float32), f(B, H, K, V),
            f(B, T, H, V), f(B, H, K, V))


def _packed(B, T, seed=0):
    """Segment ids (B, T): a few documents per row, one of them a single token."""
    ids = np.sort(np.random.default_rng(seed).integers(0, 4, (B, T)), axis=1)
    ids[:, T // 2] = 9
    ids[:, T // 2 + 1:] += 10
    return jnp.asarray(ids, jnp.int32)


def _reference(q, k, v, g, S0, seg, scale):
    """The reference with shared q/k heads repeated and a scalar gate broadcast over channels."""
    R = v.shape[2] // q.shape[2]
    q, k = jnp.repeat(q, R, axis=2), jnp.repeat(k, R, axis=2)
    g = jnp.broadcast_to(g[..., None], q.shape) if g.ndim == 3 else g
    return gla_reference(q, k, v, g, scale=scale, segment_ids=seg, initial_state=S0)


@functools.partial(jax.jit, static_argnames=("pallas", "block_sizes"))
def _outputs_and_grads(q, k, v, g, S0, wo, ws, seg, *, pallas, block_sizes=BS):
    """(o, S) and the gradients of sum(o wo) + sum(S ws) w.r.t. q, k, v, g, S0; the reference in
    float32 from the same (possibly rounded) inputs."""
    def loss(q, k, v, g, S0):
        if pallas:
            o, S = gla_pallas(q, k, v, g, scale=0.5, segment_ids=seg, initial_state=S0,
                              block_sizes=block_sizes)
        else:
            o, S = _reference(*(x.astype(jnp.float32) for x in (q, k, v, g)), S0, seg, 0.5)
        return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(S * ws), (o, S)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, S0)


def _compare(inputs, seg, tol, dtype=jnp.float32, block_sizes=BS):
    q, k, v, g, S0, wo, ws = inputs
    lo = [x.astype(dtype) for x in (q, k, v, g)]
    grads, (o, S) = _outputs_and_grads(*lo, S0, wo, ws, seg, pallas=True, block_sizes=block_sizes)
    want_grads, (want_o, want_S) = _outputs_and_grads(*lo, S0, wo, ws, seg, pallas=False)
    assert o.dtype == dtype and S.dtype == jnp.float32
    assert_close(o, want_o, tol, "o")
    assert_close(S, want_S, tol, "final state")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dS0"), grads, want_grads):
        assert a.dtype == (jnp.float32 if name == "dS0" else dtype), name
        assert np.isfinite(np.asarray(a, np.float32)).all(), f"{name} not finite"
        assert_close(a, b, tol, name)


# (B, T, G, H, K, V, scalar gate, packed): T = 37 leaves a ragged last chunk; V = 32 runs two value
# blocks (dq, dk summed over them); K = 8 is padded to 16; G < H shares q/k heads.
CASES = {
    "channel-ragged-packed-2vblocks": (2, 37, 2, 2, 16, 32, False, True),
    "channel-T1-K8": (1, 1, 1, 1, 8, 16, False, False),
    "scalar-shared-qk-packed": (2, 37, 1, 2, 16, 16, True, True),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    B, T, G, H, K, V, scalar, packed = CASES[case]
    _compare(_inputs(B, T, G, H, K, V, scalar, seed=T), _packed(B, T) if packed else None, 1e-4)


def test_bfloat16_within_bf16_tolerance():
    B, T, G, H, K, V, scalar, _ = CASES["channel-ragged-packed-2vblocks"]
    _compare(_inputs(B, T, G, H, K, V, scalar, seed=3), _packed(B, T, 1), 2e-2, jnp.bfloat16)


def test_retention_and_linear_attention_routes():
    """retention and linear_attention with impl="pallas" (the scalar-gate kernel with g = log gamma
    and g = 0) against their token-by-token references."""
    q, k, v, _, S0, _, _ = _inputs(1, 20, 2, 2, 16, 16, True, seed=5)
    seg = _packed(1, 20, 2)
    gamma = jnp.array([0.9, 0.5])
    for op, args in ((retention, (q, k, v, gamma)), (linear_attention, (q, k, v))):
        run = jax.jit(lambda *a, impl: op(*a, segment_ids=seg, initial_state=S0, output_final_state=True,
                                          impl=impl), static_argnames="impl")
        (o, S), (want_o, want_S) = run(*args, impl="pallas"), run(*args, impl="reference")
        assert_close(o, want_o, 1e-4, f"{op.__name__} o")
        assert_close(S, want_S, 1e-4, f"{op.__name__} state")


def test_dispatch():
    q = jnp.zeros((1, 32, 2, 16))  # T > 16: "auto" takes the kernel on GPU
    jaxpr = lambda impl: str(jax.make_jaxpr(functools.partial(gla, impl=impl))(q, q, q, q))
    assert "pallas_call" in jaxpr("pallas")
    assert ("pallas_call" in jaxpr("auto")) == ON_GPU  # CPU: "auto" is the XLA chunk form
    assert "pallas_call" not in jaxpr("xla") and "pallas_call" not in jaxpr("reference")
    with pytest.raises(ValueError, match="impl=.*expected one of"):
        gla(q, q, q, q, impl="triton")
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_t=24)


def test_lowers_for_cuda_through_triton():
    """Without a GPU: the forward, dQ and dK/dV kernels lower to Triton for CUDA with the GPU block
    sizes, for both gate kinds, bf16, shared q/k heads, documents and a ragged T."""
    B, T, H, K = 2, 100, 4, 64
    seg = jnp.zeros((B, T), jnp.int32)
    for g_shape, G in (((B, T, H, K), H), ((B, T, H), 2)):
        def loss(q, k, v, g, s0):
            o, S = gla_pallas(q, k, v, g, segment_ids=seg, initial_state=s0, interpret=False,
                              block_sizes=default_block_sizes("gpu", len(g_shape) == 3))
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
        q, v = jnp.zeros((B, T, G, K), jnp.bfloat16), jnp.zeros((B, T, H, K), jnp.bfloat16)
        args = (q, q, v, jnp.zeros(g_shape, jnp.bfloat16), jnp.zeros((B, H, K, K)))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert hlo.count("__gpu$xla.gpu.triton") == 3


@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
def test_compiled_kernels_on_gpu(dtype, tol):
    """Default GPU block sizes (block_sizes=None), both gate kinds, ragged T, documents."""
    B, T, H, K = 2, 300, 4, 64
    for scalar, G in ((False, 4), (True, 2)):
        with jax.default_matmul_precision("highest"):  # a float32 reference without TF32
            _compare(_inputs(B, T, G, H, K, K, scalar, seed=7), _packed(B, T, 3), tol, dtype,
                     block_sizes=None)
