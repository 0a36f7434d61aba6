"""MixtureOfMemories' own parts (the protocol is tests/layers/test_conformance.py's): the load-balance loss it
sows in training mode (fla's Switch-style loss), and its option checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers import MixtureOfMemories


def test_balance_loss_is_sown_in_training_mode():
    layer = MixtureOfMemories(8, num_heads=1, head_dim=4, num_memories=3, top_k=2, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 8)), jnp.float32)
    assert layer.deterministic  # a new layer is in evaluation mode: no sow (MoE starts in training mode)
    layer.train()  # as train/step.py does every step
    nnx.jit(lambda m, x: m(x))(layer, x)
    sown = nnx.to_pure_dict(nnx.pop(layer, nnx.Intermediate))["mom"][0]
    p = np.asarray(jax.nn.softmax(np.asarray(x).reshape(-1, 8) @ np.asarray(layer.router.kernel[...]), axis=-1))
    f = np.zeros(3)
    for row in np.argsort(-p, axis=-1)[:, :2]:  # each token's top 2
        f[row] += 1 / len(p)
    want = 3 * np.sum(f * p.mean(0))  # M sum_m f_m P_m (fla's load_balancing_loss_func)
    np.testing.assert_allclose(sown["balance_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(sown["aux_loss"], 0.01 * want, rtol=1e-5)
    layer.eval()
    assert layer.deterministic


def test_bad_options():
    with pytest.raises(ValueError, match="top_k=4 must be between 1 and num_memories=3"):
        MixtureOfMemories(8, num_heads=2, num_memories=3, top_k=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads=3 does not divide d_model=8"):
        MixtureOfMemories(8, num_heads=3, rngs=nnx.Rngs(0))
