"""Delta-rule Pallas kernels against the token-by-token reference: outputs, final state and gradients
w.r.t. q, k, v, beta, g and initial_state, without a gate, with one per head (Gated DeltaNet) and one
per key channel (Kimi Delta Attention), ragged T, T = 1, head dims that are not powers of two, packed
documents, two value blocks, bfloat16 and gates down to -20 per token; dispatch; lowering to Triton.

On CPU the kernels run in interpret mode with 16-token chunks and 16-column value blocks, so tiny
shapes cross chunks, ragged tails and value blocks. Tests marked `gpu` run the compiled kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule import delta_rule
from kernels.delta_rule.pallas import BlockSizes, default_block_sizes, delta_rule_pallas
from kernels.delta_rule.reference import delta_rule_recurrent
from tests.util import assert_close

BS = BlockSizes(block_t=16, block_v=16)
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels)")


def _inputs(B, T, H, K, V, gated, seed=0):
    """q, k (L2-normalised, as the layers feed the op), v, beta, g (log-decays from about -6 to
    -0.01: (B, T, H) if gated is True, (B, T, H, K) if gated == "channel", None if False), S0, and
    the weights of a random projection of (o, S); numpy draws."""
    r = np.random.default_rng(seed)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    sigmoid = lambda z: 1 / (1 + np.exp(-z))
    x = [l2(r.standard_normal((B, T, H, K))), l2(r.standard_normal((B, T, H, K))), r.standard_normal((B, T, H, V)),
         sigmoid(r.standard_normal((B, T, H))), np.log(sigmoid(2 * r.standard_normal((B, T, H)) + 2)),
         r.standard_normal((B, H, K, V)), r.standard_normal((B, T, H, V)), r.standard_normal((B, H, K, V))]
    if gated == "channel":  # drawn last: the other inputs of a seed stay those of the per-head gate
        x[4] = np.log(sigmoid(2 * r.standard_normal((B, T, H, K)) + 2))
    x = [jnp.asarray(a, jnp.float32) for a in x]
    return x[:4] + [x[4] if gated else None] + x[5:]


def _packed(B, T):
    """Segment ids: row 0 has documents starting at t = 5, 6 (a one-token document) and 16 (a chunk
    boundary); row 1 one starting at t = 11."""
    rows = [np.repeat([4, 5, 6, 7], [5, 1, 10, T - 16]), np.repeat([2, 3], [11, T - 11])]
    return jnp.asarray(np.stack(rows)[:B], jnp.int32)


@functools.partial(jax.jit, static_argnames=("kernel", "block_sizes"))
def _outputs_and_grads(q, k, v, beta, g, S0, wo, ws, seg, *, kernel, block_sizes):
    """(o, S) and the gradients of sum(o wo) + sum(S ws) w.r.t. q, k, v, beta, g (if given), S0;
    kernel None: the reference in float32 from the same (possibly rounded) inputs."""
    def loss(q, k, v, beta, g, S0):
        if kernel:
            o, S = kernel(q, k, v, beta, g, scale=0.25, segment_ids=seg, initial_state=S0, block_sizes=block_sizes)
        else:
            f = lambda x: None if x is None else x.astype(jnp.float32)
            o, S = delta_rule_recurrent(f(q), f(k), f(v), f(beta), f(g), scale=0.25, segment_ids=seg, initial_state=S0)
        return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(S * ws), (o, S)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(q, k, v, beta, g, S0)


def _compare(inputs, seg, tol, dtype=jnp.float32, block_sizes=BS, kernel=delta_rule_pallas):
    q, k, v, beta, g, S0, wo, ws = inputs
    lo = [None if x is None else x.astype(dtype) for x in (q, k, v, beta, g)]
    grads, (o, S) = _outputs_and_grads(*lo, S0, wo, ws, seg, kernel=kernel, block_sizes=block_sizes)
    exact = [None if x is None else x.astype(jnp.float32) for x in lo]  # the reference's own cast, done first:
    want_grads, (want_o, want_S) = _outputs_and_grads(*exact, S0, wo, ws, seg, kernel=None, block_sizes=None)
    # one compiled reference per shape, shared by the float32 and bfloat16 tests
    assert o.dtype == dtype and o.shape == want_o.shape and S.dtype == jnp.float32
    assert_close(o, want_o, tol, "o")
    assert_close(S, want_S, tol, "final state")
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dS0"), grads, want_grads):
        if name == "dg" and g is None:
            assert a is None and b is None
            continue
        assert a.dtype == (jnp.float32 if name == "dS0" else dtype) and a.shape == b.shape, name
        assert np.isfinite(np.asarray(a, np.float32)).all(), f"{name} not finite"
        assert float(jnp.abs(b).max()) > 0, f"{name}: the reference gradient is zero"
        assert_close(a, b, tol, name)


# (B, T, H, K, V, gated, packed): T = 21 leaves a ragged second chunk; V = 32 runs two value blocks
# (dq, dk, dbeta, dg summed over them); K = 8 is padded to 16; K = 12, V = 20 (not powers of two)
# are padded to 16 and 32 (two value blocks, the second half padding); T = 37: three chunks.
CASES = {
    "gated-ragged-packed-2vblocks": (2, 21, 2, 16, 32, True, True),
    "plain-ragged-packed-K8": (2, 21, 1, 8, 16, False, True),
    "gated-T1-B1": (1, 1, 2, 8, 16, True, False),
    "channel-ragged-packed-2vblocks": (2, 21, 2, 16, 32, "channel", True),
    "channel-T37-K12-V20": (1, 37, 2, 12, 20, "channel", False),
    "channel-T1-B1-K8": (1, 1, 2, 8, 16, "channel", False),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    B, T, H, K, V, gated, packed = CASES[case]
    _compare(_inputs(B, T, H, K, V, gated, seed=T + K), _packed(B, T) if packed else None, 1e-4)


@pytest.mark.parametrize("gated", [True, "channel"])
def test_bfloat16_within_bf16_tolerance(gated):
    B, T, H, K, V, _, _ = CASES["gated-ragged-packed-2vblocks"]
    _compare(_inputs(B, T, H, K, V, gated, seed=3), _packed(B, T), 2e-2, jnp.bfloat16)


def strong_decay_inputs(B, T, H, K, V):
    """Per-channel gates of -20 per token on every other channel (e^-20 per token, e^-640 across a
    32-token chunk: e^{-G} overflows float32 after 5 tokens) and -0.01 on the rest, with documents."""
    inputs = _inputs(B, T, H, K, V, "channel", seed=11)
    inputs[4] = jnp.where(jnp.arange(K) % 2 == 0, -20.0, -0.01) * jnp.ones((B, T, H, K))
    return inputs


def test_strong_per_channel_decay_is_finite_and_exact():
    """Every value and gradient finite (checked in _compare) and equal to the reference."""
    _compare(strong_decay_inputs(2, 21, 1, 16, 16), _packed(2, 21), 1e-4)


def test_dispatch():
    q, beta = jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2))  # T > 16: "auto" takes the kernel on GPU
    for g in (beta, q):  # a gate per head, per key channel
        jaxpr = lambda impl: str(jax.make_jaxpr(functools.partial(delta_rule, impl=impl))(q, q, q, beta, g))
        assert "pallas_call" in jaxpr("pallas")
        assert "pallas_call" not in jaxpr("auto")  # kernels.AUTO_PALLAS is off unless ZOO_AUTO_PALLAS=1
        assert "pallas_call" not in jaxpr("xla") and "pallas_call" not in jaxpr("reference")
    with pytest.raises(ValueError, match="expected one of"):
        delta_rule(q, q, q, beta, impl="triton")
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_t=24)


@pytest.mark.parametrize("gated,dtype", [(True, jnp.bfloat16), (False, jnp.float32), ("channel", jnp.bfloat16),
                                         ("channel", jnp.float32)])
def test_lowers_for_cuda_through_triton(gated, dtype):
    """Without a GPU: the forward, state-recomputing and backward kernels lower to Triton for CUDA
    with the GPU block sizes, documents and a ragged T; gates per head, per key channel or none."""
    B, T, H, K = 2, 100, 4, 64
    seg = jnp.zeros((B, T), jnp.int32)

    def loss(q, k, v, beta, g, S0):
        o, S = delta_rule_pallas(q, k, v, beta, g if gated else None, scale=0.125, segment_ids=seg,
                                 initial_state=S0, interpret=False, block_sizes=default_block_sizes("gpu"))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    x, t = jnp.zeros((B, T, H, K), dtype), jnp.zeros((B, T, H), dtype)
    g = x if gated == "channel" else t
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))).trace(x, x, x, t, g, jnp.zeros((B, H, K, K))).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3


@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
def test_compiled_kernels_on_gpu(dtype, tol):
    """Default GPU block sizes (block_sizes=None), gates per head, per channel and none, ragged T,
    documents; and gates of -20 per token."""
    B, T, H, K = 2, 300, 4, 64
    with jax.default_matmul_precision("highest"):  # a float32 reference without TF32
        for gated in (True, False, "channel"):
            _compare(_inputs(B, T, H, K, K, gated, seed=7), _packed(B, T), tol, dtype, block_sizes=None)
        _compare(strong_decay_inputs(B, T, H, K, K), _packed(B, T), tol, dtype, block_sizes=None)
