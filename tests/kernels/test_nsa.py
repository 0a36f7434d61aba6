"""NSA op: the block choice against a brute-force loop over the paper's definitions (compressed
attention probabilities, eq. 9's overlap weights, eq. 10's sum over a kv group, the forced initial
and local blocks), exact causality, and the given-choice path equal to the op's own choice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.nsa import NSASizes, nsa, nsa_select
from tests.util import assert_close

B, T, H, G, K = 2, 29, 4, 2, 8
SIZES = NSASizes(block_len=4, stride=2, select_len=4, num_selected=4, window=5)


def randn(seed, shape):
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), jnp.float32)


def inputs():
    q, k, v, kc, vc = (randn(i, (B, T, h, K)) for i, h in enumerate((H, G, G, G, G)))
    gates = jax.nn.sigmoid(randn(5, (B, T, H, 3)))
    seg = jnp.asarray(np.repeat([[0] * 11 + [1] * 18], B, axis=0), jnp.int32)
    return q, k, v, kc, vc, gates, seg


def brute_force_choice(q, kc, seg, *, block_len, stride, select_len, num_selected, window):
    """Per (row, query, kv group) the set of selected blocks, from the definitions written out."""
    q, kc, seg = (np.asarray(a, np.float64) for a in (q, kc, seg))
    R = H // G
    out = np.zeros((B, T, G), object)
    for b in range(B):
        for t in range(T):
            doc = [s for s in range(T) if seg[b, s] == seg[b, t]]
            p = doc.index(t)
            # compressed blocks i: document positions [i d, i d + l), complete at or before t
            blocks = [i for i in range(p + 1) if i * stride + block_len - 1 <= p]
            cur = p // select_len
            for g in range(G):
                score = np.zeros(cur + 1)
                for h in range(g * R, (g + 1) * R):
                    if not blocks:
                        continue
                    ends = [doc[i * stride + block_len - 1] for i in blocks]
                    logits = np.array([q[b, t, h] @ kc[b, e, g] for e in ends]) * K ** -0.5
                    prob = np.exp(logits - logits.max())
                    prob /= prob.sum()
                    for i, pi in zip(blocks, prob):
                        span = set(range(i * stride, i * stride + block_len))
                        for j in range(cur + 1):
                            score[j] += pi * len(span & set(range(j * select_len, (j + 1) * select_len))) / stride
                forced = {j for j in (0, cur - 1, cur) if j >= 0}
                rest = sorted((j for j in range(1, cur - 1)), key=lambda j: (-score[j], j))
                out[b, t, g] = forced | set(rest[:num_selected - len(forced)])
    return out


def test_block_choice_matches_the_definition():
    q, k, v, kc, vc, gates, seg = inputs()
    got = np.asarray(jax.jit(lambda q, kc, seg: nsa_select(q, kc, SIZES, segment_ids=seg))(q, kc, seg))
    want = brute_force_choice(q, kc, seg, **dataclasses.asdict(SIZES))
    for index in np.ndindex(B, T, G):
        assert {int(n) for n in got[index] if n >= 0} == want[index], f"block choice at (b, t, g) = {index}"


def test_causal_and_the_given_choice_equals_the_own():
    q, k, v, kc, vc, gates, seg = inputs()
    run = jax.jit(lambda *a, selected=None: nsa(*a, SIZES, segment_ids=seg, selected=selected))
    o = run(q, k, v, kc, vc, gates)
    sel = nsa_select(q, kc, SIZES, segment_ids=seg)
    assert_close(run(q, k, v, kc, vc, gates, selected=sel), o, what="given choice")
    t0 = 17  # a change at t0 of every input leaves the outputs before t0 exactly as they were
    changed = [a.at[:, t0:].add(3.0) for a in (q, k, v, kc, vc, gates)]
    np.testing.assert_array_equal(np.asarray(run(*changed))[:, :t0], np.asarray(o)[:, :t0])


def test_bad_arguments():
    x = jnp.zeros((1, 8, 2, 4))
    g = jnp.zeros((1, 8, 2, 3))
    with pytest.raises(ValueError, match="stride=3 must divide"):
        nsa(x, x, x, x, x, g, dataclasses.replace(SIZES, stride=3))
    with pytest.raises(ValueError, match="num_selected=2"):
        nsa(x, x, x, x, x, g, dataclasses.replace(SIZES, num_selected=2))
