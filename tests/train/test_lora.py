"""Low-rank adapters (train/lora.py, layers/lora.py): a new adapter (b = 0) is the base model exactly;
with b moved, the merged model gives the adapted model's logits and its weights are W + (alpha / r) A B
computed by hand; an adapted model decodes like its full pass; a fine-tuning step through the
`trainable` mask moves only the adapters; bad input names what was wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from layers.lora import LowRank
from tests.util import assert_close, decode_in_pieces, forward, tiny_model, unchecked
from train.lora import add_lora, merge_lora, projections, trainable

KINDS = {  # 3-D attention weights read through `project`, and Linear kernels (a Mamba-2's in_proj, out_proj)
    "attention": {"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
    "mamba2": {"kind": "mamba2", "state_size": 8, "head_dim": 16},
}
T = 11


def _tokens(seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (2, T)), jnp.int32)


def _moved(model, seed=1):
    """The adapted model with every b set to noise (a fresh adapter's b is zero)."""
    rng = np.random.default_rng(seed)
    for _, m, name, _ in projections(model):
        w = getattr(m, name).get_value()
        if isinstance(w, LowRank):
            b = jnp.asarray(0.1 * rng.standard_normal(w.b.shape), w.b.dtype)
            setattr(m, name, nnx.Param(jax.tree.unflatten(jax.tree.structure(w), [w.base, w.a, b])))
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_adapter_is_the_base_model_and_a_merged_one_gives_its_logits(kind):
    model = tiny_model(KINDS[kind], num_layers=2)
    tokens = _tokens()
    adapted = add_lora(model, rank=4, alpha=8)
    held = [w for _, m, name, _ in projections(adapted) if isinstance(w := getattr(m, name).get_value(), LowRank)]
    assert held and len(held) == len(projections(model)), "every projection carries an adapter"
    np.testing.assert_array_equal(forward(adapted, tokens), forward(model, tokens))  # b = 0: exactly the base
    _moved(adapted)
    logits = forward(adapted, tokens)
    assert float(jnp.abs(logits - forward(model, tokens)).max()) > 1e-3, "the moved adapters change nothing"
    assert_close(forward(merge_lora(adapted), tokens), logits, 1e-5, f"{kind}: merged vs adapted")
    pieces, _ = decode_in_pieces(adapted, tokens, cuts=[7, 9, 10])
    assert_close(pieces, logits, 1e-4, f"{kind}: adapted prefill + decode vs full pass")


def test_merge_folds_w_plus_scaled_a_b_into_each_weight():
    model = tiny_model(KINDS["attention"], num_layers=1)
    adapted = _moved(add_lora(model, rank=2, alpha=6, targets=r"mixer\.wo$"))
    (path, m, name, _), = [p for p in projections(adapted) if isinstance(getattr(p[1], name := p[2]).get_value(),
                                                                          LowRank)]
    assert path == "blocks.0.mixer.wo"
    w = m.wo.get_value()
    assert w.a.shape == (32, 2) and w.b.shape == (2, 32) and w.in_ndim == 2  # wo: (H, K, D), contracted over H, K
    by_hand = np.asarray(w.base) + 3.0 * (np.asarray(w.a) @ np.asarray(w.b)).reshape(w.base.shape)
    np.testing.assert_allclose(np.asarray(merge_lora(adapted).blocks[0].mixer.wo.get_value()), by_hand, rtol=1e-6)
    assert not isinstance(merge_lora(adapted).blocks[0].mixer.wo.get_value(), LowRank)


def test_a_masked_step_moves_only_the_adapters():
    model = add_lora(tiny_model({"kind": "gla", "num_heads": 2}, num_layers=1), rank=4, targets=r"mixer\.[qkv]_proj")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mask = trainable(params)
    assert sum(jax.tree.leaves(mask)) == 6  # a and b of q, k and v
    tokens = _tokens(2)

    @jax.jit
    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    tx = optax.multi_transform({True: optax.sgd(0.5), False: optax.set_to_zero()}, mask)
    opt_state, new = tx.init(params), params
    for _ in range(2):  # a's gradient is zero while b is (LoRA's start): a moves from the second step
        updates, opt_state = tx.update(jax.jit(jax.grad(loss))(new), opt_state, new)
        new = optax.apply_updates(new, updates)
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new, params)
    assert jax.tree.leaves(moved) == jax.tree.leaves(mask), "exactly the adapters' a and b move"
    assert float(loss(new)) < float(loss(params))


def test_bad_input_names_it():
    model = tiny_model(KINDS["attention"], num_layers=1)
    for rank in (0, 2.0, True):  # as users run: without the suite's annotation checks
        with unchecked(), pytest.raises(ValueError, match=r"rank=.*expected a positive integer"):
            add_lora(model, rank=rank)
    with pytest.raises(ValueError, match=r"targets='nothing' matches no projection; they are blocks\.0\.ffn\.w_gate"):
        add_lora(model, rank=2, targets="nothing")
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate already carries an adapter"):
        add_lora(add_lora(model, rank=2), rank=2)
