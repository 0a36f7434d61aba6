"""Decode states: frozen dataclasses that are JAX pytrees, one annotated array (or None) per field.

    @state
    class GLAState:
        S: Float[Array, "B H K V"]  # (B, H, K, V) float32 recurrent state

Like `flax.struct.dataclass`, except that JAX rebuilds a state without calling its __init__ (as
equinox does). The suite checks every annotation at run time (jaxtyping's import hook), and that
check belongs on the states a layer builds, not on the ShapeDtypeStructs, tracers, shapes or
shardings that `jax.eval_shape`, `jit` and `jax.tree.map` put in the fields of the copies they make.

Rolling back without rerunning tokens (speculative decoding): `decode(x, state, steps=True)` returns
a *stepped* state, in which each field holds its value after each of the call's T tokens, a leading
axis T: (T, B, ...). `rollback(stepped, drop)` then picks, for row b, its value after token
T - 1 - drop[b]. A field that a layer cannot afford to keep per step (a KV cache's slots) is declared
`final`, `@state(final=("k", "v"))`: it is kept as the call left it, and the layer must make the
rolled-back state read it correctly (slots past a row's index are never read). `stepwise` runs a
recurrent op token by token to collect those steps: T is a handful of draft tokens, and the
projections around the op still run as one parallel pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def state(cls=None, *, final: tuple[str, ...] = ()):
    """`@state` or `@state(final=names)`: the fields a stepped state keeps once, as the call left them."""
    if cls is None:
        return lambda cls: state(cls, final=final)
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    if set(final) - set(names):
        raise ValueError(f"{cls.__name__}: final={final} names no field of {names}")
    cls.final_fields = frozenset(final)

    def stepped(cls, *values, **fields):
        """A stepped state (fields in order, as for __init__), built without __init__ and so without its
        annotation check: the leading T of its fields is not in the annotations."""
        s = object.__new__(cls)
        for name, value in {**dict(zip(names, values)), **fields}.items():
            object.__setattr__(s, name, value)
        return s

    cls.stepped = classmethod(stepped)
    jax.tree_util.register_pytree_with_keys(
        cls, lambda s: ([(jax.tree_util.GetAttrKey(n), getattr(s, n)) for n in names], None),
        lambda _, children: cls.stepped(*children))
    return cls


def is_state(x) -> bool:
    return hasattr(type(x), "final_fields")


def stepwise(op, initial_state, *sequences):
    """Run `op(state, *slices) -> (out, state)` on the 1-token slices (B, 1, ...) of `sequences`
    (B, T, ...; None passes through), one token after another: returns the outputs (B, T, ...) and
    the state after every token, stacked (T, B, ...)."""
    def body(carry, xs):
        out, carry = op(carry, *(None if x is None else x[:, None] for x in xs))
        return carry, (out, carry)

    time_major = tuple(None if x is None else jnp.swapaxes(x, 0, 1) for x in sequences)  # (T, B, ...)
    _, (out, states) = jax.lax.scan(body, initial_state, time_major)
    return jax.tree.map(lambda y: jnp.swapaxes(y[:, :, 0], 0, 1), out), states  # out: (T, B, 1, ...) -> (B, T, ...)


def per_token(a, steps: bool):
    """A value after each token of a decode call, (B, T, ...), as its state keeps it: every token's,
    (T, B, ...), in a stepped state (steps=True); else the last token's, (B, ...)."""
    return jnp.swapaxes(a, 0, 1) if steps else a[:, -1]


def empty_cache(batch_size: int, slots: int) -> dict:
    """The bookkeeping of an empty cache of `slots` slots: doc (B, S) -1 (no token), cur_doc, pos, index (B,) 0."""
    zeros = jnp.zeros((batch_size,), jnp.int32)
    return dict(doc=jnp.full((batch_size, slots), -1, jnp.int32), cur_doc=zeros, pos=zeros, index=zeros)


def cache_counters(index: Int[Array, " B"], doc: Int[Array, "B T"], positions: Int[Array, "B T"], steps: bool
                   ) -> dict:
    """A cache's counters after a decode call of T tokens written from slot `index` (B,), in documents `doc`
    at `positions` (B, T): cur_doc, pos and index, `per_token`."""
    after = index[:, None] + jnp.arange(1, doc.shape[1] + 1, dtype=index.dtype)  # (B, T)
    return dict(cur_doc=per_token(doc, steps), pos=per_token(positions + 1, steps), index=per_token(after, steps))


def map_fields(fn, *trees, build: bool = False):
    """fn(final, *values) on each field of every state in the pytrees (which share one structure), final
    telling whether the field is one of its state's final fields; None fields stay None, an array
    outside a state counts as a field that is not final. build=True makes ordinary states (through
    __init__, so their annotations are checked), else states built as `stepped` ones."""
    def one(*ss):
        s = ss[0]
        if not is_state(s):
            return fn(False, *ss)
        values = {f.name: None if getattr(s, f.name) is None else fn(f.name in s.final_fields,
                                                                      *(getattr(x, f.name) for x in ss))
                  for f in dataclasses.fields(s)}
        return type(s)(**values) if build else type(s).stepped(**values)

    return jax.tree.map(one, *trees, is_leaf=is_state)


def rollback(stepped, drop: Int[Array, " B"]):
    """The ordinary state after token T - 1 - drop[b] of the last decode(steps=True) call, for each
    row b: every state in the pytree `stepped` takes that step of each field but its final ones (and
    None); an array outside a state is taken as stepped too. drop (B,) int32 in [0, T - 1]."""
    take = lambda a: a[a.shape[0] - 1 - drop, jnp.arange(a.shape[1])]  # (T, B, ...) -> (B, ...)
    return map_fields(lambda final, a: a if final else take(a), stepped, build=True)


def take_rows(stepped, rows: Int[Array, " R"]):
    """Rows `rows` of a stepped state: axis 1 of its stepped fields (T, B, ...), axis 0 of final ones."""
    return map_fields(lambda final, a: a[rows] if final else a[:, rows], stepped)


def hold(keep: Bool[Array, " B"], old, new):
    """Ordinary states: `new` in the rows where keep (B,) is True, `old` in the others; final fields from
    `new` (a held row's index did not move, so it never reads what the call wrote past it)."""
    where = lambda n, o: jnp.where(keep.reshape(-1, *(1,) * (n.ndim - 1)), n, o)
    return map_fields(lambda final, n, o: n if final else where(n, o), new, old)


def without_final(stepped):
    """A stepped state without its final fields (None): what a scan of 1-token decode(steps=True) calls
    keeps per step, instead of a copy of a KV cache per step."""
    return map_fields(lambda final, a: None if final else a, stepped)


def join_steps(after, steps):
    """One stepped state from S consecutive 1-token decode(steps=True) calls: `steps` their
    `without_final` states stacked by a scan, (S, 1, B, ...), `after` the ordinary state after the
    last call, which holds the final fields."""
    return map_fields(lambda final, a, s: a if final else s.reshape(s.shape[0], *s.shape[2:]), after, steps)
