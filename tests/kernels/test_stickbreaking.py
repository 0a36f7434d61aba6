"""Stick-breaking attention (kernels/stickbreaking): the reference against a numpy loop of the paper's
equations (the stick broken key by key, nearest first, within each document), and the dense XLA form
against the reference on outputs, the leftover stick r and the gradients of q, k and v (T = 1, odd T,
GQA, packed documents, queries against a longer, heads-first key sequence with their own positions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.stickbreaking import stickbreaking
from tests.util import assert_close


def inputs(B, T, S, H, G, K, seed):
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    return n(B, T, H, K) * 2.0, n(B, S, G, K), n(B, S, G, K)  # larger logits: β spread over (0, 1)


def packed(B, T, seed):
    """(B, T) int32 segment ids: a few documents per row, of random lengths."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32))


def stick_loop(q, k, v, seg):
    """The paper's process, one query at a time in float64: the stick (length 1) is broken by the keys
    j < i of i's document from the nearest back, key j taking β_ij = σ(q_i . k_j / sqrt(K)) of what is left."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, K = q.shape
    R = H // k.shape[2]
    o, rem = np.zeros((B, T, H, v.shape[-1])), np.zeros((B, T, H))
    for b in range(B):
        for h in range(H):
            for i in range(T):
                stick = 1.0
                for j in range(i - 1, -1, -1):
                    if seg[b, j] != seg[b, i]:
                        continue
                    beta = 1 / (1 + np.exp(-q[b, i, h] @ k[b, j, h // R] / K ** 0.5))
                    o[b, i, h] += beta * stick * v[b, j, h // R]
                    stick *= 1 - beta
                rem[b, i, h] = stick
    return o, rem


def test_reference_matches_the_papers_process():
    B, T, H, G, K = 2, 9, 4, 2, 8
    q, k, v = inputs(B, T, T, H, G, K, seed=0)
    seg = packed(B, T, seed=1)
    run = jax.jit(lambda *a: [stickbreaking(*a, segment_ids=seg, impl=i) for i in ("reference", "xla")])
    want_o, want_r = stick_loop(q, k, v, np.asarray(seg))
    for impl, (o, r) in zip(("reference", "xla"), run(q, k, v)):
        assert_close(o, want_o, 1e-5, f"{impl}: o")
        assert_close(r, want_r, 1e-5, f"{impl}: r")


# (B, T, S, H, G, packed, heads first with own positions): T = 1, odd T with GQA and packed documents, and
# T queries at the last positions of S keys in a KV cache's layout, the keys' documents their own.
CASES = {
    "T1": (2, 1, 1, 2, 2, False, False),  # o = 0, r = 1
    "odd-gqa2-packed": (2, 13, 13, 4, 2, True, False),
    "cache-layout": (2, 5, 11, 4, 1, True, True),
}


@pytest.mark.parametrize("case", CASES)
def test_xla_matches_reference(case):
    B, T, S, H, G, pack, cache = CASES[case]
    K = 8
    q, k, v = inputs(B, T, S, H, G, K, seed=2)
    kw = {}
    if pack:
        seg = packed(B, S, seed=3)
        kw = dict(segment_ids=seg[:, S - T:], kv_segment_ids=seg)
    if cache:  # heads first, and the queries at positions 6..10 of the 11 keys: as a decode call sees them
        k, v = (a.transpose(0, 2, 1, 3) for a in (k, v))  # (B, G, S, K)
        kw.update(kv_heads_first=True, q_positions=jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T)))
    rng = np.random.default_rng(4)
    ct = (jnp.asarray(rng.standard_normal((B, T, H, K)).astype(np.float32)),
          jnp.asarray(rng.standard_normal((B, T, H)).astype(np.float32)))

    @jax.jit
    def both(q, k, v):
        out = {}
        for impl in ("reference", "xla"):
            y, vjp = jax.vjp(lambda *a, impl=impl: stickbreaking(*a, impl=impl, **kw), q, k, v)
            out[impl] = (*y, *vjp(ct))
        return out

    out = both(q, k, v)
    if S == 1:  # a lone token sees no key: nothing taken, the whole stick left, no gradient
        for impl in out:
            np.testing.assert_array_equal(out[impl][0], 0.0)
            np.testing.assert_array_equal(out[impl][1], 1.0)
        return
    for name, got, want in zip(("o", "r", "dq", "dk", "dv"), out["xla"], out["reference"]):
        assert np.abs(np.asarray(want)).max() > 1e-3, f"{name} ~ 0: a vacuous check"
        assert_close(got, want, 1e-5, f"{case}: {name}")


def test_bad_calls_are_refused():
    q, k, v = inputs(1, 4, 4, 3, 2, 4, seed=0)
    with pytest.raises(ValueError, match="2 kv heads do not divide 3 query heads"):
        stickbreaking(q, k, v)
    with pytest.raises(ValueError, match="impl='pallas' has no kernel"):
        stickbreaking(q, k[:, :, :1], v[:, :, :1], impl="pallas")
