"""Hyena operator: Poli et al. 2023, "Hyena Hierarchy: Towards Larger Convolutional Language Models",
Section 3 (Definition 3.1, Algorithm 3), with the implicit filter of the official HazyResearch safari code
(`src/models/sequence/hyena.py`: `PositionalEmbedding`, `Sin`, `ExponentialModulation`, `HyenaFilter`):

    x_1, ..., x_N, v = ShortConv(W_in x + b_in)       N + 1 projections, causal depthwise convolution
    z = v
    z = x_n ⊙ (h_n * z + b_n ⊙ z),  n = 1..N         long causal convolution (by FFT), then gating
    out = W_out z + b_out

    h_n(t) = window(t) · FFN(PE(t)):  PE(t) = [t / (L - 1), cos(2π f_j t / L), -sin(2π f_j t / L)]_j
    (emb_dim = 1 + 2 bands, f_j = linspace(1e-4, bands - 1)), FFN = Linear + sin(ω ⊙ ·), repeated,
    then a linear map to N D channels; window(t) = exp(-|δ_c| t / (L - 1)), δ_c linear in the channel
    from log(target) / slow to log(target) / fast.

L = l_max is the layer's `max_seq_len` (the model's trained context; 1024, safari's default, when the
layer is built alone): the filter is a function of the integer lag t and of this constant only, so a
training pass of any length T and a decode cache of any max_len use the very same tap at the same lag
(exact decoding), and a lag past L (decoding past the trained context) takes the same formula.

Code name -> paper symbol: `in_proj` the N + 1 projections, `short_conv` the short filters (width
`short_conv_size`, safari's 3), `filter_mlp` and `filter_out` the FFN (width `filter_order`, the official
"order" of the filter), `filter_freq` ω (one sine frequency vector shared by every sine, as the official
`Sin` module instance is), `filter_bias` b_n (the official `HyenaFilter.bias`, the D term of its fftconv),
`out_proj` the output projection. N = `order`, the number of long convolutions (the letter is the paper's).

Decoding is exact and caches the input of each long convolution: `HyenaState.inputs` (B, N, S, D) for
S = max_len slots, with the filter's taps for lags 0..S-1 (computed once by init_state from the
parameters it sees) and each slot's document number. A step (T = 1) is the dot product of the cached
inputs with the reversed filter, O(S D) per long convolution: the state and the cost per token grow
with the context (`grows_with_context`, like a KV cache). A prefill (T > 1) runs one FFT convolution
over the cache's S slots, O(S log S) per channel. Decoding past max_len slots is refused where it
can be seen (outside jit), as the KV cache's.

Packed documents: a long convolution by FFT mixes every earlier token in, so with `segment_ids` the
convolutions run in the masked dense form (kernels/long_conv: the Toeplitz taps zeroed across a document
start, O(T^2 D)), and decoding masks cached slots of another document out of the dot products; the
short convolution masks its taps (layers/conv.py).

Departures, all named: the gating follows the paper, z = x_n ⊙ (h_n * z) with N filters for order N;
the official code gates first (v ← x_i ⊙ v, then the convolution) and ends with a gate x_0, N - 1 filters
for N + 1 projections. The positional features are fixed functions of t (safari registers them as a
parameter trained with a small learning rate, which would tie the filter to positions 0..L-1 seen in
training); the modulation is never shifted (safari's default shift 0) and the filter is not normalised
(its default). Linear layers use Flax's lecun-normal init, biases start at zero; no dropout.

The sine frequency ω starts at 1, safari's `HyenaFilter` default. Its Pile configs start at 14, which
here (lecun-normal init, std sqrt(3) times torch's default Linear init, and configs/hyena.yaml's
learning rate 3e-3) made the filter FFN's gradients 99.99% of the global norm (138 after 250 steps:
every step clipped) and the filter a fast-oscillating function of its weights: 2.68 nats/byte at the
report card's 250-step budget against 1.91 with ω = 1 (configs/transformer.yaml: 1.96).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from kernels import check_no_pallas
from kernels.attention import write_rows
from kernels.long_conv import long_conv
from kernels.long_conv.fft import long_conv_fft
from kernels.segments import document_index
from layers.conv import ShortConvolution
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.options import Impl, NonNegInt, PosFloat, PosInt
from layers.sharding import axes
from layers.state import per_token, state


# The cached inputs, the filter and the slots' documents are kept once by a stepped state (final): a row
# never reads a slot past its index, and its next decode overwrites them.
@state(final=("inputs", "filter", "doc"))
class HyenaState:
    conv: Float[Array, "B W _C"]  # (B, short_conv_size - 1, (N + 1) D) the short convolution's window
    inputs: Float[Array, "B N S D"]  # (B, N, S, D) compute dtype: the input of long convolution n at slot s
    filter: Float[Array, "B N S D"]  # (B, N, S, D) float32: tap h_n at lag s, the same in every row
    doc: Int[Array, "B S"]  # (B, S) int32: document number of the token in each slot
    cur_doc: Int[Array, " B"]  # (B,) int32: document number of the last token written
    index: Int[Array, " B"]  # (B,) int32: each row's next slot to write; past S it flags an overflow

    def overflowed(self) -> Bool[Array, ""]:
        """True once a row decoded more tokens than the cache has slots (as layers/attention.KVCache.overflowed)."""
        return jnp.any(self.index > self.inputs.shape[2])


class Hyena(SequenceMixer):
    """Hyena (Poli et al. 2023): order N long convolutions with implicit filters, each gated by a projection, z = x_n *
    (h_n conv z + b_n z), after a short convolution (short_conv_size) of the N + 1 projections; filter h_n(t) = exp
    window (decay_fast, decay_slow, decay_target) times an FFN (filter_order wide, sine activations of frequency
    filter_sine_freq, the starting ω: safari's default, as its Pile configs' 14 trains badly here; filter_inner_layers
    hidden layers) of positional features (filter_emb_dim, odd) with positions normalised by max_seq_len (the model's);
    training by FFT; decoding caches each long convolution's inputs (grows with the context, O(context) per token); impl
    ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every path; dtype: the compute dtype
    (parameters stay float32)."""
    grows_with_context = True  # the cache of every long convolution's inputs holds max_len slots

    def __init__(self, d_model: int, *, order: PosInt = 2, filter_order: PosInt = 64, filter_emb_dim: PosInt = 33,
                 filter_sine_freq: PosFloat = 1.0, filter_inner_layers: NonNegInt = 2, short_conv_size: PosInt = 3,
                 decay_fast: PosFloat = 0.3, decay_slow: PosFloat = 1.5, decay_target: PosFloat = 1e-2,
                 max_seq_len: int | None = None, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        check_no_pallas(impl, "Hyena")
        if d_model < 1 or order < 1 or filter_order < 1 or short_conv_size < 1 or filter_inner_layers < 0:
            raise ValueError(f"Hyena: d_model={d_model}, order={order}, filter_order={filter_order} and "
                             f"short_conv_size={short_conv_size} must be >= 1, filter_inner_layers >= 0")
        if filter_emb_dim < 3 or filter_emb_dim % 2 == 0:
            raise ValueError(f"Hyena: filter_emb_dim={filter_emb_dim}; expected an odd number >= 3 (t, then a cosine "
                             "and a sine per band)")
        if not 0 < decay_target < 1 or not 0 < decay_fast <= decay_slow:
            raise ValueError(f"Hyena: need 0 < decay_target < 1 and 0 < decay_fast <= decay_slow, got decay_target="
                             f"{decay_target}, decay_fast={decay_fast}, decay_slow={decay_slow}")
        l_max = 1024 if max_seq_len is None else max_seq_len
        if l_max < 2:
            raise ValueError(f"Hyena: max_seq_len={max_seq_len}; expected >= 2 (filter positions are t / (L - 1))")
        D, N, F = d_model, order, filter_order
        self.d_model, self.order, self.l_max, self.emb_dim = D, N, l_max, filter_emb_dim
        self.impl, self.dtype = impl, dtype
        self.decay = (math.log(decay_target) / decay_slow, math.log(decay_target) / decay_fast)

        def linear(i, o, names, dtype=dtype, bias=True):
            return Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                          kernel_metadata=axes(*names), bias_metadata=axes(names[1]))

        # in_proj's output fuses the N + 1 projections, so its columns stay whole over `tensor`.
        self.in_proj = linear(D, (N + 1) * D, ("embed", None))
        self.short_conv = ShortConvolution((N + 1) * D, short_conv_size, activation=False, use_bias=True,
                                           channel_axis=None, rngs=rngs)
        widths = [filter_emb_dim] + [F] * (filter_inner_layers + 1)
        self.filter_mlp = nnx.List([linear(i, o, (None, None), jnp.float32) for i, o in zip(widths, widths[1:])])
        self.filter_out = linear(F, D * N, (None, None), jnp.float32, bias=False)
        self.filter_freq = nnx.Param(jnp.full((F,), filter_sine_freq, jnp.float32))
        self.filter_bias = nnx.Param(jax.random.normal(rngs.params(), (N, D), jnp.float32), **axes(None, "heads"))
        self.out_proj = linear(D, D, ("heads", "embed"))

    def filters(self, length: int) -> Float[Array, "N S D"]:
        """The taps h_n at lags 0..length-1, (N, length, D) float32 (module docstring)."""
        L, bands = self.l_max, (self.emb_dim - 1) // 2
        k = jnp.arange(length, dtype=jnp.float32)[:, None]  # (S, 1)
        t = k / (L - 1)
        w = 2 * math.pi * k / L * jnp.linspace(1e-4, bands - 1, bands, dtype=jnp.float32)  # (S, bands)
        a = jnp.concatenate([t, jnp.cos(w), -jnp.sin(w)], axis=-1)  # (S, emb_dim)
        for layer in self.filter_mlp:
            a = jnp.sin(self.filter_freq[...] * layer(a))
        h = self.filter_out(a)  # (S, D N), channel c = d N + n as the official (v o) layout
        h = h * jnp.exp(-t * jnp.abs(jnp.linspace(*self.decay, h.shape[-1], dtype=jnp.float32)))
        return jnp.moveaxis(h.reshape(length, self.d_model, self.order), -1, 0)  # (N, S, D)

    def init_state(self, batch_size: int, max_len: int) -> HyenaState:
        """A cache of max_len slots, and the filter's taps for lags 0..max_len-1 from the current parameters."""
        B, N, S, D = batch_size, self.order, max_len, self.d_model
        zeros = jnp.zeros((B,), jnp.int32)
        return HyenaState(conv=self.short_conv.init_state(B, self.dtype), inputs=jnp.zeros((B, N, S, D), self.dtype),
                          filter=jnp.broadcast_to(self.filters(S), (B, N, S, D)), doc=jnp.zeros((B, S), jnp.int32),
                          cur_doc=zeros, index=zeros)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None
                 ) -> Float[Array, "B T D"]:
        self._check(x, segment_ids)
        *gates, z = self._projections(x, None, segment_ids)[0]
        h = self.filters(x.shape[1])  # (N, T, D)
        for n, gate in enumerate(gates):
            conv = long_conv(z, h[n], segment_ids=segment_ids, impl=self.impl)  # (B, T, D) float32
            z = gate * (conv + self.filter_bias[n] * z).astype(self.dtype)
        return self.out_proj(z)

    def decode(self, x: Float[Array, "B T D"], state: HyenaState, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False) -> tuple[Float[Array, "B T D"], HyenaState]:
        """Continue from the cache: T = 1 or packed tokens by masked dot products with the cached inputs,
        other prefills by one FFT convolution over the cache. steps=True returns index, cur_doc and the short
        convolution's window after every token, (T, B, ...), the cache as written (layers/state.py)."""
        self._check(x, segment_ids, steps)
        B, T, _ = x.shape
        S = state.inputs.shape[2]
        self._check_room(state.index, T, S)
        (*gates, z), window = self._projections(x, state.conv, segment_ids, steps)
        doc = state.cur_doc[:, None] + document_index(segment_ids, B, T)  # (B, T)
        slot_doc = write_rows(state.doc, doc, state.index, 1)  # (B, S)
        pos = state.index[:, None] + jnp.arange(T)  # (B, T) the new tokens' slots
        new = []
        for n, gate in enumerate(gates):
            new.append(z)
            if T == 1:  # the step: the earlier slots of this document, then the token itself at lag 0
                conv = self._step_conv(state, n, doc) + state.filter[:, n, :1] * z.astype(jnp.float32)
            else:
                cache = write_rows(state.inputs[:, n], z, state.index, 1).astype(jnp.float32)  # (B, S, D)
                if segment_ids is not None:
                    lag = pos[:, :, None] - jnp.arange(S)  # (B, T, S)
                    mask = (lag >= 0) & (slot_doc[:, None, :] == doc[:, :, None])  # (B, T, S)
                    taps = jnp.take_along_axis(state.filter[:, n, None], jnp.maximum(lag, 0)[..., None], axis=2)
                    conv = jnp.einsum("bts,btsd,bsd->btd", mask.astype(jnp.float32), taps, cache)
                else:  # every new token is in the document doc[:, -1]: the slots of others are masked out
                    valid = (jnp.arange(S) < pos[:, -1:] + 1) & (slot_doc == doc[:, -1:])  # (B, S)
                    full = long_conv_fft(jnp.where(valid[..., None], cache, 0), state.filter[0, n])  # (B, S, D)
                    conv = jnp.take_along_axis(full, pos[..., None], axis=1)  # (B, T, D)
            z = gate * (conv + self.filter_bias[n] * z).astype(self.dtype)
        # One write of every order's new inputs after the reads: XLA updates the cache in place.
        inputs = write_rows(state.inputs, jnp.stack(new, axis=1), state.index, 2)  # (B, N, S, D)
        kept = dict(inputs=inputs, filter=state.filter, doc=slot_doc)
        return self.out_proj(z), (HyenaState.stepped if steps else HyenaState)(
            conv=window, **kept, cur_doc=per_token(doc, steps), index=per_token(pos + 1, steps))

    def _step_conv(self, state: HyenaState, n: int, doc):
        """Σ_{s < index, doc(s) = doc} h_n[index - s] inputs_n[s], (B, 1, D) float32: one token's long
        convolution over the cached slots. The taps come from the reversed filter rolled by index + 1
        (slot s then holds lag index - s), cheaper on CPU than gathering them lag by lag."""
        S = state.inputs.shape[2]
        flipped = jnp.flip(state.filter[:, n], axis=1)  # (B, S, D): slot s holds lag S - 1 - s
        taps = jax.vmap(lambda f, k: jnp.roll(f, k, axis=0))(flipped, state.index + 1)  # (B, S, D)
        mask = (jnp.arange(S) < state.index[:, None]) & (state.doc == doc)  # (B, S)
        prod = jnp.where(mask[..., None], taps * state.inputs[:, n].astype(jnp.float32), 0)
        return jnp.sum(prod, axis=1)[:, None]  # (B, 1, D)

    def _projections(self, x, conv_state, segment_ids, steps=False):
        """[x_1, ..., x_N, v] (B, T, D) each in the compute dtype, and the short convolution's new window."""
        x = x.astype(self.dtype)
        u = self.in_proj(x)  # (B, T, (N + 1) D)
        if conv_state is None:
            u, window = self.short_conv(u, segment_ids=segment_ids), None
        else:
            u, window = self.short_conv.decode(u, conv_state, segment_ids=segment_ids, steps=steps)
        return jnp.split(u, self.order + 1, axis=-1), window

