"""What is specific to multi-head latent attention (layers/mla.py); the protocol itself runs in
tests/layers/test_conformance.py. Sizes are all different (H 2, K 16, V 8, R 4, L 10) so a mixed-up
axis fails."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers import Attention, LatentCache, MultiHeadLatentAttention
from layers.rotary import RopeScaling, rope_frequencies
from tests.util import assert_close, assert_tree_close, randn
from zoo.config import from_dict

D, H, K, V, R, L = 32, 2, 16, 8, 4, 10
B, T, P, CHUNK = 2, 13, 5, 4  # odd T: a prefill of P, a chunk of CHUNK with a document start, then steps
YARN = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=4, mscale=0.7, mscale_all_dim=0.5)


def make(**kw):
    kw = dict(num_heads=H, head_dim=K, v_head_dim=V, rope_dim=R, kv_lora_rank=L) | kw
    return MultiHeadLatentAttention(D, **kw, rngs=nnx.Rngs(0))


def decoded(layer, x, seg):
    """Prefill P tokens (a document start in row 0), a chunk of CHUNK (a document start in row 1),
    then the rest token by token: the outputs (B, T, D)."""
    state = layer.init_state(B, 32)
    y0, state = layer.decode(x[:, :P], state, segment_ids=seg[:, :P])
    y1, state = layer.decode(x[:, P:P + CHUNK], state, segment_ids=seg[:, P:P + CHUNK])
    ys = [y0, y1]
    for t in range(P + CHUNK, T):
        y, state = layer.decode(x[:, t:t + 1], state)
        ys.append(y)
    return jnp.concatenate(ys, axis=1)


@pytest.mark.parametrize("window,q_lora_rank,rope", [(None, None, {}), (4, 6, {"rope_scaling": YARN}),
                                                     (None, 6, {"rotary": False})])
def test_absorbed_decode_equals_naive_decode_equals_the_training_path(window, q_lora_rank, rope):
    layer = make(window=window, q_lora_rank=q_lora_rank, **rope)
    x = randn(0, (B, T, D))
    seg = jnp.zeros((B, T), jnp.int32).at[0, 3:].set(1).at[1, P + 2:].set(1)
    graphdef, params = nnx.split(layer)

    @jax.jit
    def run(params, x):
        m = nnx.merge(graphdef, params)
        full = m(x, segment_ids=seg)
        absorbed = decoded(m, x, seg)
        m.absorb = False
        return full, absorbed, decoded(m, x, seg)

    full, absorbed, naive = run(params, x)
    assert_close(naive, full, 1e-5, "naive decode vs training path")
    assert_close(absorbed, naive, 1e-5, "absorbed decode vs naive decode")
    assert_close(absorbed, full, 1e-5, "absorbed decode vs training path")


@pytest.mark.parametrize("rope_scaling,rotary", [(None, True), (YARN, True), (None, False)])
def test_training_path_is_the_papers_equations(rope_scaling, rotary):
    """Per head, written out in numpy: softmax(s [q^C ; q^R] . [k^C ; k^R]) v, causal, s = (K + R)^-1/2; with
    yarn, its frequencies and cos/sin factor m on the rotary and DeepSeek's mscale(factor, mscale_all_dim)^2 on s;
    rotary=False: q^R and k^R unrotated."""
    layer = make(q_lora_rank=6, rope_scaling=rope_scaling, rotary=rotary)
    x = np.asarray(randn(1, (1, 7, D)))
    p = {n: np.asarray(getattr(layer, n)[...]) for n in ("wdq", "wuq", "wdkv", "wkr", "wuk", "wuv", "wo")}
    rms = lambda a: a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + 1e-6)  # the norms' weights are ones
    inv_freq, m = rope_frequencies(R, 10000.0, rope_scaling)
    scale = (K + R) ** -0.5 * ((0.1 * 0.5 * np.log(4.0) + 1) ** 2 if rope_scaling else 1)

    def rope(a, pos):  # rotate-half, a (T, ..., R)
        if not rotary:
            return a
        half = a.shape[-1] // 2
        ang = pos[:, None] * inv_freq  # (T, R/2)
        cos, sin = m * np.cos(ang), m * np.sin(ang)
        if a.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]
        a1, a2 = a[..., :half], a[..., half:]
        return np.concatenate([a1 * cos - a2 * sin, a1 * sin + a2 * cos], -1)

    pos = np.arange(7.0)
    c_kv = rms(x[0] @ p["wdkv"])  # (T, L)
    k_r = rope(x[0] @ p["wkr"], pos)  # (T, R)
    q = np.einsum("TQ,QHK->THK", rms(x[0] @ p["wdq"]), p["wuq"])  # (T, H, K + R)
    q = np.concatenate([q[..., :K], rope(q[..., K:], pos)], -1)
    o = []
    for h in range(H):
        k = np.concatenate([c_kv @ p["wuk"][:, h], k_r], -1)  # (T, K + R)
        s = scale * q[:, h] @ k.T + np.triu(np.full((7, 7), -np.inf), 1)
        w = np.exp(s - s.max(-1, keepdims=True))
        o.append((w / w.sum(-1, keepdims=True)) @ (c_kv @ p["wuv"][:, h]))  # (T, V)
    want = np.einsum("THV,HVD->TD", np.stack(o, 1), p["wo"])
    assert_close(layer(jnp.asarray(x))[0], want, 1e-5, "training path vs the equations")


def shapes(text: str):
    return {tuple(int(n) for n in m.split("x")[:-1]) for m in re.findall(r"tensor<([0-9x]+x[a-z0-9]+)>", text)}


def test_the_cache_holds_latent_plus_rope_per_token_and_absorbed_decode_makes_no_per_head_key():
    S, rows = 64, 3
    layer = make()
    state = layer.init_state(rows, S)
    assert isinstance(state, LatentCache) and state.kv.shape == (rows, S, L + R)
    assert state.kv.nbytes == rows * S * (L + R) * 4  # float32: (L + R) numbers per token per row
    kv = Attention(D, num_heads=H, head_dim=K, rngs=nnx.Rngs(0)).init_state(rows, S)
    assert kv.k.nbytes + kv.v.nbytes == rows * S * 2 * H * K * 4  # 2 x G x K per token: 64 against 14 here

    def program(absorb: bool) -> set:
        layer.absorb = absorb
        return shapes(jax.jit(layer.decode).lower(jax.ShapeDtypeStruct((rows, 1, D), jnp.float32), state).as_text())

    per_head = lambda shape: S in shape and H in shape and shape[-1] in (K, K + R, V)  # a head's keys or values
    assert any(per_head(s) for s in program(False)), "the naive decode expands keys per head (the test is live)"
    assert not [s for s in program(True) if per_head(s)], "the absorbed decode made a key or value per head"


def test_gradients_reach_every_parameter_with_a_full_query_projection():
    layer = make(window=5)
    x = randn(2, (B, 9, D))

    def grads(impl):
        layer.impl = impl
        graphdef, params = nnx.split(layer, nnx.Param)
        return jax.jit(jax.grad(lambda p: jnp.sum(jnp.cos(nnx.merge(graphdef, p)(x)))))(params)

    fast = grads("auto")
    for path, g in jax.tree_util.tree_leaves_with_path(fast):
        assert np.isfinite(g).all() and np.abs(g).max() > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
    assert layer.wdq is None and layer.wuq[...].shape == (D, H, K + R)
    assert_tree_close(fast, grads("reference"), 1e-4, "gradient vs impl=reference")


@pytest.mark.parametrize("key,value,message", [
    ("num_heads", 0, "model.mixer.num_heads: expected 1 <= num_heads, got 0"),
    ("num_heads", 3, "model.mixer.num_heads: 3 must be positive and divide d_model=32"),
    ("kv_lora_rank", 0, "model.mixer.kv_lora_rank: expected 1 <= kv_lora_rank, got 0"),
    ("q_lora_rank", -2, "model.mixer.q_lora_rank: expected 1 <= q_lora_rank, got -2"),
    ("rope_dim", 3, "model.mixer.rope_dim: 3; expected an even number >= 2"),
    ("head_dim", 2, "model.mixer.rope_dim: 1; expected an even number >= 2 (the rotary turns pairs of channels; "
                    "head_dim / 2 is its default)"),
    ("long_context", "none", "model.mixer.long_context"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "model.mixer.rope_scaling: type 'dynamic' is not supported"),
])
def test_bad_config_values_are_refused_by_dotted_path(key, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_dict({"model": {"d_model": 32, "num_layers": 1, "mixer": {"kind": "mla", key: value}}})


def test_bad_layer_arguments_are_refused():
    for kw, message in [(dict(kv_lora_rank=0), "kv_lora_rank=0"), (dict(rope_dim=5), "rope_dim=5"),
                        (dict(num_heads=3, head_dim=None), "num_heads=3"), (dict(long_context="x"), "long_context"),
                        (dict(rotary=False, rope_scaling=YARN), "rope_scaling: set with rotary=False")]:
        with pytest.raises(ValueError, match=message):
            make(**kw)
