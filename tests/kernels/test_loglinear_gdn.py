"""Log-linear Gated DeltaNet (kernels/loglinear_gdn): the parallel form against the token-by-token reference
(outputs, final Fenwick states and count, gradients w.r.t. every input, the initial state included) with packed
documents, an odd T, T = 1 and a level cap that binds; the reference against an independent numpy loop of the
paper's equation (explicit transition products Φ(t, s)); and, with every λ = 1, both forms against the plain gated
delta rule (kernels/delta_rule), whose state is the levels' sum."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule import delta_rule
from kernels.loglinear import num_levels
from kernels.loglinear_gdn import loglinear_gated_delta_rule
from tests.util import assert_close


def make_inputs(seed, Bsz, T, H, K, V, L):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape)
    k = f(Bsz, T, H, K)
    softplus = lambda x: np.log1p(np.exp(x))
    inputs = dict(q=f(Bsz, T, H, K), k=k / np.linalg.norm(k, axis=-1, keepdims=True), v=f(Bsz, T, H, V),
                  beta=1 / (1 + np.exp(-f(Bsz, T, H))), g=-softplus(f(Bsz, T, H) - 1.0),
                  lam=softplus(f(Bsz, T, H, L)), initial_state=f(Bsz, H, L, K, V))
    return {name: jnp.asarray(x, jnp.float32) for name, x in inputs.items()}


@functools.cache
def outputs_and_grads(mode):
    def loss(inputs, count, segment_ids, wy, ws):
        o, (S, n) = loglinear_gated_delta_rule(**inputs, initial_count=count, segment_ids=segment_ids,
                                               output_final_state=True, mode=mode)
        return jnp.sum(o * wy) + jnp.sum(S * ws), (o, S, n)

    return jax.jit(jax.grad(loss, has_aux=True))


CASES = [  # (B, T, H, K, V, L, initial counts, segment rows or None)
    (2, 13, 2, 4, 3, 5, (5, 0), [[0] * 4 + [1] * 9, [3] + [4] * 12]),  # a 1-token document; n0 = 0
    (1, 1, 2, 3, 2, 2, (6,), None),  # T = 1; L = 2 < num_levels(7): the cap at level 1 binds
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}L{c[5]}")
def test_parallel_matches_reference(case):
    Bsz, T, H, K, V, L, counts, seg = case
    inputs = make_inputs(T + L, Bsz, T, H, K, V, L)
    count = jnp.asarray(counts, jnp.int32)
    seg = None if seg is None else jnp.asarray(seg, jnp.int32)
    rng = np.random.default_rng(1)
    wy, ws = rng.standard_normal((Bsz, T, H, V)), rng.standard_normal((Bsz, H, L, K, V))
    ref_grads, (ref_o, ref_S, ref_n) = outputs_and_grads("recurrent")(inputs, count, seg, wy, ws)
    grads, (o, S, n) = outputs_and_grads("parallel")(inputs, count, seg, wy, ws)
    assert_close(o, ref_o, what="o")
    assert_close(S, ref_S, what="final states")
    np.testing.assert_array_equal(n, ref_n)
    for name in inputs:
        assert np.all(np.isfinite(grads[name])), f"d/d{name} not finite"
        assert_close(grads[name], ref_grads[name], what=f"d/d{name}")


def numpy_loglinear_gdn(q, k, v, beta, g, lam):
    """o_t = K^-1/2 Σ_{s ≤ t} λ_t^(ℓ(t, s)) (q_t^T Φ(t, s) k_s) β_s v_s, Φ as explicit K x K products, float64
    (one row, no documents, zero initial state)."""
    T, H, K = q.shape
    o = np.zeros(v.shape)
    for h in range(H):
        for t in range(T):
            Phi = np.eye(K)  # Φ(t, s), built from s = t downwards
            for s in range(t, -1, -1):
                level = min((t ^ s).bit_length(), lam.shape[-1] - 1)
                o[t, h] += lam[t, h, level] * (q[t, h] @ Phi @ k[s, h]) * beta[s, h] * v[s, h] / np.sqrt(K)
                Phi = Phi @ (np.exp(g[s, h]) * (np.eye(K) - beta[s, h] * np.outer(k[s, h], k[s, h])))
    return o


def test_reference_matches_a_numpy_loop_and_lambda_one_is_the_gated_delta_rule():
    T, H, K, V = 11, 2, 3, 2
    L = num_levels(T)
    inputs = make_inputs(0, 1, T, H, K, V, L)
    S0 = inputs.pop("initial_state")
    seg = jnp.asarray([[0] * 4 + [1] * 7], jnp.int32)
    count = jnp.asarray([3], jnp.int32)

    @jax.jit
    def run(inputs, S0):
        ref = loglinear_gated_delta_rule(**inputs, impl="reference")[0]
        ones = dict(inputs, lam=jnp.ones_like(inputs["lam"]))
        forms = [loglinear_gated_delta_rule(**ones, segment_ids=seg, initial_state=S0, initial_count=count,
                                            output_final_state=True, mode=mode) for mode in ("recurrent", "parallel")]
        plain = delta_rule(*(inputs[n] for n in ("q", "k", "v", "beta", "g")), segment_ids=seg,
                           initial_state=S0.sum(axis=2), output_final_state=True, mode="recurrent")
        return ref, [(o, S.sum(axis=2)) for o, (S, _) in forms], plain

    ref, forms, (plain_o, plain_S) = run(inputs, S0)
    want = numpy_loglinear_gdn(*(np.asarray(inputs[n], np.float64)[0] for n in ("q", "k", "v", "beta", "g", "lam")))
    assert_close(ref[0], want, what="reference vs numpy loop")
    for mode, (o, S) in zip(("recurrent", "parallel"), forms):
        assert_close(o, plain_o, what=f"{mode}, lambda = 1: o vs delta_rule")
        assert_close(S, plain_S, what=f"{mode}, lambda = 1: summed levels vs delta_rule's state")


def test_bad_impl_is_refused():
    x = jnp.zeros((1, 1, 1, 1))
    with pytest.raises(ValueError, match="impl='pallas'"):
        loglinear_gated_delta_rule(x, x, x, x[..., 0], None, x, impl="pallas")
