"""Context parallelism: one sequence split along time over the `context` axis of the device mesh.

Under a mesh in context (`jax.set_mesh`) whose `context` axis has n > 1 devices, each device holds a
contiguous span of T / n tokens of every row. Per-token work (projections, norms, FFNs, the loss)
needs nothing: XLA partitions it along time from the batch's sharding. What carries information
along time does, and is written here once:

- a recurrence whose state is linear in the state it starts from (`split_recurrence`): every kind
  whose op has a chunk form (linear attention, RetNet, GLA, HGRN2, the delta rules, Mamba-2, RWKV)
  has S_end = M S_in + S_loc over a span, with M (K, K) acting on the state's key axis;
- attention's keys and values, which every query of the sequence may read (`gather_sequence`).

`split_recurrence`, per device and inside one `shard_map` over the axis:

1. one pass of the op over the span from the state [0 | I]: the values are widened by K zero
   columns and the state by the K x K identity beside a zero (K, V) state, so the widened end
   state is [S_loc | M]: the span's own end state and how it maps the state it starts from (the
   columns of a state are independent in these recurrences, so the identity columns carry M);
2. all-gather of (M, S_loc) and of the first and last segment id of every span, and the scan over
   devices S_in(d + 1) = c(d + 1) (M(d) S_in(d) + S_loc(d)), S_in(0) the caller's initial state,
   c = 0 where a document starts at the boundary (a start inside a span already zeroes its M);
3. the op again over the span from S_in: the outputs and end state of the single-device run.

It costs the op twice (the first pass K columns wider) plus n (K, K + V) states per layer sent to
every device; its gradient is JAX's transpose of the same program (the all-gather's is a
reduce-scatter), so the states' cotangents travel the other way. `docs/context.md` has the figures.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "context"
SEQ = P(None, AXIS)  # (B, T, ...) arrays: time split over the axis


def size() -> int:
    """Devices on the `context` axis of the mesh in context: 1 without one, and inside a shard_map over it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or AXIS in mesh.manual_axes:
        return 1
    return mesh.shape[AXIS]


def active(T: int) -> bool:
    """Whether a call of T tokens runs split over the axis: more than one device, and T a multiple of
    their count (decode steps and other short calls run whole, as XLA places them)."""
    n = size()
    return n > 1 and T % n == 0


def check_length(T: int, where: str):
    """Refuse a sequence of T tokens that the context axis cannot split."""
    n = size()
    if n > 1 and T % n:
        raise ValueError(f"{where}: {T} tokens do not split over train.mesh.context={n}; use a sequence length "
                         f"that is a multiple of {n}")


def _shard_map(f, in_specs, out_specs):
    return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS}, check_vma=False)


def _boundaries(segment_ids, n):
    """(B,) per device: 1.0 where its first token continues the document of the previous device's last
    token (its incoming state is kept), 0.0 where a document starts at the boundary; all of them, (n, B)."""
    if segment_ids is None:
        return None
    first, last = (jax.lax.all_gather(s, AXIS) for s in (segment_ids[:, 0], segment_ids[:, -1]))  # (n, B)
    return (first[1:] == last[:-1]).astype(jnp.float32)  # (n - 1, B): boundary d -> d + 1


def from_left(x, carry_in, segment_ids):
    """Inside a shard_map over the axis: what device d receives from device d - 1 (`x`, a (B, ...) tree
    made by each device, e.g. its last inputs), `carry_in` on device 0; zero where a document starts at
    the boundary. For windows that one span fills (short convolutions, token shifts)."""
    n, i = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    shifted = jax.lax.ppermute(x, AXIS, [(d, d + 1) for d in range(n - 1)])
    keep = _boundaries(segment_ids, n)
    if keep is not None:
        c = jnp.concatenate([jnp.ones_like(keep[:1]), keep])[i]  # (B,)
        shifted = jax.tree.map(lambda s: s * c.reshape((-1,) + (1,) * (s.ndim - 1)).astype(s.dtype), shifted)
    return jax.tree.map(lambda s, c0: jnp.where(i == 0, c0.astype(s.dtype), s), shifted, carry_in)


def split_recurrence(run, seq: tuple, rest: tuple = (), *, value: int, segment_ids=None, initial_state=None,
                     state_axes: tuple[int, int] = (2, 3)):
    """The op `run(*seq, *rest, segment_ids=, initial_state=) -> (o, end state)` over the whole sequence,
    split over the context axis (module docstring). seq: (B, T, ...) arrays split along time; rest:
    arrays every device holds whole; seq[value]: the values, whose last axis is the state's value axis.
    state_axes: the (key, value) axes of the state, (B, H, K, V) by default. Returns (o, end state)."""
    key_axis, value_axis = state_axes
    have_seg, have_s0 = segment_ids is not None, initial_state is not None

    def canonical(S):  # (B, H, K, V) whatever the op's layout
        return jnp.moveaxis(S, (key_axis, value_axis), (2, 3))

    def native(S):
        return jnp.moveaxis(S, (2, 3), (key_axis, value_axis))

    def local(seq, rest, seg, S0):
        seg = seg if have_seg else None
        v = seq[value]
        native_shape = jax.eval_shape(lambda: run(*seq, *rest, segment_ids=seg, initial_state=None)[1]).shape
        B, H, K, V = shape = tuple(native_shape[a] for a in (0, 1, key_axis, value_axis))
        wide = seq[:value] + (jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (K,), v.dtype)], -1),) + seq[value + 1:]
        eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))
        start = jnp.concatenate([jnp.zeros(shape, jnp.float32), eye], -1)  # [0 | I]
        end = canonical(run(*wide, *rest, segment_ids=seg, initial_state=native(start))[1])
        S_loc, M = end[..., :V], end[..., V:]  # (B, H, K, V), (B, H, K, K)
        n, i = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
        Ms, Ss = jax.lax.all_gather(M, AXIS), jax.lax.all_gather(S_loc, AXIS)  # (n, B, H, K, *)
        keep = _boundaries(seg, n)
        S = canonical(S0).astype(jnp.float32) if have_s0 else jnp.zeros(shape, jnp.float32)
        for d in range(n - 1):  # the scan over devices, n small: each device stops at its own index
            nxt = jnp.einsum("bhkj,bhjv->bhkv", Ms[d], S) + Ss[d]
            if keep is not None:
                nxt = nxt * keep[d][:, None, None, None]
            S = jnp.where(d < i, nxt, S)
        o, final = run(*seq, *rest, segment_ids=seg, initial_state=native(S))
        final = jax.lax.psum(jnp.where(i == n - 1, final, 0), AXIS)  # the last span's end: the sequence's
        return o, final

    seg = segment_ids if have_seg else jnp.zeros((), jnp.int32)
    S0 = initial_state if have_s0 else jnp.zeros((), jnp.float32)
    f = _shard_map(local, in_specs=((SEQ,) * len(seq), (P(),) * len(rest), SEQ if have_seg else P(), P()),
                   out_specs=(SEQ, P()))
    return f(tuple(seq), tuple(rest), seg, S0)
