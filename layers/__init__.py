"""Flax NNX building blocks, each usable alone in any NNX model.

Every sequence mixer follows one protocol:

    y = mixer(x, segment_ids=None)                 # (B, T, D) -> (B, T, D), the training path
    state = mixer.init_state(batch_size, max_len)  # a fixed-shape pytree (flax.struct dataclass)
    y, state = mixer.decode(x, state, segment_ids=None)   # prefill (T tokens) or a step (T = 1)
    y, stepped = mixer.decode(x, state, steps=True)       # the same y; the state after each token
    state = mixer.rollback(stepped, drop)                 # row b without its last drop[b] tokens

`layers.mixer.SequenceMixer`, the base of every mixer, holds what the protocol does alike (the input
checks, the training call as a decode from a fresh state, decode's choice of form, `rollback`).
`decode` continues from `state`; inside one call, a change of segment id starts a new document
(see kernels/segments.py). `steps` and `rollback` serve speculative decoding, which verifies draft
tokens in one call and keeps a different number per row (layers/state.py); a stateful FFN (RWKV's
channel mix) has them too. A recurrent mixer's state does not grow with max_len; a mixer whose
state does (attention's full KV cache, not its ring buffer) says so with `grows_with_context = True`.
A mixer keeps `impl` (and `mode`, where it has several exact forms) as attributes read at call time. States are
`layers.state.state` dataclasses; shape annotations use the one letter legend of kernels/__init__.py.
Parameters name their logical sharding axes where they are made (layers/sharding.py).
A constructor annotates each option with its type, choices and range (layers/options.py) and its
class docstring says what each does: a config kind is derived from these (zoo/registry.py).
tests/layers/conformance.py checks all of this for every registered kind.
"""

from layers.attention import Attention, HeadMask, KVCache
from layers.base_conv import BaseConv, BaseConvState
from layers.conv import ShortConvolution
from layers.deltaformer import DeltaFormer
from layers.deltanet import (
    DeltaNet,
    DeltaNetState,
    DeltaProductState,
    GatedDeltaNet,
    GatedDeltaProduct,
    KimiDeltaAttention,
)
from layers.deltanet2 import Comba, GatedDeltaNet2
from layers.fox import ForgettingAttention, FoXCache
from layers.gated_conv import GatedConv, GatedConvState
from layers.gla import GatedLinearAttention, GLAState
from layers.gsa import GatedSlotAttention, GSAState
from layers.hgrn2 import HGRN2, HGRN2State
from layers.hyena import Hyena, HyenaState
from layers.lightning import LightningAttention, LightningState
from layers.linear_attention import LinearAttention, LinearAttentionState
from layers.loglinear import LogLinearMamba2, LogLinearMamba2State
from layers.loglinear_gdn import LogLinearGatedDeltaNet, LogLinearGatedDeltaNetState
from layers.mamba import Mamba, MambaState
from layers.mamba2 import Mamba2, Mamba2State
from layers.mamba3 import Mamba3, Mamba3State
from layers.mesa import MesaNet, MesaState
from layers.mixer import SequenceMixer
from layers.mla import LatentCache, MultiHeadLatentAttention
from layers.mlp import MLP, NoFFN
from layers.mlstm import MLSTM, MLSTMState
from layers.moba import MoBA, MoBABlocks
from layers.moe import MoE
from layers.mom import MixtureOfMemories, MoMState
from layers.norm import GatedRMSNorm, RMSNorm
from layers.nsa import NativeSparseAttention, NSACompressed
from layers.path_attention import PaTHAttention, PaTHCache
from layers.residual import AttentionResidual, DepthAttention, HyperConnection
from layers.retnet import MultiScaleRetention, RetentionState
from layers.rglru import RGLRU, RGLRUState
from layers.rotary import apply_rotary
from layers.rwkv6 import RWKV6ChannelMix, RWKV6TimeMix
from layers.rwkv7 import RWKV7ChannelMix, RWKV7TimeMix
from layers.s4d import S4D, S4DState
from layers.slstm import SLSTM, SLSTMState
from layers.stickbreaking import StickBreakingAttention
from layers.titans import TitansMemory, TitansMLPState, TitansState
from layers.ttt import TTTMLP, TTTLinear, TTTMixer, TTTMLPState, TTTState
