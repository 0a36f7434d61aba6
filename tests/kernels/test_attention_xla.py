"""The XLA attention forms (kernels/attention/xla.py) against the reference: outputs and the
gradients of q, k and v, dense and blocked (16-token blocks here, so ragged T spans several blocks
and skipped pairs), on the Pallas tests' cases: ragged T, GQA ratios 1 and 4, one kv head, causal or
not, sliding window, packed documents, a decode-style call against a longer cache with empty slots
and a query that sees no key, bfloat16."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from kernels.attention import Band, CacheView, Tokens, attention, xla
from kernels.attention.reference import attention_reference
from tests.kernels.test_attention_pallas import CASES, _compare, _inputs, _out_and_grads, _packed
from tests.util import assert_close

FORMS = ("dense", "blocked")


@pytest.fixture(params=FORMS)
def form(request, monkeypatch):
    """The form attention_xla takes: dense always, or blocked always, with 16-token blocks."""
    if request.param == "dense":
        monkeypatch.setattr(xla, "DENSE_MAX", 2 ** 62)
    else:
        monkeypatch.setattr(xla, "DENSE_MAX", 0)
        monkeypatch.setattr(xla, "BLOCK", 16)
        monkeypatch.setattr(xla, "LONG_BLOCK", 16)
    return request.param


def compare(q, k, v, ct, kw, tol):
    """attention_xla (inputs' dtype) against the float32 reference on o, dq, dk, dv; returns its o."""
    return _compare(q, k, v, ct, kw, tol, block_sizes=None,
                    kernel=lambda q, k, v, block_sizes, **kw: xla.attention_xla(q, k, v, **kw))


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, form):
    B, T, H, G, K, V, causal, window, packed = CASES[case]
    q, k, v, ct = _inputs(B, T, T, H, G, K, V)
    compare(q, k, v, ct, dict(causal=causal, band=Band(window), segment_ids=_packed(B, T, 5) if packed else None),
            1e-4)


def test_decode_style_call_against_a_cache(form):
    """3 queries at slots 20..22 of a 40-slot cache (unwritten slots: document -1); row 0's document
    has no key in the cache, so its queries see nothing and return zeros."""
    B, T, S, H, G, K = 2, 3, 40, 4, 2, 16
    q, k, v, ct = _inputs(B, T, S, H, G, K, K, seed=10)
    cache_doc = jnp.where(jnp.arange(S) < 23, jnp.array([[0], [1]]), -1).at[1, 22].set(2).at[1, 5:15].set(0)
    kw = dict(segment_ids=jnp.array([[7, 7, 7], [1, 1, 2]], jnp.int32), band=Band(window=6),
              tokens=Tokens(kv_segment_ids=cache_doc, q_positions=jnp.arange(20, 23, dtype=jnp.int32)[None]))
    o = compare(q, k, v, ct, kw, 1e-4)
    assert float(jnp.abs(o[0]).max()) == 0.0


def test_one_query_against_a_long_cache_reads_only_written_blocks(form):
    """A decode step at slot 37 of a 100-slot cache: the blocked form skips the blocks past it."""
    q, k, v, ct = _inputs(2, 1, 100, 4, 1, 16, 16, seed=20)
    compare(q, k, v, ct, dict(tokens=Tokens(q_positions=jnp.array([[37], [37]], jnp.int32))), 1e-4)


def test_bfloat16(form):
    B, T, H, G, K, V, causal, window, _ = CASES["gqa4-window-packed-K8"]
    q, k, v, ct = _inputs(B, T, T, H, G, K, V, dtype=jnp.bfloat16, seed=30)
    compare(q, k, v, ct, dict(causal=causal, band=Band(window), segment_ids=_packed(B, T, 6)), 2e-2)


def test_auto_and_xla_take_the_xla_form_on_cpu_and_reference_the_reference():
    q = jnp.zeros((1, 8, 2, 16))
    jaxpr = lambda impl: str(jax.make_jaxpr(partial(attention, impl=impl))(q, q, q))
    marker = "is_finite"  # the reference's guard of its hand-written softmax
    assert marker in jaxpr("reference") and marker not in jaxpr("xla")
    if jax.default_backend() == "cpu":
        assert marker not in jaxpr("auto")


def test_explicit_key_positions_in_any_order(form):
    """Key positions given (here shuffled): the blocked form tests every block pair instead of a range."""
    import numpy as np

    q, k, v, ct = _inputs(1, 29, 29, 4, 2, 16, 16, seed=40)
    kp = jnp.asarray(np.random.default_rng(0).permutation(29), jnp.int32)[None]
    tokens = Tokens(kv_positions=kp, q_positions=jnp.arange(29, dtype=jnp.int32)[None])
    compare(q, k, v, ct, dict(tokens=tokens, band=Band(window=11)), 1e-4)


def test_keys_heads_first_are_the_same_call():
    q, k, v, _ = _inputs(2, 9, 9, 4, 2, 16, 16, seed=50)
    heads_first = attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), kv_heads_first=True,
                            band=Band(window=4))
    for impl in ("reference", "xla"):
        assert_close(attention(q, k, v, band=Band(window=4), impl=impl), heads_first, 1e-5, impl)


@pytest.mark.parametrize("T,window", [(1, None), (3, 6), (12, None)])
def test_attention_cached_reads_the_cache_before_the_step(T, window, monkeypatch):
    """attention_cached (the cache before the step beside the step's own keys) equals writing the
    step's keys into the cache and attending with the reference: outputs and gradients, packed
    documents, stale keys in unwritten slots (they must stay unseen), rows holding different numbers
    of tokens, T = 12 through the write-then-attend path (DENSE_MAX lowered below T * S)."""
    from kernels.attention import attention_cached
    if T == 12:
        monkeypatch.setattr("kernels.attention.DENSE_MAX", 0)
    B, S, H, G, K, index = 2, 40, 4, 2, 16, jnp.array([17, 11], jnp.int32)
    q, k, v, ct = _inputs(B, T, T, H, G, K, K, seed=3)
    ck, cv = (jax.random.normal(jax.random.key(i), (B, G, S, K)) for i in (4, 5))  # stale past `index` too
    cache_doc = jnp.broadcast_to(jnp.array([[0], [1]], jnp.int32), (B, S)).at[1, 3:8].set(0)  # stale slots too
    doc = jnp.array([[0] * T, [1] * (T - 1) + [2]], jnp.int32)

    def reference(q, k, v):
        rows = lambda axis: jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, axis))
        write = lambda c, x: rows(1)(c, x.transpose(0, 2, 1, 3), index)  # row b's slots from index[b]
        seg = rows(0)(cache_doc, doc, index)
        return attention_reference(q, write(ck, k).transpose(0, 2, 1, 3), write(cv, v).transpose(0, 2, 1, 3),
                                   segment_ids=doc, band=Band(window),
                                   tokens=Tokens(kv_segment_ids=seg, q_positions=index[:, None] + jnp.arange(T)[None]))

    def cached(q, k, v, impl):
        return attention_cached(q, k, v, CacheView(ck, cv, index, cache_doc), segment_ids=doc, band=Band(window),
                                impl=impl)

    want = _out_and_grads(lambda q, k, v: reference(q, k, v), q, k, v, ct, kw={})
    for impl in ("xla", "reference"):
        got = jax.jit(partial(_out_and_grads, partial(cached, impl=impl), kw={}))(q, k, v, ct)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
            assert_close(a, b, 1e-5, f"{impl} {name}")


SPARSE = {  # the masks of reference.py beyond the window: sinks, dilation, per head, growing spans
    "sinks": Band(window=5, sinks=3),
    "dilated": Band(window=4, dilation=3, sinks=1),
    "per-head": Band(window=(3, 2 ** 30, 6, 2), sinks=(0, 2, 1, 4), dilation=(1, 1, 2, 4)),
    "growth": Band(window=(2, 1, 3, 1), growth=(0.0, 0.5, 0.25, 1.0), sinks=(1, 0, 2, 0)),
}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", SPARSE)
def test_sparse_masks_match_reference(name, packed, form):
    """Outputs and gradients at ragged T = 45 (16-token blocks: the sinks' blocks lie below the
    window's range), packed documents (each with its own sinks)."""
    B, T, H, G, K = 2, 45, 4, 2, 16
    q, k, v, ct = _inputs(B, T, T, H, G, K, K, seed=60)
    compare(q, k, v, ct, dict(band=SPARSE[name], segment_ids=_packed(B, T, 7) if packed else None), 1e-4)


def test_traced_per_head_masks_match_reference(form):
    """Per-head parameters as jit arguments (no static bounds: the blocked form skips by causality
    only), outputs and gradients, packed."""
    B, T, H, G, K = 2, 37, 4, 1, 16
    q, k, v, ct = _inputs(B, T, T, H, G, K, K, seed=61)
    seg = _packed(B, T, 8)
    growth = SPARSE["growth"]
    band = dict(window=growth.window, sinks=growth.sinks, dilation=(1, 2, 1, 3), growth=growth.growth)
    band = {n: jnp.asarray(x) for n, x in band.items()}

    def run(attn, q, k, v, ct, band):
        return _out_and_grads(lambda q, k, v: attn(q, k, v, segment_ids=seg, band=Band(**band)), q, k, v, ct, kw={})

    got = jax.jit(partial(run, xla.attention_xla))(q, k, v, ct, band)
    want = jax.jit(partial(run, attention_reference))(q, k, v, ct, band)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert_close(a, b, 1e-4, name)


def test_sinks_with_explicit_key_positions(form):
    """Keys in any order (every block pair behind its test): the blocks holding sinks are kept."""
    import numpy as np

    q, k, v, ct = _inputs(1, 40, 40, 4, 2, 16, 16, seed=62)
    kp = jnp.asarray(np.random.default_rng(1).permutation(40), jnp.int32)[None]
    compare(q, k, v, ct, dict(tokens=Tokens(kv_positions=kp, q_positions=jnp.arange(40, dtype=jnp.int32)[None]),
                              band=Band(window=4, sinks=2, dilation=2)), 1e-4)


@pytest.mark.parametrize("T", [1, 4, 30])
def test_attention_cached_on_a_ring_of_slots(T, monkeypatch):
    """A cache whose slots hold positions out of order (a ring buffer, with unwritten and stale slots)
    equals the reference on the same keys at their positions; T = 30 attends to the cache beside the
    new keys (the blocked form), never writing first. Sinks of the document, a dilated window."""
    import numpy as np

    from kernels.attention import attention_cached
    if T == 30:  # past DENSE_MAX: the blocked form, with 16-token blocks
        monkeypatch.setattr("kernels.attention.DENSE_MAX", 0)
        for name, value in (("DENSE_MAX", 0), ("BLOCK", 16), ("LONG_BLOCK", 16)):
            monkeypatch.setattr(xla, name, value)
    B, S, H, G, K = 2, 12, 4, 2, 16
    index = jnp.array([25, 9], jnp.int32)
    q, k, v, ct = _inputs(B, T, T, H, G, K, K, seed=63)
    ck, cv = (jax.random.normal(jax.random.key(i), (B, G, S, K)) for i in (6, 7))
    rng = np.random.default_rng(2)
    rows = (np.r_[0:3, 16:25], np.r_[-1, 0:9, 30, 31])  # sinks and a window; unwritten (-1) and stale (30, 31)
    pos = jnp.asarray(np.stack([rng.permutation(r) for r in rows]), jnp.int32)
    doc = jnp.zeros((B, S), jnp.int32)
    seg = jnp.zeros((B, T), jnp.int32).at[1, T // 2 + 1:].set(1)
    slots = index[:, None] + jnp.arange(T)[None]
    cpos = jnp.where(seg == 0, slots, slots - (index[:, None] + T // 2 + 1))  # positions in the document
    band = Band(window=4, sinks=2, dilation=2)

    def reference(q, k, v):
        seen = (pos >= 0) & (pos < index[:, None])
        kp = jnp.concatenate([jnp.where(seen, pos, 10 ** 6), slots], 1)
        cat = lambda c, x: jnp.concatenate([c.transpose(0, 2, 1, 3), x], 1)
        tokens = Tokens(kv_segment_ids=jnp.concatenate([doc, seg], 1), q_positions=slots, kv_positions=kp,
                        q_doc_positions=cpos)
        return attention_reference(q, cat(ck, k), cat(cv, v), segment_ids=seg, tokens=tokens, band=band)

    def cached(q, k, v):
        return attention_cached(q, k, v, CacheView(ck, cv, index, doc, positions=pos), segment_ids=seg,
                                doc_positions=cpos, band=band, impl="xla")

    want = jax.jit(partial(_out_and_grads, reference, kw={}))(q, k, v, ct)
    got = jax.jit(partial(_out_and_grads, cached, kw={}))(q, k, v, ct)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert_close(a, b, 1e-5, name)
