"""Pallas flash attention against the XLA reference: outputs and dq, dk, dv (and the decay's gradients).

On CPU the kernel runs in interpret mode with 16-row blocks, so tiny shapes still cross several
blocks, ragged tails and skipped blocks. Tests marked `gpu` run the compiled kernel and skip on CPU.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels import IMPLS
from kernels.attention import Band, CacheView, Tokens, attention, attention_cached
from kernels.attention.pallas import BlockSizes, default_block_sizes, flash_attention
from kernels.attention.reference import attention_reference
from layers import Attention
from tests.util import assert_close

BS = BlockSizes(16, 16, 16, 16, 16, 16)
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernel)")


def _out_and_grads(attn, q, k, v, ct, kw):
    o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, **kw), q, k, v)
    return (o, *vjp(ct))


def _inputs(B, T, S, H, G, K, V, dtype=jnp.float32, seed=0):
    """q, k, v and an output cotangent; numpy draws (eager jax.random would compile per shape)."""
    rng = np.random.default_rng(seed)
    shapes = ((B, T, H, K), (B, S, G, K), (B, S, G, V), (B, T, H, V))
    return (jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype) for s in shapes)


def _compare(q, k, v, ct, kw, tol, block_sizes=BS, kernel=flash_attention):
    """Kernel (inputs' dtype) against the float32 reference on o, dq, dk, dv; returns kernel's o."""
    got = jax.jit(partial(_out_and_grads, partial(kernel, block_sizes=block_sizes), kw=kw))(q, k, v, ct)
    f32 = (x.astype(jnp.float32) for x in (q, k, v, ct))
    want = jax.jit(partial(_out_and_grads, attention_reference, kw=kw))(*f32)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert a.dtype == q.dtype, name
        assert_close(a, b, tol, name)
    return got[0]


def _packed(B, T, seed):
    """Random segment ids (B, T): non-decreasing, a few documents per row."""
    starts = np.random.default_rng(seed).random((B, T)) < 0.15
    return jnp.asarray(np.cumsum(starts, axis=1, dtype=np.int32))


# (B, T, H, G, K, V, causal, window, packed): ragged T, B=1, GQA ratios 1 and 4, all heads sharing
# one kv head (G=1), two head dims (K=8 is padded to 16 inside), masks alone and together.
CASES = {
    "ragged-causal-G1": (2, 37, 4, 1, 16, 16, True, None, False),
    "B1-mha-noncausal-packed": (1, 64, 2, 2, 16, 8, False, None, True),
    "gqa4-window-packed-K8": (2, 37, 8, 2, 8, 16, True, 9, True),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    B, T, H, G, K, V, causal, window, packed = CASES[case]
    q, k, v, ct = _inputs(B, T, T, H, G, K, V)
    kw = dict(causal=causal, band=Band(window), segment_ids=_packed(B, T, 5) if packed else None)
    _compare(q, k, v, ct, kw, 1e-4)


def _decay(B, S, H, seed):
    """FoX's decay (B, S, H) float32: cumulative log forget gates log sigmoid(x) of random x."""
    x = np.random.default_rng(seed).standard_normal((B, S, H)).astype(np.float32) + 1.0
    return jnp.asarray(np.cumsum(-np.logaddexp(0.0, -x), axis=1))


def _with_decay(attn, q, k, v, decay, kv_decay, ct, kw):
    o, vjp = jax.vjp(lambda q, k, v, d, kd: attn(q, k, v, decay=d, tokens=Tokens(kv_decay=kd), **kw),
                     q, k, v, decay, kv_decay)
    return o, *vjp(ct)


# (B, T, S, H, G, causal, window, packed, own kv_decay): ragged T over 16-row blocks with GQA 4, a
# window and packed documents; T = 1 and T = 9 queries (the last of S keys) with their own kv_decay;
# a non-causal call (keys after the query: positive biases), all heads on one kv head.
DECAY_CASES = {
    "ragged-gqa4-window-packed": (2, 37, 37, 8, 2, True, 9, True, False),
    "T1-against-longer-keys": (1, 1, 21, 2, 1, True, 5, False, True),
    "T9-against-longer-keys-gqa2": (2, 9, 40, 4, 2, True, None, False, True),
    "noncausal-G1-packed": (1, 21, 21, 2, 1, False, None, True, False),
}


@pytest.mark.parametrize("case", DECAY_CASES)
def test_decay_matches_reference(case):
    """o, dq, dk, dv, d decay and d kv_decay against the reference; with its own kv_decay, d decay is 0
    (a query's shift cancels in its softmax), else the decay is both and its gradient d kv_decay's."""
    B, T, S, H, G, causal, window, packed, cross = DECAY_CASES[case]
    q, k, v, ct = _inputs(B, T, S, H, G, 16, 8, seed=60)
    c = _decay(B, S, H, seed=61)
    decay, kv_decay = (c[:, S - T:], c) if cross else (c, None)
    kw = dict(causal=causal, band=Band(window), segment_ids=_packed(B, T, 62) if packed else None)
    got = jax.jit(partial(_with_decay, partial(flash_attention, block_sizes=BS), kw=kw))(q, k, v, decay, kv_decay, ct)
    want = jax.jit(partial(_with_decay, attention_reference, kw=kw))(q, k, v, decay, kv_decay, ct)
    for name, a, b in zip(("o", "dq", "dk", "dv", "d decay", "d kv_decay"), got, want):
        if cross and name == "d decay":
            assert float(jnp.abs(a).max()) == 0.0 and float(jnp.abs(b).max()) < 1e-5, name
        elif b is not None:
            assert_close(a, b, 1e-4, name)


def test_decay_through_attention_cached():
    """A FoX decode step as layers.ForgettingAttention makes it: 3 new tokens at slots index[b] of a
    24-slot cache (stale slots past them), impl="pallas" (the kernel, write-then-attend) against
    impl="reference" on the outputs and the gradients of q, k, v and the new tokens' decay."""
    B, T, S, H, G, K, index = 2, 3, 24, 4, 2, 16, jnp.array([17, 9], jnp.int32)
    q, k, v, ct = _inputs(B, T, T, H, G, K, K, seed=70)
    ck, cv = (jnp.asarray(np.random.default_rng(s).standard_normal((B, G, S, K), np.float32)) for s in (71, 72))
    c = _decay(B, S + T, H, seed=73)  # (B, S + T, H): the new tokens' decay follows each row's cache
    new = jnp.stack([c[b, i:i + T] for b, i in enumerate(index.tolist())])  # (B, T, H)

    def grads(impl):
        f = partial(attention_cached, cache=CacheView(ck, cv, index, decay=jnp.swapaxes(c[:, :S], 1, 2)),
                    impl=impl)  # cache decay (B, H, S)
        step = lambda q, k, v, d: f(q, k, v, decay=d)
        return jax.jit(lambda *a: (step(*a), *jax.vjp(step, *a)[1](ct)))(q, k, v, new)

    for name, a, b in zip(("o", "dq", "dk", "dv", "d decay"), grads("pallas"), grads("reference")):
        assert_close(a, b, 1e-4, name)


def test_cache_positions_and_documents():
    """As layers.Attention.decode calls it: 3 new queries at cache slots 20..22 against a 40-slot
    cache whose unwritten slots hold document -1; row 1's last query starts a document that has no
    key yet except itself, and row 0's queries belong to a document absent from the cache."""
    B, T, S, H, G, K = 2, 3, 40, 4, 2, 16
    q, k, v, ct = _inputs(B, T, S, H, G, K, K, seed=10)
    slots = jnp.arange(20, 23, dtype=jnp.int32)[None]  # (1, T)
    cache_doc = jnp.where(jnp.arange(S) < 23, jnp.array([[0], [1]]), -1)  # (B, S)
    cache_doc = cache_doc.at[1, 22].set(2).at[1, 5:15].set(0)
    seg = jnp.array([[7, 7, 7], [1, 1, 2]], jnp.int32)  # row 0: no key in document 7
    kw = dict(segment_ids=seg, tokens=Tokens(kv_segment_ids=cache_doc, q_positions=slots), band=Band(window=6))
    o = _compare(q, k, v, ct, kw, 1e-4)
    assert float(jnp.abs(o[0]).max()) == 0.0  # a query that sees no key returns zeros


# (B, T, S, H, G, packed, band): the band of reference.py in the kernel. Sinks beside a window that
# skips key blocks (the sink blocks are visited apart, the dK/dV kernel's later query blocks too);
# packed documents (every document's own sinks); a dilated window; per-head masks with GQA (a head
# without a window, heads with and without sinks, three dilations); growth with sinks; T queries the
# last of S keys with their positions inside their documents given (a prefill after a cache).
BAND_CASES = {
    "sinks-window": (2, 53, 53, 4, 2, False, dict(band=Band(window=7, sinks=3))),
    "sinks-window-packed": (2, 53, 53, 4, 2, True, dict(band=Band(window=7, sinks=2))),
    "dilated-G1": (1, 45, 45, 2, 1, False, dict(band=Band(window=5, dilation=3))),
    "per-head-gqa-packed": (2, 41, 41, 4, 2, True, dict(band=Band(window=(3, 2 ** 30, 9, 5), sinks=(0, 0, 2, 4),
                                                                  dilation=(1, 1, 2, 3)))),
    "growth-sinks": (1, 37, 37, 2, 1, False, dict(band=Band(window=(4, 2), growth=(0.5, 0.25), sinks=1))),
    "T20-of-S50-doc-positions": (1, 20, 50, 2, 2, False, dict(band=Band(window=6, sinks=2), tokens=Tokens(
        q_doc_positions=jnp.arange(18, 38, dtype=jnp.int32)[None]))),
}


def compare_band(case, kernel, block_sizes, sizes=None, seg_seed=81):
    """The band case against the reference; `sizes` (B, T, S, H, G) in place of the case's own and
    `seg_seed` the packed documents' draw (the TPU tests' smaller shapes)."""
    B, T, S, H, G, packed, band = BAND_CASES[case]
    B, T, S, H, G = sizes or (B, T, S, H, G)
    q, k, v, ct = _inputs(B, T, S, H, G, 16, 8, seed=80)
    _compare(q, k, v, ct, dict(band, segment_ids=_packed(B, T, seg_seed) if packed else None), 1e-4, block_sizes,
             kernel)


@pytest.mark.parametrize("case", BAND_CASES)
def test_band_matches_reference(case):
    compare_band(case, flash_attention, BS)


def test_single_query_step():
    B, S, H, G, K = 2, 37, 4, 2, 16
    q, k, v, _ = _inputs(B, 1, S, H, G, K, K, seed=20)
    kw = dict(tokens=Tokens(q_positions=jnp.array([[36], [11]], jnp.int32)), band=Band(window=5))
    fast = jax.jit(partial(flash_attention, block_sizes=BS, **kw))
    assert_close(fast(q, k, v), jax.jit(partial(attention_reference, **kw))(q, k, v), 1e-4)


def test_bfloat16_within_bf16_tolerance_of_float32_reference():
    B, T, H, G, K, V, causal, window, _ = CASES["gqa4-window-packed-K8"]
    q, k, v, ct = _inputs(B, T, T, H, G, K, V, dtype=jnp.bfloat16, seed=30)
    _compare(q, k, v, ct, dict(causal=causal, band=Band(window), segment_ids=_packed(B, T, 6)), 2e-2)


def test_dispatch():
    q = jnp.zeros((1, 32, 2, 16))  # T > 16: not decode-sized, so "auto" on GPU takes the kernel
    jaxpr = lambda impl, **kw: str(jax.make_jaxpr(partial(attention, impl=impl, **kw))(q, q, q))
    assert "pallas_call" in jaxpr("pallas")
    assert "pallas_call" in jaxpr("pallas", decay=jnp.zeros((1, 32, 2)))
    assert "pallas_call" in jaxpr("pallas", band=Band(sinks=2, window=(4, 2 ** 30)))
    assert "pallas_call" not in jaxpr("pallas", band=Band(sinks=2, window=jnp.array([4, 8])))  # traced: XLA
    assert ("pallas_call" in jaxpr("auto")) == ON_GPU  # CPU: "auto" is the XLA reference
    assert "pallas_call" not in jaxpr("xla")
    assert IMPLS == ("auto", "reference", "xla", "pallas")
    with pytest.raises(ValueError, match="pallas"):
        attention(q, q, q, impl="triton")
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=48)


def test_lowers_for_cuda_through_triton():
    """Without a GPU: the three kernels (forward, dQ, dK/dV) lower to Triton for CUDA with the GPU
    block sizes (power-of-two tiles, every primitive has a Triton rule), here for bf16 GQA with a
    window, packed documents, a decay and ragged T, per-head sinks and dilations beside a window and
    growth (guarded sink blocks), and for a decode-sized call with cache positions."""
    gpu_blocks = partial(flash_attention, block_sizes=default_block_sizes("gpu"), interpret=False)
    q, k, v = (jnp.zeros(s, jnp.bfloat16) for s in ((2, 300, 8, 64), (2, 300, 2, 64), (2, 300, 2, 64)))
    seg = jnp.zeros((2, 300), jnp.int32)
    per_head = dict(band=Band(window=(3, 2 ** 30, 90, 5) * 2, sinks=(0, 0, 2, 4) * 2, dilation=2, growth=0.5))
    for query, kw in ((q, dict(band=Band(window=100), segment_ids=seg, decay=jnp.zeros((2, 300, 8)))),
                      (q, dict(band=Band(window=100, sinks=4), segment_ids=seg)), (q, per_head),
                      (q[:, :3], dict(tokens=Tokens(q_positions=jnp.arange(3)[None] + 50, kv_segment_ids=seg),
                                      segment_ids=seg[:, :3]))):
        f = partial(_out_and_grads, partial(gpu_blocks, **kw), kw={})
        hlo = jax.jit(f).trace(query, k, v, query).lower(lowering_platforms=("cuda",)).as_text()
        assert hlo.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize("masks", [dict(window=6), dict(window=3, sinks=2, dilation=2)])
def test_attention_layer_pallas_equals_reference_call_and_decode(masks):
    """layers.Attention(impl="pallas") against impl="reference": packed __call__, then a 5-token
    prefill and 2 single-token steps on the KV cache (a ring buffer with sinks)."""
    call = nnx.jit(lambda layer, x, seg: layer(x, segment_ids=seg))
    decode = nnx.jit(lambda layer, x, state: layer.decode(x, state))
    x = jnp.asarray(np.random.default_rng(40).standard_normal((2, 12, 32), np.float32))
    seg = jnp.array([[0] * 7 + [1] * 5, [0] * 12], jnp.int32)
    fast, ref = (Attention(32, num_heads=4, num_kv_heads=2, **masks, impl=impl, rngs=nnx.Rngs(0))
                 for impl in ("pallas", "reference"))
    assert_close(call(fast, x, seg), call(ref, x, seg), 1e-4, "__call__")
    states = [layer.init_state(2, 16) for layer in (fast, ref)]
    for a, b in ((0, 5), (5, 6), (6, 7)):
        (yf, states[0]), (yr, states[1]) = (decode(layer, x[:, a:b], s) for layer, s in zip((fast, ref), states))
        assert_close(yf, yr, 1e-4, f"decode tokens {a}:{b}")


def test_language_model_with_pallas_mixer():
    """`model.mixer.impl: pallas` (interpret mode on CPU) gives impl=reference's logits and decode."""
    from tests.util import tiny_model

    mixer = {"kind": "attention", "num_heads": 4, "num_kv_heads": 2}
    fast = tiny_model({**mixer, "impl": "pallas"})
    ref = tiny_model({**mixer, "impl": "reference"})
    call = nnx.jit(lambda model, tokens: model(tokens))
    decode = nnx.jit(lambda model, tokens, state: model.decode(tokens, state))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 8)), jnp.int32)
    assert_close(call(fast, tokens), call(ref, tokens), 1e-4, "logits")
    states = [model.init_state(2, 8) for model in (fast, ref)]
    for a, b in ((0, 6), (6, 7), (7, 8)):  # prefill, then token by token
        (lf, states[0]), (lr, states[1]) = (decode(m, tokens[:, a:b], s) for m, s in zip((fast, ref), states))
        assert_close(lf, lr, 1e-4, f"decode tokens {a}:{b}")


@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_compiled_kernel_on_gpu(dtype, tol):
    """Default GPU block sizes, ragged lengths, GQA 4, window and packed documents."""
    B, T, H, G, K = 2, 300, 8, 2, 64
    q, k, v, ct = _inputs(B, T, T, H, G, K, K, dtype=dtype, seed=50)
    kw = dict(band=Band(window=100), segment_ids=_packed(B, T, 7))
    with jax.default_matmul_precision("highest"):  # a float32 reference without TF32
        _compare(q, k, v, ct, kw, tol, block_sizes=None)
