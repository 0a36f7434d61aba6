"""The fused CPU kernels (kernels/attention/cpu.cc through cpu.py) against the reference: outputs and the
gradients of q, k and v on ragged T (a partial last block), several 64-token blocks and 8-block chunks, GQA
ratios 1, 2 and 4, one kv head, head dims that are padded (8, 24) and not, windows inside a block and across
blocks, packed documents short and long; that `attention` takes them on CPU for the layers' calls and a prefill
into empty caches, and leaves them for what they do not
express; and that a machine without a working compiler gets the XLA forms, with a warning."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import layers
from kernels import native
from kernels.attention import Band, CacheView, attention, attention_cached, cpu, fresh_caches
from tests.kernels.test_attention_pallas import _compare, _inputs, _packed
from tests.util import NEEDS_CXX, assert_close

# (B, T, H, G, K, V, window, documents): packed documents of random lengths (about 7 tokens) when True, of
# that many tokens when a number (whole blocks inside one document, beside blocks across two)
CASES = {
    "ragged-G1": (2, 37, 4, 1, 16, 16, None, False),
    "blocks-mha-packed": (1, 192, 2, 2, 32, 32, None, True),
    "tail-gqa4-window-K8": (2, 130, 8, 2, 8, 16, 9, True),
    "gqa2-window-across-blocks-K24-V48": (1, 200, 4, 2, 24, 48, 70, False),
    "window-of-two": (1, 70, 2, 1, 16, 16, 2, True),
    "forward-chunks": (1, 1100, 2, 1, 16, 16, None, False),  # the forward's 8-block chunks: 3 per row at the end
    "chunks-window-packed": (1, 700, 2, 2, 16, 16, 300, True),  # a window starting inside a chunk
    "long-documents": (2, 600, 2, 1, 16, 16, None, 150),
}


@NEEDS_CXX
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case):
    B, T, H, G, K, V, window, docs = CASES[case]
    q, k, v, ct = _inputs(B, T, T, H, G, K, V, seed=3)
    ids = _packed(B, T, 5) if docs is True else jnp.broadcast_to(jnp.arange(T) // docs, (B, T)) if docs else None
    kw = dict(band=Band(window), segment_ids=ids)
    _compare(q, k, v, ct, kw, 1e-5, block_sizes=None,
             kernel=lambda q, k, v, block_sizes, band, segment_ids: cpu.attention_cpu(q, k, v, segment_ids, band))


def _custom_calls(f, *args) -> int:
    return jax.jit(f).lower(*args).as_text().count("zoo_attention_cpu_forward")


@NEEDS_CXX
def test_auto_takes_the_layers_calls_and_leaves_the_rest():
    x = jnp.ones((2, 40, 64))
    layer = layers.Attention(64, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))  # band: the trained context
    assert _custom_calls(lambda x: layer(x), x) == 1
    q, k, v, _ = _inputs(1, 40, 40, 2, 2, 16, 16)
    assert _custom_calls(lambda q: attention(q, k, v), q) == 1
    for other in (dict(band=Band(window=8, sinks=2)), dict(causal=False), dict(impl="xla"),
                  dict(decay=jnp.zeros((1, 40, 2)))):
        assert _custom_calls(lambda q: attention(q, k, v, **other), q) == 0, other
    with pytest.raises(ValueError, match="one static window"):
        cpu.attention_cpu(q, k, v, band=Band(window=8, sinks=2))


def test_without_a_compiler_attention_runs_the_xla_forms(monkeypatch, tmp_path):
    build = lambda: native._build.__wrapped__(cpu.SOURCE, (("ZooAttentionForward", "unregistered"),))
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.warns(UserWarning, match="did not compile"):
        assert build() is False
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert build() is False
    monkeypatch.setenv("ZOO_CPU_KERNELS", "0")
    assert cpu.KERNELS.available() is False
    assert not any((tmp_path / "ffi").iterdir())  # nothing half-written


@NEEDS_CXX
def test_a_prefill_into_fresh_caches_takes_the_kernel():
    """attention_cached traced inside fresh_caches() (the caller's promise that the caches are empty) is its tokens'
    own self-attention, in documents and in a window, through the kernel; it equals the cache path's XLA form,
    which runs outside it."""
    B, T, S, H, G, K = 2, 100, 160, 4, 2, 16
    q, k, v, _ = _inputs(B, T, T, H, G, K, K, seed=5)
    old = jax.random.normal(jax.random.key(6), (2, B, G, S, K))  # slots past the lengths: never read
    cache = CacheView(old[0], old[1], jnp.zeros((B,), jnp.int32), jnp.zeros((B, S), jnp.int32))
    call = lambda q: attention_cached(q, k, v, cache, segment_ids=_packed(B, T, 7), band=Band(40))

    def fresh(q):
        with fresh_caches():
            return call(q)

    assert _custom_calls(fresh, q) == 1 and _custom_calls(call, q) == 0
    assert_close(jax.jit(fresh)(q), call(q), 1e-5, "a prefill")
