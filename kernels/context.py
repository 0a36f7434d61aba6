"""Context parallelism: one sequence split along time over the `context` axis of the device mesh.

Under a mesh in context (`jax.set_mesh`) whose `context` axis has n > 1 devices, each device holds a
contiguous span of T / n tokens of every row. Per-token work (projections, norms, FFNs, the loss)
needs nothing: XLA partitions it along time from the batch's sharding. What carries information
along time does, and is written here once:

- a recurrence whose state decays elementwise (`split_diagonal`: linear attention, RetNet, GLA,
  HGRN2, Mamba-2, RWKV-6, Mamba-1's selective scan, the RG-LRU, S4D): over a span S_end = M ⊙ S_in +
  S_loc, M the product of the span's decays, computed from its inputs (exp of a sum of log-decays);
- a recurrence whose transition mixes the state's key axis (`split_recurrence`: the delta rules of
  DeltaNet, Gated DeltaNet, KDA, Gated DeltaProduct and Comba, RWKV-7): S_end = M S_in + S_loc with
  M (K, K), which the op itself computes;
- attention's keys and values, which every query of the sequence may read (`gather_sequence`);
- a carry that holds more than such a state (Mamba-3's angles and previous token, kernels/mamba3/split.py):
  the op writes its own form from the same pieces, `over_spans` (the shard_map), `scan_devices` (the
  exchange of step 2 below, for any transition), `from_left` and `last`.

Both run per device inside one `shard_map` over the axis (`over_spans`); `split_diagonal` runs the op
from a zero state (S_loc), exchanges as in step 2 below and runs the op again (step 3): the op twice at
its own width, plus n (B, H, K, V) states (and their decays) per layer sent to every device.
`split_recurrence`:

1. one pass of the op over the span from the state [0 | I]: the values are widened by K zero
   columns and the state by the K x K identity beside a zero (K, V) state, so the widened end
   state is [S_loc | M]: the span's own end state and how it maps the state it starts from (the
   columns of a state are independent in these recurrences, so the identity columns carry M);
2. all-gather of (M, S_loc) and of the first and last segment id of every span, and the scan over
   devices S_in(d + 1) = c(d + 1) (M(d) S_in(d) + S_loc(d)), S_in(0) the caller's initial state,
   c = 0 where a document starts at the boundary, and M zeroed where one starts inside a span;
3. the op again over the span from S_in: the outputs and end state of the single-device run.

It costs the op twice (the first pass K columns wider) plus n (K, K + V) states per layer sent to
every device. The gradient of every form is JAX's transpose of the same program (the all-gather's is a
reduce-scatter), so the states' cotangents travel the other way. `docs/context.md` has the figures.

`split_queries`, for an op whose queries read every key of the sequence (softmax attention), per
device inside one `shard_map`: the keys' arrays all-gathered (`gather_sequence`), the op run for the
device's queries at their positions in the sequence, the outputs back on the devices that hold their
tokens. Which queries a device runs is `split` (SPLITS):

- "contiguous": its own span, nothing moves but the keys. Under a causal mask device d's queries see
  (d + 1/2) / n of the keys on average, and the forms that skip masked blocks (kernels/attention) do
  that share of the work: the last device does about 2n - 1 times the first's, and the step waits
  for it;
- "zigzag" (the causal load balancing of Llama 3's context parallelism, Dubey et al. 2024): each
  span cut in two halves, a = ceil(L / 2) and L - a tokens (L = T / n), gives the 2n chunks of the
  sequence in order, and device d runs chunks d and 2n - 1 - d: one early and one late, so every
  device's queries see about as many keys as any other's. The halves travel by two `ppermute`s
  (every device sends its first half along one permutation of the devices, its second half along
  another), the outputs by the inverse two: L tokens a device each way, where all-gathering the
  queries and the outputs would send T (an `all_to_all` needs equal pieces for every device, and
  each device here trades with at most two). An odd L pads the shorter half to a: one query a device
  is computed and dropped.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kernels.segments import document_starts

AXIS = "context"
SEQ = P(None, AXIS)  # (B, T, ...) arrays: time split over the axis
SPLITS = ("contiguous", "zigzag")  # which queries a device runs in `split_queries` (module docstring)


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


_DEVICE = []  # the index of the device, inside the shard_maps being traced (innermost last)


def _device():
    """Inside a shard_map over the axis: this device's index on it."""
    return _DEVICE[-1]


def _shard_map(f, in_specs, out_specs):
    """shard_map over the context axis alone (the others stay XLA's); check_vma off, since the ops' scans start
    from fresh zeros that vary by device only once they have run. The device's index enters as data, an arange
    split over the axis, not as jax.lax.axis_index: XLA's partitioner refuses the PartitionId that axis_index
    lowers to once many such regions share one program (a model with a layer of every kind)."""

    def g(index, *args):
        _DEVICE.append(index[0])
        try:
            return f(*args)
        finally:
            _DEVICE.pop()

    def call(*args):
        index = jnp.arange(size(), dtype=jnp.int32)
        return jax.shard_map(g, in_specs=(P(AXIS), *in_specs), out_specs=out_specs, axis_names={AXIS},
                             check_vma=False)(index, *args)

    return call


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
    n, i = jax.lax.axis_size(AXIS), _device()
    shifted = jax.lax.ppermute(x, AXIS, [(d, d + 1) for d in range(n - 1)])
    keep = _boundaries(segment_ids, n)
    if keep is not None:
        c = jnp.concatenate([jnp.ones_like(keep[:1]), keep])[i]  # (B,)
        shifted = jax.tree.map(lambda s: s * c.reshape((-1,) + (1,) * (s.ndim - 1)).astype(s.dtype), shifted)
    return jax.tree.map(lambda s, c0: jnp.where(i == 0, c0.astype(s.dtype), s), shifted, carry_in)


def carried(segment_ids):
    """Inside a shard_map over the axis: (B,) float32, 1 where the span's start carries to its end (no document
    starts inside it), else 0; None without segment_ids (always 1)."""
    return None if segment_ids is None else 1.0 - jnp.any(document_starts(segment_ids), axis=1).astype(jnp.float32)


def scan_devices(M, S_loc, S0, segment_ids, apply):
    """Inside a shard_map over the axis: the state this device's span starts from, for a recurrence whose end
    state over a span is apply(M, S) + S_loc from the state S it starts from (M and S_loc made by each device, M
    of any shape that broadcasts against S_loc, zeroed here where a document starts inside the span: `carried`):
    the scan over devices S_in(d + 1) = c(d + 1) (apply(M(d), S_in(d)) + S_loc(d)) from S_in(0) = S0, the
    caller's, c as in `from_left`."""
    n, i = jax.lax.axis_size(AXIS), _device()
    through = carried(segment_ids)
    if through is not None:
        M = through.reshape((-1,) + (1,) * (S_loc.ndim - 1)) * M
    Ms, Ss = jax.lax.all_gather(M, AXIS), jax.lax.all_gather(S_loc, AXIS)  # (n, B, ...)
    keep = _boundaries(segment_ids, n)
    S = S0
    for d in range(n - 1):  # n small: each device stops at its own index
        nxt = apply(Ms[d], S) + Ss[d]
        if keep is not None:
            nxt = nxt * keep[d].reshape((-1,) + (1,) * (nxt.ndim - 1))
        S = jnp.where(d < i, nxt, S)
    return S


def last(tree):
    """Inside a shard_map over the axis: the last device's `tree` on every device (the sequence's end state)."""
    n, i = jax.lax.axis_size(AXIS), _device()
    return jax.tree.map(lambda a: jax.lax.psum(jnp.where(i == n - 1, a, 0), AXIS), tree)


def over_spans(local, seq: tuple, rest: tuple, segment_ids, initial_state):
    """local(seq, rest, segment_ids, initial_state) -> (o, end state) run on every device's span inside one
    shard_map over the axis: seq (B, T, ...) arrays split along time, rest and initial_state (a tree, or None)
    held whole, segment_ids (B, T) or None. Returns (o split along time, the end state local returns, which
    must be the same on every device)."""
    have_seg, have_s0 = segment_ids is not None, initial_state is not None

    def f(seq, rest, seg, S0):
        return local(seq, rest, seg if have_seg else None, S0 if have_s0 else None)

    seg = segment_ids if have_seg else jnp.zeros((), jnp.int32)
    S0 = initial_state if have_s0 else jnp.zeros((), jnp.float32)
    in_specs = ((SEQ,) * len(seq), (P(),) * len(rest), SEQ if have_seg else P(), P())
    return _shard_map(f, in_specs, (SEQ, P()))(tuple(seq), tuple(rest), seg, S0)


def split_recurrence(run, seq: tuple, rest: tuple = (), *, value: int, segment_ids=None, initial_state=None):
    """The op `run(*seq, *rest, segment_ids=, initial_state=) -> (o, end state (B, H, K, V))` over the whole
    sequence, split over the context axis (module docstring). seq: (B, T, ...) arrays split along time; rest:
    arrays every device holds whole; seq[value]: the values, whose last axis is the state's. Returns
    (o, end state)."""

    def local(seq, rest, seg, S0):
        v = seq[value]
        B, H, K, V = shape = jax.eval_shape(lambda: run(*seq, *rest, segment_ids=seg, initial_state=None)[1]).shape
        wide = seq[:value] + (jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (K,), v.dtype)], -1),) + seq[value + 1:]
        eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))
        start = jnp.concatenate([jnp.zeros(shape, jnp.float32), eye], -1)  # [0 | I]
        end = run(*wide, *rest, segment_ids=seg, initial_state=start)[1]
        S_loc, M = end[..., :V], end[..., V:]  # (B, H, K, V), (B, H, K, K)
        S0 = jnp.zeros(shape, jnp.float32) if S0 is None else S0.astype(jnp.float32)
        S = scan_devices(M, S_loc, S0, seg, lambda M, S: jnp.einsum("bhkj,bhjv->bhkv", M, S))
        o, final = run(*seq, *rest, segment_ids=seg, initial_state=S)
        return o, last(final)

    return over_spans(local, seq, rest, segment_ids, initial_state)


def split_diagonal(run, seq: tuple, rest: tuple = (), *, decay, segment_ids=None, initial_state=None):
    """The op `run(*seq, *rest, segment_ids=, initial_state=) -> (o, end state)` over the whole sequence, split
    over the context axis, for a state with an elementwise transition: over a span, S_end = M ⊙ S_in + S_loc.
    seq: (B, T, ...) arrays split along time; rest: arrays every device holds whole; initial_state=None must
    be the zero state. decay(*seq, *rest) -> M, the span's transition were no document to start inside it (any
    shape that broadcasts against the state; `scan_devices` zeroes it where one does). Per device:
    the op from the zero state gives S_loc, `scan_devices` the state the span starts from, the op again from it
    the outputs and end state (the op twice at its own width). Returns (o, end state)."""

    def local(seq, rest, seg, S0):
        S_loc = run(*seq, *rest, segment_ids=seg, initial_state=None)[1]
        S0 = jnp.zeros_like(S_loc) if S0 is None else S0.astype(S_loc.dtype)
        S = scan_devices(decay(*seq, *rest), S_loc, S0, seg, lambda M, S: M * S)
        o, final = run(*seq, *rest, segment_ids=seg, initial_state=S)
        return o, last(final)

    return over_spans(local, seq, rest, segment_ids, initial_state)


def check_split(split: str, where: str):
    """Refuse a `split_queries` split that is not one of SPLITS, naming `where`."""
    if split not in SPLITS:
        raise ValueError(f"{where}: context_split={split!r}; expected one of {SPLITS}")


def gather_sequence(tree):
    """Inside a shard_map over the axis: every (B, T / n, ...) array of `tree` (None stays None)
    all-gathered along time, (B, T, ...) in sequence order on every device. Its transpose, in the
    gradient, is a reduce-scatter: each span gets the sum of every device's cotangents for it."""
    return jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True), tree)


def _zigzag(n: int, L: int):
    """The zigzag's routes for n spans of L tokens (module docstring): the halves' lengths (a, L - a)
    and, per half p, the ppermute pairs (owner o -> the device that runs chunk 2o + p) and the (n,)
    position where the chunk each device receives starts."""
    a = -(-L // 2)
    runs = lambda c: c if c < n else 2 * n - 1 - c  # the device that runs chunk c
    pairs, starts = [], []
    for p in (0, 1):
        pairs.append([(o, runs(2 * o + p)) for o in range(n)])
        start = np.zeros(n, np.int32)
        for o in range(n):
            start[runs(2 * o + p)] = o * L + p * a
        starts.append(start)
    return (a, L - a), pairs, starts


def split_queries(run, queries: tuple, keys: tuple, rest=(), *, split: str = "contiguous"):
    """The op `run(rows, whole, positions, rest) -> out` over the sequence split over the context axis,
    for an op whose queries read the keys of the whole sequence (module docstring). Per device: rows,
    the rows of its queries of `queries` ((B, T, ...) arrays); whole, `keys` ((B, T, ...) arrays or
    None) all-gathered; positions (T',) int32, the rows' positions in the sequence; rest, a tree of
    arrays every device holds whole. out: a tree of (B, T', ...) arrays, one row per query, returned
    as (B, T, ...) arrays split as the inputs. split: one of SPLITS (spans of one token run contiguous)."""
    check_split(split, "split_queries")

    def local(queries, keys, rest):
        n, i = jax.lax.axis_size(AXIS), _device()
        L = jax.tree.leaves(queries)[0].shape[1]
        whole = gather_sequence(keys)
        if split == "contiguous" or L < 2:
            return run(queries, whole, i * L + jnp.arange(L, dtype=jnp.int32), rest)
        sizes, pairs, starts = _zigzag(n, L)
        a = sizes[0]
        halves = (jax.tree.map(lambda x: x[:, :a], queries),
                  jax.tree.map(lambda x: jnp.pad(x[:, a:], [(0, 0), (0, a - sizes[1])] + [(0, 0)] * (x.ndim - 2)),
                               queries))  # (B, a, ...) each, the second padded
        rows = jax.tree.map(lambda *h: jnp.concatenate(h, axis=1),
                            *(jax.lax.ppermute(h, AXIS, pr) for h, pr in zip(halves, pairs)))  # (B, 2a, ...)
        t = jnp.arange(a, dtype=jnp.int32)
        positions = jnp.concatenate([jnp.asarray(st)[i] + jnp.minimum(t, m - 1) for st, m in zip(starts, sizes)])
        out = run(rows, whole, positions, rest)  # a padded row repeats its chunk's last position; dropped below
        back = [jax.lax.ppermute(jax.tree.map(lambda x: x[:, p * a:(p + 1) * a], out), AXIS,
                                 [(d, o) for o, d in pairs[p]]) for p in (0, 1)]
        return jax.tree.map(lambda x, y: jnp.concatenate([x, y[:, :sizes[1]]], axis=1), *back)

    f = _shard_map(local, in_specs=((SEQ,) * len(queries), (SEQ,) * len(keys), P()), out_specs=SEQ)
    return f(tuple(queries), tuple(keys), rest)
