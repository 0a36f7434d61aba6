"""The config dataclass of every kind, each registered with its layer (zoo/registry.py).

A dataclass's fields are its layer's keyword arguments with the layer's defaults; its docstring is
what `python -m train --help` prints for the kind. Mixers inherit `impl` (registry.Mixer) and, where
the kind has several exact forms, `mode` and `chunk_size` (registry.Chunked).
"""

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import layers
from kernels import MODES
from layers.rotary import RopeScaling
from zoo.registry import Chunked, Kind, Mixer, ffn, mixer
from zoo.schema import NonNegFloat, NonNegInt, PosFloat, PosInt, Range


@dataclass(frozen=True)
class RopeScalingConfig(RopeScaling):
    """attention.rope_scaling: type linear, llama3, yarn or dynamic and that type's keys (layers/rotary.py)."""
    factor: PosFloat = 1.0
    original_max_position_embeddings: PosInt = 8192
    low_freq_factor: PosFloat = 1.0
    high_freq_factor: PosFloat = 4.0
    beta_fast: PosFloat = 32.0
    beta_slow: PosFloat = 1.0
    attention_factor: PosFloat | None = None
    mscale: PosFloat | None = None
    mscale_all_dim: PosFloat | None = None


@dataclass(frozen=True)
class HeadMaskConfig(layers.HeadMask):
    """attention.head_masks[h]: query head h's band (layers/attention.py): window (null = every earlier
    token), sinks, dilation, growth (the window grows by growth tokens per token of the document)."""
    window: PosInt | None = None
    sinks: NonNegInt = 0
    dilation: PosInt = 1
    growth: NonNegFloat = 0.0


@mixer(layers.Attention)
@dataclass(frozen=True)
class AttentionConfig(Mixer):
    """Softmax attention: MHA (num_kv_heads = num_heads or null), GQA, MQA (num_kv_heads = 1);
    window: sliding-window length in tokens (null = full causal); sinks: the first tokens of each
    document stay visible to every later query (StreamingLLM); dilation: the window takes every
    dilation-th token, spanning window * dilation (Longformer); head_masks: a list of one {window, sinks,
    dilation, growth} per head instead (SemSA / MoA: span window * dilation + growth * tokens so far);
    ring_spare: with windows on every head (and no growth) the KV cache is a ring of sinks + window *
    dilation + ring_spare slots, whatever the context; speculative decoding verifies at most ring_spare
    tokens a round; long_context: past the trained
    context (model.max_seq_len), window = each query sees the last max_seq_len tokens (the distances
    it was trained on), full = every earlier token (distances it never saw); rope_scaling: a rotary
    scaling for a longer context (type linear, llama3, yarn or dynamic, with its keys: layers/rotary.py);
    qkv_bias: biases on the q, k, v projections (Qwen2); qk_norm: RMSNorm of each head's query and key
    before the rotary, with eps norm_eps (Qwen3)."""
    KIND: ClassVar[str] = "attention"
    num_heads: PosInt = 4
    num_kv_heads: PosInt | None = None
    head_dim: PosInt | None = None
    window: PosInt | None = None
    sinks: NonNegInt = 0
    dilation: PosInt = 1
    head_masks: tuple[HeadMaskConfig, ...] | None = None
    ring_spare: PosInt = 16
    rope_base: PosFloat = 10000.0
    rope_scaling: RopeScalingConfig | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_eps: PosFloat = 1e-6
    long_context: Literal["window", "full"] = "window"

    def check(self, d_model: int, path: str):
        if self.num_heads <= 0 or d_model % self.num_heads and self.head_dim is None:
            raise ValueError(f"{path}.num_heads: {self.num_heads} does not divide model.d_model={d_model}")
        kv = self.num_kv_heads
        if kv is not None and (kv <= 0 or self.num_heads % kv):
            raise ValueError(f"{path}.num_kv_heads: {kv} does not divide {path}.num_heads={self.num_heads}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"{path}.window: expected a positive number of tokens or null, got {self.window}")
        if self.head_masks is not None:
            if len(self.head_masks) != self.num_heads:
                raise ValueError(f"{path}.head_masks: {len(self.head_masks)} masks for {path}.num_heads="
                                 f"{self.num_heads}; expected one per head")
            if (self.window, self.sinks, self.dilation) != (None, 0, 1):
                raise ValueError(f"{path}.head_masks: give window, sinks and dilation in {path} or per head in "
                                 f"{path}.head_masks, not both")
            for h, m in enumerate(self.head_masks):
                if m.growth and m.window is None:
                    raise ValueError(f"{path}.head_masks[{h}].growth: {m.growth} grows a window; give its window")
        super().check(d_model, path)


@mixer(layers.ForgettingAttention)
@dataclass(frozen=True)
class FoXConfig(Mixer):
    """Forgetting attention (FoX, Lin et al. 2025): softmax attention whose logits get c_i - c_j, c the
    cumulative log of a per-head forget gate sigmoid(x . w_f + b_f); num_kv_heads below num_heads is
    GQA; rope_base: null = no positional encoding (FoX's default); qk_norm, output_norm, output_gate:
    the Pro block's per-head RMSNorms of q and k and of the output, and sigmoid output gate."""
    KIND: ClassVar[str] = "fox"
    num_heads: PosInt = 4
    num_kv_heads: PosInt | None = None
    head_dim: PosInt | None = None
    rope_base: PosFloat | None = None
    qk_norm: bool = False
    output_norm: bool = False
    output_gate: bool = False
    norm_eps: PosFloat = 1e-6

    def check(self, d_model: int, path: str):
        if d_model % self.num_heads and self.head_dim is None:
            raise ValueError(f"{path}.num_heads: {self.num_heads} does not divide model.d_model={d_model}")
        kv = self.num_kv_heads
        if kv is not None and self.num_heads % kv:
            raise ValueError(f"{path}.num_kv_heads: {kv} does not divide {path}.num_heads={self.num_heads}")
        super().check(d_model, path)


@mixer(layers.BaseConv)
@dataclass(frozen=True)
class BaseConvConfig(Kind):
    """Based's gated short convolution (Arora et al. 2024): y = (silu(conv(u)) * g) W_out with [u, g] =
    x W_in, u and g expand * d_model / 2 wide, a causal depthwise conv of kernel_size taps."""
    KIND: ClassVar[str] = "base_conv"
    expand: PosInt = 4
    kernel_size: PosInt = 3


@mixer(layers.MultiHeadLatentAttention)
@dataclass(frozen=True)
class MLAConfig(Mixer):
    """Multi-head latent attention (DeepSeek-V2 2024): every head's keys and values from one shared
    latent of width kv_lora_rank (null = 4 head_dim) and a rotary key of width rope_dim (null =
    head_dim / 2, even) shared by the heads, so decoding caches kv_lora_rank + rope_dim numbers per token;
    head_dim: a head's key width besides the rotary part (null = d_model / num_heads); v_head_dim: its
    value width (null = head_dim); q_lora_rank: queries through a normalised latent of that width (null
    = one projection); absorb: decode with W_UK folded into the query and W_UV into the output (false =
    keys and values expanded from the cache, the reference); window, long_context, rope_base, norm_eps
    as attention's (norm_eps: the latents' RMSNorms)."""
    KIND: ClassVar[str] = "mla"
    num_heads: PosInt = 4
    head_dim: PosInt | None = None
    v_head_dim: PosInt | None = None
    rope_dim: PosInt | None = None
    kv_lora_rank: PosInt | None = None
    q_lora_rank: PosInt | None = None
    window: PosInt | None = None
    rope_base: PosFloat = 10000.0
    norm_eps: PosFloat = 1e-6
    long_context: Literal["window", "full"] = "window"
    absorb: bool = True

    def check(self, d_model: int, path: str):
        if self.head_dim is None and d_model % self.num_heads:
            raise ValueError(f"{path}.num_heads: {self.num_heads} does not divide model.d_model={d_model} "
                             f"(or give {path}.head_dim)")
        rope = (self.head_dim or d_model // self.num_heads) // 2 if self.rope_dim is None else self.rope_dim
        if rope < 2 or rope % 2:
            raise ValueError(f"{path}.rope_dim: expected an even number >= 2, got {rope}"
                             + (" (head_dim / 2, its default)" if self.rope_dim is None else ""))
        super().check(d_model, path)


@mixer(layers.MoBA)
@dataclass(frozen=True)
class MoBAConfig(Mixer):
    """MoBA, Mixture of Block Attention (Lu et al. 2025): each query head attends to its own block of
    block_size tokens (causally) and the top_k - 1 earlier blocks of its document whose mean-pooled keys
    score highest against it (top_k counts the own block, as the paper does); GQA with num_kv_heads;
    decode scores the cached block sums and reads only the selected blocks of the KV cache."""
    KIND: ClassVar[str] = "moba"
    num_heads: PosInt = 4
    num_kv_heads: PosInt | None = None
    head_dim: PosInt | None = None
    block_size: PosInt = 16
    top_k: PosInt = 3
    rope_base: PosFloat = 10000.0


@mixer(layers.NativeSparseAttention)
@dataclass(frozen=True)
class NSAConfig(Mixer):
    """NSA, Native Sparse Attention (Yuan et al. 2025): three branches mixed by learned sigmoid gates:
    compressed (blocks of block_len keys every stride tokens, each compressed by a learned MLP),
    selected (num_selected blocks of select_len keys, the initial and the two local ones always, the
    others by the compressed branch's attention summed over a kv group) and a sliding window of
    window tokens; GQA with num_kv_heads. One set of keys and values serves the three branches."""
    KIND: ClassVar[str] = "nsa"
    num_heads: PosInt = 4
    num_kv_heads: PosInt | None = None
    head_dim: PosInt | None = None
    block_len: PosInt = 16
    stride: PosInt = 8
    select_len: PosInt = 16
    num_selected: PosInt = 4
    window: PosInt = 32
    rope_base: PosFloat = 10000.0


@mixer(layers.LinearAttention)
@dataclass(frozen=True)
class LinearAttentionConfig(Chunked):
    """Linear attention (Katharopoulos et al. 2020) with a feature map: identity, elu (elu+1), relu,
    performer (FAVOR+), cosformer (relu + cos re-weighting), hedgehog (learned), taylor (Based's
    second-order Taylor expansion of exp); normalize adds the denominator q . sum(k); qk_dim: the
    per-head width of q and k the feature map reads (null = d_model / num_heads; Based uses 16)."""
    KIND: ClassVar[str] = "linear_attention"
    num_heads: PosInt = 4
    feature_map: Literal["identity", "elu", "relu", "performer", "cosformer", "hedgehog", "taylor"] = "elu"
    normalize: bool = True
    num_features: PosInt | None = None
    qk_dim: PosInt | None = None
    cosformer_max_len: PosInt = 2048
    eps: PosFloat = 1e-6


@mixer(layers.MultiScaleRetention)
@dataclass(frozen=True)
class RetNetConfig(Chunked):
    """Multi-scale retention (Sun et al. 2023): fixed per-head decay, rotary, norm and swish gate."""
    KIND: ClassVar[str] = "retnet"
    num_heads: PosInt = 4
    expand_k: PosFloat = 1.0
    expand_v: PosFloat = 2.0
    rotary_base: PosFloat = 10000.0
    norm_eps: PosFloat = 1e-5


@mixer(layers.GatedLinearAttention)
@dataclass(frozen=True)
class GLAConfig(Chunked):
    """Gated linear attention (Yang et al. 2024): data-dependent per-key decay from a low-rank gate."""
    KIND: ClassVar[str] = "gla"
    num_heads: PosInt = 4
    expand_k: PosFloat = 0.5
    expand_v: PosFloat = 1.0
    gate_low_rank_dim: PosInt = 16
    gate_logit_normalizer: PosFloat = 16.0
    conv_size: NonNegInt = 0
    use_output_gate: bool = True
    norm_eps: PosFloat = 1e-5


@mixer(layers.Mamba)
@dataclass(frozen=True)
class MambaConfig(Chunked):
    """Mamba (Gu & Dao 2023): selective SSM with input-dependent Δ, B, C; mode auto picks the fastest
    exact scan for the backend (recurrent on CPU)."""
    KIND: ClassVar[str] = "mamba"
    state_size: PosInt = 16
    expand: PosInt = 2
    conv_size: NonNegInt = 4
    dt_rank: PosInt | Literal["auto"] = "auto"
    dt_min: PosFloat = 0.001
    dt_max: PosFloat = 0.1
    dt_init_floor: PosFloat = 1e-4
    mode: Literal[("auto", *MODES)] = "auto"


@mixer(layers.Mamba2)
@dataclass(frozen=True)
class Mamba2Config(Chunked):
    """Mamba-2 (Dao & Gu 2024): SSD with a scalar decay per head and grouped B/C; norm_before_gate:
    the output norm RMSNorm(y) * SiLU(z) (true) or the official RMSNorm(y * SiLU(z)) per group (false),
    with eps norm_eps."""
    KIND: ClassVar[str] = "mamba2"
    state_size: PosInt = 64
    expand: PosInt = 2
    head_dim: PosInt = 64
    num_groups: PosInt = 1
    conv_size: NonNegInt = 4
    dt_min: PosFloat = 0.001
    dt_max: PosFloat = 0.1
    dt_init_floor: PosFloat = 1e-4
    A_init_range: tuple[PosFloat, PosFloat] = (1.0, 16.0)
    norm_before_gate: bool = True
    norm_eps: PosFloat = 1e-5


@mixer(layers.Mamba3)
@dataclass(frozen=True)
class Mamba3Config(Chunked):
    """Mamba-3 (Lahoti et al. 2026), SISO: exponential-trapezoidal SSM with a complex (data-dependent
    rotary) state, data-dependent A_t, normed and biased B/C, no conv; rope_fraction: the share of the
    state's channels rotated; A_floor: the least decay rate -A_t."""
    KIND: ClassVar[str] = "mamba3"
    state_size: PosInt = 128
    expand: PosInt = 2
    head_dim: PosInt = 64
    num_groups: PosInt = 1
    rope_fraction: Annotated[float, Range(0, 1, lo_open=True)] = 0.5
    dt_min: PosFloat = 0.001
    dt_max: PosFloat = 0.1
    dt_init_floor: PosFloat = 1e-4
    A_floor: PosFloat = 1e-4
    norm_eps: PosFloat = 1e-5


@mixer(layers.S4D)
@dataclass(frozen=True)
class S4DConfig(Mixer):
    """S4D (Gu, Gupta, Goel & Ré 2022): a diagonal linear time-invariant SSM per channel, state_size N
    (N/2 complex conjugate pairs), init lin (S4D-Lin, A_n = -1/2 + i π n) or inv (S4D-Inv), log Δ
    uniform in [dt_min, dt_max], GELU, then output glu (linear to 2 d_model and a GLU) or linear; mode
    fft (the SSM's kernel applied by FFT, O(T log T)) or recurrent; decode is the recurrence."""
    KIND: ClassVar[str] = "s4d"
    state_size: PosInt = 64
    init: Literal["lin", "inv"] = "lin"
    dt_min: PosFloat = 0.001
    dt_max: PosFloat = 0.1
    output: Literal["glu", "linear"] = "glu"
    mode: Literal["recurrent", "fft"] = "fft"


@mixer(layers.Hyena)
@dataclass(frozen=True)
class HyenaConfig(Mixer):
    """Hyena (Poli et al. 2023): order N long convolutions with implicit filters, each gated by a projection,
    z = x_n * (h_n conv z + b_n z), after a short convolution (short_conv_size) of the N + 1 projections;
    filter h_n(t) = exp window (decay_fast, decay_slow, decay_target) times an FFN (filter_order wide, sine
    activations of frequency filter_sine_freq, filter_inner_layers hidden layers) of positional features
    (filter_emb_dim, odd) with positions normalised by model.max_seq_len; training by FFT; decoding
    caches each long convolution's inputs (grows with the context, O(context) per token)."""
    KIND: ClassVar[str] = "hyena"
    order: PosInt = 2
    filter_order: PosInt = 64
    filter_emb_dim: PosInt = 33
    filter_sine_freq: PosFloat = 1.0  # the starting ω (safari's default; its Pile configs' 14 trains badly here)
    filter_inner_layers: NonNegInt = 2
    short_conv_size: PosInt = 3
    decay_fast: PosFloat = 0.3
    decay_slow: PosFloat = 1.5
    decay_target: PosFloat = 1e-2


@mixer(layers.RWKV6TimeMix)
@dataclass(frozen=True)
class RWKV6Config(Chunked):
    """RWKV-6 "Finch" time mix (Peng et al. 2024): data-dependent token shift and decay, bonus u."""
    KIND: ClassVar[str] = "rwkv6"
    head_dim: PosInt = 64
    mix_lora_dim: PosInt = 32
    decay_lora_dim: PosInt = 64


@mixer(layers.RWKV7TimeMix)
@dataclass(frozen=True)
class RWKV7Config(Chunked):
    """RWKV-7 "Goose" time mix (Peng et al. 2025): generalised delta rule with vector decay and
    in-context learning rate, value residual from layer 0 (LoRA ranks null = the official sizes)."""
    KIND: ClassVar[str] = "rwkv7"
    head_dim: PosInt = 64
    decay_lora_dim: PosInt | None = None
    icl_lora_dim: PosInt | None = None
    value_lora_dim: PosInt | None = None
    gate_lora_dim: PosInt | None = None


@mixer(layers.DeltaNet)
@dataclass(frozen=True)
class DeltaNetConfig(Chunked):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with L2-normalised q, k."""
    KIND: ClassVar[str] = "deltanet"
    num_heads: PosInt = 4
    head_dim: PosInt | None = None
    expand_v: PosFloat = 1.0
    conv_size: NonNegInt = 4
    use_beta: bool = True
    qk_norm: Literal["l2", "sum"] = "l2"
    use_output_gate: bool = False
    norm_eps: PosFloat = 1e-5


@mixer(layers.GatedDeltaNet)
@dataclass(frozen=True)
class GatedDeltaNetConfig(Chunked):
    """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): the delta rule with a Mamba-2 decay."""
    KIND: ClassVar[str] = "gated_deltanet"
    num_heads: PosInt = 4
    head_dim: PosInt | None = None
    expand_v: PosFloat = 2.0
    conv_size: NonNegInt = 4
    use_output_gate: bool = True
    norm_eps: PosFloat = 1e-5


@mixer(layers.HGRN2)
@dataclass(frozen=True)
class HGRN2Config(Chunked):
    """HGRN2 (Qin et al. 2024): gated linear RNN with outer-product state expansion: forget gate with a
    learned lower bound that starts at layer_id / num_layers, input gate 1 - forget as the key, SiLU
    query as the output gate (the GLA op); expand_ratio: key width per head (null = d_model / num_heads);
    conv_size: short convolutions on q, f, i (0 = none)."""
    KIND: ClassVar[str] = "hgrn2"
    num_heads: PosInt = 4
    expand_ratio: PosInt | None = None
    conv_size: NonNegInt = 0
    norm_eps: PosFloat = 1e-5


@mixer(layers.KimiDeltaAttention)
@dataclass(frozen=True)
class KDAConfig(Chunked):
    """Kimi Delta Attention (Kimi Team 2025, Kimi Linear): the gated delta rule with a decay per key
    channel from a low-rank projection, sigmoid output gate; allow_neg_eigval: beta in (0, 2)."""
    KIND: ClassVar[str] = "kda"
    num_heads: PosInt = 4
    head_dim: PosInt | None = None
    expand_v: PosFloat = 1.0
    conv_size: NonNegInt = 4
    allow_neg_eigval: bool = False
    norm_eps: PosFloat = 1e-5


@mixer(layers.GatedDeltaProduct)
@dataclass(frozen=True)
class GatedDeltaProductConfig(Chunked):
    """Gated DeltaProduct (Siems et al. 2025): num_householder delta-rule steps per token (each its own
    k, v, beta), the Gated DeltaNet decay once per token; run as T x num_householder sub-steps of the
    delta-rule op (chunk_size counts sub-steps); allow_neg_eigval: beta in (0, 2)."""
    KIND: ClassVar[str] = "gated_deltaproduct"
    num_heads: PosInt = 4
    head_dim: PosInt | None = None
    expand_v: PosFloat = 2.0
    num_householder: PosInt = 2
    conv_size: NonNegInt = 4
    use_forget_gate: bool = True
    allow_neg_eigval: bool = True
    use_output_gate: bool = True
    norm_eps: PosFloat = 1e-5


@ffn(layers.NoFFN)
@dataclass(frozen=True)
class NoFFNConfig(Kind):
    """No FFN: each block is its mixer alone (Mamba's blocks)."""
    KIND: ClassVar[str] = "none"


@ffn(layers.MLP)
@dataclass(frozen=True)
class MLPConfig(Kind):
    """SwiGLU MLP; hidden_dim null = 8/3 d_model rounded up to 32."""
    KIND: ClassVar[str] = "mlp"
    hidden_dim: PosInt | None = None


@ffn(layers.MoE)
@dataclass(frozen=True)
class MoEConfig(Kind):
    """Mixture of SwiGLU experts: routers topk (softmax_then_topk or topk_then_softmax), switch
    (top-1), expert_choice (not causal; outside training it routes by token choice); dispatch, in
    training: capacity (drops overflow, GShard order) or dropless (ragged_dot), and always dropless
    outside training (evaluation, decoding); balance aux_loss (Switch loss), bias (DeepSeek-V3,
    loss-free) or none; shared experts (DeepSeekMoE; shared_hidden_dim: their own width, null =
    num_shared_experts x hidden_dim; shared_gate: a sigmoid gate on them per token, Qwen2-MoE).
    hidden_dim null = the dense width / active experts (same active params)."""
    KIND: ClassVar[str] = "moe"
    num_experts: PosInt = 8
    top_k: PosInt = 2
    hidden_dim: PosInt | None = None
    router: Literal["topk", "switch", "expert_choice"] = "topk"
    score_order: Literal["softmax_then_topk", "topk_then_softmax"] = "softmax_then_topk"
    renormalize: bool = True
    dispatch: Literal["capacity", "dropless"] = "capacity"
    capacity_factor: PosFloat = 1.25
    num_shared_experts: NonNegInt = 0
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    balance_loss_weight: NonNegFloat = 0.01
    z_loss_weight: NonNegFloat = 0.001
    bias_update_rate: NonNegFloat = 0.001
    router_jitter: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    shared_hidden_dim: PosInt | None = None
    shared_gate: bool = False

    def check(self, d_model: int, path: str):
        if self.top_k > self.num_experts:
            raise ValueError(f"{path}.top_k: {self.top_k} must be between 1 and {path}.num_experts={self.num_experts}")
        super().check(d_model, path)


@ffn(layers.RWKV6ChannelMix)
@dataclass(frozen=True)
class RWKV6ChannelMixConfig(Kind):
    """RWKV-6 channel mix: token-shifted squared-ReLU FFN with a receptance gate (hidden null = 3.5 D)."""
    KIND: ClassVar[str] = "rwkv6_channel_mix"
    hidden_dim: PosInt | None = None


@ffn(layers.RWKV7ChannelMix)
@dataclass(frozen=True)
class RWKV7ChannelMixConfig(Kind):
    """RWKV-7 channel mix: token-shifted squared-ReLU FFN (hidden null = 4 D)."""
    KIND: ClassVar[str] = "rwkv7_channel_mix"
    hidden_dim: PosInt | None = None
