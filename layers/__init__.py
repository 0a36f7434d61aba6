"""Flax NNX building blocks, each usable alone in any NNX model.

Every sequence mixer follows one protocol:

    y = mixer(x, segment_ids=None)                 # (B, T, D) -> (B, T, D), the training path
    state = mixer.init_state(batch_size, max_len)  # a fixed-shape pytree (flax.struct dataclass)
    y, state = mixer.decode(x, state, segment_ids=None)   # prefill (T tokens) or a step (T = 1)

`decode` continues from `state`; inside one call, a change of segment id starts a new document
(see kernels/segments.py). A recurrent mixer's state does not grow with max_len.
"""

from layers.conv import ShortConvolution
from layers.norm import GatedRMSNorm, RMSNorm
from layers.rotary import apply_rotary
from layers.attention import Attention, KVCache
from layers.mlp import MLP
from layers.deltanet import DeltaNet, DeltaNetState, GatedDeltaNet
from layers.gla import GatedLinearAttention, GLAState
from layers.linear_attention import LinearAttention, LinearAttentionState
from layers.retnet import MultiScaleRetention, RetentionState
from layers.mamba import Mamba, MambaState
from layers.mamba2 import Mamba2, Mamba2State
from layers.moe import MoE
from layers.rwkv6 import RWKV6ChannelMix, RWKV6TimeMix
from layers.rwkv7 import RWKV7ChannelMix, RWKV7TimeMix
