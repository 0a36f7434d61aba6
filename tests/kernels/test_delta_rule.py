"""The chunk and parallel delta rule (plain, gated per head, and gated per key channel as Kimi Delta
Attention) against the token-by-token reference, and the reference against the paper's equations."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule import delta_rule
from kernels.delta_rule.reference import delta_rule_recurrent
from tests.util import assert_close, assert_tree_close, unchecked

ARGS = ("q", "k", "v", "beta", "g", "initial_state")


def l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def make_inputs(seed, B, T, H, K, V, gated):
    """gated: False (no decay), True (one per head, (B, T, H)) or "channel" (one per key channel,
    (B, T, H, K), with channel 0 forgetting at e^-40 a token: e^{-G} would overflow within a chunk)."""
    # numpy, not jax.random: threefry costs seconds of XLA compile per shape on a 2-core CPU
    r = np.random.default_rng(seed)
    sigmoid = lambda z: 1 / (1 + np.exp(-z))
    if gated == "channel":
        g = np.log(sigmoid(2 * r.standard_normal((B, T, H, K)) + 2))
        g[..., 0] = -40.0
    x = dict(
        q=l2norm(r.standard_normal((B, T, H, K))),  # as the layers feed the op
        k=l2norm(r.standard_normal((B, T, H, K))),
        v=r.standard_normal((B, T, H, V)),
        beta=sigmoid(r.standard_normal((B, T, H))),
        # log-decays between about -6 and -0.01: strong forgetting is where exp() would overflow
        g=g if gated == "channel" else np.log(sigmoid(2 * r.standard_normal((B, T, H)) + 2)) if gated else None,
        initial_state=r.standard_normal((B, H, K, V)),
    )
    return {a: None if x[a] is None else jnp.asarray(x[a], jnp.float32) for a in x}


@partial(jax.jit, static_argnames=("chunk_size",))
def all_modes(inputs, cotangents, segment_ids, chunk_size):
    """Outputs, final states and gradients (of a random linear function of both) for every mode."""
    do, dS = cotangents

    def loss(x, mode):
        o, S = delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"], segment_ids=segment_ids,
                          initial_state=x["initial_state"], output_final_state=True, mode=mode,
                          chunk_size=chunk_size)
        return jnp.sum(o * do) + jnp.sum(S * dS), (o, S)

    def run_reference(x):
        o, S = delta_rule_recurrent(x["q"], x["k"], x["v"], x["beta"], x["g"], scale=x["q"].shape[-1] ** -0.5,
                                    segment_ids=segment_ids, initial_state=x["initial_state"])
        return jnp.sum(o * do) + jnp.sum(S * dS), (o, S)

    # mode="recurrent" runs delta_rule_recurrent itself, so it is checked by the cheaper tests below.
    out = {"reference": jax.grad(run_reference, has_aux=True)(inputs)}
    for mode in ("chunk", "parallel"):
        out[mode] = jax.grad(loss, has_aux=True)(inputs, mode)
    return {name: (aux[0], aux[1], grads) for name, (grads, aux) in out.items()}


CASES = [  # (seed, B, T, H, K, V, chunk, gated, segments)
    (0, 2, 63, 2, 16, 8, 16, True, True),
    (1, 1, 63, 2, 8, 16, 16, False, True),
    (2, 2, 1, 2, 8, 8, 16, True, False),
    (3, 2, 63, 2, 16, 8, 32, "channel", True),  # C = 32: two sub-chunks of the decayed products
    (4, 1, 1, 2, 8, 8, 16, "channel", False),
]


def segments(B, T):
    # Row 0: documents start at t = 16 (a chunk boundary), 17 (a one-token document) and 37.
    row0 = np.repeat([4, 5, 6, 7], [16, 1, 20, T - 37])
    row1 = np.repeat([2, 3], [5, T - 5])
    return jnp.asarray(np.stack([row0, row1])[:B], jnp.int32)


@pytest.mark.parametrize("seed,B,T,H,K,V,chunk,gated,segs", CASES)
def test_modes_match_reference(seed, B, T, H, K, V, chunk, gated, segs):
    inputs = make_inputs(seed, B, T, H, K, V, gated)
    r = np.random.default_rng(seed + 100)
    cotangents = (r.standard_normal((B, T, H, V)), r.standard_normal((B, H, K, V)))
    out = all_modes(inputs, cotangents, segments(B, T) if segs else None, chunk)
    o_ref, S_ref, g_ref = out["reference"]
    assert set(g_ref) == set(ARGS) and (g_ref["g"] is None) == (not gated)
    assert float(jnp.abs(g_ref["initial_state"]).max()) > 0 and float(jnp.abs(g_ref["beta"]).max()) > 0
    for mode in ("chunk", "parallel"):
        o, S, grads = out[mode]
        assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V) and S.dtype == jnp.float32
        assert_close(o, o_ref, 1e-4, f"{mode} o")
        assert_close(S, S_ref, 1e-4, f"{mode} final state")
        assert_tree_close(grads, g_ref, 1e-4, f"{mode} grad")


@pytest.mark.parametrize("gated", [False, True, "channel"])
@pytest.mark.parametrize("T", [1, 7])
def test_reference_matches_explicit_loop(T, gated):
    """The reference against a plain float64 loop over the papers' equations (DeltaNet; Gated DeltaNet;
    Kimi Delta Attention: S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,
    o_t = scale S_t^T q_t), with a document start at t = 3, so that it cannot drift."""
    K, V = 4, 3
    x = make_inputs(6, 1, T, 1, K, V, gated)
    seg = jnp.asarray((np.arange(T) >= 3)[None], jnp.int32)
    o, S = jax.jit(partial(delta_rule_recurrent, scale=0.5))(x["q"], x["k"], x["v"], x["beta"], x["g"],
                                                              segment_ids=seg, initial_state=x["initial_state"])
    q, k, v, beta = (np.asarray(x[a], np.float64)[0, :, 0] for a in ("q", "k", "v", "beta"))
    alpha = np.ones((T, K)) if x["g"] is None else np.exp(np.asarray(x["g"], np.float64)[0, :, 0])
    alpha = alpha[:, None] if alpha.ndim == 1 else alpha  # (T, 1) per head or (T, K) per channel
    state = np.asarray(x["initial_state"], np.float64)[0, 0]
    outs = []
    for t in range(T):
        if t == 3:  # document start: the state resets
            state = np.zeros_like(state)
        decayed = np.diag(np.broadcast_to(alpha[t], (K,))) @ state
        state = (np.eye(K) - beta[t] * np.outer(k[t], k[t])) @ decayed + beta[t] * np.outer(k[t], v[t])
        outs.append(0.5 * state.T @ q[t])
    assert_close(np.asarray(o)[0, :, 0], np.stack(outs), 1e-5, "o")
    assert_close(np.asarray(S)[0, 0], state, 1e-5, "S")


def test_reset_is_not_a_continuation():
    """Guards the test above against a vacuous reset: with segments, results must differ."""
    x = make_inputs(0, 2, 63, 2, 16, 8, True)
    run = jax.jit(partial(delta_rule_recurrent, scale=0.25, initial_state=x["initial_state"]))
    args = (x["q"], x["k"], x["v"], x["beta"], x["g"])
    with_segments, without = run(*args, segment_ids=segments(2, 63))[0], run(*args)[0]
    assert float(jnp.abs(with_segments[:, 17:] - without[:, 17:]).max()) > 1e-2


def test_packed_equals_documents_alone(mode="chunk"):
    # The other modes match the reference, and so this, on packed rows (test_modes_match_reference).
    B, T, H, K, V = 1, 40, 2, 8, 8
    x = make_inputs(7, B, T, H, K, V, True)
    lengths = [8, 1, 31]  # documents start at t = 8 (a chunk boundary) and t = 9 (inside a chunk)
    seg = jnp.asarray(np.repeat([3, 1, 2], lengths)[None], jnp.int32)
    run = jax.jit(partial(delta_rule, output_final_state=True, mode=mode, chunk_size=8))
    o, S = run(x["q"], x["k"], x["v"], x["beta"], x["g"], segment_ids=seg, initial_state=x["initial_state"])
    start = 0
    for i, n in enumerate(lengths):
        piece = {a: np.asarray(x[a])[:, start:start + n] for a in ("q", "k", "v", "beta", "g")}
        o_doc, S_doc = run(**piece, initial_state=x["initial_state"] if i == 0 else None)
        assert_close(o[:, start:start + n], o_doc, 1e-5, f"document {i}")
        start += n
    assert_close(S, S_doc, 1e-5, "final state")


def test_bfloat16_inputs():
    x = make_inputs(4, 1, 20, 2, 8, 8, True)
    x16 = {a: x[a].astype(jnp.bfloat16) for a in ("q", "k", "v", "beta", "g")}
    o, S = jax.jit(partial(delta_rule, output_final_state=True, chunk_size=8))(**x16)
    # mode="recurrent" on the same (bfloat16-rounded) values, in float32
    x32 = {a: x16[a].astype(jnp.float32) for a in x16}
    o_ref, S_ref = jax.jit(partial(delta_rule, output_final_state=True, mode="recurrent"))(**x32)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert_close(o, o_ref, 2e-2, "bf16 o")
    assert_close(S, S_ref, 1e-4, "bf16 final state")  # the state accumulates in float32


def test_bad_arguments():
    x = make_inputs(5, 1, 4, 1, 4, 4, False)
    args = (x["q"], x["k"], x["v"], x["beta"])
    with pytest.raises(ValueError, match="recurrent"):
        jax.eval_shape(partial(delta_rule, mode="fused"), *args)  # traces only: nothing compiles
    with pytest.raises(ValueError, match="xla"):
        jax.eval_shape(partial(delta_rule, impl="triton"), *args)
    with pytest.raises(ValueError, match="chunk_size"):
        jax.eval_shape(partial(delta_rule, chunk_size=0), *args)
    assert jax.eval_shape(delta_rule, *args)[1] is None
    with pytest.raises(ValueError, match=r"g \(B, T, H\) or \(B, T, H, K\)"), unchecked():  # the kernel's own check
        jax.eval_shape(partial(delta_rule, impl="pallas"), *args, jnp.zeros((*x["q"].shape, 2)))
