"""`model.mixer.impl`: a model built with `impl: pallas` gives the logits of `impl: reference` (same
seed, so the same weights) and its prefill then token-by-token decode equals its full pass, for every
mixer kind with Pallas kernels and both kernel families (ZOO_PALLAS_PLATFORM picks the GPU kernels of
kernels/*/pallas.py or the TPU kernels of kernels/*/pallas_tpu.py; both run in interpret mode here);
a layer_pattern mixes impls per entry, and a bad impl is a config error naming the dotted path.

T = 21 leaves ragged tails after the kernels' chunks; the prefill of 17 tokens crosses one chunk, and
the single-token steps run the kernels too, except for mamba and mamba2, which step with their plain
step functions. RWKV-6 and RWKV-7 (whose official init zeroes W_o) run on perturbed weights.
"""

import jax
import pytest

from tests.layers.conformance import perturbed
from tests.util import assert_close, decode_in_pieces, forward, tiny_config, tiny_model

TINY = {
    "attention": {"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
    "mla": {"kind": "mla", "num_heads": 2, "rope_dim": 4, "kv_lora_rank": 12, "q_lora_rank": 8},
    "gla": {"kind": "gla", "num_heads": 2, "conv_size": 4},
    "retnet": {"kind": "retnet", "num_heads": 2},
    "linear_attention": {"kind": "linear_attention", "num_heads": 2, "feature_map": "hedgehog"},
    "mamba": {"kind": "mamba", "state_size": 4},
    "mamba2": {"kind": "mamba2", "state_size": 8, "head_dim": 16, "num_groups": 2},
    "deltanet": {"kind": "deltanet", "num_heads": 2},
    "gated_deltanet": {"kind": "gated_deltanet", "num_heads": 2},
    "kda": {"kind": "kda", "num_heads": 2},
    "hgrn2": {"kind": "hgrn2", "num_heads": 2},
    "gated_deltaproduct": {"kind": "gated_deltaproduct", "num_heads": 2},
    "rwkv6": {"kind": "rwkv6", "head_dim": 16, "mix_lora_dim": 4, "decay_lora_dim": 4},
    "rwkv7": {"kind": "rwkv7", "head_dim": 16, "decay_lora_dim": 4, "icl_lora_dim": 4, "value_lora_dim": 4,
              "gate_lora_dim": 4},
}
T, PREFILL = 21, 17


def _tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (2, T), 0, 256)


def _kernels(fn, *args) -> str | None:
    """The Pallas kernel family ("gpu" or "tpu") that tracing fn (a closure over an NNX model)
    reaches, None if none: without this, pallas-vs-reference equality could hold because impl never
    reached the op, or reached the other family."""
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    if "pallas_call" not in jaxpr:
        return None
    return "tpu" if "dimension_semantics" in jaxpr else "gpu"  # only the TPU CompilerParams have it


def _model(kind, impl):
    model = tiny_model({**TINY[kind], "impl": impl}, num_layers=1)
    if kind.startswith("rwkv"):
        model = perturbed(model)
    return model


# Retention, linear attention, SSD and WKV6 run GLA's kernels (with their own wrappers, which the GPU
# family runs here); the TPU family runs once per kernel.
GLA_KERNELS = ("retnet", "linear_attention", "mamba2", "rwkv6")
CASES = [(kind, platform) for platform in ("gpu", "tpu") for kind in TINY
         if platform == "gpu" or kind not in GLA_KERNELS]


@pytest.mark.parametrize("kind, platform", CASES)
def test_pallas_equals_reference_and_decodes(kind, platform, monkeypatch):
    if jax.default_backend() in ("gpu", "tpu") and jax.default_backend() != platform:
        pytest.skip(f"a {jax.default_backend()} runs its own kernels, not the {platform} ones")
    monkeypatch.setenv("ZOO_PALLAS_PLATFORM", platform)
    pallas, reference = _model(kind, "pallas"), _model(kind, "reference")
    assert pallas.blocks[0].mixer.impl == "pallas" and reference.blocks[0].mixer.impl == "reference"
    tokens = _tokens()
    state = pallas.init_state(2, T)
    assert _kernels(lambda t: pallas(t), tokens) == platform
    assert _kernels(lambda t, s: pallas.decode(t, s), tokens[:, :PREFILL], state) == platform
    step = None if kind in ("mamba", "mamba2") else platform  # their T = 1 step is the plain step function
    assert _kernels(lambda t, s: pallas.decode(t, s), tokens[:, :1], state) == step
    assert _kernels(lambda t: reference(t), tokens) is None
    full = forward(pallas, tokens)
    assert_close(full, forward(reference, tokens), 1e-4, f"{kind}: impl=pallas ({platform}) vs reference")
    pieces, _ = decode_in_pieces(pallas, tokens, cuts=list(range(PREFILL, T)))
    assert_close(pieces, full, 1e-4, f"{kind}: impl=pallas ({platform}) prefill + steps vs full pass")


def test_layer_pattern_mixes_impls():
    pattern = [{**TINY["gla"], "impl": "pallas"}, {**TINY["mamba2"], "impl": "xla"}]
    mixed = tiny_model(layer_pattern=pattern)
    assert [b.mixer.impl for b in mixed.blocks] == ["pallas", "xla"]
    reference = tiny_model(layer_pattern=[{**m, "impl": "reference"} for m in pattern])
    tokens = _tokens(1)
    x = jax.random.normal(jax.random.key(2), (2, T, 32))
    assert [_kernels(b.mixer, x) for b in mixed.blocks] == ["gpu", None]
    assert_close(forward(mixed, tokens), forward(reference, tokens), 1e-4, "layer_pattern pallas + xla vs reference")


@pytest.mark.parametrize("kind", TINY)
def test_bad_impl_names_the_dotted_path(kind):
    with pytest.raises(ValueError, match=r"model\.mixer\.impl: expected one of 'auto'"):
        tiny_config({**TINY[kind], "impl": "triton"})
    with pytest.raises(ValueError, match=r"model\.layer_pattern\[1\]\.impl"):
        tiny_config(layer_pattern=[TINY["gla"], {**TINY[kind], "impl": "cuda"}])


@pytest.mark.parametrize("kind", TINY)
def test_layer_rejects_bad_impl(kind):
    """The layer itself (used without a config) checks impl in its constructor."""
    from flax import nnx

    from zoo.registry import LAYER_OF, MIXERS

    layer_cls = LAYER_OF[MIXERS[kind]]
    kwargs = {k: v for k, v in TINY[kind].items() if k != "kind"}
    with pytest.raises(ValueError, match=r"impl='triton'; expected one of"):
        layer_cls(32, **kwargs, impl="triton", rngs=nnx.Rngs(0))
