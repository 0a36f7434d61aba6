"""Gated slot attention op: the chunk and parallel forms against the token-by-token reference (outputs,
both final states, gradients w.r.t. every input and the initial states; odd T, ragged chunks, two
sub-chunks per chunk, packed documents, a slot that forgets at once), the reference against a numpy
loop of flash-linear-attention's naive_recurrent_gsa equations, and argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gsa import gsa
from tests.util import assert_close


def inputs(B, T, H, K, V, M, seed=0):
    r = np.random.RandomState(seed)
    n = lambda *shape: r.standard_normal(shape).astype(np.float32)
    g = -np.logaddexp(0, -(2 * n(B, T, H, M) + 2)) / 2
    g[..., 0] = -40.0  # a slot that forgets at once: e^{-b} would overflow within a chunk
    s = 1 / (1 + np.exp(-n(B, T, H, M)))  # the op takes s apart from g; the layer ties s = 1 - alpha
    return [jnp.asarray(x, jnp.float32) for x in (n(B, T, H, K), n(B, T, H, K), n(B, T, H, V), s, g,
                                                    n(B, H, M, K), n(B, H, M, V))]


@functools.partial(jax.jit, static_argnames=("mode", "chunk_size"))
def outputs_and_grads(q, k, v, s, g, K0, V0, segment_ids, *, mode, chunk_size):
    def loss(*args):
        o, (Ks, Vs) = gsa(*args[:5], initial_state=args[5:], scale=0.5, segment_ids=segment_ids,
                          output_final_state=True, mode=mode, chunk_size=chunk_size)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(Ks * jnp.sin(Ks)) + jnp.sum(Vs * jnp.sin(Vs)), (o, Ks, Vs)
    return jax.grad(loss, argnums=tuple(range(7)), has_aux=True)(q, k, v, s, g, K0, V0)


# (B, T, chunk_size, packed): T=37/C=32 pads the last chunk and runs two sub-chunks of 16 per chunk;
# T=1 is a single token.
@pytest.mark.parametrize("B, T, C, packed", [(2, 37, 32, True), (1, 1, 8, False)])
def test_fast_forms_match_reference(B, T, C, packed):
    args = inputs(B, T, 2, 4, 3, 5)
    ids = jnp.asarray(np.sort(np.random.RandomState(1).randint(0, 3, (B, T)), axis=1)) if packed else None
    want_grads, want = outputs_and_grads(*args, ids, mode="recurrent", chunk_size=C)
    for mode in ("chunk", "parallel"):
        grads, got = outputs_and_grads(*args, ids, mode=mode, chunk_size=C)
        for name, a, b in zip(("o", "K~", "V~"), got, want):
            assert_close(a, b, what=f"{mode} {name}")
        for name, a, b in zip("q k v s g K0 V0".split(), grads, want_grads):
            assert np.isfinite(np.asarray(a)).all(), f"{mode} d{name} not finite"
            assert_close(a, b, what=f"{mode} d{name}")


def test_reference_matches_fla_naive_loop():
    """fla's naive_recurrent_gsa, written again in numpy (its layout: K~ as (K, M)), with a document start."""
    q, k, v, s, g, K0, V0 = inputs(1, 6, 1, 4, 3, 5, seed=3)
    seg = jnp.array([[0, 0, 0, 1, 1, 1]], jnp.int32)
    o, (Ks, Vs) = jax.jit(functools.partial(gsa, scale=0.5, output_final_state=True, impl="reference"))(
        q, k, v, s, g, segment_ids=seg, initial_state=(K0, V0))
    q, k, v, s, g = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k, v, s, g))  # (T, K), (T, V), (T, M)
    hk, hv = np.asarray(K0, np.float64)[0, 0].T, np.asarray(V0, np.float64)[0, 0]  # (K, M), (M, V)
    want = []
    for t in range(6):
        if t == 3:  # document start: both states reset
            hk, hv = np.zeros_like(hk), np.zeros_like(hv)
        hk = hk * np.exp(g[t])[None, :] + np.outer(k[t], s[t])
        ok = (0.5 * q[t]) @ hk
        p = np.exp(ok - ok.max())
        hv = hv * np.exp(g[t])[:, None] + np.outer(s[t], v[t])
        want.append((p / p.sum()) @ hv)
    assert_close(o[0, :, 0], np.stack(want), what="o")
    assert_close(Ks[0, 0], hk.T, what="K~")
    assert_close(Vs[0, 0], hv, what="V~")


def test_bad_arguments():
    args = inputs(1, 3, 1, 4, 3, 2)[:5]
    with pytest.raises(ValueError, match="mode='fused'"):
        gsa(*args, mode="fused")
    with pytest.raises(ValueError, match="impl='triton'"):
        gsa(*args, impl="triton")
