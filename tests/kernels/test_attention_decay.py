"""Attention with a decay (kernels/attention: logits + decay_i - kv_decay_j, Forgetting attention's
cumulative log forget gate): the reference against a brute-force loop over FoX's equation, the XLA
forms (dense and blocked, 16-token blocks) against the reference on outputs and the gradients of q, k,
v and the decay (odd T, GQA, windows, packed documents, queries against a longer key sequence with
their own kv_decay) and attention_cached against the full call (the Pallas kernels' decay:
test_attention_pallas.py)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import Band, CacheView, Tokens, attention, attention_cached, xla
from kernels.attention.reference import attention_reference
from tests.kernels.test_attention_pallas import _inputs, _packed
from tests.util import assert_close


def log_gates(B, T, H, seed):
    """log f_t = log sigmoid(x), FoX's forget gate, for random logits x (B, T, H) float32 (numpy)."""
    x = np.random.default_rng(seed).standard_normal((B, T, H)).astype(np.float32) + 1.0
    return -np.logaddexp(0.0, -x)


def fox_loop(q, k, v, log_f, seg):
    """FoX (Lin et al., 2025, eq. 5), a loop per query: o_i = sum_j F_ij exp(q_i . k_j / sqrt(K)) v_j /
    sum_j F_ij exp(q_i . k_j / sqrt(K)) over the keys j <= i of i's document, F_ij = prod_{j < l <= i} f_l."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, K = q.shape
    R = H // k.shape[2]
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for i in range(T):
                js = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
                F = [np.prod(np.exp(log_f[b, j + 1:i + 1, h])) for j in js]  # prod_{j < l <= i} f_l
                w = np.array([F_ij * np.exp(q[b, i, h] @ k[b, j, h // R] / K ** 0.5) for F_ij, j in zip(F, js)])
                o[b, i, h] = w @ v[b, js, h // R] / w.sum()
    return o


def test_reference_matches_the_papers_equation():
    """c_t = sum_{l <= t} log f_l over the whole packed row: its offset at a document start cancels in
    c_i - c_j, since a query sees only keys of its own document."""
    B, T, H, G, K = 2, 11, 4, 2, 8
    q, k, v, _ = _inputs(B, T, T, H, G, K, K, seed=1)
    log_f = log_gates(B, T, H, seed=2)
    seg = np.asarray(_packed(B, T, 3))
    o = attention_reference(q, k, v, segment_ids=jnp.asarray(seg), decay=jnp.asarray(np.cumsum(log_f, axis=1)))
    assert_close(o, fox_loop(q, k, v, log_f, seg), 1e-5, "FoX")


@pytest.fixture(params=("dense", "blocked"))
def form(request, monkeypatch):
    """The form attention_xla takes: dense always, or blocked always, with 16-token blocks."""
    if request.param == "dense":
        monkeypatch.setattr(xla, "DENSE_MAX", 2 ** 62)
    else:
        monkeypatch.setattr(xla, "DENSE_MAX", 0)
        monkeypatch.setattr(xla, "BLOCK", 16)
        monkeypatch.setattr(xla, "LONG_BLOCK", 16)
    return request.param


def out_and_grads(attn, q, k, v, decay, kv_decay, ct, kw):
    f = lambda *a: attn(*a[:3], decay=a[3], tokens=Tokens(kv_decay=a[4]), **kw)
    o, vjp = jax.vjp(f, q, k, v, decay, kv_decay)
    return o, *vjp(ct)


# (B, T, S, H, G, window, packed, own kv_decay): T = 1, ragged T over 16-token blocks, GQA 1, 2 and 4,
# a window, packed documents, and T queries (the last T positions) against S keys with their own decays.
CASES = {
    "T1": (2, 1, 1, 2, 2, None, False, False),
    "ragged-gqa2-packed": (2, 37, 37, 4, 2, None, True, False),
    "gqa4-window": (1, 21, 21, 4, 1, 7, False, False),
    "queries-against-longer-keys": (2, 9, 40, 4, 2, None, False, True),
}


@pytest.mark.parametrize("case", CASES)
def test_xla_forms_match_the_reference(case, form):
    B, T, S, H, G, window, packed, cross = CASES[case]
    q, k, v, ct = _inputs(B, T, S, H, G, 8, 8, seed=4)
    c = jnp.asarray(np.cumsum(log_gates(B, S, H, seed=5), axis=1))  # (B, S, H)
    decay, kv_decay = (c[:, S - T:], c) if cross else (c, None)
    kw = dict(band=Band(window), segment_ids=_packed(B, T, 6) if packed else None)
    got = jax.jit(partial(out_and_grads, partial(attention, impl="xla"), kw=kw))(q, k, v, decay, kv_decay, ct)
    want = jax.jit(partial(out_and_grads, attention_reference, kw=kw))(q, k, v, decay, kv_decay, ct)
    for name, a, b in zip(("o", "dq", "dk", "dv", "d decay", "d kv_decay"), got, want):
        if cross and name == "d decay":  # a query's shift cancels in its softmax: zero up to rounding
            assert float(jnp.abs(a).max()) < 1e-5 and float(jnp.abs(b).max()) < 1e-5, name
        elif b is not None:
            assert_close(a, b, 1e-4, name)


@pytest.mark.parametrize("T", [1, 12])
def test_attention_cached_equals_the_full_call(T, monkeypatch):
    """T new tokens at slots index[b] of a 40-slot cache with stale slots past them: the same outputs
    and gradients (q, k, v, the new decays) as `attention` over the written cache; T = 12 takes the
    write-then-attend path."""
    if T == 12:
        monkeypatch.setattr("kernels.attention.DENSE_MAX", 0)
    B, S, H, G, K, index = 2, 40, 4, 2, 8, jnp.array([17, 11], jnp.int32)
    q, k, v, ct = _inputs(B, T, T, H, G, K, K, seed=7)
    ck, cv = (jax.random.normal(jax.random.key(i), (B, G, S, K)) for i in (8, 9))
    c = jnp.asarray(np.cumsum(log_gates(B, S + T, H, seed=10), axis=1))  # (B, S + T, H)
    cache_c, new_c = jnp.swapaxes(c[:, :S], 1, 2), c[:, S:]  # (B, H, S), (B, T, H)

    def full(q, k, v, decay):
        rows = lambda axis: jax.vmap(lambda a, x, i: jax.lax.dynamic_update_slice_in_dim(a, x, i, axis))
        write = lambda a, x: rows(1)(a, jnp.swapaxes(x, 1, 2), index)  # row b's slots from index[b]
        pos = index[:, None] + jnp.arange(T)[None]
        return attention_reference(q, *(jnp.swapaxes(write(a, x), 1, 2) for a, x in ((ck, k), (cv, v))),
                                   decay=decay, tokens=Tokens(q_positions=pos,
                                                              kv_decay=jnp.swapaxes(write(cache_c, decay), 1, 2)))

    def cached(q, k, v, decay, impl):
        return attention_cached(q, k, v, CacheView(ck, cv, index, decay=cache_c), impl=impl, decay=decay)

    grads = lambda f: jax.jit(lambda *a: (f(*a), *jax.vjp(f, *a)[1](ct)))(q, k, v, new_c)
    want = grads(full)
    for impl in ("xla", "reference"):
        for name, a, b in zip(("o", "dq", "dk", "dv", "d decay"), grads(partial(cached, impl=impl)), want):
            # d decay sums dS, whose rows sum to zero (softmax): values ~1e-4 here, small against the terms
            # they sum, so float32 rounding is a larger part of them (2e-4 under the suite's compile flags)
            assert_close(a, b, 1e-3 if name == "d decay" else 1e-5, f"{impl} {name}")
