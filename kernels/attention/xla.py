"""Softmax attention in XLA, fast in both directions: impl="xla" (and "auto" off GPU/TPU). The same
function, arguments and masks as reference.py, in two forms:

- `attention_dense`: every head's (T, S) scores at once, laid out heads first — queries (B, G, R,
  T, K) against keys (B, G, S, K), the R query heads of a kv head as a batch dimension, K/V never
  copied — masked by a finite -1e30 and normalised by jax.nn.softmax, whose autodiff XLA turns into
  a few fused passes. The reference's masked softmax written out by hand (where, max, exp, where,
  divide) on a (B, G, R, T, S) layout is what made attention training slow on CPU: at B=8, T=256,
  H=4, K=32 its forward+backward takes 48-52 ms, this form 9-12 ms (benchmarks/attention.py).
- blocked (`_blocked`): query blocks against key blocks with the online softmax of flash attention
  (Dao et al., 2022), so no (T, S) scores are ever held, and a block pair that no query of the
  block can see is skipped (`lax.cond`): above the causal diagonal, outside the sliding window (and
  not among the document's sinks), a KV cache's slots after the last written one. Its custom_vjp is
  flash attention's backward (Dao, 2023): per block pair, P = exp(S - lse) recomputed, dV += P^T dO,
  dS = P (dO V^T - rowsum(dO o O)), dQ += dS K, dK += dS^T Q.

A `decay` (reference.py: logits + decay_i - kv_decay_j) is added to the logits where they are made, in
both forms; the dense form differentiates it by autodiff, the blocked backward adds d kv_decay_j -=
colsum(dS) (dS the logits' gradient, before `scale`). d decay_i = rowsum(dS) is exactly zero (a shift of
a query's logits cancels in its softmax; the query's term only keeps the logits small, c_i - c_j <= 0).

`attention_xla` takes the blocked form when the (T, S) scores of a row would exceed DENSE_MAX
entries. Key positions in slot order (the default, and every KV cache) make the blocks a query
block needs one contiguous range, which the loop visits alone (cost proportional to the keys it
can see); explicit key positions make it test every pair (`lax.cond`): a pair is skipped when its
positions prove it fully masked (min key position above the queries' max for causal; max key
position at or below the queries' min minus the window, and no sink of the queries' documents).

Skipping by the window reads static bounds: the largest window * dilation over the heads (and the
largest growth and sinks), when window, sinks, dilation and growth are all Python numbers or tuples.
When any field of the Band is a traced array (per-head masks under calibration), only causality skips blocks:
every block pair under the diagonal is computed and masked, which is exact for any values.

Keys and values may come heads first, (B, G, S, K) (`kv_heads_first`): the layout of the KV cache
(layers/attention.py), which a decode step then reads without a transpose (at 4K slots, 8 heads on
2 kv heads of 32, the transpose from (B, S, G, K) took about half of a step's attention). A decode
step reads the cache as it was before the step, its own keys beside it (`attention_dense_parts`, through
kernels.attention.attention_cached), and writes it afterwards: inside a decode loop XLA then updates
the loop-carried cache in place (with `xla_cpu_copy_insertion_use_region_analysis`, which
infer/generate.py sets for its loop) instead of copying it every step (one GQA layer at 4K slots:
405 us per step written first, 161 read first; 185 with no write at all).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from kernels.attention.masks import Band, Tokens
from kernels.attention.reference import (
    decay_bias,
    default_positions,
    doc_positions,
    grouped,
    heads_first_decay,
    visible,
)

NEG = -1e30  # finite: a row that sees no key stays free of NaN (its output is zeroed separately)
DENSE_MAX = 128 * 128  # scores per (row, head) above which the blocked form is used
BLOCK = 128  # query and key block of the blocked form (training lengths: the working set stays in cache)
LONG_BLOCK = 512  # ... and for calls longer than 1024 (fewer block pairs; 4K prefill 80 -> 54 ms)


def attention_xla(q: Float[Array, "B T H K"], k: Array, v: Array, *, segment_ids: Int[Array, "B T"] | None = None,
                  tokens: Tokens | None = None, band: Band | None = None, causal: bool = True,
                  scale: float | None = None, decay: Float[Array, "B T H"] | None = None,
                  kv_heads_first: bool = False) -> Float[Array, "B T H V"]:
    """k, v: (B, S, G, K|V), or (B, G, S, K|V) with kv_heads_first. The masks and the decay of reference.py."""
    kt, vt = (k, v) if kv_heads_first else (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))  # (B, G, S, K)
    T, S = q.shape[1], kt.shape[2]
    tokens, band = Tokens() if tokens is None else tokens, Band() if band is None else band
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qp, kp = default_positions(T, S, tokens)
    kv_seg = segment_ids if tokens.kv_segment_ids is None else tokens.kv_segment_ids
    _, sinks, _, growth = band.terms()
    qdp = None if sinks is None and growth is None else doc_positions(T, S, tokens, segment_ids, qp)
    kv_decay = decay if tokens.kv_decay is None else tokens.kv_decay
    if T * S > DENSE_MAX:
        arrays = tuple(None if x is None else jnp.asarray(x) for x in band.terms())
        qc, kc = (None, None) if decay is None else (heads_first_decay(d, kt.shape[1]) for d in (decay, kv_decay))
        return _blocked(q, kt, vt, qp, kp, segment_ids, kv_seg, qdp, arrays, causal, _skip(band), scale,
                        tokens.kv_positions is None, qc, kc)
    bias = None if decay is None else decay_bias(decay, kv_decay, kt.shape[1])
    return attention_dense(q, kt, vt, visible(qp, kp, segment_ids, kv_seg, causal, band, qdp), scale, bias)


def _skip(band: Band):
    """The static bounds block skipping reads: (reach, growth, sinks), the largest window * dilation,
    growth and sinks over the heads; None (skip by causality only) when there is no window or any
    field is a traced array."""
    window, sinks, dilation, growth = band.terms()
    if window is None or any(isinstance(x, jax.Array) for x in band.terms()):
        return None
    top = lambda x, none: none if x is None else max(np.atleast_1d(x).tolist())
    reach = max((np.atleast_1d(window) * np.atleast_1d(top(dilation, 1))).tolist())
    return None if reach >= 2 ** 29 else (int(reach), float(top(growth, 0.0)), int(top(sinks, 0)))


def _heads_first(q, G: int):
    B, T, H, K = q.shape
    return q.reshape(B, T, G, H // G, K).transpose(0, 2, 3, 1, 4)  # (B, G, R, T, K)


def _tokens_first(o, dtype):
    B, G, R, T, V = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, G * R, V).astype(dtype)  # (B, T, H, V)


def attention_dense(q, kt, vt, mask: Array, scale: float, bias: Array | None = None):
    """kt, vt heads first (B, G, S, K|V); mask (B|1, H|1, T, S): True where a query sees a key; bias
    (B, G, R, T, S) float32 added to the logits (a decay), or None."""
    return attention_dense_parts(q, [(kt, vt, mask)], scale, None if bias is None else [bias])


def attention_dense_parts(q, parts, scale: float, biases: list | None = None):
    """attention_dense with the keys in parts [(kt, vt, mask)], one softmax over all of them: a decode
    step reads its KV cache as it was before the step and its own keys beside it (`attention_cached`).
    biases: one (B, G, R, T, S_i) logit bias per part, or None."""
    G = parts[0][0].shape[1]
    qt = _heads_first(q, G)
    masks = [grouped(m, G) for _, _, m in parts]  # (B|1, G|1, R|1, T, S_i)
    logits = [jnp.einsum("BGRTK,BGSK->BGRTS", qt, kt, preferred_element_type=jnp.float32) * scale
              for kt, _, _ in parts]
    if biases is not None:
        logits = [x + b for x, b in zip(logits, biases)]
    s = [jnp.where(m, x, NEG) for x, m in zip(logits, masks)]
    p = jax.nn.softmax(jnp.concatenate(s, axis=-1), axis=-1)
    o, at = 0.0, 0
    for (_, vt, _), si in zip(parts, s):
        o = o + jnp.einsum("BGRTS,BGSV->BGRTV", p[..., at:at + si.shape[-1]], vt.astype(jnp.float32))
        at += si.shape[-1]
    seen = functools.reduce(jnp.logical_or, [jnp.any(m, axis=-1) for m in masks])
    return _tokens_first(o * seen[..., None], q.dtype)  # a query that sees no key: zeros


def _pad(x, axis, size, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _blocks(qp, kp, qseg, kvseg, qdp, T, S, bq, bk):
    """Positions and segments padded to whole blocks (padded keys are never visible, padded queries
    see nothing and are dropped), and the bounds of each block: its queries' positions (lo, hi), their
    documents' starts (lo, hi) and largest position inside the document, its keys' positions (lo, hi)."""
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    big = jnp.iinfo(jnp.int32).max // 2
    qp, kp = _pad(qp.astype(jnp.int32), 1, Tp, -big), _pad(kp.astype(jnp.int32), 1, Sp, big)
    kvalid = _pad(jnp.ones((1, S), bool), 1, Sp, False)
    qseg = None if qseg is None else _pad(qseg, 1, Tp, -1)
    kvseg = None if kvseg is None else _pad(kvseg, 1, Sp, -2)
    qdp = jnp.zeros_like(qp) if qdp is None else _pad(qdp.astype(jnp.int32), 1, Tp, 0)
    by_q = lambda f, x: f(x.reshape(x.shape[0], -1, bq), axis=(0, 2))  # (nq,)
    k_lo, k_hi = (f(kp.reshape(kp.shape[0], -1, bk), axis=(0, 2)) for f in (jnp.min, jnp.max))  # (nk,)
    bounds = (by_q(jnp.min, qp), by_q(jnp.max, qp), k_lo, k_hi, by_q(jnp.min, qp - qdp), by_q(jnp.max, qp - qdp),
              by_q(jnp.max, qdp))
    return qp, kp, kvalid, qseg, kvseg, qdp, bounds


def _lowest(bounds, i, skip):
    """The key position below which query block i sees only its documents' sinks (`_skip`'s bounds)."""
    reach, growth, _ = skip
    c_hi = bounds[6][i]
    return bounds[0][i] - reach - (jnp.ceil(growth * (c_hi + 1)).astype(jnp.int32) if growth else 0)


def _worth(bounds, i, j, causal, skip):
    """False when positions prove block pair (i, j) fully masked."""
    q_lo, q_hi, k_lo, k_hi, st_lo, st_hi, _ = bounds
    keep = jnp.bool_(True)
    if causal:
        keep = keep & (k_lo[j] <= q_hi[i])
    if skip is not None:
        near = k_hi[j] > _lowest(bounds, i, skip)
        if skip[2]:  # a sink of a query's document: position in [start, start + sinks)
            near = near | (k_lo[j] < st_hi[i] + skip[2]) & (k_hi[j] >= st_lo[i])
        keep = keep & near
    return keep


def _key_loop(bounds, i, causal, skip, in_order, body, init):
    """body(j, carry) over the key blocks query block i may see: with keys in slot order the blocks of
    its documents' sinks and one range [lo, hi) (while loops of that many steps), else every block,
    each behind a lax.cond."""
    q_lo, q_hi, k_lo, k_hi, st_lo, st_hi, _ = bounds
    nk = k_lo.shape[0]
    if not in_order:
        return lax.fori_loop(0, nk, lambda j, c: lax.cond(_worth(bounds, i, j, causal, skip), lambda c: body(j, c),
                                                          lambda c: c, c), init)
    find = lambda a, x, side: jnp.searchsorted(a, x, side=side).astype(jnp.int32)
    hi = find(k_lo, q_hi[i], "right") if causal else jnp.int32(nk)
    lo = jnp.int32(0) if skip is None else find(k_hi, _lowest(bounds, i, skip), "right")
    if skip is not None and skip[2]:  # the sinks' blocks below the window's range first
        s_lo, s_hi = find(k_hi, st_lo[i], "left"), find(k_lo, st_hi[i] + skip[2], "left")
        init = lax.fori_loop(s_lo, jnp.maximum(s_lo, jnp.minimum(jnp.minimum(s_hi, lo), hi)), body, init)
    return lax.fori_loop(lo, jnp.maximum(lo, hi), body, init)


def _mask(qp, kp, kvalid, qseg, kvseg, qdp, band, i, j, bq, bk, causal, G):
    sl = lambda x, at, n: lax.dynamic_slice_in_dim(x, at * n, n, axis=1)
    m = visible(sl(qp, i, bq), sl(kp, j, bk), None if qseg is None else sl(qseg, i, bq),
                None if kvseg is None else sl(kvseg, j, bk), causal, Band(*band), sl(qdp, i, bq))
    return grouped(m & sl(kvalid, j, bk)[:, None, None, :], G)  # (B|1, G|1, R|1, bq, bk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def _blocked(q, kt, vt, qp, kp, qseg, kvseg, qdp, band, causal, skip, scale, in_order, qc=None, kc=None):
    """The blocked form on the arguments of attention_xla after defaults are filled in: q (B, T, H, K),
    kt/vt heads first (B, G, S, K|V), positions (B|1, T) / (B|1, S), segments (B, T) / (B, S) or None,
    the queries' positions in their documents (B|1, T) or None, band the arrays (or None) of
    Band.terms() (differentiated as zeros). skip: `_skip`'s static bounds. in_order: key positions
    ascend with the slots. qc (B, G, R, T) / kc (B, G, R, S): a decay heads first, or None."""
    return _blocked_fwd(q, kt, vt, qp, kp, qseg, kvseg, qdp, band, causal, skip, scale, in_order, qc, kc)[0]


def _sizes(T, S):
    b = BLOCK if max(T, S) <= 1024 else LONG_BLOCK
    return min(b, T), min(b, S)


def _logits(qi, kj, scale, qc, kc, i, j, bq, bk):
    """A block pair's logits (B, G, R, bq, bk) float32: q . k * scale, plus qc_i - kc_j with a decay."""
    s = jnp.einsum("BGRQK,BGSK->BGRQS", qi, kj, preferred_element_type=jnp.float32) * scale
    if qc is None:
        return s
    qci, kcj = lax.dynamic_slice_in_dim(qc, i * bq, bq, axis=3), lax.dynamic_slice_in_dim(kc, j * bk, bk, axis=3)
    return s + qci[..., :, None] - kcj[..., None, :]


def _blocked_fwd(q, k, v, qp, kp, qseg, kvseg, qdp, band, causal, skip, scale, in_order, qc=None, kc=None):
    T, S = q.shape[1], k.shape[2]  # k, v heads first
    bq, bk = _sizes(T, S)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    qt, kt, vt = _pad(_heads_first(q, k.shape[1]), 3, Tp), _pad(k, 2, Sp), _pad(v, 2, Sp)
    qcp, kcp = (None, None) if qc is None else (_pad(qc, 3, Tp), _pad(kc, 3, Sp))
    qpp, kpp, kvalid, qs, ks, qds, bounds = _blocks(qp, kp, qseg, kvseg, qdp, T, S, bq, bk)
    B, G, R, _, K = qt.shape
    V = vt.shape[-1]

    def query_block(i):
        qi = lax.dynamic_slice_in_dim(qt, i * bq, bq, axis=3)  # (B, G, R, bq, K)

        def key_block(j, carry):
            m, l, acc = carry
            kj, vj = (lax.dynamic_slice_in_dim(x, j * bk, bk, axis=2) for x in (kt, vt))  # (B, G, bk, K)
            mask = _mask(qpp, kpp, kvalid, qs, ks, qds, band, i, j, bq, bk, causal, G)
            s = jnp.where(mask, _logits(qi, kj, scale, qcp, kcp, i, j, bq, bk), NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None]) * mask  # exactly 0 where masked
            a = jnp.exp(m - m_new)
            acc = acc * a[..., None] + jnp.einsum("BGRQS,BGSV->BGRQV", p, vj.astype(jnp.float32))
            return m_new, l * a + jnp.sum(p, axis=-1), acc

        init = (jnp.full((B, G, R, bq), NEG, jnp.float32), jnp.zeros((B, G, R, bq), jnp.float32),
                jnp.zeros((B, G, R, bq, V), jnp.float32))
        m, l, acc = _key_loop(bounds, i, causal, skip, in_order, key_block, init)
        seen = l > 0
        o = acc / jnp.where(seen, l, 1.0)[..., None]
        return o, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)  # lse; 0 for rows that see nothing

    o, lse = lax.map(query_block, jnp.arange(Tp // bq))  # (nq, B, G, R, bq, V), (nq, B, G, R, bq)
    o = jnp.moveaxis(o, 0, 3).reshape(B, G, R, Tp, V)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, G, R, Tp)
    return _tokens_first(o[:, :, :, :T], q.dtype), (q, k, v, qp, kp, qseg, kvseg, qdp, band, qc, kc, o, lse)


def _blocked_bwd(causal, skip, scale, in_order, res, do):
    q, k, v, qp, kp, qseg, kvseg, qdp, band, qc, kc, o, lse = res  # k, v heads first
    T, S = q.shape[1], k.shape[2]
    bq, bk = _sizes(T, S)
    qt = _heads_first(q, k.shape[1])
    Tp, Sp = o.shape[3], -(-S // bk) * bk
    qt, kt, vt = _pad(qt, 3, Tp), _pad(k, 2, Sp), _pad(v, 2, Sp)
    dot = _pad(_heads_first(do, k.shape[1]).astype(jnp.float32), 3, Tp)  # (B, G, R, Tp, V)
    delta = jnp.sum(dot * o, axis=-1)  # (B, G, R, Tp)
    qpp, kpp, kvalid, qs, ks, qds, bounds = _blocks(qp, kp, qseg, kvseg, qdp, T, S, bq, bk)
    qcp, kcp = (None, None) if qc is None else (_pad(qc, 3, Tp), _pad(kc, 3, Sp))
    G = k.shape[1]
    sl = lambda x, at, n, axis: lax.dynamic_slice_in_dim(x, at * n, n, axis=axis)

    def query_block(carry, i):
        dk, dv, dkc = carry
        qi, doi = sl(qt, i, bq, 3), sl(dot, i, bq, 3)
        lse_i, delta_i = sl(lse, i, bq, 3), sl(delta, i, bq, 3)

        def key_block(j, inner):
            dq_i, dk, dv, dkc = inner
            kj, vj = sl(kt, j, bk, 2), sl(vt, j, bk, 2)
            mask = _mask(qpp, kpp, kvalid, qs, ks, qds, band, i, j, bq, bk, causal, G)
            s = _logits(qi, kj, scale, qcp, kcp, i, j, bq, bk)
            p = jnp.exp(jnp.where(mask, s, NEG) - lse_i[..., None]) * mask
            dv_j = jnp.einsum("BGRQS,BGRQV->BGSV", p, doi)
            dp = jnp.einsum("BGRQV,BGSV->BGRQS", doi, vj.astype(jnp.float32))
            dl = p * (dp - delta_i[..., None])  # the logits' gradient
            ds = dl * scale
            dq_i = dq_i + jnp.einsum("BGRQS,BGSK->BGRQK", ds, kj.astype(jnp.float32))
            dk_j = jnp.einsum("BGRQS,BGRQK->BGSK", ds, qi.astype(jnp.float32))
            add = lambda acc, x, axis: lax.dynamic_update_slice_in_dim(acc, sl(acc, j, bk, axis) + x, j * bk, axis)
            if qc is not None:  # the decay: d kc_j = -sum_i dl_ij (d qc_i = sum_j dl_ij = 0)
                dkc = add(dkc, -jnp.sum(dl, axis=-2), 3)
            return dq_i, add(dk, dk_j, 2), add(dv, dv_j, 2), dkc

        dq_i, dk, dv, dkc = _key_loop(bounds, i, causal, skip, in_order, key_block,
                                      (jnp.zeros(qi.shape, jnp.float32), dk, dv, dkc))
        return (dk, dv, dkc), dq_i

    B, G, R, _, K = qt.shape
    zeros = (jnp.zeros(kt.shape, jnp.float32), jnp.zeros(vt.shape, jnp.float32),
             None if qc is None else jnp.zeros(kcp.shape, jnp.float32))
    (dk, dv, dkc), dq = lax.scan(query_block, zeros, jnp.arange(Tp // bq))
    dq = jnp.moveaxis(dq, 0, 3).reshape(B, G, R, Tp, K)[:, :, :, :T]
    dq = _tokens_first(dq, q.dtype)
    dk, dv = (x[:, :, :S].astype(y.dtype) for x, y in ((dk, k), (dv, v)))
    none = lambda x: None if x is None else jnp.zeros(x.shape, jax.dtypes.float0) \
        if jnp.issubdtype(x.dtype, jnp.integer) else jnp.zeros_like(x)
    dqc, dkc = (None, None) if qc is None else (jnp.zeros(qc.shape, jnp.float32), dkc[..., :S])  # (B, G, R, S)
    return dq, dk, dv, none(qp), none(kp), none(qseg), none(kvseg), none(qdp), tuple(map(none, band)), dqc, dkc


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
