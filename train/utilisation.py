"""Model FLOPs utilisation (MFU), as PaLM (Chowdhery et al., 2022, appendix B), levanter and MaxText
report it: the FLOPs a training step needs by the model's own count, per second, over the rate the
machine's matrix products reach.

- Per trained token: 6 N (a forward and a backward product per weight) with N the weights a token
  multiplies: all parameters, less the input embedding when the LM head is a separate matrix (a lookup
  is not a product), and a MoE's routed experts counted top_k / num_experts of their size; plus, per
  softmax attention layer (attention, fox, mla), 6 H (K_qk + K_v) T_seen: its two (T, T) products
  forward and backward, over the T_seen keys a query reaches (T, or the window), as PaLM's 12 L H Q T
  (PaLM counts the causal half too). Other mixers' state products are not counted, as those
  libraries do not count them: their MFU is a lower bound.
- The products' rate: on CPU, measured on the machine at hand (the best of float32 `jnp.dot` at
  1024^3, after a warm-up: about 0.2 s); on a GPU, the device's dense bf16 peak from its data sheet
  where PEAKS names it, else measured as on CPU.
"""

import time

import jax
import jax.numpy as jnp
from flax import nnx

from layers.attention import Attention
from layers.fox import ForgettingAttention
from layers.mla import MultiHeadLatentAttention
from layers.moe import MoE

PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}  # dense bf16 FLOP/s (SXM data sheets)


def flops_per_token(model, seq_len: int) -> float:
    """The model's training FLOPs per token at `seq_len` (module docstring)."""
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if getattr(model, "head", None) is not None:
        n -= model.embed.embedding.size
    attention = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, MoE):
            routed = sum(w.size for w in (m.w_gate, m.w_up, m.w_down) if w is not None)
            n -= routed * (1 - m.top_k / m.num_experts)
        elif isinstance(m, (Attention, ForgettingAttention, MultiHeadLatentAttention)):
            window = m.band.window if isinstance(m, Attention) else getattr(m, "window", None)
            windows = window if isinstance(window, tuple) else (window,)  # one per head, or shared
            seen = sum(seq_len if w is None else min(seq_len, w) for w in windows) / len(windows)
            k_v = m.head_dim + getattr(m, "rope_dim", 0) + getattr(m, "v_head_dim", m.head_dim)
            attention += 6 * m.num_heads * k_v * seen
    return 6 * n + attention


def products_rate(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s the default device's matrix products reach (module docstring)."""
    device = jax.devices()[0]
    for name, peak in PEAKS.items():
        if device.platform == "gpu" and name in device.device_kind:
            return peak
    a = jnp.ones((n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best
