"""The registry of kinds: `kind` in a config -> (config dataclass, layer class).

A config dataclass's fields are exactly its layer's keyword arguments (besides d_model, dtype and
rngs), so adding an architecture is one layer file, one dataclass here, one `register` line and one
YAML file. `check` validates a config against the model width before any array exists: by default
it builds the layer abstractly (nnx.eval_shape) and re-raises the layer's own ValueError under the
config's dotted path.
"""

import dataclasses
import inspect
from dataclasses import dataclass
from typing import ClassVar, Literal

import jax.numpy as jnp
from flax import nnx

import layers
from zoo.config import build

MIXERS: dict[str, type] = {}  # kind -> config dataclass
FFNS: dict[str, type] = {}
LAYER_OF: dict[type, type] = {}  # config dataclass -> layer class


def register(table: dict, config_cls: type, layer_cls: type):
    table[config_cls.KIND] = config_cls
    LAYER_OF[config_cls] = layer_cls


def build_kind(table: dict, data, path: str):
    if not isinstance(data, dict) or "kind" not in data:
        raise ValueError(f"{path}.kind: missing; expected one of {', '.join(table)}")
    if data["kind"] not in table:
        raise ValueError(f"{path}.kind: unknown kind {data['kind']!r}; expected one of {', '.join(table)}")
    return build(table[data["kind"]], data, path)


def make_layer(cfg, d_model: int, *, dtype=jnp.float32, rngs: nnx.Rngs, layer_id: int = 0, num_layers: int = 1):
    """The layer of a config. Layers whose initialisation depends on depth (RWKV) also get
    `layer_id` and `num_layers`, which are not config keys."""
    cls = LAYER_OF[type(cfg)]
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if "layer_id" in inspect.signature(cls).parameters:
        kwargs.update(layer_id=layer_id, num_layers=num_layers)
    return cls(d_model, **kwargs, dtype=dtype, rngs=rngs)


class Kind:
    """Base of the config dataclasses of mixers and FFNs."""
    KIND: ClassVar[str]

    def check(self, d_model: int, path: str):
        try:
            nnx.eval_shape(lambda: make_layer(self, d_model, rngs=nnx.Rngs(0)))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class AttentionConfig(Kind):
    """Softmax attention: MHA (num_kv_heads = num_heads or null), GQA, MQA (num_kv_heads = 1);
    window: sliding-window length in tokens (null = full causal)."""
    KIND: ClassVar[str] = "attention"
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    window: int | None = None
    rope_base: float = 10000.0
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"

    def check(self, d_model: int, path: str):
        if self.num_heads <= 0 or d_model % self.num_heads and self.head_dim is None:
            raise ValueError(f"{path}.num_heads: {self.num_heads} does not divide model.d_model={d_model}")
        kv = self.num_kv_heads
        if kv is not None and (kv <= 0 or self.num_heads % kv):
            raise ValueError(f"{path}.num_kv_heads: {kv} does not divide {path}.num_heads={self.num_heads}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"{path}.window: expected a positive number of tokens or null, got {self.window}")
        super().check(d_model, path)


@dataclass(frozen=True)
class MLPConfig(Kind):
    """SwiGLU MLP; hidden_dim null = 8/3 d_model rounded up to 32."""
    KIND: ClassVar[str] = "mlp"
    hidden_dim: int | None = None


Mode = Literal["recurrent", "chunk", "parallel"]


@dataclass(frozen=True)
class DeltaNetConfig(Kind):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with L2-normalised q, k."""
    KIND: ClassVar[str] = "deltanet"
    num_heads: int = 4
    head_dim: int | None = None
    expand_v: float = 1.0
    conv_size: int = 4
    use_beta: bool = True
    qk_norm: Literal["l2", "sum"] = "l2"
    use_output_gate: bool = False
    norm_eps: float = 1e-5
    mode: Mode = "chunk"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class GatedDeltaNetConfig(Kind):
    """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): the delta rule with a Mamba-2 decay."""
    KIND: ClassVar[str] = "gated_deltanet"
    num_heads: int = 4
    head_dim: int | None = None
    expand_v: float = 2.0
    conv_size: int = 4
    use_output_gate: bool = True
    norm_eps: float = 1e-5
    mode: Mode = "chunk"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class LinearAttentionConfig(Kind):
    """Linear attention (Katharopoulos et al. 2020) with a feature map: identity, elu (elu+1), relu,
    performer (FAVOR+), cosformer (relu + cos re-weighting), hedgehog (learned); normalize adds the
    denominator q . sum(k)."""
    KIND: ClassVar[str] = "linear_attention"
    num_heads: int = 4
    feature_map: Literal["identity", "elu", "relu", "performer", "cosformer", "hedgehog"] = "elu"
    normalize: bool = True
    num_features: int | None = None
    cosformer_max_len: int = 2048
    eps: float = 1e-6
    mode: Mode = "chunk"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class RetNetConfig(Kind):
    """Multi-scale retention (Sun et al. 2023): fixed per-head decay, rotary, norm and swish gate."""
    KIND: ClassVar[str] = "retnet"
    num_heads: int = 4
    expand_k: float = 1.0
    expand_v: float = 2.0
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    mode: Mode = "chunk"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class GLAConfig(Kind):
    """Gated linear attention (Yang et al. 2024): data-dependent per-key decay from a low-rank gate."""
    KIND: ClassVar[str] = "gla"
    num_heads: int = 4
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    conv_size: int = 0
    use_output_gate: bool = True
    norm_eps: float = 1e-5
    mode: Mode = "chunk"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class MambaConfig(Kind):
    """Mamba (Gu & Dao 2023): selective SSM with input-dependent Δ, B, C; mode auto picks the fastest
    exact scan for the backend (recurrent on CPU)."""
    KIND: ClassVar[str] = "mamba"
    state_size: int = 16
    expand: int = 2
    conv_size: int = 4
    dt_rank: int | Literal["auto"] = "auto"
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    mode: Literal["auto", "recurrent", "chunk", "parallel"] = "auto"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class Mamba2Config(Kind):
    """Mamba-2 (Dao & Gu 2024): SSD with a scalar decay per head and grouped B/C."""
    KIND: ClassVar[str] = "mamba2"
    state_size: int = 64
    expand: int = 2
    head_dim: int = 64
    num_groups: int = 1
    conv_size: int = 4
    chunk_size: int = 64
    mode: Mode = "chunk"
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_init_range: tuple[float, float] = (1.0, 16.0)
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class MoEConfig(Kind):
    """Mixture of SwiGLU experts: routers topk (softmax_then_topk or topk_then_softmax), switch
    (top-1), expert_choice (not causal); dispatch capacity (drops overflow, GShard order) or dropless
    (ragged_dot); balance aux_loss (Switch loss), bias (DeepSeek-V3, loss-free) or none; shared
    experts (DeepSeekMoE). hidden_dim null = the dense width / active experts (same active params)."""
    KIND: ClassVar[str] = "moe"
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int | None = None
    router: Literal["topk", "switch", "expert_choice"] = "topk"
    score_order: Literal["softmax_then_topk", "topk_then_softmax"] = "softmax_then_topk"
    renormalize: bool = True
    dispatch: Literal["capacity", "dropless"] = "capacity"
    capacity_factor: float = 1.25
    num_shared_experts: int = 0
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    balance_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    bias_update_rate: float = 0.001
    router_jitter: float = 0.0

    def check(self, d_model: int, path: str):
        if self.num_shared_experts > 0 and self.num_experts == 0:
            raise ValueError(f"{path}.num_shared_experts: {self.num_shared_experts} shared experts need "
                             f"{path}.num_experts >= 1 routed experts (got 0); use ffn.kind: mlp for a dense FFN")
        if not 1 <= self.top_k <= max(self.num_experts, 1):
            raise ValueError(f"{path}.top_k: {self.top_k} must be between 1 and {path}.num_experts={self.num_experts}")
        if self.capacity_factor <= 0:
            raise ValueError(f"{path}.capacity_factor: expected > 0, got {self.capacity_factor}")
        super().check(d_model, path)


@dataclass(frozen=True)
class RWKV6Config(Kind):
    """RWKV-6 "Finch" time mix (Peng et al. 2024): data-dependent token shift and decay, bonus u."""
    KIND: ClassVar[str] = "rwkv6"
    head_dim: int = 64
    mix_lora_dim: int = 32
    decay_lora_dim: int = 64
    mode: Mode = "chunk"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class RWKV7Config(Kind):
    """RWKV-7 "Goose" time mix (Peng et al. 2025): generalised delta rule with vector decay and
    in-context learning rate, value residual from layer 0 (LoRA ranks null = the official sizes)."""
    KIND: ClassVar[str] = "rwkv7"
    head_dim: int = 64
    decay_lora_dim: int | None = None
    icl_lora_dim: int | None = None
    value_lora_dim: int | None = None
    gate_lora_dim: int | None = None
    mode: Mode = "chunk"
    chunk_size: int = 64
    impl: Literal["auto", "reference", "xla", "pallas"] = "auto"


@dataclass(frozen=True)
class RWKV6ChannelMixConfig(Kind):
    """RWKV-6 channel mix: token-shifted squared-ReLU FFN with a receptance gate (hidden null = 3.5 D)."""
    KIND: ClassVar[str] = "rwkv6_channel_mix"
    hidden_dim: int | None = None


@dataclass(frozen=True)
class RWKV7ChannelMixConfig(Kind):
    """RWKV-7 channel mix: token-shifted squared-ReLU FFN (hidden null = 4 D)."""
    KIND: ClassVar[str] = "rwkv7_channel_mix"
    hidden_dim: int | None = None


register(MIXERS, AttentionConfig, layers.Attention)
register(MIXERS, LinearAttentionConfig, layers.LinearAttention)
register(MIXERS, RetNetConfig, layers.MultiScaleRetention)
register(MIXERS, GLAConfig, layers.GatedLinearAttention)
register(MIXERS, MambaConfig, layers.Mamba)
register(MIXERS, Mamba2Config, layers.Mamba2)
register(MIXERS, RWKV6Config, layers.RWKV6TimeMix)
register(MIXERS, RWKV7Config, layers.RWKV7TimeMix)
register(MIXERS, DeltaNetConfig, layers.DeltaNet)
register(MIXERS, GatedDeltaNetConfig, layers.GatedDeltaNet)
register(FFNS, MLPConfig, layers.MLP)
register(FFNS, MoEConfig, layers.MoE)
register(FFNS, RWKV6ChannelMixConfig, layers.RWKV6ChannelMix)
register(FFNS, RWKV7ChannelMixConfig, layers.RWKV7ChannelMix)
