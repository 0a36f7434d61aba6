"""DeltaFormer (kernels/deltaformer): the reference and the parallel form against a numpy float64 loop of the
paper's equations (u by the delta rule in the softmax kernel, then causal softmax attention over u), and the
parallel form against the reference on u, o and the gradients of every input: T = 1, odd T in ragged blocks
with GQA and packed documents, and a decode call after a KV cache whose rows hold different numbers of slots."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import CacheView
from kernels.deltaformer import deltaformer, deltaformer_values
from tests.util import assert_close


def inputs(B, T, H, G, K, seed):
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0.2, 1.0, (B, T, G)).astype(np.float32))
    return n(B, T, H, K), n(B, T, G, K), n(B, T, G, K), beta, n(B, T, G, K)  # q, k, v, β, w


def packed(B, T, seed):
    """(B, T) int32 segment ids: a few documents per row, of random lengths."""
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 3, (B, T)), axis=1).astype(np.int32))


def equations_loop(q, k, v, beta, w, seg):
    """The equations in float64, token by token: u_i = v_i - β_i Σ_{j<i} softmax_j(w_i.k_j/√K) u_j, then
    o_t = Σ_{j<=t} softmax_j(q_t.k_j/√K) u_j, over the tokens of t's document."""
    q, k, v, beta, w = (np.asarray(a, np.float64) for a in (q, k, v, beta, w))
    B, T, H, K = q.shape
    R = H // k.shape[2]
    soft = lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    u, o = np.zeros(v.shape), np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for i in range(T):
            js = [j for j in range(i) if seg[b, j] == seg[b, i]]
            for g in range(k.shape[2]):
                a = soft(np.array([w[b, i, g] @ k[b, j, g] for j in js]) / K ** 0.5) if js else []
                u[b, i, g] = v[b, i, g] - beta[b, i, g] * sum(a_j * u[b, j, g] for a_j, j in zip(a, js))
        for t in range(T):
            js = [j for j in range(t + 1) if seg[b, j] == seg[b, t]]
            for h in range(H):
                a = soft(np.array([q[b, t, h] @ k[b, j, h // R] for j in js]) / K ** 0.5)
                o[b, t, h] = sum(a_j * u[b, j, h // R] for a_j, j in zip(a, js))
    return u, o


def test_forms_match_the_equations():
    B, T, H, G, K = 2, 9, 4, 2, 8
    q, k, v, beta, w = inputs(B, T, H, G, K, seed=0)
    seg = packed(B, T, seed=1)

    @jax.jit
    def run(q, k, v, beta, w):
        kw = dict(segment_ids=seg, chunk_size=4)
        return {i: (deltaformer_values(w, k, v, beta, impl=i, **kw), deltaformer(q, k, v, beta, w=w, impl=i, **kw))
                for i in ("reference", "xla")}

    want_u, want_o = equations_loop(q, k, v, beta, w, np.asarray(seg))
    for impl, (u, o) in run(q, k, v, beta, w).items():
        assert_close(u, want_u, 1e-5, f"{impl}: u")
        assert_close(o, want_o, 1e-5, f"{impl}: o")


# (B, T, H, G, chunk_size, packed, cached slots): T = 1; odd T in ragged blocks of 4 with GQA, w = k and packed
# documents; a decode call of 5 tokens (a document starting inside it) after a cache of 7 slots, rows holding 4
# and 6 of them.
CASES = {"T1": (1, 1, 2, 2, 4, False, 0), "odd-gqa-packed": (2, 13, 4, 2, 4, True, 0),
         "cached": (2, 5, 2, 2, 2, True, 7)}


@pytest.mark.parametrize("case", CASES)
def test_parallel_matches_reference(case):
    B, T, H, G, C, pack, S = CASES[case]
    K = 8
    q, k, v, beta, w = inputs(B, T, H, G, K, seed=2)
    seg = packed(B, T, seed=3) if pack else None
    rng = np.random.default_rng(4)
    ct = jnp.asarray(rng.standard_normal((B, T, G, K)).astype(np.float32))
    ct_o = jnp.asarray(rng.standard_normal((B, T, H, K)).astype(np.float32))
    cache = None
    if S:  # slots beyond each row's length hold junk that must never be read; the cache's documents 0 and 1
        ck, cu = (jnp.asarray(rng.standard_normal((B, G, S, K)).astype(np.float32)) for _ in range(2))
        cache = CacheView(ck, cu, jnp.asarray([4, 6], jnp.int32), jnp.asarray([[0, 0, 1, 1, 1, 1, 1]] * B, jnp.int32))
        seg = seg + 1  # the call's first document continues the cache's last

    @jax.jit
    def both(q, k, v, beta, w, cache):
        out = {}
        for impl in ("reference", "xla"):
            kw = dict(segment_ids=seg, chunk_size=C, impl=impl)
            if cache is None:
                u, vjp_u = jax.vjp(lambda *a: deltaformer_values(*a, **kw), w, k, v, beta)
                o, vjp_o = jax.vjp(lambda q, k, v, beta: deltaformer(q, k, v, beta, **kw), q, k, v, beta)
                out[impl] = (u, *vjp_u(ct), o, *vjp_o(ct_o))
            else:
                u, vjp_u = jax.vjp(lambda *a: deltaformer_values(*a[:4], cache=CacheView(*a[4:], cache.length,
                                                                                          cache.segment_ids), **kw),
                                   w, k, v, beta, cache.k, cache.v)
                out[impl] = (u, *vjp_u(ct))
        return out

    out = both(q, k, v, beta, w, cache)
    if T == 1:  # a lone token sees no key: u = v, o = u
        assert_close(out["xla"][0], v, 1e-6, "T = 1: u")
    names = ("u", "dw", "dk", "dv", "dbeta") + (("dcache_k", "dcache_u") if S else ("o", "dq", "dk'", "dv'", "dbeta'"))
    for name, got, want in zip(names, out["xla"], out["reference"]):
        if T == 1 and name not in ("u", "dv", "o", "dv'"):  # one key or none: weights fixed, no gradient
            np.testing.assert_array_equal(got, 0.0)
            continue
        assert np.abs(np.asarray(want)).max() > 1e-3, f"{name} ~ 0: a vacuous check"
        assert_close(got, want, 1e-5, f"{case}: {name}")


def test_bad_calls_are_refused():
    q, k, v, beta, w = inputs(1, 4, 3, 2, 4, seed=0)
    with pytest.raises(ValueError, match="2 kv heads do not divide 3 query heads"):
        deltaformer(q, k, v, beta)
    with pytest.raises(ValueError, match="impl='pallas' has no kernel"):
        deltaformer_values(w, k, v, beta, impl="pallas")
    with pytest.raises(ValueError, match="mode='chunk'"):
        deltaformer_values(w, k, v, beta, mode="chunk")
