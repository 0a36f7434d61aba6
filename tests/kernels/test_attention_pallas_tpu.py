"""Pallas TPU flash attention against the XLA reference: outputs and dq, dk, dv (and the decay's gradients).

Off a TPU the kernels run in the TPU interpreter (which randomises the order of "parallel" grid
points and fills scratch with NaN, so a missing initialisation or a cross-step dependence fails);
8- and 16-row blocks make tiny shapes cross several blocks, ragged tails and skipped blocks. The
Mosaic lowering test proves the default TPU block sizes lower without a TPU.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import Band, Tokens, attention
from kernels.attention.pallas_tpu import BlockSizes, flash_attention_tpu
from kernels.attention.reference import attention_reference
from tests.kernels.test_attention_pallas import _compare as _compare_kernel
from tests.kernels.test_attention_pallas import _decay, _inputs, _out_and_grads, _with_decay, compare_band
from tests.util import assert_close

BS8, BS16 = BlockSizes(8, 8, 8, 8, 8, 8), BlockSizes(16, 16, 16, 16, 16, 16)


# Value tests run in the TPU interpreter on every machine (their tiny blocks are below Mosaic's
# tiling); the lowering tests check the compiled path with the default blocks.
_compare = partial(_compare_kernel, kernel=partial(flash_attention_tpu, interpret=True))


def _packed(B, T, seed):
    """Random segment ids (B, T): non-decreasing, a few documents per row, a one-token document."""
    starts = np.random.default_rng(seed).random((B, T)) < 0.15
    starts[:, 3:5] = True  # token 3 is a document of its own
    return jnp.asarray(np.cumsum(starts, axis=1, dtype=np.int32))


# (B, T, H, G, K, V, causal, window, packed, blocks): ragged T (21 = 2 blocks of 8 + 5, 29), B=1,
# GQA ratios 1, 2 and 4, all heads sharing one kv head (G=1), two head dims, masks alone and together.
# The interpreter's cost is per grid step (B H nq nk of each kernel): the G=1 case has 2 heads.
CASES = {
    "ragged-causal-G1": (2, 21, 2, 1, 16, 8, True, None, False, BS8),
    "B1-mha-noncausal-packed": (1, 21, 2, 2, 8, 16, False, None, True, BS8),
    "gqa4-window-packed": (1, 29, 8, 2, 16, 16, True, 9, True, BS16),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    B, T, H, G, K, V, causal, window, packed, blocks = CASES[case]
    q, k, v, ct = _inputs(B, T, T, H, G, K, V)
    kw = dict(causal=causal, band=Band(window), segment_ids=_packed(B, T, 5) if packed else None)
    _compare(q, k, v, ct, kw, 1e-4, blocks)


@pytest.mark.parametrize("T", [1, 5])
def test_queries_shorter_than_keys(T):
    """Decode-style: the T queries are the last T of S = 21 keys (one step, then a chunk of 5 that
    spans a block boundary), with a window that skips the first key blocks."""
    q, k, v, ct = _inputs(1, T, 21, 4, 2, 16, 16, seed=10 + T)
    _compare(q, k, v, ct, dict(band=Band(window=7)), 1e-4, BS8)


def test_cache_positions_and_documents():
    """As layers.Attention.decode calls it: 3 new queries at cache slots 20..22 against a 40-slot
    cache whose unwritten slots hold document -1; row 1's last query starts a document that has no
    key yet except itself, and row 0's queries belong to a document absent from the cache."""
    B, T, S, H, G, K = 2, 3, 40, 2, 1, 16
    q, k, v, ct = _inputs(B, T, S, H, G, K, K, seed=20)
    slots = jnp.arange(20, 23, dtype=jnp.int32)[None]  # (1, T)
    cache_doc = jnp.where(jnp.arange(S) < 23, jnp.array([[0], [1]]), -1)  # (B, S)
    cache_doc = cache_doc.at[1, 22].set(2).at[1, 5:15].set(0)
    seg = jnp.array([[7, 7, 7], [1, 1, 2]], jnp.int32)  # row 0: no key in document 7
    kw = dict(segment_ids=seg, tokens=Tokens(kv_segment_ids=cache_doc, q_positions=slots), band=Band(window=6))
    o = _compare(q, k, v, ct, kw, 1e-4, BS16)
    assert float(jnp.abs(o[0]).max()) == 0.0  # a query that sees no key returns zeros


def test_bfloat16_within_bf16_tolerance_of_float32_reference():
    q, k, v, ct = _inputs(1, 21, 21, 4, 1, 16, 16, dtype=jnp.bfloat16, seed=30)
    _compare(q, k, v, ct, dict(band=Band(window=9), segment_ids=_packed(1, 21, 6)), 2e-2, BS8)


# (B, T, S, H, G, causal, window, packed, own kv_decay, blocks): ragged T with GQA 2, a window and
# packed documents; T = 5 queries (the last of S = 21 keys, a block boundary inside) with their own
# kv_decay; non-causal on one kv head (positive biases of later keys).
DECAY_CASES = {
    "ragged-gqa2-window-packed": (1, 21, 21, 4, 2, True, 9, True, False, BS8),
    "T5-against-longer-keys": (1, 5, 21, 2, 1, True, 7, False, True, BS8),
    "noncausal-G1": (1, 19, 19, 2, 1, False, None, False, False, BS16),
}


@pytest.mark.parametrize("case", DECAY_CASES)
def test_decay_matches_reference(case):
    """o, dq, dk, dv, d decay and d kv_decay against the reference (see test_attention_pallas.py)."""
    B, T, S, H, G, causal, window, packed, cross, blocks = DECAY_CASES[case]
    q, k, v, ct = _inputs(B, T, S, H, G, 16, 8, seed=80)
    c = _decay(B, S, H, seed=81)
    decay, kv_decay = (c[:, S - T:], c) if cross else (c, None)
    kw = dict(causal=causal, band=Band(window), segment_ids=_packed(B, T, 82) if packed else None)
    kernel = partial(flash_attention_tpu, block_sizes=blocks, interpret=True)
    got = jax.jit(partial(_with_decay, kernel, kw=kw))(q, k, v, decay, kv_decay, ct)
    want = jax.jit(partial(_with_decay, attention_reference, kw=kw))(q, k, v, decay, kv_decay, ct)
    for name, a, b in zip(("o", "dq", "dk", "dv", "d decay", "d kv_decay"), got, want):
        if cross and name == "d decay":
            assert float(jnp.abs(a).max()) == 0.0 and float(jnp.abs(b).max()) < 1e-5, name
        elif b is not None:
            assert_close(a, b, 1e-4, name)


# The GPU kernel's band cases that reach the TPU kernel's own logic, at the interpreter's cost per grid
# step: (sizes (B, T, S, H, G) in place of the case's, blocks, seed of the packed documents).
# sinks-window-packed: 3 blocks of 8 (the last ragged), where with these documents a query block (and
# for dK/dV a key block) has a block outside the window's range that holds a sink of its documents
# (run) and one that holds none (skipped); the GPU case's 4 blocks of 16 had only the latter.
# per-head-gqa-packed: one row (the GPU case's first) of 3 blocks: a head without a window means no
# block is skipped, the case is the per-head masks and GQA.
BAND_SIZES = {
    "sinks-window-packed": ((2, 21, 21, 4, 2), BS8, 83),
    "per-head-gqa-packed": ((1, 41, 41, 4, 2), BS16, 81),
    "growth-sinks": (None, BS16, 81),
    "T20-of-S50-doc-positions": (None, BS16, 81),
}


@pytest.mark.parametrize("case", BAND_SIZES)
def test_band_matches_reference(case):
    """The GPU kernel's band cases (tests/kernels/test_attention_pallas.py) that reach the TPU kernel's
    own logic: sink blocks fetched and masked outside the window's range, per-head values by the head
    program id, a span without a start bound, a prefill after a cache (the band itself is
    pallas.KernelBand's, shared)."""
    sizes, blocks, seg_seed = BAND_SIZES[case]
    compare_band(case, partial(flash_attention_tpu, interpret=True), blocks, sizes, seg_seed)


def test_decay_is_routed_to_the_tpu_kernel(monkeypatch):
    monkeypatch.setenv("ZOO_PALLAS_PLATFORM", "tpu")
    q = jnp.zeros((1, 32, 2, 16))
    f = partial(attention, impl="pallas", decay=jnp.zeros((1, 32, 2)))
    assert "pallas_call" in str(jax.make_jaxpr(f)(q, q, q))


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="block_q_dkv"):
        BlockSizes(block_q_dkv=48)
    with pytest.raises(ValueError, match="block_k"):  # (1, 64) key-row blocks do not tile on TPU
        q = jnp.zeros((1, 256, 1, 128))
        flash_attention_tpu(q, q, q, block_sizes=BlockSizes(block_k=64), interpret=False)


def test_lowers_for_tpu_through_mosaic():
    """Without a TPU: the three kernels (forward, dQ, dK/dV) lower to Mosaic with the default block
    sizes, in bf16 with D = 128: GQA with a window, packed documents and a decay (blocks skipped), and
    a decode-sized call with cache positions and its own kv_decay (every block visited); sinks beside
    a window, and per-head windows, sinks and dilations with growth (blocks masked to find sinks)."""
    q, k = jnp.zeros((1, 1024, 2, 128), jnp.bfloat16), jnp.zeros((1, 1024, 1, 128), jnp.bfloat16)
    seg = jnp.zeros((1, 1024), jnp.int32)
    tpu = partial(flash_attention_tpu, interpret=False)
    per_head = dict(band=Band(window=(300, 2 ** 30), sinks=(0, 4), dilation=(1, 3), growth=0.5))
    for query, kw in ((q, dict(band=Band(window=300), segment_ids=seg, decay=jnp.zeros((1, 1024, 2)))),
                      (q, dict(band=Band(window=300, sinks=4), segment_ids=seg)), (q, per_head),
                      (q[:, :3], dict(tokens=Tokens(q_positions=jnp.arange(3)[None] + 50, kv_segment_ids=seg,
                                                    kv_decay=jnp.zeros((1, 1024, 2))),
                                      segment_ids=seg[:, :3], decay=jnp.zeros((1, 3, 2))))):
        f = partial(_out_and_grads, partial(tpu, **kw), kw={})
        text = jax.jit(f).trace(query, k, k, query).lower(lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") == 3
