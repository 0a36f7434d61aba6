import jax.numpy as jnp
from flax import nnx

from layers import ShortConvolution
from tests.util import assert_close, randn


def test_decode_in_pieces_and_packed_rows_equal_the_full_pass():
    conv = ShortConvolution(6, 4, use_bias=True, rngs=nnx.Rngs(0))
    x = randn(1, (2, 11, 6))
    seg = jnp.array([[0] * 5 + [1] * 6, [0] * 2 + [1] * 7 + [2] * 2])
    full = conv(x, segment_ids=seg)
    alone = jnp.concatenate([conv(x[:1, :5]), conv(x[:1, 5:])], axis=1)
    assert_close(full[:1], alone, 1e-6)
    # Documents starting just before a cut: their predecessors must not leak through the window.
    # (Every document start lies inside a call: token 0 of a call always continues the state.)
    for cuts in ([6], [3, 4, 10], [10], [7, 10]):
        state, out = conv.init_state(2), []
        for a, b in zip([0, *cuts], [*cuts, 11]):
            y, state = conv.decode(x[:, a:b], state, segment_ids=seg[:, a:b])
            out.append(y)
        assert_close(jnp.concatenate(out, axis=1), full, 1e-6, f"cuts {cuts}")
