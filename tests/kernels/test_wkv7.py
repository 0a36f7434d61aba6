"""WKV7: the chunked (WY/UT) and parallel forms against the token-by-token reference (outputs, final
state, gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.wkv7 import wkv7
from tests.util import assert_close, assert_tree_close

NAMES = ("r", "w_log", "k", "v", "a", "b", "initial_state")


def randn(seed, shape):
    """numpy, not jax.random: eager jax.random compiles a kernel per shape, which dominates here."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def make_inputs(seed, B, T, H, K, V, decay_scale=0.0):
    """Inputs shaped like the RWKV-7 layer's: a = -kappa^, b = kappa^ * a_icl with |kappa^| = 1 and
    a_icl in (0, 1); log decays in (-e^{-0.5}, 0) as in the model, or -exp(decay_scale * (N(0, 1) - 1)) when
    decay_scale > 0 to exercise very fast and very slow decays together."""
    kappa = randn(seed, (B, T, H, K))
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    icl = 1 / (1 + np.exp(-randn(seed + 1, (B, T, H, K))))
    d = randn(seed + 2, (B, T, H, K))
    w_log = -np.exp(decay_scale * (d - 1)) if decay_scale > 0 else -np.exp(-0.5) / (1 + np.exp(-2 * d))
    x = dict(r=randn(seed + 3, (B, T, H, K)), w_log=w_log, k=0.5 * randn(seed + 4, (B, T, H, K)),
             v=randn(seed + 5, (B, T, H, V)), a=-kappa, b=kappa * icl,
             initial_state=randn(seed + 6, (B, H, K, V)))
    return {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}


@functools.partial(jax.jit, static_argnames=("mode", "chunk_size", "max_decay"))
def value_and_grads(inputs, segment_ids, cotangents, mode, chunk_size=16, max_decay=None):
    """o, S_T and the gradients of a random projection of both w.r.t. every input."""
    def loss(x):
        o, s = wkv7(**x, segment_ids=segment_ids, output_final_state=True, mode=mode, chunk_size=chunk_size,
                    max_decay=max_decay)
        return jnp.sum(o * cotangents[0]) + jnp.sum(s * cotangents[1]), (o, s)
    (_, (o, s)), g = jax.value_and_grad(loss, has_aux=True)(inputs)
    return o, s, g


def check_against_reference(inputs, segment_ids, chunk_size, max_decay=None):
    B, T, H, K = inputs["r"].shape
    V = inputs["v"].shape[-1]
    cot = (jnp.asarray(randn(100, (B, T, H, V))), jnp.asarray(randn(101, (B, H, K, V))))
    o_ref, s_ref, g_ref = value_and_grads(inputs, segment_ids, cot, "recurrent")
    for mode in ("chunk", "parallel"):
        o, s, g = value_and_grads(inputs, segment_ids, cot, mode, chunk_size, max_decay)
        assert_close(o, o_ref, 1e-4, f"{mode}: o")
        assert_close(s, s_ref, 1e-4, f"{mode}: final state")
        for name in NAMES:
            assert_close(g[name], g_ref[name], 1e-4, f"{mode}: d/d{name}")


SEG63 = [0] * 5 + [1] * 30 + [2] * 28  # resets inside chunks and sub-chunks (16 divides neither 5 nor 35)


@pytest.mark.parametrize("B,T,H,K,V,chunk,decay_scale,seg,max_decay", [
    (2, 63, 2, 16, 16, 16, 0.0, SEG63, None),  # T not a multiple of the chunk; row 0 packed, row 1 one document
    (1, 1, 1, 8, 8, 16, 0.0, None, None),      # a single token
    (2, 63, 2, 8, 16, 48, 2.5, SEG63, None),   # 3 sub-chunks per chunk, K != V, per-step log w from ~-1e-4 to ~-e^5
    # the model's decay bound: factored blocks of 32 (chunk 64: two of them with the cross-block part; parallel one)
    (2, 63, 2, 16, 8, 64, 0.0, SEG63, float(np.exp(-0.5))),
])
def test_fast_forms_match_reference(B, T, H, K, V, chunk, decay_scale, seg, max_decay):
    segment_ids = None if seg is None else jnp.array([seg] + [[7] * T] * (B - 1), jnp.int32)
    check_against_reference(make_inputs(0, B, T, H, K, V, decay_scale), segment_ids, chunk, max_decay)


@jax.jit
def forward(inputs, segment_ids):
    return wkv7(**inputs, segment_ids=segment_ids, output_final_state=True, chunk_size=16)


def test_packed_equals_documents_alone():
    x = make_inputs(20, 1, 63, 2, 8, 8)
    seg = jnp.repeat(jnp.arange(3, dtype=jnp.int32), 21)[None]
    o, s = forward(x, seg)
    alone = {n: a.reshape(3, 21, *a.shape[2:]) for n, a in x.items() if n != "initial_state"}
    alone["initial_state"] = jnp.concatenate([x["initial_state"], jnp.zeros((2,) + x["initial_state"].shape[1:])])
    o_alone, s_alone = forward(alone, jnp.zeros((3, 21), jnp.int32))
    assert_close(o.reshape(o_alone.shape), o_alone, 1e-5, "packed o")
    assert_close(s[0], s_alone[2], 1e-5, "packed final state")
    o_one_doc, _ = forward(x, jnp.zeros_like(seg))  # the reset is real: one document gives other outputs
    assert not jnp.allclose(o_one_doc, o, atol=1e-3)


def test_bfloat16_inputs_and_errors():
    x = make_inputs(30, 1, 8, 1, 8, 8)
    run = jax.jit(lambda x, mode: wkv7(**x, output_final_state=True, chunk_size=4, mode=mode), static_argnums=1)
    o, s = run({n: a.astype(jnp.bfloat16) for n, a in x.items()}, "chunk")
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o_ref, s_ref = run({n: a.astype(jnp.bfloat16).astype(jnp.float32) for n, a in x.items()}, "recurrent")
    assert_tree_close((o.astype(jnp.float32), s), (o_ref, s_ref), 2e-2, "bf16")
    for bad in (dict(mode="fused"), dict(impl="triton"), dict(chunk_size=0)):
        with pytest.raises(ValueError, match="wkv7"):
            wkv7(**x, **bad)
