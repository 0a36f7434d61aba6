"""Gated DeltaNet-2 op: the chunk and parallel forms (RWKV-7's op under the DPLR mapping) against the
token-by-token reference (outputs, final state, gradients w.r.t. every input and the initial state, odd T,
packed documents, strong decays); the reference against a float64 numpy loop in the order of fla's
naive_recurrent_gdn2 (decay, gated read, write); KDA back when b = w = beta; and Comba's recurrence (fla's
naive_recurrent_comba with its L2-normalised erase key p) equal to the gated delta rule, the claim
layers/deltanet2.py runs Comba on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule import delta_rule
from kernels.gdn2 import gdn2
from tests.util import assert_close


def inputs(B, T, H, K, V, seed=0):
    r = np.random.RandomState(seed)
    n = lambda *s: r.standard_normal(s).astype(np.float32)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = unit(n(B, T, H, K)), unit(n(B, T, H, K)), n(B, T, H, V)
    g = -np.logaddexp(0, -(3 * n(B, T, H, K) + 3)).astype(np.float32)
    g[..., 0] = -40.0  # a channel that forgets at once
    b, w = 1 / (1 + np.exp(-n(B, T, H, K))), 1 / (1 + np.exp(-n(B, T, H, V)))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, 2 * b, w, n(B, H, K, V))]


@functools.partial(jax.jit, static_argnames=("mode", "chunk_size"))
def outputs_and_grads(q, k, v, g, b, w, S0, segment_ids, *, mode, chunk_size):
    def loss(*args):
        o, S = gdn2(*args[:6], initial_state=args[6], segment_ids=segment_ids, output_final_state=True, mode=mode,
                    chunk_size=chunk_size)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(S * jnp.sin(S)), (o, S)
    return jax.grad(loss, argnums=tuple(range(7)), has_aux=True)(q, k, v, g, b, w, S0)


@pytest.mark.parametrize("T, C, packed", [(21, 8, True), (1, 8, False)])
def test_fast_forms_match_reference(T, C, packed):
    args = inputs(2, T, 2, 4, 6)
    ids = jnp.asarray(np.sort(np.random.RandomState(1).randint(0, 3, (2, T)), axis=1)) if packed else None
    want_grads, (want_o, want_S) = outputs_and_grads(*args, ids, mode="recurrent", chunk_size=C)
    for mode in ("chunk", "parallel"):
        grads, (o, S) = outputs_and_grads(*args, ids, mode=mode, chunk_size=C)
        assert_close(o, want_o, what=f"{mode} o")
        assert_close(S, want_S, what=f"{mode} S")
        for name, a, b in zip("q k v g b w S0".split(), grads, want_grads):
            assert_close(a, b, 1e-3, what=f"{mode} d{name}")


def test_reference_is_fla_order_and_kda_is_a_special_case():
    q, k, v, g, b, w, S0 = (np.asarray(x, np.float64) for x in inputs(1, 9, 2, 4, 3, seed=2))
    S, out = S0[0].copy(), []
    for t in range(9):  # fla's naive_recurrent_gdn2: decay, read at b * k, write w * v minus the read
        S = S * np.exp(g[0, t])[..., None]
        erase = np.einsum("hk,hkv->hv", b[0, t] * k[0, t], S)
        S = S + k[0, t][..., None] * (w[0, t] * v[0, t] - erase)[:, None, :]
        out.append(np.einsum("hk,hkv->hv", q[0, t] * 0.5, S))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    o, S_T = jax.jit(functools.partial(gdn2, output_final_state=True, mode="recurrent"))(
        *map(f32, (q, k, v, g, b, w)), initial_state=f32(S0))
    assert_close(o[0], np.stack(out), what="reference o")
    assert_close(S_T[0], S, what="reference S")
    beta = np.asarray(b[..., 0])  # b = w = beta (scalar per head): Kimi Delta Attention
    as_kda = lambda x, n: jnp.asarray(np.broadcast_to(beta[..., None], x.shape[:3] + (n,)), jnp.float32)
    q, k, v, g = (jnp.asarray(x, jnp.float32) for x in (q, k, v, g))
    o, _ = jax.jit(functools.partial(gdn2, mode="chunk", chunk_size=4))(q, k, v, g, as_kda(k, 4), as_kda(v, 3))
    want, _ = jax.jit(functools.partial(delta_rule, scale=0.5, mode="recurrent"))(q, k, v, f32(beta), g)
    assert_close(o, want, what="gdn2 with b = w = beta against the delta rule (KDA)")


def test_comba_recurrence_with_normalised_p_is_the_gated_delta_rule():
    q, k, v, g, _, _, S0 = (np.asarray(x, np.float64) for x in inputs(1, 7, 2, 4, 3, seed=3))
    g = g[..., 0]  # Comba's decay: one per head
    beta = 1 / (1 + np.exp(-np.random.RandomState(4).standard_normal((1, 7, 2))))
    p = 0.3 * k  # sigmoid(d) k, then fla's kernel normalises it: p^ = k^ (k is unit already)
    p = p / np.linalg.norm(p, axis=-1, keepdims=True)
    S, out = S0[0].copy(), []
    for t in range(7):  # fla's naive_recurrent_comba: decay, v - p^T S, times beta, write along k
        S = S * np.exp(g[0, t])[:, None, None]
        delta = beta[0, t][:, None] * (v[0, t] - np.einsum("hk,hkv->hv", p[0, t], S))
        S = S + k[0, t][..., None] * delta[:, None, :]
        out.append(np.einsum("hk,hkv->hv", q[0, t] * 0.5, S))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    o, _ = jax.jit(functools.partial(delta_rule, mode="chunk", chunk_size=4))(
        f32(q), f32(k), f32(v), f32(beta), f32(g), initial_state=f32(S0))
    assert_close(o[0], np.stack(out), what="Comba's recurrence against the gated delta rule")
