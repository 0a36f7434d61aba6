"""Every registered mixer kind (and every FFN kind with a decode state) through the mixer protocol of
tests/layers/conformance.py, built from its config as the model builds it (zoo.registry.make_layer).

A kind registered later runs here with no edit: at its config's defaults, on width WIDTH, with
chunk_size 8 when it has one (T = 20 leaves ragged chunks). TINY only shrinks the shipped kinds for
speed. RWKV-7 runs as its second layer, so its value residual (v_first) is exercised.
"""

import typing

import pytest
from flax import nnx

from tests.layers.conformance import check_mixer
from zoo.registry import FFNS, LAYER_OF, MIXERS, make_layer

WIDTH = 64  # a kind's defaults at this width must build
TINY = {  # (d_model, config) of the shipped kinds, small and with every optional part on
    "attention": (32, {"num_heads": 4, "num_kv_heads": 2, "window": 7}),
    "mla": (32, {"num_heads": 2, "v_head_dim": 8, "rope_dim": 4, "kv_lora_rank": 12, "q_lora_rank": 8,
                 "window": 7}),
    "moba": (32, {"num_heads": 4, "num_kv_heads": 2, "block_size": 4, "top_k": 3}),
    "nsa": (32, {"num_heads": 4, "num_kv_heads": 2, "block_len": 4, "stride": 2, "select_len": 4,
                 "num_selected": 4, "window": 3}),
    "linear_attention": (32, {"num_heads": 2, "feature_map": "elu"}),
    "base_conv": (16, {"expand": 2}),
    "fox": (32, {"num_heads": 4, "num_kv_heads": 2, "qk_norm": True, "output_norm": True, "output_gate": True}),
    "retnet": (32, {"num_heads": 2}),
    "lightning": (16, {"num_heads": 2}),
    "gla": (32, {"num_heads": 2, "conv_size": 4}),
    "mamba": (16, {"state_size": 4}),
    "mamba2": (32, {"state_size": 8, "head_dim": 16, "num_groups": 2}),
    "mamba3": (32, {"state_size": 8, "head_dim": 16, "num_groups": 2}),
    "loglinear_mamba2": (32, {"state_size": 8, "head_dim": 16, "num_groups": 2, "max_levels": 6}),
    "s4d": (16, {"state_size": 8}),
    "hyena": (16, {"filter_order": 8, "filter_emb_dim": 5, "filter_inner_layers": 1}),
    "rwkv6": (32, {"head_dim": 16, "mix_lora_dim": 4, "decay_lora_dim": 4}),
    "rwkv7": (32, {"head_dim": 16, "decay_lora_dim": 4, "icl_lora_dim": 4, "value_lora_dim": 4,
                   "gate_lora_dim": 4}),
    "deltanet": (16, {"num_heads": 2}),
    "gated_deltanet": (16, {"num_heads": 2, "num_v_heads": 4, "head_dim": 4}),
    "kda": (16, {"num_heads": 2, "head_dim": 4, "expand_v": 2.0, "allow_neg_eigval": True}),
    "gated_deltaproduct": (16, {"num_heads": 2, "head_dim": 4, "num_householder": 3}),
    "gated_deltanet2": (16, {"num_heads": 2, "head_dim": 4, "expand_v": 2.0, "allow_neg_eigval": True}),
    "comba": (16, {"num_heads": 2, "head_dim": 4}),
    "loglinear_gated_deltanet": (16, {"num_heads": 2, "head_dim": 4, "max_levels": 6}),
    "mesanet": (16, {"num_heads": 2, "cg_steps": 2, "use_output_gate": True}),
    "mom": (16, {"num_heads": 2, "head_dim": 4, "num_memories": 3, "top_k": 2, "conv_size": 2}),
    "gsa": (16, {"num_heads": 2, "num_slots": 4, "feature_map": "t2r", "conv_size": 4}),
    "hgrn2": (16, {"num_heads": 2, "expand_ratio": 4, "conv_size": 4}),
    "rglru": (16, {"lru_width": 24, "num_heads": 2, "conv_size": 4}),
    "slstm": (16, {"num_heads": 2, "conv_size": 4}),
    "mlstm": (16, {"num_heads": 2}),
    "stickbreaking": (16, {"num_heads": 4, "num_kv_heads": 2, "remainder": True, "qkv_bias": True,
                           "qk_norm": True}),
    "path_attention": (16, {"num_heads": 4, "num_kv_heads": 2, "w_rank": 4, "conv_size": 4, "use_forget_gate": True,
                            "qk_norm": True, "conv_bias": True}),
    "ttt_linear": (16, {"num_heads": 2, "mini_batch_size": 4}),
    "ttt_mlp": (8, {"num_heads": 2, "mini_batch_size": 4}),
    "titans": (16, {"num_heads": 2, "mini_batch_size": 4, "conv_size": 2, "memory_depth": 2}),  # depth 1: test_kinds
    "deltaformer": (16, {"num_heads": 4, "num_kv_heads": 2, "write_key": "separate", "qkv_bias": True,
                         "qk_norm": True}),
    # Falcon-H1's layer: a Mamba-2 of an inner width no multiple of d_model, grouped gated norm, beside GQA
    "parallel": (32, {"mixers": ({"kind": "mamba2", "state_size": 8, "head_dim": 8, "num_groups": 2, "d_inner": 48,
                                  "output_norm": "grouped", "chunk_size": 8},
                                 {"kind": "attention", "num_heads": 4, "num_kv_heads": 2})}),
    "rwkv6_channel_mix": (32, {"hidden_dim": 64}),
    "rwkv7_channel_mix": (32, {"hidden_dim": 64}),
}
STATEFUL_FFNS = [k for k, c in FFNS.items() if hasattr(LAYER_OF[c], "init_state")]


def modes(config_cls) -> tuple:
    """The modes a kind's config allows (its `OneOf` choices), but "auto" (an alias of one of them)."""
    hint = typing.get_type_hints(config_cls, include_extras=True).get("mode")
    choices = [c for a in typing.get_args(hint)[1:] for c in getattr(a, "choices", ())]
    return tuple(m for m in choices if m != "auto")


def maker(kind: str):
    table = MIXERS if kind in MIXERS else FFNS
    D, overrides = TINY.get(kind, (WIDTH, {}))
    fields = {f for f in typing.get_type_hints(table[kind])}
    data = {"kind": kind, **overrides, **({"chunk_size": 8} if "chunk_size" in fields else {})}
    cfg = table[kind](**{k: v for k, v in data.items() if k != "kind"})
    return D, cfg, lambda **kw: make_layer(cfg, D, rngs=nnx.Rngs(0), layer_id=1, num_layers=2, **kw)


@pytest.mark.parametrize("kind", [*MIXERS, *STATEFUL_FFNS])
def test_kind_follows_the_mixer_protocol(kind):
    D, cfg, make = maker(kind)
    check_mixer(make, D, modes(type(cfg)))
