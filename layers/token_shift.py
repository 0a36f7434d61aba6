"""The token shift of RWKV's time and channel mixing (RWKV-6, RWKV-7): every token reads the one
before it, zero at a document start, and the last token of a call carries over to the next call in
the layers' states (defined here, one for each kind of mixing); and the parts of time and channel mixing
that both versions share."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels import context
from kernels.segments import document_starts
from layers.linear import project
from layers.mixer import SequenceMixer
from layers.rwkv_init import orthogonal, param
from layers.sharding import COLUMNS, ROWS
from layers.state import state


@state
class RWKVTimeMixState:
    shift: Float[Array, "B D"]  # (B, D) float32: the previous token's input, for the token shift
    wkv: Float[Array, "B H K V"]  # (B, H, K, V) float32: the WKV recurrent state


@state
class RWKVChannelMixState:
    shift: Float[Array, "B D"]  # (B, D) float32: the previous token's input, for the token shift


def token_shift(x: Float[Array, "B T D"], last: Float[Array, "B D"], segment_ids: Int[Array, "B T"] | None,
                steps: bool = False):
    """(x_{t-1} for every t, the new last token). x_{-1} is `last`; at a document start it is zero.
    With `steps`, the last token after every token: (T, B, D) (layers/state.py). Over a sequence split along
    time (kernels/context.py), each span's x_{-1} is the last token of the span before it."""
    if not steps and context.active(x.shape[1]):
        def span(seq, _, segment_ids, last):
            (x,) = seq
            prev, end = token_shift(x, context.from_left(x[:, -1].astype(last.dtype), last, segment_ids), segment_ids)
            return prev, context.last(end)

        return context.over_spans(span, (x,), (), segment_ids, last)
    prev = jnp.concatenate([last[:, None].astype(x.dtype), x[:, :-1]], axis=1)  # (B, T, D)
    if segment_ids is not None:
        prev = jnp.where(document_starts(segment_ids)[..., None], 0, prev)
    return prev, (jnp.swapaxes(x, 0, 1) if steps else x[:, -1]).astype(jnp.float32)


class RWKVTimeMix(SequenceMixer):
    """RWKV time mixing, as RWKV-6 and RWKV-7 share it: the receptance, key and value projections, the output
    projection and per-head group norm, and the decode state (the previous token's input and the (H, K, V)
    WKV state). A subclass sets num_heads and head_dim and writes the rest."""

    context_parallel = True

    def _init_rkv(self, D: int, rngs):
        self.w_r = param(orthogonal(rngs.params(), (D, D)), *COLUMNS)
        self.w_k = param(orthogonal(rngs.params(), (D, D), 0.1), *COLUMNS)
        self.w_v = param(orthogonal(rngs.params(), (D, D)), *COLUMNS)

    def _init_out(self, D: int, layer_id: int, num_layers: int):
        self.w_o = param(np.zeros((D, D)), *ROWS)
        self.ln_weight = param(np.full(D, ((1 + layer_id) / num_layers) ** 0.7))
        self.ln_bias = param(np.zeros(D))

    def init_state(self, batch_size: int, max_len: int) -> RWKVTimeMixState:
        """max_len is ignored: the state has a fixed size."""
        H, K = self.num_heads, self.head_dim
        return RWKVTimeMixState(shift=jnp.zeros((batch_size, H * K), jnp.float32),
                                wkv=jnp.zeros((batch_size, H, K, K), jnp.float32))


class RWKVChannelMix(SequenceMixer):
    """RWKV channel mixing, as RWKV-6 and RWKV-7 share it: a squared-ReLU FFN of the token-shifted input,
    k = relu((x + (x_{t-1} - x) mu_k) W_k)^2, y = k W_v (times RWKV-6's receptance gate, `_gate`), whose decode
    state is the previous token's input. A subclass's __init__ calls `_init_ffn`."""

    context_parallel = True

    def _init_ffn(self, d_model: int, hidden_dim: int, mu_k: np.ndarray, dtype, rngs):
        if hidden_dim < 1:
            raise ValueError(f"hidden_dim={hidden_dim} must be >= 1")
        self.d_model, self.dtype = d_model, dtype
        self.mu_k = param(mu_k)
        self.w_k = param(orthogonal(rngs.params(), (d_model, hidden_dim)), "embed", "mlp")
        self.w_v = param(np.zeros((hidden_dim, d_model)), "mlp", "embed")

    def _p(self, w):
        return w[...].astype(self.dtype)

    def init_state(self, batch_size: int, max_len: int) -> RWKVChannelMixState:
        """max_len is ignored: the state has a fixed size."""
        return RWKVChannelMixState(shift=jnp.zeros((batch_size, self.d_model), jnp.float32))

    def _gate(self, x, prev, y):
        return y

    def _mix(self, x, state: RWKVChannelMixState, segment_ids, mode, steps: bool):
        """One form (mode unused)."""
        x = x.astype(self.dtype)
        prev, last = token_shift(x, state.shift, segment_ids, steps)
        k = jnp.square(jax.nn.relu(project(x + (prev - x) * self._p(self.mu_k), self._p(self.w_k))))  # (B, T, F)
        y = self._gate(x, prev, project(k, self._p(self.w_v)))
        return y, (RWKVChannelMixState.stepped if steps else RWKVChannelMixState)(last)
