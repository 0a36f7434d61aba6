"""What is GatedConv's own (the protocol at its defaults runs in test_conformance.py): its equations written
out in numpy, with every bias on, and the protocol with the biases."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import GatedConv
from tests.layers.conformance import check_mixer, perturbed, randn


def test_the_equations_with_biases():
    layer = perturbed(GatedConv(8, kernel_size=3, bias=True, rngs=nnx.Rngs(0)))
    x = np.asarray(randn(0, (2, 7, 8)), np.float64)
    w_in, b_in = np.asarray(layer.w_in[...]), np.asarray(layer.b_in[...])
    w, b = np.asarray(layer.conv.weight[...]), np.asarray(layer.conv.bias[...])
    bch = np.einsum("btd,dke->btke", x, w_in) + b_in  # [b_t, c_t, h_t] = x_t W_in + b_in
    u = bch[:, :, 0] * bch[:, :, 2]
    up = np.concatenate([np.zeros((2, 2, 8)), u], axis=1)  # two zero inputs before the first token
    z = sum(w[j] * up[:, j:j + 7] for j in range(3)) + b  # z_t = sum_j w_j u_{t-2+j} + b_conv
    y = (bch[:, :, 1] * z) @ np.asarray(layer.out_proj.kernel[...]) + np.asarray(layer.out_proj.bias[...])
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x, jnp.float32))), y, atol=1e-5)


def test_the_protocol_with_biases_and_a_longer_kernel():
    check_mixer(lambda **kw: GatedConv(16, kernel_size=4, bias=True, rngs=nnx.Rngs(0), **kw), 16)
