"""Causal softmax self-attention on CPU through the fused kernels of cpu.cc (XLA FFI custom calls, built by
kernels/native.py), forward and backward: no (T, T) scores in memory, where XLA's forms write every softmax
pass between products.

`supports` says which calls it takes: float32 self-attention (T = S, default positions), causal, with
optional packed documents (segment_ids), a band of at most one static window for every head, no decay, GQA
with G dividing H (K and V are padded to multiples of 16 for the kernels), on the CPU and not under a mesh of
several devices. Tests compare it with reference.py: tests/kernels/test_attention_cpu.py.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import native

SOURCE = Path(__file__).with_name("cpu.cc")
FORWARD, BACKWARD = "zoo_attention_cpu_forward", "zoo_attention_cpu_backward"


KERNELS = native.Kernels(SOURCE, (("ZooAttentionForward", FORWARD), ("ZooAttentionBackward", BACKWARD)),
                         "kernels.attention.attention runs the XLA forms")


def supports(q, k, v, *, tokens, band, causal, decay, kv_heads_first) -> bool:
    """Whether `attention_cpu` computes this call of kernels.attention.attention (module docstring)."""
    if tokens is not None or decay is not None or not causal or kv_heads_first:
        return False
    if _window(band) is None:
        return False
    if any(x.dtype != jnp.float32 for x in (q, k, v)) or not native.on_one_cpu():
        return False
    (_, T, H, _), (_, S, G, _) = q.shape, k.shape
    if T != S or H % G:
        return False
    return KERNELS.available()


def _window(band) -> int | None:
    """The band as the kernels take it: one static window for every head (2**30: none), or None when the
    band has more (sinks, dilation, growth, per-head or traced windows)."""
    window, *rest = (None,) * 4 if band is None else band.terms()
    if any(term is not None for term in rest) or not (window is None or isinstance(window, int) and window >= 1):
        return None
    return min(2 ** 30, window or 2 ** 30)


def _attrs(q, scale, segment_ids, window):
    segments = segment_ids is not None
    ids = segment_ids.astype(jnp.int32) if segments else jnp.zeros(q.shape[:2], jnp.int32)
    return ids, {"scale": np.float32(scale), "segments": np.int32(segments), "window": np.int32(window)}


def attention_cpu(q, k, v, segment_ids=None, band=None, scale=None):
    """q (B, T, H, K), k (B, T, G, K), v (B, T, G, V) float32, segment_ids (B, T) or None -> o (B, T, H, V):
    causal self-attention of `kernels.attention.attention` (scale None: K^-1/2), with a band that `supports`."""
    window = _window(band)
    if window is None:
        raise ValueError(f"attention_cpu: band {band}; expected None or one static window for every head")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    V = v.shape[-1]
    pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, -x.shape[-1] % 16),))  # zeros: q . k and o unchanged
    return _attention(pad(q), pad(k), pad(v), segment_ids, scale, window)[..., :V]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, segment_ids, scale, window):
    return _forward(q, k, v, segment_ids, scale, window)[0]


def _forward(q, k, v, segment_ids, scale, window):
    ids, attrs = _attrs(q, scale, segment_ids, window)
    B, T, H = q.shape[:3]
    out = (jax.ShapeDtypeStruct((B, T, H, v.shape[-1]), jnp.float32), jax.ShapeDtypeStruct((B, H, T), jnp.float32))
    o, lse = KERNELS.call(FORWARD, out, q, k, v, ids, **attrs)
    return o, (q, k, v, segment_ids, o, lse)


def _backward(scale, window, saved, do):
    q, k, v, segment_ids, o, lse = saved
    ids, attrs = _attrs(q, scale, segment_ids, window)
    out = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    dq, dk, dv = KERNELS.call(BACKWARD, out, q, k, v, ids, o, lse, do, **attrs)
    return dq, dk, dv, None


_attention.defvjp(_forward, _backward)
