"""DeltaNet and GatedDeltaNet layers: modes agree, decode == full pass, packed == alone, state, grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.deltanet import DeltaNet, DeltaNetState, GatedDeltaNet

D, B, T = 16, 2, 20
LAYERS = {
    "deltanet": lambda **kw: DeltaNet(D, num_heads=2, chunk_size=8, rngs=nnx.Rngs(0), **kw),
    "gated_deltanet": lambda **kw: GatedDeltaNet(D, num_heads=2, head_dim=4, chunk_size=8, rngs=nnx.Rngs(0), **kw),
    # no short convolution (state without conv windows), output gate, beta = 1, sum-normalised q, k
    "deltanet_variant": lambda **kw: DeltaNet(D, num_heads=2, conv_size=0, use_output_gate=True, use_beta=False,
                                              qk_norm="sum", chunk_size=8, rngs=nnx.Rngs(0), **kw),
}
# Two documents, A (9 tokens) and B (11), packed as the rows [A, B] and [B, A]. numpy data:
# jax.random would add seconds of compile on a 2-core CPU.
LEN_A = 9
_row = np.random.default_rng(0).standard_normal((T, D))
X = jnp.asarray(np.stack([_row, np.concatenate([_row[LEN_A:], _row[:LEN_A]])]), jnp.float32)  # (B, T, D)
SEG = jnp.asarray(np.stack([np.repeat([0, 1], [LEN_A, T - LEN_A]), np.repeat([5, 2], [T - LEN_A, LEN_A])]), jnp.int32)

forward = nnx.jit(lambda m, x, seg: m(x, segment_ids=seg))
decode = nnx.jit(lambda m, x, state, seg: m.decode(x, state, segment_ids=seg))


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_modes_agree(name):
    ys = {mode: forward(LAYERS[name](mode=mode), X, SEG) for mode in ("recurrent", "chunk", "parallel")}
    assert ys["chunk"].shape == (B, T, D) and ys["chunk"].dtype == jnp.float32
    for mode in ("recurrent", "parallel"):
        np.testing.assert_allclose(ys[mode], ys["chunk"], atol=1e-5, rtol=0, err_msg=mode)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "deltanet_variant"])
def test_prefill_then_steps_equals_full_pass(name):
    layer = LAYERS[name]()
    full = forward(layer, X, SEG)
    # The prefill holds both rows' document changes (t = 9 and t = 11); the steps continue the last
    # documents. It ends conv_size - 1 = 3 tokens after the last change: layers/conv.py hands back a
    # window that still holds the previous document's inputs when a change is closer to the end.
    y, state = decode(layer, X[:, :14], layer.init_state(B, 64), SEG[:, :14])
    ys = [y]
    for t in range(14, T):
        y, state = decode(layer, X[:, t:t + 1], state, None)
        ys.append(y)
    assert float(jnp.abs(jnp.concatenate(ys, axis=1) - full).max()) <= 1e-4
    assert float(jnp.abs(full).max()) > 1e-3  # not vacuous


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_packed_equals_documents_alone(name):
    layer = LAYERS[name]()
    packed = forward(layer, X, SEG)
    # A document alone = the first tokens of a causal pass over it followed by anything: the rows of
    # X without segment ids give A alone (row 0) and B alone (row 1).
    alone = forward(layer, X, None)
    la, lb = LEN_A, T - LEN_A
    for got, want in [(packed[0, :la], alone[0, :la]), (packed[0, la:], alone[1, :lb]),
                      (packed[1, :lb], alone[1, :lb]), (packed[1, lb:], alone[0, :la])]:
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "deltanet_variant"])
def test_state_size_independent_of_max_len(name):
    layer = LAYERS[name]()
    nbytes = lambda s: sum(leaf.nbytes for leaf in jax.tree.leaves(s))
    small, large = layer.init_state(B, 128), layer.init_state(B, 16384)
    assert isinstance(small, DeltaNetState) and nbytes(small) == nbytes(large) > 0


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_gradients_reach_every_parameter(name):
    layer = LAYERS[name](use_output_gate=True) if name == "deltanet" else LAYERS[name]()
    target = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(X, segment_ids=SEG) * target)))(layer)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert bool(jnp.all(jnp.isfinite(g))), jax.tree_util.keystr(path)
        assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_bad_shapes():
    with pytest.raises(ValueError, match="num_heads=3 does not divide d_model=16"):
        DeltaNet(16, num_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expand_v"):
        GatedDeltaNet(16, num_heads=2, head_dim=3, expand_v=0.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mode"):
        GatedDeltaNet(16, mode="fused_recurrent", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qk_norm"):
        DeltaNet(16, qk_norm="l1", rngs=nnx.Rngs(0))
