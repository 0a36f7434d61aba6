"""Delta-rule Pallas TPU kernels against the token-by-token reference under the TPU interpreter:
outputs, final state and gradients w.r.t. q, k, v, beta, g and initial_state, without a gate, with
one per head and one per key channel (Kimi Delta Attention), ragged T, T = 1, B = 1, packed documents
(one of them a single token), head dims 16, 8 and 12, bfloat16 and gates down to -20 per token;
Mosaic TPU lowering of the forward and backward with the default block sizes.

On CPU the kernels run in the TPU interpreter with 8-token chunks, so T = 21 crosses chunks, ends
in a ragged tail and has document starts inside a chunk and on a chunk boundary.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule.pallas_tpu import BlockSizes, _inverse, delta_rule_pallas_tpu
from tests.kernels.test_delta_rule_pallas import _compare as _compare_kernel
from tests.kernels.test_delta_rule_pallas import _inputs, _packed, strong_decay_inputs
from tests.util import assert_close, unchecked

BS = BlockSizes(block_t=8)
# Value tests run in the TPU interpreter on every machine (their tiny blocks are below Mosaic's
# tiling); the lowering tests check the compiled path with the default blocks.
_compare = functools.partial(_compare_kernel, kernel=functools.partial(delta_rule_pallas_tpu, interpret=True))


# (B, T, H, K, V, gated, packed, block sizes): T = 21 gives chunks 8, 8 and a ragged 5; head dims
# K = 16, 8 and 12 (V = 20: neither is padded here); block_sizes=None (default 64) shrinks the chunk
# to the padded T = 8, or 32 for T = 19.
CASES = {
    "gated-ragged-packed": (2, 21, 2, 16, 16, True, True, BS),
    "plain-ragged-packed-K8": (2, 21, 1, 8, 16, False, True, BS),
    "gated-T1-B1-default-blocks": (1, 1, 2, 8, 16, True, False, None),
    "channel-ragged-packed": (2, 21, 2, 16, 16, "channel", True, BS),
    "channel-K12-V20-default-blocks": (1, 19, 1, 12, 20, "channel", False, None),
    "channel-T1-B1": (1, 1, 2, 8, 16, "channel", False, BS),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    B, T, H, K, V, gated, packed, bs = CASES[case]
    _compare(_inputs(B, T, H, K, V, gated, seed=T + K), _packed(B, T) if packed else None, 1e-4, block_sizes=bs)


@pytest.mark.parametrize("gated", [True, "channel"])
def test_bfloat16_within_bf16_tolerance(gated):
    B, T, H, K, V, _, _, bs = CASES["gated-ragged-packed"]
    _compare(_inputs(B, T, H, K, V, gated, seed=3), _packed(B, T), 2e-2, jnp.bfloat16, block_sizes=bs)


def test_strong_per_channel_decay_is_finite_and_exact():
    """Gates of -20 per token on every other channel (e^{-G} would overflow float32 inside one
    16-token chunk): every value and gradient finite and equal to the reference."""
    _compare(strong_decay_inputs(2, 21, 1, 16, 16), _packed(2, 21), 1e-4, block_sizes=BlockSizes(block_t=16))


def test_inverse_by_block_doubling():
    """The in-kernel (I + A)^{-1}, run as plain JAX: a random strictly lower A, and equal keys with
    beta = 1 (A all ones below the diagonal), where the inverse is I minus the subdiagonal but the
    series prod (I + L^{2^i}) would cancel terms near 1e17."""
    C = 64
    r = np.random.default_rng(0)
    A = np.tril(r.uniform(-1, 1, (C, C)) / 4, -1)
    ones = np.tril(np.ones((C, C)), -1)
    inv = jax.jit(jax.vmap(_inverse))(jnp.asarray(np.stack([A, ones]), jnp.float32))
    assert_close(inv[0], np.linalg.inv(np.eye(C) + A), 1e-5, "random A")
    np.testing.assert_array_equal(np.asarray(inv[1]), np.eye(C) - np.eye(C, k=-1))


def test_block_sizes_validated():
    with pytest.raises(ValueError, match="block_t"):
        BlockSizes(block_t=24)
    with pytest.raises(ValueError, match="block_t"):
        BlockSizes(block_t=4)
    with pytest.raises(ValueError, match="delta_rule_pallas_tpu"), unchecked():  # the kernel's own check
        x = jnp.zeros((1, 8, 2, 16))
        delta_rule_pallas_tpu(x, x, x, jnp.zeros((1, 8, 3)), scale=1.0)


@pytest.mark.parametrize("gated", [True, "channel"])
def test_lowers_for_tpu_through_mosaic(gated):
    """Without a TPU: the forward, and the state-recomputing and backward kernels of the gradient,
    lower to Mosaic (tpu_custom_call) with the default block sizes, bfloat16, documents and a gate per
    head or per key channel."""
    B, T, H, K = 1, 256, 2, 128
    seg = jnp.zeros((B, T), jnp.int32)

    def fwd(q, k, v, beta, g, S0):
        return delta_rule_pallas_tpu(q, k, v, beta, g, scale=K ** -0.5, segment_ids=seg, initial_state=S0,
                                     interpret=False)

    def loss(*args):
        o, S = fwd(*args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    x, t, S0 = jnp.zeros((B, T, H, K), jnp.bfloat16), jnp.zeros((B, T, H), jnp.bfloat16), jnp.zeros((B, H, K, K))
    g = x if gated == "channel" else t
    lower = lambda f: f.trace(x, x, x, t, g, S0).lower(lowering_platforms=("tpu",)).as_text()
    assert lower(jax.jit(fwd)).count("tpu_custom_call") == 1
    assert lower(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))).count("tpu_custom_call") == 3
