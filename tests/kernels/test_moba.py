"""MoBA op: the block choice against a brute-force loop over the paper's definition, and the XLA form
against the dense-masked reference with the same block choice (outputs and gradients), on odd T,
T not a multiple of the block, T = 1, GQA and packed documents."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.moba import moba, moba_gate, moba_reference, select_blocks
from kernels.moba.xla import moba_dense, moba_gathered
from tests.util import assert_close

# B, T, H, G, K, block_size, top_k, packed
CASES = [(2, 37, 4, 2, 8, 4, 3, True), (1, 1, 2, 1, 8, 4, 3, False), (1, 20, 2, 2, 4, 8, 2, False)]


def randn(seed, shape):
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), jnp.float32)


def packed_ids(B, T, seed=0):
    return jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, 3, (B, T)), axis=1), jnp.int32)


def brute_force_choice(q, k, seg, b, top_k):
    """Per (row, query, head): the set of earlier complete blocks of the query's document that MoBA
    selects, by the definition: block n = the document's positions [n b, (n + 1) b), gate = q . mean
    of its keys, the top_k - 1 highest (ties to the lower n)."""
    q, k, seg = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(seg)
    B, T, H, _ = q.shape
    R = H // k.shape[2]
    out = np.zeros((B, T, H), object)
    for bi in range(B):
        for t in range(T):
            doc = [s for s in range(T) if seg[bi, s] == seg[bi, t]]
            p = doc.index(t)
            for h in range(H):
                blocks = [doc[n * b:(n + 1) * b] for n in range(p // b)]
                score = [q[bi, t, h] @ k[bi, keys, h // R].mean(axis=0) for keys in blocks]
                order = sorted(range(len(blocks)), key=lambda n: (-score[n], n))
                out[bi, t, h] = set(order[:top_k - 1])
    return out


FORMS = {"reference": moba_reference, "dense": moba_dense, "gathered": moba_gathered}


@functools.partial(jax.jit, static_argnames=("form", "block_size", "top_k"))
def outputs_and_grads(q, k, v, w, seg, selected, *, form, block_size, top_k):
    def loss(q, k, v):
        o = FORMS[form](q, k, v, block_size=block_size, top_k=top_k, segment_ids=seg, selected=selected)
        return jnp.sum(o * w), o
    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}G{}K{}b{}k{}".format(*c[:7]))
def test_block_choice_and_forms_match_reference(case):
    B, T, H, G, K, b, top_k, packed = case
    q, k, v, w = randn(0, (B, T, H, K)), randn(1, (B, T, G, K)), randn(2, (B, T, G, K)), randn(3, (B, T, H, K))
    seg = packed_ids(B, T) if packed else None
    selected = jax.jit(lambda q, k, seg: select_blocks(moba_gate(q, k, b, seg), top_k))(q, k, seg)
    want = brute_force_choice(q, k, np.zeros((B, T)) if seg is None else seg, b, top_k)
    got = np.asarray(selected)
    for index in np.ndindex(B, T, H):
        assert {int(n) for n in got[index] if n >= 0} == want[index], f"block choice at (b, t, h) = {index}"
    ref_grads, ref = outputs_and_grads(q, k, v, w, seg, selected, form="reference", block_size=b, top_k=top_k)
    for form, name, sel in (("gathered", "same blocks", selected), ("gathered", "own choice", None),
                            ("dense", "own choice", None)):
        grads, o = outputs_and_grads(q, k, v, w, seg, sel, form=form, block_size=b, top_k=top_k)
        assert_close(o, ref, what=f"{form} o, {name}")
        for g, want_g, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
            assert_close(g, want_g, what=f"{form} {what}, {name}")


def test_selection_is_sparse_and_always_has_the_own_block():
    """With top_k = 1 a query sees only its own block: a key in another block changes nothing."""
    q, k, v = randn(0, (1, 12, 2, 4)), randn(1, (1, 12, 2, 4)), randn(2, (1, 12, 2, 4))
    run = jax.jit(lambda k: moba_gathered(q, k, v, block_size=4, top_k=1))
    o, o2 = run(k), run(k.at[:, 0].add(100.0))
    np.testing.assert_array_equal(np.asarray(o)[:, 4:], np.asarray(o2)[:, 4:])


def test_bad_arguments():
    q = jnp.zeros((1, 4, 2, 4))
    with pytest.raises(ValueError, match="block_size=0"):
        moba(q, q, q, block_size=0, top_k=2)
    with pytest.raises(ValueError, match="kv heads do not divide"):
        moba(q, q[:, :, :1].repeat(3, 2), q[:, :, :1].repeat(3, 2), block_size=2, top_k=2)
    with pytest.raises(ValueError, match="impl"):
        moba(q, q, q, block_size=2, top_k=2, impl="pallas")
