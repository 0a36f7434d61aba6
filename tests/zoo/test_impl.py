"""`model.mixer.impl` of the recurrent kinds whose ops have Pallas kernels: a model built with
`impl: pallas` gives the logits of `impl: reference` (same seed, so the same weights), its prefill
then token-by-token decode equals its full pass, a layer_pattern mixes impls per entry, and a bad
impl is a config error naming the dotted path.

On CPU `impl: pallas` runs the kernels in interpret mode (kernels/*/pallas.py pick it off GPU). T = 21
leaves ragged tails after the 16-token GLA/SSD/delta-rule chunks and the 8-token selective-scan
chunks; the prefill of 17 tokens crosses one chunk, and the single-token steps run the kernels too
for gla, retnet, linear_attention, deltanet and gated_deltanet (mamba and mamba2 step with their
plain step functions).
"""

import jax
import pytest

from tests.util import assert_close, decode_in_pieces, forward, tiny_config, tiny_model

TINY = {
    "gla": {"kind": "gla", "num_heads": 2, "conv_size": 4},
    "retnet": {"kind": "retnet", "num_heads": 2},
    "linear_attention": {"kind": "linear_attention", "num_heads": 2, "feature_map": "hedgehog"},
    "mamba": {"kind": "mamba", "state_size": 4},
    "mamba2": {"kind": "mamba2", "state_size": 8, "head_dim": 16, "num_groups": 2},
    "deltanet": {"kind": "deltanet", "num_heads": 2},
    "gated_deltanet": {"kind": "gated_deltanet", "num_heads": 2},
}
T, PREFILL = 21, 17


def _tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (2, T), 0, 256)


def _runs_pallas(fn, *args) -> bool:
    """Whether tracing fn (a closure over an NNX model) reaches a Pallas kernel: without it,
    pallas-vs-reference equality could hold because impl never reached the op."""
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("kind", TINY)
def test_pallas_equals_reference_and_decodes(kind):
    pallas = tiny_model({**TINY[kind], "impl": "pallas"}, num_layers=1)
    reference = tiny_model({**TINY[kind], "impl": "reference"}, num_layers=1)
    assert pallas.blocks[0].mixer.impl == "pallas" and reference.blocks[0].mixer.impl == "reference"
    tokens = _tokens()
    state = pallas.init_state(2, T)
    assert _runs_pallas(lambda t: pallas(t), tokens)
    assert _runs_pallas(lambda t, s: pallas.decode(t, s), tokens[:, :PREFILL], state)
    steps_in_op = kind not in ("mamba", "mamba2")  # their T = 1 step is the plain step function
    assert _runs_pallas(lambda t, s: pallas.decode(t, s), tokens[:, :1], state) == steps_in_op
    assert not _runs_pallas(lambda t: reference(t), tokens)
    full = forward(pallas, tokens)
    assert_close(full, forward(reference, tokens), 1e-4, f"{kind}: impl=pallas vs reference")
    pieces, _ = decode_in_pieces(pallas, tokens, cuts=list(range(PREFILL, T)))
    assert_close(pieces, full, 1e-4, f"{kind}: impl=pallas prefill + steps vs full pass")


def test_rwkv6_pallas_equals_reference_and_decodes():
    """RWKV-6's official init zeroes W_o (every output 0), so both models get the same noisy weights."""
    from tests.layers.test_rwkv6 import perturbed

    mixer = {"kind": "rwkv6", "head_dim": 16, "mix_lora_dim": 4, "decay_lora_dim": 4}
    pallas, reference = (perturbed(tiny_model({**mixer, "impl": impl}, num_layers=1)) for impl in ("pallas", "reference"))
    tokens = _tokens()
    assert _runs_pallas(lambda t: pallas(t), tokens) and not _runs_pallas(lambda t: reference(t), tokens)
    full = forward(pallas, tokens)
    assert_close(full, forward(reference, tokens), 1e-4, "rwkv6: impl=pallas vs reference")
    pieces, _ = decode_in_pieces(pallas, tokens, cuts=list(range(PREFILL, T)))
    assert_close(pieces, full, 1e-4, "rwkv6: impl=pallas prefill + steps vs full pass")


def test_layer_pattern_mixes_impls():
    pattern = [{**TINY["gla"], "impl": "pallas"}, {**TINY["mamba2"], "impl": "xla"}]
    mixed = tiny_model(layer_pattern=pattern)
    assert [b.mixer.impl for b in mixed.blocks] == ["pallas", "xla"]
    reference = tiny_model(layer_pattern=[{**m, "impl": "reference"} for m in pattern])
    tokens = _tokens(1)
    x = jax.random.normal(jax.random.key(2), (2, T, 32))
    assert [_runs_pallas(b.mixer, x) for b in mixed.blocks] == [True, False]
    assert_close(forward(mixed, tokens), forward(reference, tokens), 1e-4, "layer_pattern pallas + xla vs reference")


@pytest.mark.parametrize("kind", TINY)
def test_bad_impl_names_the_dotted_path(kind):
    with pytest.raises(ValueError, match=r"model\.mixer\.impl: expected one of 'auto'"):
        tiny_config({**TINY[kind], "impl": "triton"})
    with pytest.raises(ValueError, match=r"model\.layer_pattern\[1\]\.impl"):
        tiny_config(layer_pattern=[TINY["gla"], {**TINY[kind], "impl": "cuda"}])


@pytest.mark.parametrize("kind", TINY)
def test_layer_rejects_bad_impl_and_pallas_on_tpu(kind, monkeypatch):
    """The layer itself (used without a config) checks impl in its constructor; on a TPU backend
    impl=pallas is a config error (no TPU kernel) before any array is made."""
    from flax import nnx

    from zoo.registry import LAYER_OF, MIXERS

    layer_cls = LAYER_OF[MIXERS[kind]]
    kwargs = {k: v for k, v in TINY[kind].items() if k != "kind"}
    with pytest.raises(ValueError, match=r"impl='triton'; expected one of"):
        layer_cls(32, **kwargs, impl="triton", rngs=nnx.Rngs(0))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match=r"model\.mixer: .*impl='pallas' has no TPU kernel"):
        tiny_config({**TINY[kind], "impl": "pallas"})
    tiny_config({**TINY[kind], "impl": "xla"})
