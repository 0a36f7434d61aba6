"""model.residual (layers/residual.py): the default is today's pre-norm walk bit for bit; mHC's H_res is
doubly stochastic and its n = 1 start is the standard residual; Full AttnRes is its equations written
out; decoding equals the full pass for both; bad options are ValueErrors naming the dotted path. The
shipped configs/mhc.yaml and configs/attnres.yaml also decode and pack in tests/zoo/test_kinds.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.residual import HyperConnection
from tests.layers.conformance import perturbed
from tests.util import assert_close, decode_in_pieces, forward, tiny_config, tiny_model
from zoo.config import from_dict

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 7)), jnp.int32)


def test_standard_is_the_pre_norm_walk_bit_for_bit():
    model = tiny_model(num_layers=2)
    assert not any("residual" in str(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    x = model.embed(TOKENS)
    for b in model.blocks:  # written out: x + mixer(norm(x)), then x + ffn(norm(x))
        x = x + b.mixer(b.mixer_norm(x))
        x = x + b.ffn(b.ffn_norm(x))
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), np.asarray(model.logits(x)))


def test_mhc_h_res_is_doubly_stochastic_and_h_pre_h_post_non_negative():
    hc = perturbed(HyperConnection(8, 4, index=1, iterations=20))  # the paper's 20 rounds, phi random
    stream = jax.random.normal(jax.random.key(1), (2, 5, 4, 8))
    start = hc.coefficients(stream)[2]
    hc.alpha[...] = jnp.full((3,), 0.1)  # the dynamic part grown: H_res moves off its start
    pre, post, res = hc.coefficients(stream)
    np.testing.assert_allclose(res.sum(-1), 1, atol=1e-5)
    np.testing.assert_allclose(res.sum(-2), 1, atol=1e-5)
    assert float(res.min()) >= 0 and float(jnp.abs(res - start).max()) > 1e-2
    assert 0 < float(pre.min()) and float(pre.max()) < 1 and 0 < float(post.min()) and float(post.max()) < 2


def test_mhc_with_one_stream_starts_as_the_standard_residual():
    standard, mhc = tiny_model(num_layers=2), tiny_model(num_layers=2, residual={"kind": "mhc", "rate": 1})
    assert_close(forward(mhc, TOKENS), forward(standard, TOKENS), 1e-5, "mhc n=1 vs standard")


def test_full_attnres_is_its_equations():
    """One block (mixer, FFN): h_1 = v_0, h_2 = read([v_0, y_1]), final = read([v_0, y_1, y_2])."""
    model = perturbed(tiny_model(num_layers=1, residual={"kind": "attnres"}))
    b = model.blocks[0]

    def read(module, values):
        v = jnp.stack(values)  # (S, B, T, D)
        k = v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-6) * module.key_norm.weight[...]
        return jnp.einsum("sbt,sbtd->btd", jax.nn.softmax(k @ module.query[...], axis=0), v)

    v0 = model.embed(TOKENS)
    y1 = b.mixer(b.mixer_norm(v0))
    y2 = b.ffn(b.ffn_norm(read(b.residual[1].read, [v0, y1])))
    assert_close(forward(model, TOKENS), model.logits(read(model.residual_read, [v0, y1, y2])), 1e-5, "attnres")


@pytest.mark.parametrize("residual", [{"kind": "mhc", "rate": 3}, {"kind": "attnres", "block_size": 3}],
                         ids=lambda r: r["kind"])
def test_decode_equals_the_full_pass(residual):
    model = perturbed(tiny_model(num_layers=2, residual=residual))
    decoded, _ = decode_in_pieces(model, TOKENS, cuts=[4, 5])
    assert_close(decoded, forward(model, TOKENS), 1e-4, f"{residual['kind']}: decode vs full pass")


@pytest.mark.parametrize("residual,exits,match", [
    ({"kind": "mhc", "rate": 0}, None, r"model\.residual\.rate: expected 1 <= rate"),
    ({"kind": "hyper"}, None, r"model\.residual\.kind: expected one of"),
    ({"kind": "mhc", "streams": 4}, None, r"model\.residual\.streams: unknown key"),
    ({"kind": "mhc", "block_size": 2}, None, r"residual\.block_size: an option of model\.residual\.kind=attnres"),
    ({"kind": "attnres", "iterations": 5}, None, r"residual\.iterations: an option of model\.residual\.kind=mhc"),
    ({"kind": "attnres"}, {"layers": [1], "weights": [0.5]}, r"model\.residual\.kind: 'attnres' with model\.exits"),
])
def test_bad_options_are_errors_naming_the_dotted_path(residual, exits, match):
    model = {"d_model": 32, "num_layers": 2, "residual": residual, **({"exits": exits} if exits else {})}
    with pytest.raises(ValueError, match=match):
        from_dict({"model": model})


def test_default_config_holds_the_standard_residual():
    assert tiny_config().residual.kind == "standard"
