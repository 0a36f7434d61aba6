"""Linear attention op: every mode against the token-by-token reference (outputs, final state,
gradients w.r.t. q, k, v and initial_state), the segment reset rule, dtypes and argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.linear_attention import linear_attention
from kernels.linear_attention.reference import linear_attention_reference
from tests.util import assert_close

# Compiles dominate these tests: skip XLA's backend optimisations (the same float32 math, about a
# third less CPU time).

# B, T, H, K, V, chunk_size, packed. T=63/C=16 pads the last chunk; T=1 is a single token.
CASES = [(2, 63, 2, 8, 16, 16, True), (1, 1, 1, 16, 8, 16, False)]


def randn(seed, shape):
    # numpy, not jax.random: eager jax ops would each cost a compile, and compiles dominate this file.
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), jnp.float32)


def make_inputs(B, T, H, K, V, seed=0):
    return randn(seed, (B, T, H, K)), randn(seed + 1, (B, T, H, K)), randn(seed + 2, (B, T, H, V)), \
        randn(seed + 4, (B, H, K, V))


def packed_ids(B, T, seed=0):
    return jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, 4, (B, T)), axis=1), jnp.int32)


@functools.partial(jax.jit, static_argnames=("mode", "chunk_size"))
def outputs_and_grads(q, k, v, S0, wo, ws, segment_ids, *, mode, chunk_size):
    """(o, S) and the gradients of a random projection of both w.r.t. q, k, v and S0."""
    def loss(q, k, v, S0):
        o, S = linear_attention(q, k, v, initial_state=S0, segment_ids=segment_ids, output_final_state=True,
                                mode=mode, chunk_size=chunk_size, scale=0.5)
        return jnp.sum(o * wo) + jnp.sum(S * ws), (o, S)
    return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, S0)


reference = jax.jit(linear_attention_reference, static_argnames=("scale",))
run = jax.jit(linear_attention, static_argnames=("mode", "chunk_size", "output_final_state", "scale"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}K{}V{}C{}".format(*c[:6]))
def test_modes_match_reference(case):
    B, T, H, K, V, C, packed = case
    inputs = make_inputs(B, T, H, K, V)
    extra = (randn(10, (B, T, H, V)), randn(11, (B, H, K, V)), packed_ids(B, T) if packed else None)
    want_grads, (want_o, want_S) = outputs_and_grads(*inputs, *extra, mode="recurrent", chunk_size=C)
    for mode in ("chunk", "parallel"):
        grads, (o, S) = outputs_and_grads(*inputs, *extra, mode=mode, chunk_size=C)
        assert_close(o, want_o, what=f"{mode} o")
        assert_close(S, want_S, what=f"{mode} final state")
        for name, a, b in zip(("dq", "dk", "dv", "dS0"), grads, want_grads):
            assert np.isfinite(np.asarray(a)).all(), f"{mode} {name} not finite"
            assert_close(a, b, what=f"{mode} {name}")


def test_reference_matches_explicit_loop():
    """The reference against a plain loop over the paper's equations, so it cannot drift."""
    q, k, v, S0 = make_inputs(1, 5, 1, 4, 3, seed=20)
    seg = jnp.array([[0, 0, 1, 1, 1]], jnp.int32)
    o, S = reference(q, k, v, scale=0.5, segment_ids=seg, initial_state=S0)
    q, k, v = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k, v))  # (T, K) or (T, V)
    state, outs = np.asarray(S0, np.float64)[0, 0], []
    for t in range(5):
        if t == 2:  # document start: the state resets
            state = np.zeros_like(state)
        state = state + np.outer(k[t], v[t])
        outs.append(0.5 * q[t] @ state)
    assert_close(np.asarray(o)[0, :, 0], np.stack(outs), what="o")
    assert_close(np.asarray(S)[0, 0], state, what="S")


def test_packed_row_equals_documents_alone():
    T, H, K, V = 37, 2, 8, 8
    q, k, v, S0 = make_inputs(1, T, H, K, V, seed=30)
    bounds = [0, 20, 21, 30, T]  # documents of 20, 1, 9 and 7 tokens
    seg = np.repeat(np.arange(4, dtype=np.int32), np.diff(bounds))[None]
    o, S = run(q, k, v, segment_ids=seg, initial_state=S0, output_final_state=True, chunk_size=16)
    # The documents alone, one per batch row. The later ones are zero-padded in front: they start
    # from a zero state, which zero keys and values leave at zero.
    L = bounds[1]
    alone = [np.stack([np.pad(np.asarray(x)[0, a:b], ((L - (b - a), 0), (0, 0), (0, 0)))
                       for a, b in zip(bounds, bounds[1:])]) for x in (q, k, v)]
    inits = np.concatenate([S0, np.zeros((3,) + S0.shape[1:], np.float32)])  # only token 0 continues S0
    o_alone, S_alone = reference(*alone, initial_state=inits)
    for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
        assert_close(o[0, a:b], o_alone[d, L - (b - a):], what=f"document {d}")
    assert_close(S[0], S_alone[-1], what="final state")


def test_bfloat16_inputs():
    q, k, v, S0 = make_inputs(1, 33, 2, 8, 8, seed=40)
    want, want_S = run(q, k, v, initial_state=S0, output_final_state=True, mode="recurrent")
    lo = [jnp.asarray(np.asarray(x), jnp.bfloat16) for x in (q, k, v)]
    o, S = run(*lo, initial_state=S0, output_final_state=True, chunk_size=16)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert_close(o, want, tol=3e-2, what="bf16 o")
    assert_close(S, want_S, tol=3e-2, what="bf16 S")


def test_argument_errors():
    q, k, v, _ = make_inputs(1, 4, 1, 4, 4)
    with pytest.raises(ValueError, match="linear_attention: mode='fused'"):
        linear_attention(q, k, v, mode="fused")
    with pytest.raises(ValueError, match="impl='triton'"):
        linear_attention(q, k, v, impl="triton")
    assert jax.eval_shape(lambda: linear_attention(q, k, v))[1] is None
