"""LanguageModel: token embedding, N pre-norm residual blocks (mixer, then FFN), final norm, LM head.

    h = x + mixer(norm(x));  y = h + ffn(norm(h))      (y = h with ffn: none, Mamba's blocks)

Each block's mixer and FFN are its layer's of `model.layer_pattern` / `model.ffn_pattern` (or the one
`model.mixer` / `model.ffn`).

`model.embed_scale` multiplies the embeddings entering block 0 (Gemma's sqrt(d_model)); `model.logit_softcap`
bounds all the logits the model makes (the final head's and each exit's) as cap tanh(logits / cap) (Gemma 2,
RecurrentGemma), so early exit and self-speculation compare the same quantities as the full model.

`model.residual` replaces the two `+` (layers/residual.py, docs/residual.md): mHC widens the stream to
n copies mixed by a doubly stochastic matrix around each sublayer, AttnRes gives each sublayer a
softmax over the embedding and earlier outputs. The walk carries that stream (`enter_residual`) and
the final norm reads `leave_residual` of it; both act per token, so decoding is unchanged.

Every mixer kind plugs in through the registry; the model never looks at which kind it holds. A
stateful FFN (one with `init_state`, e.g. RWKV's channel mix with its token shift) gets a decode
state beside its mixer's. A mixer with `carries_v_first` (RWKV-7's value residual) receives the
first layer's values and passes them on: the one place a layer sees another layer.
`decode(..., steps=True)` and `rollback` pass through to every mixer and stateful FFN: speculative
decoding rolls each row's state back to the draft tokens it keeps (layers/state.py).

`walk` is the only loop over the blocks: the forward pass, `decode`, and the decoding techniques of
infer/ (early exit's pass, self-speculation's drafting with the first layers) all go through it, so
on a mesh they run the same blocks under the same sharding hints. A caller's `step` runs each block
its own way (under a condition, holding a row's hidden state, deciding an exit after it).

Early exits (`model.exits`): after block l of each configured layer count, an exit norm and the LM
head (shared, or its own) give next-token logits from the hidden state there; `__call__(...,
return_exits=True)` also returns those hidden states for the training loss. Each exit also has a
linear confidence classifier (zero until fitted afterwards on the frozen model, train/exits.py).
LayerSkip's layer dropout skips block i for a row with probability p * i / (L - 1) in training
(no rescaling, as LayerSkip); `model.eval()` turns it off.

On a device mesh (zoo/sharding.py) the residual stream is held with its rows split over the batch
axes and its width whole, and the logits with the vocabulary split over `tensor`: the hints that
make XLA gather FSDP-sharded weights rather than split activations by width. On one device they
are no-ops.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from layers import NoFFN, RMSNorm
from layers.linear import project
from layers.norm import LayerNorm
from layers.residual import AttentionResidual, DepthAttention, HyperConnection, narrow, start, widen
from layers.sharding import axes, constrain
from zoo.config import ModelConfig
from zoo.registry import make_layer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
RESIDUAL = ("batch", "length", None)  # (B, T, D): rows over the batch axes, time over context, the width whole


def norm_of(cfg: ModelConfig):
    """A new norm of the model's kind (model.norm) over d_model."""
    return (RMSNorm if cfg.norm == "rms" else LayerNorm)(cfg.d_model, eps=cfg.norm_eps)


class Block(nnx.Module):
    def __init__(self, mixer: nnx.Module, ffn: nnx.Module, norm, residual=None):
        self.mixer_norm, self.mixer = norm(), mixer
        self.ffn_norm, self.ffn = (None if isinstance(ffn, NoFFN) else norm()), ffn  # none: no FFN
        self.stateful_ffn = hasattr(ffn, "init_state")
        self.residual = residual  # None: x + f(x); else the connection around each sublayer (model.residual)

    def connect(self, j: int, x, f):
        """Sublayer j (0 mixer, 1 FFN) joined to the residual stream x: f(h) -> (y, aux) gives (x, aux)."""
        if self.residual is None:
            y, aux = f(x)
            return x + y, aux
        return self.residual[j](x, f)

    def __call__(self, x, segment_ids=None, v_first=None):
        def mix(h):
            if getattr(self.mixer, "carries_v_first", False):
                return self.mixer(self.mixer_norm(h), segment_ids=segment_ids, v_first=v_first)
            return self.mixer(self.mixer_norm(h), segment_ids=segment_ids), v_first

        def ffn(h):
            h = self.ffn_norm(h)
            return (self.ffn(h, segment_ids=segment_ids) if self.stateful_ffn else self.ffn(h)), None

        x, v_first = self.connect(0, x, mix)
        return (x if self.ffn_norm is None else self.connect(1, x, ffn)[0]), v_first

    def init_state(self, batch_size: int, max_len: int):
        ffn = self.ffn.init_state(batch_size, max_len) if self.stateful_ffn else None
        return self.mixer.init_state(batch_size, max_len), ffn

    def decode(self, x, state, segment_ids=None, v_first=None, steps=False):
        steps = {"steps": True} if steps else {}  # asked for only when used: a mixer without it still decodes

        def mix(h):
            if getattr(self.mixer, "carries_v_first", False):
                y, s, vf = self.mixer.decode(self.mixer_norm(h), state[0], segment_ids=segment_ids,
                                             v_first=v_first, **steps)
                return y, (s, vf)
            y, s = self.mixer.decode(self.mixer_norm(h), state[0], segment_ids=segment_ids, **steps)
            return y, (s, v_first)

        def ffn(h):
            if not self.stateful_ffn:
                return self.ffn(self.ffn_norm(h)), None
            return self.ffn.decode(self.ffn_norm(h), state[1], segment_ids=segment_ids, **steps)

        x, (mixer_state, v_first) = self.connect(0, x, mix)
        if self.ffn_norm is None:
            return x, (mixer_state, None), v_first
        x, ffn_state = self.connect(1, x, ffn)
        return x, (mixer_state, ffn_state), v_first

    def rollback(self, stepped, drop):
        ffn = None if stepped[1] is None else self.ffn.rollback(stepped[1], drop)
        return self.mixer.rollback(stepped[0], drop), ffn


def connections(cfg: ModelConfig, first: int, sublayers: int) -> nnx.List | None:
    """The model.residual connection around each sublayer of a block whose first sublayer is number
    `first` in the model (mixer, then FFN); None: the standard x + f(x)."""
    r = cfg.residual
    if r.kind == "mhc":
        return nnx.List([HyperConnection(cfg.d_model, r.rate, index=first + j, iterations=r.iterations,
                                         eps=cfg.norm_eps) for j in range(sublayers)])
    if r.kind == "attnres":
        return nnx.List([AttentionResidual(cfg.d_model, index=first + j, block_size=r.block_size, eps=cfg.norm_eps)
                         for j in range(sublayers)])
    return None


def _runner(block: Block, segment_ids, steps: bool, train: bool):
    """Block as `LanguageModel.walk` runs it: (x, (state, v_first)) -> (y, (state, v_first)); in
    training the state stays None."""
    if train:
        def run(x, rest):
            y, v_first = block(x, segment_ids=segment_ids, v_first=rest[1])
            return y, (None, v_first)
    else:
        def run(x, rest):
            y, s, v_first = block.decode(x, rest[0], segment_ids=segment_ids, v_first=rest[1], steps=steps)
            return y, (s, v_first)
    return run


class LanguageModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = DTYPES[cfg.dtype]
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(0.02),
                               embedding_metadata=axes("vocab", "embed"), rngs=rngs)
        model_kwargs = lambda i: dict(layer_id=i, num_layers=cfg.num_layers, max_seq_len=cfg.max_seq_len)
        sublayers = [1 if f.KIND == "none" else 2 for f in cfg.ffns()]
        self.blocks = nnx.List([
            Block(make_layer(m, cfg.d_model, dtype=dtype, rngs=rngs, **model_kwargs(i)),
                  make_layer(f, cfg.d_model, dtype=dtype, rngs=rngs, **model_kwargs(i)),
                  lambda: norm_of(cfg), connections(cfg, sum(sublayers[:i]), sublayers[i]))
            for i, (m, f) in enumerate(zip(cfg.mixers(), cfg.ffns()))])
        self.residual_read = DepthAttention(cfg.d_model, eps=cfg.norm_eps) if cfg.residual.kind == "attnres" \
            else None  # AttnRes: the final norm's input, a last read over depth
        self.embed_norm = norm_of(cfg) if cfg.embed_norm else None
        self.norm = norm_of(cfg)
        self.head = None if cfg.tie_embeddings else nnx.Param(
            nnx.initializers.normal(cfg.d_model ** -0.5)(rngs.params(), (cfg.d_model, cfg.vocab_size)),
            **axes("embed", "vocab"))
        if cfg.head == "pooled_decoder":  # MAD's compression decoder: norm, linear, GELU, twice
            self.decoder = nnx.List([m for _ in range(2) for m in (
                RMSNorm(cfg.d_model, eps=cfg.norm_eps), nnx.Linear(cfg.d_model, cfg.d_model, dtype=dtype, rngs=rngs))])
        exits = cfg.exits
        self.exit_layers = exits.layers if exits else ()
        if exits:
            E = len(exits.layers)
            self.exit_norms = nnx.List([norm_of(cfg) for _ in range(E)])
            self.exit_heads = nnx.Param(nnx.initializers.normal(cfg.d_model ** -0.5)(
                rngs.params(), (E, cfg.d_model, cfg.vocab_size)), **axes(None, "embed", "vocab")) \
                if exits.own_head else None
            self.exit_classifier = nnx.Param(jnp.zeros((E, cfg.d_model + 1), jnp.float32),  # weights, bias
                                             **axes(None, None))
            self.layer_dropout, self.deterministic = exits.layer_dropout, False
            if exits.layer_dropout > 0:
                self.dropout_rngs = rngs["layer_dropout"].fork()

    def set_view(self, deterministic: bool | None = None):
        """Lets `nnx.view(model, deterministic=...)` make a train/eval view without mutating model."""
        if deterministic is not None and self.exit_layers:
            self.deterministic = deterministic

    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """The residual stream entering block 0: the embeddings, times model.embed_scale and normed when
        model.embed_norm."""
        x = self.embed(tokens)
        x = x if self.cfg.embed_scale is None else x * jnp.asarray(self.cfg.embed_scale, x.dtype)
        return x if self.embed_norm is None else self.embed_norm(x)

    def soft_cap(self, logits: Float[Array, "B T V"]) -> Float[Array, "B T V"]:
        """model.logit_softcap: cap tanh(logits / cap), float32 (None: the logits as they are)."""
        cap = self.cfg.logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def logits(self, x: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        x = self.norm(x)
        w = self.embed.embedding[...].T if self.head is None else self.head[...]
        logits = project(x, w.astype(x.dtype), preferred_element_type=jnp.float32)  # (B, T, V)
        return constrain(self.soft_cap(logits), ("batch", "length", "vocab"))

    def exit_logits(self, j: int, h: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """Next-token logits from the hidden state `h` at exit j (an index into `exit_layers`)."""
        x = self.exit_norms[j](h)
        w = self.embed.embedding[...].T if self.head is None else self.head[...]
        w = w if self.exit_heads is None else self.exit_heads[j]
        return self.soft_cap(project(x, w.astype(x.dtype), preferred_element_type=jnp.float32))  # (B, T, V)

    def exit_classifier_logits(self, j: int, h: Float[Array, "B T D"]) -> Float[Array, "B T"]:
        """The learned exit classifier: the logit of P(exit j already predicts the full model's token)."""
        wb = self.exit_classifier[j]
        return self.exit_norms[j](h).astype(jnp.float32) @ wb[:-1] + wb[-1]

    def check_tokens(self, tokens, segment_ids=None, where="LanguageModel"):
        """tokens (B, T) of integer ids in [0, vocab_size), segment_ids (B, T): a ValueError naming what
        was given otherwise. The ids are checked when they are concrete; under jit (where no check
        can raise) an id out of range gives NaN logits, which a training step reports as a
        non-finite loss."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"{where}: expected tokens of shape (B, T) with integer ids, got shape "
                             f"{tuple(tokens.shape)} of {tokens.dtype}")
        if segment_ids is not None and tuple(segment_ids.shape) != tuple(tokens.shape):
            raise ValueError(f"{where}: expected segment_ids of the tokens' shape {tuple(tokens.shape)}, got "
                             f"{tuple(segment_ids.shape)}")
        if not isinstance(tokens, jax.core.Tracer) and tokens.size:  # concrete: read on the host, not traced
            ids = np.asarray(tokens)
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"{where}: token ids must be in [0, {self.cfg.vocab_size}) (model.vocab_size); got "
                                 f"ids from {lo} to {hi}")

    def __call__(self, tokens: Int[Array, "B T"], *, segment_ids: Int[Array, "B T"] | None = None,
                 return_exits: bool = False):
        """Logits (B, T, V); with return_exits, also the hidden state at each exit (a tuple of (B, T, D))."""
        self.check_tokens(tokens, segment_ids)
        x, _, hidden = self.walk(self.embed_tokens(tokens), segment_ids=segment_ids, step=self._train_block,
                                   carry=())
        if self.cfg.head == "pooled_decoder":
            x = self.pooled_decode(x)
        return (self.logits(x), hidden) if return_exits else self.logits(x)

    def _train_block(self, i: int, run, x, rest, hidden: tuple):
        """Block i of the training path (a `walk` step): LayerSkip's layer dropout, and the hidden state
        after each exit's layer appended to `hidden`."""
        y, rest = run(x, rest)
        if self.exit_layers and self.layer_dropout > 0 and not self.deterministic and i > 0:
            L = len(self.blocks)
            keep = jax.random.bernoulli(self.dropout_rngs(), 1 - self.layer_dropout * i / (L - 1), x.shape[:1])
            y = jnp.where(keep[:, None, None], y, x)
        return y, rest, (*hidden, constrain(y, RESIDUAL)) if i + 1 in self.exit_layers else hidden

    def walk(self, x: Float[Array, "B T D"], state: tuple | None = None, *, segment_ids=None, steps: bool = False,
             depth: int | None = None, step=None, carry=None):
        """The one loop over the blocks: the residual stream x through blocks 0 .. depth - 1 (default all),
        held as RESIDUAL on a mesh after each. Returns (x, new state, carry).

        Without `state` this is the training path (the new state is None); with a decode state (one block's
        state per block run) each block decodes (with `steps`, as `decode`) and the new states are returned.
        step(i, run, x, rest, carry) -> (y, rest, carry), when given, runs block i the caller's way:
        run(x, rest) -> (y, rest) is the block itself, `rest` its state and RWKV-7's value residual (opaque
        to the caller). The caller may run it under control flow or for its state alone, replace its output
        (hold a row's hidden state) and update its own `carry` (early exit's decisions so far)."""
        x, v_first, new_state = self.enter_residual(constrain(x, RESIDUAL)), None, []
        for i, block in enumerate(self.blocks[:depth]):
            run = _runner(block, segment_ids, steps, train=state is None)
            rest = (None if state is None else state[i], v_first)
            y, (s, v_first), carry = step(i, run, x, rest, carry) if step else (*run(x, rest), carry)
            x = jax.tree.map(lambda a: constrain(a, ("batch", "length") + (None,) * (a.ndim - 2)), y)  # RESIDUAL, wider
            new_state.append(s)
        return self.leave_residual(x), None if state is None else tuple(new_state), carry

    def enter_residual(self, x: Float[Array, "B T D"]):
        """The residual stream block 0 reads (model.residual): x itself; mHC's n copies (B, T, n, D);
        AttnRes's (closed blocks, open partial sum)."""
        kind = self.cfg.residual.kind
        return x if kind == "standard" else widen(x, self.cfg.residual.rate) if kind == "mhc" else start(x)

    def leave_residual(self, stream) -> Float[Array, "B T D"]:
        """What the final norm reads from the stream: itself; mHC's sum of the n streams; AttnRes's last read."""
        kind = self.cfg.residual.kind
        return stream if kind == "standard" else narrow(stream) if kind == "mhc" else \
            self.residual_read((*stream[0], stream[1]))

    def pooled_decode(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        """model.head=pooled_decoder: every position decoded from the last position's state alone."""
        T, D = x.shape[1:]
        half = D // 2
        angle = np.arange(T)[:, None] / 10000 ** (np.arange(half) / max(half - 1, 1))  # MAD's sincos, (T, D/2)
        pos = np.concatenate([np.sin(angle), np.cos(angle), np.zeros((T, D - 2 * half))], axis=1)
        x = x[:, -1:] + jnp.asarray(pos, x.dtype)  # (B, T, D)
        for norm, linear in zip(self.decoder[0::2], self.decoder[1::2]):
            x = jax.nn.gelu(linear(norm(x)))
        return x

    def init_state(self, batch_size: int, max_len: int) -> tuple:
        return tuple(block.init_state(batch_size, max_len) for block in self.blocks)

    @staticmethod
    def overflowed(state) -> jax.Array:
        """True if any layer's decode state overflowed (a KV cache decoded past its max_len slots)."""
        flags = [s.overflowed() for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "overflowed"))
                 if hasattr(s, "overflowed")]
        return jnp.any(jnp.stack(flags)) if flags else jnp.bool_(False)

    def decode(self, tokens: Int[Array, "B T"], state: tuple, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False) -> tuple[Float[Array, "B T V"], tuple]:
        """Run T >= 1 tokens from `state` (prefill or one step); returns logits and the new state.

        steps=True (segment_ids None) returns instead a stepped state, every layer's state after each
        of the T tokens, for `rollback`: speculative decoding verifies T draft tokens in one call and
        rolls each row back to the tokens it keeps without running them again (layers/state.py)."""
        if self.cfg.head != "lm":
            raise ValueError(f"LanguageModel.decode: model.head={self.cfg.head!r} is not a language model; "
                             "only model.head=lm decodes")
        self.check_tokens(tokens, segment_ids, "LanguageModel.decode")
        model = nnx.view(self, deterministic=True)  # decoding is inference: MoE routes as in evaluation, any mode
        x, new_state, _ = model.walk(model.embed_tokens(tokens), state, segment_ids=segment_ids, steps=steps)
        return model.logits(x), new_state

    def rollback(self, stepped: tuple, drop: Int[Array, " B"]) -> tuple:
        """The state after token T - 1 - drop[b] of the last decode(..., steps=True) for each row b,
        drop (B,) int32 in [0, T - 1]: what decoding only those tokens would have left."""
        return tuple(block.rollback(s, drop) for block, s in zip(self.blocks, stepped))
