import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers import Attention, HeadMask
from layers.rotary import RopeScaling
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


HYBRID = {  # the 2025-2026 hybrids' options on, small: every one in each case, GQA, a ring or a scaled rotary
    "no-rope-ring": dict(num_heads=4, num_kv_heads=2, rope_fraction=0.0, window=3, ring_spare=5),  # Jamba, Nemotron-H
    "differential-ring": dict(num_heads=4, num_kv_heads=2, differential=True, output_gate="head", rope_fraction=0.5,
                              qk_norm=True, window=3, sinks=1, ring_spare=5),
    "gated-partial-yarn": dict(num_heads=2, num_kv_heads=1, output_gate="channel", rope_fraction=0.25, qkv_bias=True,
                               out_bias=True,
                               rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8)),
}


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_options_follow_the_mixer_protocol(name):
    """The conformance suite (decode == full pass, chunked prefill, packed == alone, rollback, the state's
    size, gradients) on the output gate, partial rotary and differential attention."""
    from tests.layers.conformance import check_mixer

    check_mixer(lambda **kw: Attention(32, **HYBRID[name], layer_id=2, rngs=nnx.Rngs(0), **kw), 32)


def _softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_differential_attention_is_the_papers_equations():
    """impl=reference against the equations in numpy, head by head under GQA (half s of query head h meets half
    s of key head h // 2), with λ_init from layer_id and the output norm's weight."""
    D, H, G, K, T, layer_id = 16, 4, 2, 4, 5, 3
    layer = Attention(D, num_heads=H, num_kv_heads=G, differential=True, layer_id=layer_id, impl="reference",
                      rngs=nnx.Rngs(0))
    layer.sub_norm.weight[...] = jnp.asarray(np.linspace(0.5, 1.5, K), jnp.float32)
    x = np.random.default_rng(5).standard_normal((1, T, D)).astype(np.float32)
    q, k, v = (np.asarray(a[0], np.float64) for a in layer._qkv(jnp.asarray(x), jnp.arange(T)[None]))  # (T, H|G, K)
    p = {n: np.asarray(getattr(layer, f"lambda_{n}")[...], np.float64) for n in ("q1", "k1", "q2", "k2")}
    lam_init = 0.8 - 0.6 * np.exp(-0.3 * layer_id)
    assert abs(layer.lambda_init - lam_init) < 1e-12
    lam = np.exp(p["q1"] @ p["k1"]) - np.exp(p["q2"] @ p["k2"]) + lam_init
    causal = np.where(np.tril(np.ones((T, T))) > 0, 0, -np.inf)
    heads = []
    for h in range(H):
        g, d = h // (H // G), K // 2
        a1, a2 = (_softmax(q[:, h, s * d:(s + 1) * d] @ k[:, g, s * d:(s + 1) * d].T / np.sqrt(d) + causal)
                  for s in (0, 1))
        o = (a1 - lam * a2) @ v[:, g]
        o = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-5) * np.linspace(0.5, 1.5, K)
        heads.append((1 - lam_init) * o)
    want = np.stack(heads, 1).reshape(T, H * K) @ np.asarray(layer.wo[...]).reshape(H * K, D)
    assert_close(nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x))[0], want, 1e-5, "differential vs the equations")


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_output_gate_multiplies_each_head_before_the_output_projection(gate):
    """W_g = 0 halves every head (σ(0) = 1/2); a large negative gate bias on head 1 silences that head alone."""
    plain = Attention(32, num_heads=4, rngs=nnx.Rngs(0))
    gated = Attention(32, num_heads=4, output_gate=gate, qkv_bias=True, rngs=nnx.Rngs(0))
    assert gated.w_out_gate.shape == ((32, 4) if gate == "head" else (32, 4, 8))
    for name in ("wq", "wk", "wv", "wo"):
        getattr(gated, name)[...] = getattr(plain, name)[...]
    x = randn(6, (1, 7, 32))
    gated.w_out_gate[...] = jnp.zeros_like(gated.w_out_gate[...])
    assert_close(gated(x), 0.5 * plain(x), 1e-5, "σ(0) = 1/2")
    gated.b_out_gate[...] = gated.b_out_gate[...].at[1].set(-1e4)
    plain.wo[...] = plain.wo[...].at[1].set(0)
    assert_close(gated(x), 0.5 * plain(x), 1e-5, "head 1 gated off")


def test_out_bias_is_added_after_the_output_projection():
    """out_bias (RecurrentGemma's o_proj bias): the plain layer's output plus bo, on the full pass and in decode."""
    plain = Attention(32, num_heads=4, num_kv_heads=1, rngs=nnx.Rngs(0))
    biased = Attention(32, num_heads=4, num_kv_heads=1, out_bias=True, rngs=nnx.Rngs(0))
    assert plain.bo is None and biased.bo.shape == (32,)
    biased.bo[...] = randn(9, (32,))
    x = randn(8, (1, 5, 32))
    want = plain(x) + biased.bo[...]
    assert_close(biased(x), want, 1e-6, "full pass")
    assert_close(biased.decode(x, biased.init_state(1, 5))[0], want, 1e-5, "decode")


def test_partial_rotary_turns_the_first_dims_and_passes_the_rest():
    """rotary_dim r < K: the first r dims as a rotary of head dim r (scaled frequencies and yarn's m over r
    dims, transformers' partial_rotary_factor), dims r..K unchanged."""
    from layers.rotary import apply_rotary

    x, pos = randn(7, (1, 6, 2, 16)), jnp.arange(6)[None] * 3
    scaling = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=4)
    got = apply_rotary(x, pos, 500.0, scaling, rotary_dim=4)
    assert_close(got[..., :4], apply_rotary(x[..., :4], pos, 500.0, scaling), 1e-6, "rotated dims")
    assert bool(jnp.all(got[..., 4:] == x[..., 4:]))
    layer = Attention(64, num_heads=2, head_dim=16, rope_fraction=0.25, rngs=nnx.Rngs(0))
    assert layer.rotary_dim == 4


def test_rotary_gradient_is_autodiffs():
    """The rotary's own backward (the turn back from the forward's cos and sin) against autodiff of the
    formula written out, on odd shapes, whole and partial, through a loss that mixes heads and dims."""
    from layers.rotary import apply_rotary, rope_frequencies

    def plain(x, pos, r):
        inv, m = rope_frequencies(r, 500.0)
        a = pos.astype(jnp.float32)[..., None] * inv
        cos, sin = m * jnp.cos(a)[:, :, None], m * jnp.sin(a)[:, :, None]
        x1, x2 = x[..., :r // 2], x[..., r // 2:r]
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., r:]], axis=-1)

    x, w, pos = randn(1, (3, 7, 5, 10)), randn(2, (3, 7, 5, 10)), jnp.arange(21).reshape(3, 7) * 5 - 4
    for r in (10, 6):
        fast, slow = (lambda x: apply_rotary(x, pos, 500.0, rotary_dim=r)), (lambda x: plain(x, pos, r))
        grad = lambda f: jax.grad(lambda x: jnp.sum(jnp.sin(f(x) * w)))(x)
        assert_close(fast(x), slow(x), 1e-6, f"r={r} forward")
        assert_close(grad(fast), grad(slow), 1e-6, f"r={r} gradient")


def test_hybrid_options_are_checked():
    make = lambda **kw: Attention(32, num_heads=4, rngs=nnx.Rngs(0), **kw)
    for bad in (-0.5, 1.5):
        with pytest.raises(ValueError, match=f"rope_fraction={bad}"):
            make(rope_fraction=bad)
    with pytest.raises(ValueError, match=r"rope_fraction=0.375 rotates int\(8 \* 0.375\) = 3"):
        make(rope_fraction=0.375)
    with pytest.raises(ValueError, match=r"rope_fraction=0.25 rotates int\(4 \* 0.25\) = 1 dims of each half"):
        make(rope_fraction=0.25, differential=True)
    with pytest.raises(ValueError, match="head_dim=9 must be even"):
        make(differential=True, head_dim=9)
    with pytest.raises(ValueError, match="output_gate='sigmoid'"):
        make(output_gate="sigmoid")


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_rope_fraction_zero_has_no_positions(impl):
    """rope_fraction=0 (Jamba, Nemotron-H): no positional encoding, so the last token's output is the same whatever
    the order of the tokens before it, on every impl (pallas: interpret mode on CPU), in the full pass and in a
    prefill then one decode step; with the rotary the order shows."""
    x = randn(9, (1, 7, 32))
    shuffled = x[:, jnp.array([3, 0, 5, 1, 4, 2, 6])]
    make = lambda f: Attention(32, num_heads=4, num_kv_heads=2, rope_fraction=f, impl=impl, rngs=nnx.Rngs(0))

    @nnx.jit
    def run(layer, x, shuffled):
        y, state = layer.decode(shuffled[:, :6], layer.init_state(1, 8))
        return layer(x)[:, -1], layer(shuffled)[:, -1], layer.decode(shuffled[:, 6:], state)[0][:, 0]

    full, again, step = run(make(0.0), x, shuffled)
    assert make(0.0).rotary_dim == 0
    assert_close(again, full, 1e-5, "shuffled prefix")
    assert_close(step, full, 1e-5, "prefill + decode step")
    rotary, shuffled_rotary, _ = run(make(1.0), x, shuffled)
    assert float(jnp.abs(rotary - shuffled_rotary).max()) > 1e-3


def test_differential_and_gate_on_the_pallas_kernels():
    """impl="pallas" (interpret mode on CPU) against impl="reference": packed __call__, then a prefill and
    one step on the KV cache (the kernels' gradients, V != K included: tests/kernels/test_attention_pallas.py)."""
    x = randn(8, (2, 9, 32))
    seg = jnp.array([[0] * 4 + [1] * 5, [0] * 9], jnp.int32)
    fast, ref = (Attention(32, num_heads=2, num_kv_heads=1, differential=True, output_gate="channel", rope_fraction=0.5,
                           layer_id=1, impl=impl, rngs=nnx.Rngs(0)) for impl in ("pallas", "reference"))

    @nnx.jit
    def run(layer, x, seg):
        y, state = layer.decode(x[:, :8], layer.init_state(2, 9))
        return layer(x, segment_ids=seg), jnp.concatenate([y, layer.decode(x[:, 8:], state)[0]], axis=1)

    for got, want, what in zip(run(fast, x, seg), run(ref, x, seg), ("__call__", "decode")):
        assert_close(got, want, 1e-4, what)
