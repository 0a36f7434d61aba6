"""`model.mixer.impl`: a model built with `impl: pallas` gives the logits of `impl: reference` (same
seed, so the same weights) and its prefill then token-by-token decode equals its full pass, for every
mixer kind with Pallas kernels and both kernel families (ZOO_PALLAS_PLATFORM picks the GPU kernels of
kernels/*/pallas.py or the TPU kernels of kernels/*/pallas_tpu.py; both run in interpret mode here);
a layer_pattern mixes impls per entry, and a bad impl is a config error naming the dotted path.

T = 21 leaves ragged tails after the kernels' chunks; the prefill of 17 tokens crosses one chunk, and
the single-token steps run the kernels too, except for the kinds of PLAIN_STEP, which step with their
plain step functions. RWKV-6 and RWKV-7 (whose official init zeroes W_o) run on perturbed weights.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from tests.layers.conformance import perturbed
from tests.util import assert_close, forward, tiny_config, tiny_model

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
    # kinds on the kernels above: attention's (fox), GLA's (lightning, gsa, mamba3, mesanet's products), the
    # delta rule's (comba, mom), RWKV-7's (gated_deltanet2)
    "fox": {"kind": "fox", "num_heads": 4, "num_kv_heads": 2},
    "lightning": {"kind": "lightning", "num_heads": 2},
    "gsa": {"kind": "gsa", "num_heads": 2, "num_slots": 4},
    "mamba3": {"kind": "mamba3", "state_size": 8, "head_dim": 16, "num_groups": 2},
    "mamba3_mimo": {"kind": "mamba3", "state_size": 8, "head_dim": 16, "num_groups": 2, "mimo_rank": 2},
    "mesanet": {"kind": "mesanet", "num_heads": 2, "cg_steps": 2},
    "comba": {"kind": "comba", "num_heads": 2},
    "mom": {"kind": "mom", "num_heads": 2, "num_memories": 3, "top_k": 2},
    "gated_deltanet2": {"kind": "gated_deltanet2", "num_heads": 2},
}
T, PREFILL = 21, 17


def _tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (2, T), 0, 256)


def _family(jaxpr) -> str | None:
    """The Pallas kernel family ("gpu" or "tpu") a traced program reaches, None if none: without this,
    pallas-vs-reference equality could hold because impl never reached the op, or reached the other
    family."""
    text = str(jaxpr)
    if "pallas_call" not in text:
        return None
    return "tpu" if "dimension_semantics" in text else "gpu"  # only the TPU CompilerParams have it


def _compiled(model, method, *args):
    """(model.method compiled for args' shapes, the kernel family it reaches): one trace serves both."""
    graphdef, state = nnx.split(model)
    traced = jax.jit(lambda s, *a: getattr(nnx.merge(graphdef, s), method)(*a)).trace(state, *args)
    compiled = traced.lower().compile()
    return (lambda *a: compiled(state, *a)), _family(traced.jaxpr)


def _model(kind, impl):
    model = tiny_model({**TINY[kind], "impl": impl}, num_layers=1)
    if kind.startswith("rwkv"):
        model = perturbed(model)
    return model


# Retention, linear attention, SSD and WKV6 run GLA's kernels (with their own wrappers, which the GPU
# family runs here), and the kinds after RWKV-7 in TINY the kernels of the kinds before them: the TPU
# family runs once per kernel.
PLAIN_STEP = ("mamba", "mamba2", "mamba3", "mamba3_mimo", "gsa", "mesanet", "gated_deltanet2")  # T = 1: a step function
REUSED = ("retnet", "linear_attention", "mamba2", "rwkv6", *list(TINY)[list(TINY).index("rwkv7") + 1:])
CASES = [(kind, platform) for platform in ("gpu", "tpu") for kind in TINY if platform == "gpu" or kind not in REUSED]


@pytest.mark.parametrize("kind, platform", CASES)
def test_pallas_equals_reference_and_decodes(kind, platform, monkeypatch):
    if jax.default_backend() in ("gpu", "tpu") and jax.default_backend() != platform:
        pytest.skip(f"a {jax.default_backend()} runs its own kernels, not the {platform} ones")
    monkeypatch.setenv("ZOO_PALLAS_PLATFORM", platform)
    pallas, reference = _model(kind, "pallas"), _model(kind, "reference")
    assert pallas.blocks[0].mixer.impl == "pallas" and reference.blocks[0].mixer.impl == "reference"
    tokens, state = _tokens(), pallas.init_state(2, T)
    run, family = _compiled(pallas, "__call__", tokens)
    assert family == platform
    run_reference, family = _compiled(reference, "__call__", tokens)
    assert family is None
    full = run(tokens)
    assert_close(full, run_reference(tokens), 1e-4, f"{kind}: impl=pallas ({platform}) vs reference")
    prefill, family = _compiled(pallas, "decode", tokens[:, :PREFILL], state)
    assert family == platform
    logits, state = prefill(tokens[:, :PREFILL], state)
    step, family = _compiled(pallas, "decode", tokens[:, :1], state)
    assert family == (None if kind in PLAIN_STEP else platform)
    pieces = [logits]
    for t in range(PREFILL, T):
        logits, state = step(tokens[:, t:t + 1], state)
        pieces.append(logits)
    assert_close(jnp.concatenate(pieces, axis=1), full, 1e-4,
                 f"{kind}: impl=pallas ({platform}) prefill + steps vs full pass")


def test_layer_pattern_mixes_impls():
    pattern = [{**TINY["gla"], "impl": "pallas"}, {**TINY["mamba2"], "impl": "xla"}]
    mixed = tiny_model(layer_pattern=pattern)
    assert [b.mixer.impl for b in mixed.blocks] == ["pallas", "xla"]
    reference = tiny_model(layer_pattern=[{**m, "impl": "reference"} for m in pattern])
    tokens = _tokens(1)
    x = jax.random.normal(jax.random.key(2), (2, T, 32))
    assert [_family(jax.make_jaxpr(b.mixer)(x)) for b in mixed.blocks] == ["gpu", None]
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

    kwargs = dict(TINY[kind])
    layer_cls = LAYER_OF[MIXERS[kwargs.pop("kind")]]
    with pytest.raises(ValueError, match=r"impl='triton'; expected one of"):
        layer_cls(32, **kwargs, impl="triton", rngs=nnx.Rngs(0))
