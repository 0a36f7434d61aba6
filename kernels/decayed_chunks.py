"""Chunked forms of decayed linear recurrences S_n = decay * S_{n-1} + update: cutting a sequence
into chunks, the documents' masks per chunk and the pass of the state across chunks, which every
chunk form (GLA, retention, linear attention, WKV-6, WKV-7, SSD, Mamba-3) builds on, and the
decayed intra-chunk scores of a per-channel decay (WKV-6 and WKV-7, kernels/wkv6 and kernels/wkv7).

Stability: the decay is per channel, so the intra-chunk scores cannot be one matmul of r * exp(G)
with k * exp(-G) (exp(-G) overflows for fast decays). `decayed_scores` follows the two-level scheme
of flash-linear-attention's chunk_rwkv6/chunk_gla: inside each sub-chunk of SUB = 16 tokens the decay
between t and s is taken pairwise, and across sub-chunks it is split at the sub-chunk edges, so every
exp() has an argument <= 0. Departure from fla: each such argument is a sum of log decays over its
exact interval (cumulative sums of same-sign terms), never a difference G_t - G_s of two cumulative
sums, which loses all precision on a slow decay that follows a very fast one in the same chunk.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.segments import document_index

SUB = 16  # sub-chunk length of the pairwise (exact) part of `decayed_scores`
FACTOR_SPAN = 20.0  # the largest total log decay a factored block of `decayed_scores` spans


def chunk_length(chunk_size: int, length: int) -> int:
    """The chunk length used: chunk_size, but no longer than the sequence rounded up to whole sub-chunks."""
    return min(chunk_size, SUB * -(-length // SUB))


def split_chunks(x: Array, chunk_size: int) -> Array:
    """(B, T, ...) -> (B, N, C, ...): zero-padded (False for a mask) in time to a multiple of C, dtype kept."""
    B, T = x.shape[:2]
    N = -(-T // chunk_size)
    x = jnp.pad(x, [(0, 0), (0, N * chunk_size - T)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(B, N, chunk_size, *x.shape[2:])


def to_chunks(x: Float[Array, "B T H D"], chunk_size: int) -> Float[Array, "B H N C D"]:
    """float32, zero-padded to a multiple of chunk_size, cut into (N, C) chunks per head."""
    return split_chunks(x.astype(jnp.float32), chunk_size).transpose(0, 3, 1, 2, 4)


def from_chunks(x: Float[Array, "B H N C D"], length: int) -> Float[Array, "B T H D"]:
    B, H, N, C, D = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(B, N * C, H, D)[:, :length]


def document_masks(segment_ids: Int[Array, "B T"] | None, batch: int, length: int, chunk_size: int) -> tuple[
        Bool[Array, "B N C"], Bool[Array, "B N C C"], Bool[Array, "B N C"], Bool[Array, "B N"]]:
    """Document masks per chunk:
    cont (B, N, C): token t still belongs to the document of the state entering its chunk;
    same (B, N, C, C): tokens t and s belong to the same document;
    last (B, N, C): token s belongs to the chunk's last document (it reaches the chunk's end state);
    carry (B, N): the entering state survives to the chunk's end (no document starts in the chunk)."""
    N = -(-length // chunk_size)
    doc = document_index(segment_ids, batch, length)  # (B, T)
    doc = jnp.pad(doc, ((0, 0), (0, N * chunk_size - length)), mode="edge")  # padding joins the last one
    entering = jnp.concatenate([doc[:, :1], doc[:, :-1]], axis=1)[:, ::chunk_size]  # (B, N)
    doc = doc.reshape(batch, N, chunk_size)
    cont = doc == entering[..., None]
    return cont, doc[..., :, None] == doc[..., None, :], doc == doc[..., -1:], cont[..., -1]


def chunk_masks(segment_ids: Int[Array, "B T"] | None, batch: int, length: int, chunk_size: int):
    """`document_masks` with a size-1 head axis for broadcasting, float32 0/1: cont (B, 1, N, C),
    same (B, 1, N, C, C), last (B, 1, N, C), carry (B, 1, N)."""
    return tuple(m[:, None].astype(jnp.float32) for m in document_masks(segment_ids, batch, length, chunk_size))


def carry_states(decay: Float[Array, "..."], update: Float[Array, "..."], state: Float[Array, "..."], *,
                 axis: int) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """The pass across chunks, S_n = decay_n * S_{n-1} + update_n, as a lax.scan over the chunk axis
    `axis` of decay (broadcast against S) and update; S_{-1} = state. Returns (the state entering each
    chunk, chunk axis at `axis`, the final state)."""
    def step(S, x):
        decay_n, update_n = x
        return decay_n * S + update_n, S

    final, entering = jax.lax.scan(step, state, (jnp.moveaxis(decay, axis, 0), jnp.moveaxis(update, axis, 0)))
    return jnp.moveaxis(entering, 0, axis), final


def chunk_inputs(xs: tuple, segment_ids: Int[Array, "B T"] | None, chunk_size: int):
    """The per-channel chunk forms' prologue: each x (B, T, H, D) of xs as `to_chunks` cuts it
    (B, H, N, C, D) into chunks of `chunk_length(chunk_size, T)`, and their `chunk_masks`."""
    B, T = xs[0].shape[:2]
    C = chunk_length(chunk_size, T)
    return tuple(to_chunks(x, C) for x in xs), chunk_masks(segment_ids, B, T, C)


def cumsum_exclusive(log_w: Float[Array, "... C K"], *, reverse: bool = False) -> Float[Array, "... C K"]:
    """sum_{i < t} log_w_i (reverse: sum_{i > t}) along the C axis. Sums of same-sign terms taken
    directly, never as a difference of two cumulative sums, so small ones stay exact next to large ones."""
    if reverse:
        return jnp.flip(cumsum_exclusive(jnp.flip(log_w, -2)), -2)
    return jnp.cumsum(jnp.pad(log_w[..., :-1, :], ((0, 0),) * (log_w.ndim - 2) + ((1, 0), (0, 0))), axis=-2)


def factor_length(C: int, max_decay: float | None) -> int | None:
    """The block length `decayed_scores` factors with a decay bound: C halved until its total decay
    fits FACTOR_SPAN, or None (pairwise sub-chunks) without a bound or below SUB tokens."""
    if max_decay is None:
        return None
    c = C
    while c * max_decay > FACTOR_SPAN and c % 2 == 0 and c > SUB:
        c //= 2
    return c if c * max_decay <= FACTOR_SPAN else None


def decayed_scores(q: Float[Array, "... C K"], k: Float[Array, "... C K"], log_w: Float[Array, "... C K"], *,
                   inclusive: bool, max_decay: float | None = None) -> Float[Array, "... C C"]:
    """A[t, s] = sum_k q[t, k] k[s, k] prod_{s < i <= t'} w[i, k] on s <= t', else 0, where t' = t if
    inclusive else t - 1. q, k and log_w have one shape.

    Every exponent is a sum of log decays (<= 0) over the exact interval, never a difference of
    cumulative sums: no overflow, and no cancellation when a huge decay precedes small ones.

    max_decay: a bound the caller guarantees on -log_w (RWKV-7's e^{-0.5}). With it, blocks of up to
    C tokens whose decay stays within e^{-FACTOR_SPAN} are scored by one matmul of q e^{G_t'} with
    k e^{-G_s} (G the block's own cumulative sums, so every factor lies in [e^{-FACTOR_SPAN},
    e^{FACTOR_SPAN}] and each term keeps a relative error of about FACTOR_SPAN float32 roundings)
    instead of the pairwise (c, c, K) exponentials, which dominate the op's cost."""
    lead = q.shape[:-2]
    C, K = q.shape[-2:]
    # Leading dimensions flattened into one keeps every intermediate at rank <= 5: XLA:CPU in jaxlib
    # 0.10.2 and 0.11 crashes or hangs on rank >= 7 multiply-reduce fusions (jax-ml/jax#39257).
    q, k, log_w = (x.reshape(-1, C, K) for x in (q, k, log_w))  # (Z, C, K)
    c = factor_length(C, max_decay)
    factored = c is not None
    c = c or (SUB if C % SUB == 0 else C)
    n = C // c
    split = lambda x: x.reshape(-1, n, c, K)
    qs, ks, lws = split(q), split(k), split(log_w)  # (Z, n, c, K)
    i = jnp.arange(c)
    after = i[:, None] > i[None, :]  # (m, s)
    keep = (i[:, None] >= i[None, :]) if inclusive else after  # (t, s)
    if factored:  # bounded decays: q_t e^{G_t'} . k_s e^{-G_s}, both exponents within the block
        G = jnp.cumsum(lws, axis=-2)
        diag = jnp.where(keep, jnp.einsum("zntk,znsk->znts", qs * jnp.exp(G if inclusive else cumsum_exclusive(lws)),
                                          ks * jnp.exp(-G)), 0.0)
    else:
        # Diagonal sub-blocks, pairwise: D[t, s] = sum_{s < m <= t'} log_w[m], a cumsum over m of the
        # log decays masked to m > s, read at t' (shifted by one token when exclusive).
        D = jnp.cumsum(jnp.where(after[:, :, None], lws[:, :, :, None, :], 0.0), axis=2)  # (Z, n, t, s, K)
        if not inclusive:
            D = jnp.pad(D[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))
        diag = jnp.einsum("zntk,znsk,zntsk->znts", qs, ks, jnp.where(keep[:, :, None], jnp.exp(D), 0.0))
    out = jnp.einsum("znts,nm->zntms", diag, jnp.eye(n, dtype=diag.dtype))  # block diagonal
    if n > 1:
        # Key s in sub-chunk j, query t in sub-chunk i > j: the interval (s, t'] splits into the rest
        # of j, the whole sub-chunks strictly between, and the start of i up to t'.
        head = jnp.cumsum(lws, axis=-2) if inclusive else cumsum_exclusive(lws)  # (Z, n, c, K)
        tail = cumsum_exclusive(lws, reverse=True)
        j = jnp.arange(n)
        between = (j[None, :, None] < j[None, None, :]) & (j[None, None, :] < j[:, None, None])  # (i, j, m)
        mid = jnp.einsum("ijm,zmk->zijk", between.astype(lws.dtype), jnp.sum(lws, axis=-2))  # (Z, i, j, K)
        before = (j[:, None] > j[None, :])[:, None, :, None]  # (i, 1, j, 1)
        expo = jnp.where(before, head[:, :, :, None, :] + mid[:, :, None, :, :], 0.0)  # (Z, i, t, j, K)
        qd = qs[:, :, :, None, :] * jnp.where(before, jnp.exp(expo), 0.0)
        kd = ks * jnp.exp(tail)  # (Z, j, s, K)
        out = out + jnp.einsum("zitjk,zjsk->zitjs", qd, kd)
    return out.reshape(lead + (C, C))
