"""The chunked SSD on CPU through the kernels of cpu.cc (XLA FFI custom calls, built by kernels/native.py),
forward and backward: chunk.py's algorithm one head at a time, each chunk's products and decays in cache,
where XLA's form runs every einsum over the whole batch with a layout change between them.

`supports` says where it runs: on the CPU and not under a mesh of several devices (its callers pass float32).
N and P are padded to multiples of 16 and the chunk rounded up to one (the chunk length changes only the
rounding).
Tests compare it, and chunk.py, with the token-by-token reference: tests/kernels/test_ssd.py.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import native

SOURCE = Path(__file__).with_name("cpu.cc")
FORWARD, BACKWARD = "zoo_ssd_cpu_forward", "zoo_ssd_cpu_backward"

KERNELS = native.Kernels(SOURCE, (("ZooSsdForward", FORWARD), ("ZooSsdBackward", BACKWARD)),
                         "kernels.ssd runs chunk.py's XLA form")


def supports() -> bool:
    """Whether `ssd_chunk_cpu` can run here (its callers, the chunked forms, compute in float32 already)."""
    return native.on_one_cpu() and KERNELS.available()


def ssd_chunk_cpu(q, k, v, g, starts, h0, chunk_size: int):
    """q, k (B, T, G, N), v (B, T, H, P), g (B, T, H) float32, starts (B, T) bool, h0 (B, H, P, N) -> y (B, T, H, P),
    the final state (B, H, P, N): chunk.scalar_gla_chunk with head h reading group h // (H / G)."""
    (_, T, G, N), (_, _, H, P) = q.shape, v.shape
    if H % G or k.shape != q.shape or g.shape != v.shape[:3] or h0.shape != (v.shape[0], H, P, N):
        raise ValueError(f"ssd_chunk_cpu: expected q, k (B, T, G, N), v (B, T, H, P), g (B, T, H), h0 (B, H, P, N) "
                         f"with G dividing H; got q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, h0 {h0.shape}")
    pad = lambda x, *axes: jnp.pad(x, [(0, -x.shape[a] % 16 if a in axes else 0) for a in range(x.ndim)])
    chunk = 16 * -(-min(chunk_size, T) // 16)
    y, h = _ssd(pad(q, 3), pad(k, 3), pad(v, 3), g, starts.astype(jnp.int32), pad(h0, 2, 3), chunk)
    return y[..., :P], h[:, :, :P, :N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ssd(q, k, v, g, starts, h0, chunk):
    return _forward(q, k, v, g, starts, h0, chunk)[0]


def _forward(q, k, v, g, starts, h0, chunk):
    (B, T, H, P), N = v.shape, q.shape[3]
    out = [(B, T, H, P), (B, H, P, N), (B, H, -(-T // chunk), N, P)]
    y, h, entering = _call(FORWARD, out, q, k, v, g, starts, h0, chunk=chunk)
    return (y, h), (q, k, v, g, starts, entering)


def _backward(chunk, saved, grads):
    q, k, v, g, starts, entering = saved
    (B, T, G, N), H = q.shape, v.shape[2]
    per_head = (B, T, H, N)
    dq, dk, dv, dg, dh0 = _call(BACKWARD, [per_head, per_head, v.shape, g.shape, (B, H, v.shape[3], N)],
                                q, k, v, g, starts, entering, *grads, chunk=chunk)
    group = lambda d: d.reshape(B, T, G, H // G, N).sum(3)  # each group's heads summed
    return group(dq), group(dk), dv, dg, None, dh0


_ssd.defvjp(_forward, _backward)


def _call(target, outs, *args, chunk):
    return KERNELS.call(target, tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in outs), *args,
                        chunk=np.int32(chunk))
