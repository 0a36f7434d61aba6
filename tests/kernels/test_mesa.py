"""MesaNet op: the chunk and parallel forms (CG whose products are GLA passes) against the token-by-token
reference (outputs, final states, gradients w.r.t. every input and the initial states, odd T, packed
documents); enough CG steps solve the regression (against numpy's solve on the materialised H_t, as
flash-linear-attention's naive_mesa_net_exact, to the accuracy its 1e-5 in the CG denominators allows);
argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.mesa import mesa
from tests.util import assert_close


def inputs(B, T, H, K, V, seed=0):
    r = np.random.RandomState(seed)
    n = lambda *s: r.standard_normal(s).astype(np.float32)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = unit(n(B, T, H, K)), unit(n(B, T, H, K)), n(B, T, H, V)
    g = -np.logaddexp(0, -(n(B, T, H) + 2)).astype(np.float32)
    beta, lamb = 1 / (1 + np.exp(-n(B, T, H))), 0.25 + np.logaddexp(0, n(H, K))
    kk = n(B, H, K, 2 * K) / 4
    H0 = np.einsum("bhki,bhli->bhkl", kk, kk)  # symmetric positive semi-definite, as any H_t
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, lamb, H0, n(B, H, K, V))]


@functools.partial(jax.jit, static_argnames=("mode", "cg_steps"))
def outputs_and_grads(q, k, v, g, beta, lamb, H0, G0, segment_ids, *, mode, cg_steps):
    def loss(*args):
        o, (Hs, Gs) = mesa(*args[:6], initial_state=args[6:], cg_steps=cg_steps, segment_ids=segment_ids,
                           output_final_state=True, mode=mode, chunk_size=8)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(Hs * jnp.sin(Hs)) + jnp.sum(Gs * jnp.sin(Gs)), (o, Hs, Gs)
    return jax.grad(loss, argnums=tuple(range(8)), has_aux=True)(q, k, v, g, beta, lamb, H0, G0)


@pytest.mark.parametrize("T, packed", [(19, True), (1, False)])
def test_fast_forms_match_reference(T, packed):
    args = inputs(2, T, 2, 4, 3)
    ids = jnp.asarray(np.sort(np.random.RandomState(1).randint(0, 3, (2, T)), axis=1)) if packed else None
    want_grads, want = outputs_and_grads(*args, ids, mode="recurrent", cg_steps=6)
    for mode in ("chunk", "parallel"):
        grads, got = outputs_and_grads(*args, ids, mode=mode, cg_steps=6)
        for name, a, b in zip(("o", "H", "G"), got, want):
            assert_close(a, b, what=f"{mode} {name}")
        for name, a, b in zip("q k v g beta lamb H0 G0".split(), grads, want_grads):
            assert_close(a, b, 1e-3, what=f"{mode} d{name}")


def test_enough_steps_solve_the_regression():
    q, k, v, g, beta, lamb, H0, G0 = (np.asarray(x, np.float64) for x in inputs(1, 6, 2, 4, 3, seed=2))
    Hs, Gs, want = H0[0].copy(), G0[0].copy(), []
    for t in range(6):
        decay = np.exp(g[0, t])[:, None, None]
        Hs = decay * Hs + beta[0, t][:, None, None] * k[0, t][:, :, None] * k[0, t][:, None, :]
        Gs = decay * Gs + beta[0, t][:, None, None] * k[0, t][:, :, None] * v[0, t][:, None, :]
        x = np.linalg.solve(Hs + np.stack([np.diag(row) for row in lamb]), q[0, t][..., None])[..., 0]
        want.append(np.einsum("hk,hkv->hv", x, Gs))
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    run = jax.jit(functools.partial(mesa, cg_steps=8, mode="chunk", chunk_size=4))
    o, _ = run(*map(f32, (q, k, v, g, beta, lamb)), initial_state=(f32(H0), f32(G0)))
    # fla's 1e-5 in the CG denominators stops the progress once |r|^2 nears it: within 1e-3 here, not to 1e-4
    assert_close(o[0], np.stack(want), 2e-3, what="8 CG steps against the exact solve")


def test_bad_arguments():
    args = inputs(1, 3, 1, 4, 3)[:6]
    with pytest.raises(ValueError, match="cg_steps=0"):
        mesa(*args, cg_steps=0)
    with pytest.raises(ValueError, match="mode='fused'"):
        mesa(*args, mode="fused")
