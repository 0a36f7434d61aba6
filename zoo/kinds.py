"""Every kind of the zoo, one line each: its name in a config's `kind:` and its layer.

A kind's options, defaults, types, ranges, checks and help are its layer's (the constructor's
signature and checks, the class docstring); zoo/registry.py derives the config dataclass from them.
"""

import layers
from zoo.registry import ffn, mixer

mixer("attention", layers.Attention)
mixer("fox", layers.ForgettingAttention)
mixer("base_conv", layers.BaseConv)
mixer("mla", layers.MultiHeadLatentAttention)
mixer("moba", layers.MoBA)
mixer("nsa", layers.NativeSparseAttention)
mixer("linear_attention", layers.LinearAttention)
mixer("retnet", layers.MultiScaleRetention)
mixer("lightning", layers.LightningAttention)
mixer("gla", layers.GatedLinearAttention)
mixer("mamba", layers.Mamba)
mixer("mamba2", layers.Mamba2)
mixer("mamba3", layers.Mamba3)
mixer("loglinear_mamba2", layers.LogLinearMamba2)
mixer("s4d", layers.S4D)
mixer("hyena", layers.Hyena)
mixer("rwkv6", layers.RWKV6TimeMix)
mixer("rwkv7", layers.RWKV7TimeMix)
mixer("deltanet", layers.DeltaNet)
mixer("gated_deltanet", layers.GatedDeltaNet)
mixer("hgrn2", layers.HGRN2)
mixer("rglru", layers.RGLRU)
mixer("kda", layers.KimiDeltaAttention)
mixer("gated_deltaproduct", layers.GatedDeltaProduct)
mixer("gated_deltanet2", layers.GatedDeltaNet2)
mixer("comba", layers.Comba)
mixer("mesanet", layers.MesaNet)
mixer("gsa", layers.GatedSlotAttention)
mixer("slstm", layers.SLSTM)
mixer("mlstm", layers.MLSTM)
mixer("stickbreaking", layers.StickBreakingAttention)
mixer("ttt_linear", layers.TTTLinear)
mixer("path_attention", layers.PaTHAttention)
mixer("titans", layers.TitansMemory)
ffn("none", layers.NoFFN)
ffn("mlp", layers.MLP)
ffn("moe", layers.MoE)
ffn("rwkv6_channel_mix", layers.RWKV6ChannelMix)
ffn("rwkv7_channel_mix", layers.RWKV7ChannelMix)
