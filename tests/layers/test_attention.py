import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from layers import Attention, HeadMask
from tests.util import assert_close, randn


@pytest.mark.parametrize("G", [1, 2])
def test_gqa_and_mqa_equal_mha_with_each_kv_head_repeated(G):
    H, D = 4, 32
    gqa = Attention(D, num_heads=H, num_kv_heads=G, rngs=nnx.Rngs(0))
    mha = Attention(D, num_heads=H, num_kv_heads=H, rngs=nnx.Rngs(1))
    mha.wq[...], mha.wo[...] = gqa.wq[...], gqa.wo[...]
    mha.wk[...] = jnp.repeat(gqa.wk[...], H // G, axis=1)
    mha.wv[...] = jnp.repeat(gqa.wv[...], H // G, axis=1)
    x = randn(2, (2, 9, D))
    assert_close(gqa(x), mha(x), 1e-5)
    assert gqa.init_state(2, 16).k.shape == (2, G, 16, D // H)  # the cache holds only kv heads, heads first


def test_cache_overflow_is_an_error():
    layer = Attention(16, num_heads=2, rngs=nnx.Rngs(0))
    state = layer.init_state(1, 4)
    _, state = layer.decode(randn(0, (1, 3, 16)), state)
    with pytest.raises(ValueError, match="max_len=4"):
        layer.decode(randn(0, (1, 2, 16)), state)


def test_bad_heads():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        Attention(32, num_heads=4, num_kv_heads=3, rngs=nnx.Rngs(0))


def test_past_the_trained_context_a_window_of_the_trained_length_or_every_token():
    """long_context="window": each query sees the last max_seq_len tokens, exactly a sliding window of
    that length (and full attention within it); "full": every earlier token."""
    x = randn(3, (1, 20, 32))
    make = lambda **kw: Attention(32, num_heads=4, rngs=nnx.Rngs(0), **kw)
    window, full = make(max_seq_len=8), make(max_seq_len=8, long_context="full")
    assert window.band.window == 8 and full.band.window is None and make(max_seq_len=8, window=4).band.window == 4
    assert_close(window(x), make(window=8)(x), 1e-6, "window vs a sliding window of 8")
    assert_close(window(x)[:, :8], full(x)[:, :8], 1e-6, "within the trained context")
    assert float(jnp.abs(window(x)[:, 8:] - full(x)[:, 8:]).max()) > 1e-3
    with pytest.raises(ValueError, match="long_context='none'"):
        make(long_context="none")


SPARSE = {  # Attention options of the sparse masks, small; "ring" ones wrap their ring within the suite's T = 20
    "ring-sinks-dilated": dict(num_heads=4, num_kv_heads=2, window=3, sinks=2, dilation=2, ring_spare=5),
    "ring-head-masks": dict(num_heads=4, ring_spare=5, head_masks=(
        HeadMask(2), HeadMask(3, sinks=1), HeadMask(2, sinks=3, dilation=3), HeadMask(5, dilation=2))),
    "growing-head-masks": dict(num_heads=4, num_kv_heads=1, head_masks=(
        HeadMask(1, growth=0.5), HeadMask(2, sinks=2, growth=0.25), HeadMask(None), HeadMask(3, dilation=2))),
}


@pytest.mark.parametrize("name", SPARSE)
def test_sparse_masks_follow_the_mixer_protocol(name):
    """The conformance suite on sparse masks: decode == full pass (a ring buffer of 11-16 slots over 20
    tokens, a document start inside the prefill), packed == alone, rollback of a 5-token verify pass
    with ring_spare = 5, the state's size (a ring's does not grow with max_len)."""
    from tests.layers.conformance import check_mixer

    make = lambda **kw: Attention(32, **SPARSE[name], rngs=nnx.Rngs(0), **kw)
    assert make().grows_with_context == name.startswith("growing")
    check_mixer(make, 32)


def _decode_pieces(layer, x, cuts, seg, max_len):
    """Outputs of decode over x[:, a:b] split at `cuts`, then token by token to the end, in one jit."""
    graphdef, params = nnx.split(layer)

    @jax.jit
    def run(params, x, seg):
        m = nnx.merge(graphdef, params)
        state, ys, start = m.init_state(x.shape[0], max_len), [], 0
        for cut in cuts:
            y, state = m.decode(x[:, start:cut], state, segment_ids=seg[:, start:cut])
            ys, start = ys + [y], cut

        def step(state, x_t):
            y, state = m.decode(x_t[:, None], state)
            return state, y[:, 0]

        state, tail = jax.lax.scan(step, state, jnp.swapaxes(x[:, start:], 0, 1))
        return jnp.concatenate(ys + [jnp.swapaxes(tail, 0, 1)], axis=1), state

    return run(params, x, seg)


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_ring_buffer_equals_the_full_masked_cache(kv_cache, monkeypatch):
    """Contexts of 64 tokens, 4-6 times the ring (2 sinks + a window of 4 every 2nd token + 2 spare):
    a prefill longer than the ring then token by token, and prefills in several chunks, with documents
    starting inside the calls, give the full-length cache's outputs (and the full pass's); the ring's
    bytes do not depend on max_len. Calls past 64 scores per head take the long path (the ring: cache
    and new keys side by side, blocked; the full cache: written first), single tokens the dense one."""
    from kernels.attention import xla

    monkeypatch.setattr("kernels.attention.DENSE_MAX", 64)
    for name, value in (("DENSE_MAX", 64), ("BLOCK", 16)):
        monkeypatch.setattr(xla, name, value)
    D, T = 32, 64
    ring = Attention(D, num_heads=4, num_kv_heads=2, window=4, sinks=2, dilation=2, ring_spare=2, rngs=nnx.Rngs(0))
    ring.kv_cache = kv_cache
    full = nnx.clone(ring)
    full.ring, full.grows_with_context = None, True  # the same masks on a cache of max_len slots
    x = randn(4, (2, T, D))
    seg = jnp.zeros((2, T), jnp.int32).at[0, 30:].set(1).at[1, 9:].set(1).at[1, 20:].set(2)  # starts inside calls
    nbytes = lambda s: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(s))
    assert nbytes(jax.eval_shape(lambda: ring.init_state(2, 100))) == nbytes(
        jax.eval_shape(lambda: ring.init_state(2, 100_000))) < nbytes(jax.eval_shape(lambda: full.init_state(2, 100)))
    assert ring.init_state(1, 100).k.shape[2] == 2 + 4 * 2 + 2
    whole = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(ring, x, seg) if kv_cache is None else None  # one compile
    for cuts in ([33], [5, 12, 31, 44]):
        got, state = _decode_pieces(ring, x, cuts, seg, T)
        want, _ = _decode_pieces(full, x, cuts, seg, T)
        assert_close(got, want, 1e-5 if kv_cache is None else 1e-4, f"ring vs full cache, cuts {cuts}")
        if kv_cache is None:
            assert_close(got, whole, 1e-4, f"ring vs the full pass, cuts {cuts}")
        assert state.k.shape[2] == 12 and not bool(state.overflowed())


def test_head_masks_are_checked():
    make = lambda **kw: Attention(32, num_heads=4, rngs=nnx.Rngs(0), **kw)
    with pytest.raises(ValueError, match="3 masks for num_heads=4"):
        make(head_masks=(HeadMask(2),) * 3)
    with pytest.raises(ValueError, match=r"head_masks\[1\].*dilation=0"):
        make(head_masks=(HeadMask(2), HeadMask(2, dilation=0), HeadMask(2), HeadMask(2)))
    with pytest.raises(ValueError, match="not both"):
        make(window=4, head_masks=(HeadMask(2),) * 4)
    with pytest.raises(ValueError, match="steps=True over 4 tokens needs ring_spare >= 4"):
        layer = make(window=4, ring_spare=3)
        layer.decode(randn(0, (1, 4, 32)), layer.init_state(1, 8), steps=True)
    # the trained context narrows each head's span, the ring follows; a growing head keeps the full cache
    narrowed = make(head_masks=(HeadMask(64), HeadMask(4, dilation=8), HeadMask(None), HeadMask(2, sinks=1)),
                    max_seq_len=16)
    assert narrowed.band.window == (16, 2, 16, 2) and narrowed.ring is None  # a head without its own window: full
    assert make(window=64, dilation=4, max_seq_len=16).band.window == 4
    assert make(window=64, max_seq_len=16).ring == (0, 16 + 16)
    assert make(head_masks=(HeadMask(4, growth=0.5),) * 4).grows_with_context
