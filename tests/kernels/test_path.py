"""PaTH attention (kernels/path): the reference against a numpy loop that builds each product of Householder
matrices H_i ... H_{j+1} explicitly, and the block form (dense.py) against the reference on outputs and the
gradients of every input (T = 1, odd T in ragged blocks, GQA, packed documents, the forget gate); decoding
from a cache, the paper's token-by-token key updates and the block form, against each other (outputs and the
cache's transformed keys) and against the training op on the whole sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.path import empty_slots, path_attention, path_attention_cached
from kernels.segments import document_index
from tests.util import assert_close


def inputs(B, T, H, G, K, seed, gate=True):
    rng = np.random.default_rng(seed)
    n = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    w = n(B, T, G, K)
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    beta = rng.uniform(0.1, 1.95, (B, T, G)).astype(np.float32)  # some near 2: reflections
    c = np.cumsum(np.log(rng.uniform(0.5, 1.0, (B, T, H))), axis=1).astype(np.float32) if gate else None
    return tuple(None if a is None else jnp.asarray(a) for a in (n(B, T, H, K), n(B, T, G, K), n(B, T, G, K), w,
                                                                 beta, c))


def packed(B, T, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32))


def products_loop(q, k, v, w, beta, c, seg):
    """In float64: the logit q_i^T (H_i H_{i-1} ... H_{j+1}) k_j with the K x K product built factor by factor,
    for the keys j <= i of i's document; softmax of scale (logit + c_i - c_j)."""
    q, k, v, w, beta = (np.asarray(a, np.float64) for a in (q, k, v, w, beta))
    c = np.zeros(q.shape[:3]) if c is None else np.asarray(c, np.float64)
    B, T, H, K = q.shape
    R = H // k.shape[2]
    o = np.zeros(q.shape[:3] + v.shape[-1:])
    for b in range(B):
        for h in range(H):
            g = h // R
            for i in range(T):
                js = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
                logits = []
                for j in js:
                    P = np.eye(K)
                    for t in range(i, j, -1):  # P = H_i ... H_{j+1}
                        P = P @ (np.eye(K) - beta[b, t, g] * np.outer(w[b, t, g], w[b, t, g]))
                    logits.append((q[b, i, h] @ P @ k[b, j, g] + c[b, i, h] - c[b, j, h]) / K ** 0.5)
                p = np.exp(np.asarray(logits) - max(logits))
                o[b, i, h] = (p / p.sum()) @ v[b, js, g]
    return o


def test_reference_matches_the_matrix_products():
    B, T, H, G, K = 2, 7, 2, 1, 4
    q, k, v, w, beta, c = inputs(B, T, H, G, K, seed=0)
    seg = packed(B, T, seed=1)

    @jax.jit
    def run(q, k, v, w, beta, c):
        slots = empty_slots(B, G, T, K, K, H)
        dec, _ = path_attention_cached(q, k, v, w, beta, slots, jnp.zeros((B,), jnp.int32),
                                       doc=document_index(seg, B, T), decay=c, impl="reference")
        return [path_attention(q, k, v, w, beta, decay=c, segment_ids=seg, impl=i, chunk_size=3)
                for i in ("reference", "xla")] + [dec]

    want = products_loop(q, k, v, w, beta, c, np.asarray(seg))
    for name, got in zip(("reference", "xla", "decode reference"), run(q, k, v, w, beta, c)):
        assert_close(got, want, 1e-5, name)


# (B, T, H, G, packed, gate, chunk): T = 1; odd T in ragged blocks of 4 with GQA, documents and the gate.
CASES = {"T1": (1, 1, 2, 2, False, False, 4), "odd-gqa-packed-gate": (2, 13, 4, 2, True, True, 4)}


@pytest.mark.parametrize("case", CASES)
def test_blocks_match_reference(case):
    B, T, H, G, pack, gate, C = CASES[case]
    K = 8
    args = inputs(B, T, H, G, K, seed=2, gate=gate)
    seg = packed(B, T, seed=3) if pack else None
    ct = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, H, K)).astype(np.float32))

    @jax.jit
    def both(*args):
        out = {}
        for impl in ("reference", "xla"):
            f = lambda q, k, v, w, beta, c, impl=impl: path_attention(q, k, v, w, beta, decay=c, segment_ids=seg,
                                                                       impl=impl, chunk_size=C)
            y, vjp = jax.vjp(f, *args)
            out[impl] = (y, *vjp(ct))
        return out

    out = both(*args)
    for name, got, want in zip(("o", "dq", "dk", "dv", "dw", "dbeta", "dc"), out["xla"], out["reference"]):
        if want is None:
            continue
        if not (name in ("dq", "dk", "dw", "dbeta", "dc") and T == 1):  # one token: softmax of one, no gradient
            assert np.abs(np.asarray(want)).max() > 1e-3, f"{name} ~ 0: a vacuous check"
        assert_close(got, want, 1e-5, f"{case}: {name}")


def test_cached_blocks_match_the_token_by_token_cache():
    """5 tokens cached, then 7 in one call (a document starting inside it, blocks of 3): the block form and the
    paper's per-token key updates agree on outputs and on the transformed keys, and both on the training op."""
    B, T, H, G, K, S, P = 2, 12, 4, 2, 8, 14, 5
    q, k, v, w, beta, c = inputs(B, T, H, G, K, seed=5)
    seg = jnp.asarray(np.repeat([[0] * 8 + [1] * 4, [0] * 2 + [1] * 10], 1, axis=0).astype(np.int32))
    doc = document_index(seg, B, T)

    @jax.jit
    def run(q, k, v, w, beta, c):
        out = {"train": path_attention(q, k, v, w, beta, decay=c, segment_ids=seg, impl="reference")}
        for impl in ("reference", "xla"):
            call = lambda lo, hi, slots, index: path_attention_cached(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], w[:, lo:hi], beta[:, lo:hi], slots, index, doc=doc[:, lo:hi],
                decay=c[:, lo:hi], impl=impl, chunk_size=3)
            o1, slots = call(0, P, empty_slots(B, G, S, K, K, H), jnp.zeros((B,), jnp.int32))
            o2, slots = call(P, T, slots, jnp.full((B,), P, jnp.int32))
            out[impl] = (jnp.concatenate([o1, o2], axis=1), slots)
        return out

    out = run(q, k, v, w, beta, c)
    for impl in ("reference", "xla"):
        assert_close(out[impl][0], out["train"], 1e-5, f"{impl}: prefill + call vs training")
    (_, ref), (_, blk) = out["reference"], out["xla"]
    for name in ("k", "v", "decay"):
        assert_close(getattr(blk, name)[:, :, :T], getattr(ref, name)[:, :, :T], 1e-5, f"slots.{name}")
    np.testing.assert_array_equal(blk.doc, ref.doc)


def test_bad_calls_are_refused():
    q, k, v, w, beta, c = inputs(1, 4, 3, 2, 4, seed=0)
    with pytest.raises(ValueError, match="2 kv heads do not divide 3 query heads"):
        path_attention(q, k, v, w, beta)
    q, k, v, w, beta, c = inputs(1, 4, 2, 2, 4, seed=0)
    with pytest.raises(ValueError, match="impl='pallas' has no kernel"):
        path_attention(q, k, v, w, beta, impl="pallas")
    with pytest.raises(ValueError, match="give decay with slots.decay"):
        path_attention_cached(q, k, v, w, beta, empty_slots(1, 2, 8, 4, 4), jnp.zeros((1,), jnp.int32),
                              doc=jnp.zeros((1, 4), jnp.int32), decay=c)
