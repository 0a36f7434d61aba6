"""Reference softmax attention (Vaswani et al., 2017) with the masks the zoo needs.

    o_i = sum_j softmax_j(q_i . k_j * scale + decay_i - kv_decay_j + mask_ij) v_j

mask_ij is 0 where key j is visible from query i, -inf elsewhere (`visible`): causal (p_j <= p_i),
segments (same segment id), and a band of keys, which may differ per query head h. With the
distance d = p_i - p_j and c_i the query's position inside its document (`q_doc_positions`):

    key j in the band  iff  d % dilation_h == 0 and d < window_h * dilation_h + growth_h * (c_i + 1)
                        or  c_i - d < sinks_h          (key j is one of its document's first sinks_h)

- window: a sliding window (window_h = w, dilation 1, growth 0: p_j > p_i - w, so a query sees w keys
  including itself); None: no window (every earlier key is in the band);
- dilation: Longformer's dilated window (Beltagy et al., 2020): every dilation-th key back from the
  query, window of them, spanning window * dilation tokens; 1 is the plain window;
- growth: a span that grows with the query's position, SemSA / MoA's alpha_h + beta_h * N (Fu et al.,
  2024) with alpha = window * dilation and beta = growth, N = c_i + 1 the tokens of the document so
  far (MoA scales a head's span with the sequence length N; here N is the query's own length, which
  keeps the mask causal, so decoding gives the training pass's outputs);
- sinks: StreamingLLM's attention sinks (Xiao et al., 2024): the first sinks tokens of each document
  stay visible to every later query of it, whatever the window. c_i - d is key j's position inside the
  document of query i, exact for the keys of that document, the only ones the segment mask lets
  through.

The band is one value, `Band(window, sinks, dilation, growth)` (masks.py): each field one number
for every head, or per query head (H,): a static tuple, or a traced array (a calibration loop runs many
candidate masks through one compiled function). Per head, a window of 2**30 stands for no window,
sinks 0, dilation 1 and growth 0 for none. Queries and keys at other positions than self-attention's,
the keys' own documents and decay: `Tokens` (masks.py).

Grouped-query attention (Ainslie et al., 2023) reshapes the H query heads into G groups of R = H / G
that share one kv head; K/V are never repeated in memory. Logits, softmax and the
weighted sum accumulate in float32; a query that sees no key returns zeros. This is the truth the
fast forms (xla.py, the Pallas kernels) are tested against: it materialises the (T, S) scores and
autodiff differentiates its masked softmax as written.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.attention.masks import Band, Tokens
from kernels.segments import positions_in_document


def attention_reference(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B S G K"],
    v: Float[Array, "B S G V"],
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    tokens: Tokens | None = None,
    band: Band | None = None,
    causal: bool = True,
    scale: float | None = None,
    decay: Float[Array, "B T H"] | None = None,
) -> Float[Array, "B T H V"]:
    B, T, H, K = q.shape
    S, G = k.shape[1], k.shape[2]
    tokens = Tokens() if tokens is None else tokens
    scale = K ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, G, H // G, K)  # (B, T, G, R, K)
    s = jnp.einsum("BTGRK,BSGK->BGRTS", qg, k, preferred_element_type=jnp.float32) * scale
    if decay is not None:
        s = s + decay_bias(decay, decay if tokens.kv_decay is None else tokens.kv_decay, G)
    qp, kp = default_positions(T, S, tokens)
    qdp = doc_positions(T, S, tokens, segment_ids, qp)
    mask = grouped(visible(qp, kp, segment_ids, tokens.kv_segment_ids, causal, band, qdp), G)
    s = jnp.where(mask, s, -jnp.inf)
    # The shift cancels in the softmax, so no gradient goes through it (through the max of a row with -inf
    # entries and a decay, XLA on CPU at the tests' optimisation level returned NaN gradients).
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("BGRTS,BSGV->BTGRV", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def heads_first_decay(decay: Float[Array, "B T H"], G: int) -> Float[Array, "B G R T"]:
    """A decay (B, T, H) in the layout of the logits, the R query heads of each kv head together."""
    B, T, H = decay.shape
    return decay.astype(jnp.float32).reshape(B, T, G, H // G).transpose(0, 2, 3, 1)  # (B, G, R, T)


def decay_bias(decay: Float[Array, "B T H"], kv_decay: Float[Array, "B S H"], G: int) -> Float[Array, "B G R T S"]:
    """decay_i - kv_decay_j, the logits' bias (module docstring)."""
    return heads_first_decay(decay, G)[..., :, None] - heads_first_decay(kv_decay, G)[..., None, :]


def default_positions(T: int, S: int, tokens: Tokens):
    """(B|1, T) query and (B|1, S) key positions; by default the T queries are the last T of the S keys."""
    qp = jnp.arange(S - T, S, dtype=jnp.int32)[None] if tokens.q_positions is None else tokens.q_positions
    kp = jnp.arange(S, dtype=jnp.int32)[None] if tokens.kv_positions is None else tokens.kv_positions
    return qp, kp


def doc_positions(T: int, S: int, tokens: Tokens, segment_ids, qp):
    """Each query's position inside its document: tokens.q_doc_positions as given; else, for a
    self-attention call on packed documents (default positions, T = S), counted from each document's
    start; else the query positions qp (one document per row, from position 0)."""
    if tokens.q_doc_positions is not None:
        return tokens.q_doc_positions
    if segment_ids is not None and tokens.q_positions is None and tokens.kv_positions is None and T == S:
        return positions_in_document(segment_ids, segment_ids.shape[0], T)
    return qp


def per_head(x):
    """A mask parameter as visible() reads it: None, a scalar, or (1, H, 1, 1) for per-head values."""
    if x is None:
        return None
    x = jnp.asarray(x)
    return x.reshape(1, -1, 1, 1) if x.ndim == 1 else x


def grouped(mask: Bool[Array, "#B #H T S"], G: int) -> Array:
    """visible()'s mask (B|1, H|1, T, S) laid out for G kv groups: (B|1, G|1, R|1, T, S)."""
    if mask.shape[1] == 1:
        return mask[:, None]
    return mask.reshape(mask.shape[0], G, -1, *mask.shape[2:])


def visible(qp: Int[Array, "#B T"], kp: Int[Array, "#B S"], segment_ids: Int[Array, "B T"] | None,
            kv_segment_ids: Int[Array, "B S"] | None, causal: bool, band: Band | None = None,
            q_doc: Int[Array, "#B T"] | None = None) -> Bool[Array, "#B #H T S"]:
    """True where query i may see key j (module docstring): causal (p_j <= p_i), the same segment
    (kv_segment_ids default to segment_ids), and the band (None: every key), which needs q_doc (the
    queries' positions inside their documents) for sinks and growth. A band per head gives (#B, H, T,
    S), else (#B, 1, T, S)."""
    window, sinks, dilation, growth = (per_head(x) for x in (Band() if band is None else band).terms())
    d = qp[:, None, :, None] - kp[:, None, None, :]  # (#B, 1, T, S)
    mask = jnp.ones((1, 1, qp.shape[1], kp.shape[1]), bool)
    if causal:
        mask = mask & (d >= 0)
    band = None
    if dilation is not None:
        band = d % dilation == 0
    if window is not None or growth is not None:
        window = 2 ** 30 if window is None else window
        if growth is None:  # d < window * dilation, for the d that dilation keeps (no int32 overflow)
            near = (d if dilation is None else d // dilation) < window
        else:
            span = jnp.asarray(window, jnp.float32) * (1 if dilation is None else dilation)
            near = d.astype(jnp.float32) < span + growth * (q_doc[:, None, :, None] + 1).astype(jnp.float32)
        band = near if band is None else band & near
    if sinks is not None and band is not None:
        start = (qp - q_doc)[:, None, :, None]  # (#B, 1, T, 1): the position where the query's document starts
        band = band | (kp[:, None, None, :] - start < sinks)
    if band is not None:
        mask = mask & band
    if segment_ids is not None:
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (kv_seg[:, None, None, :] == segment_ids[:, None, :, None])
    return mask
