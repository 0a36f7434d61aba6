"""The RG-LRU of Hawk and Griffin (De et al., 2024), the gated diagonal linear recurrence

    log a_t = -c r_t softplus(-Λ),   h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t),   y_t = h_t

(reference.py for the symbols). Layout: channels, as the selective scan: x and the gates r_t (gate_a),
i_t (gate_x) (B, T, Dm), Λ (Dm,); the state h is (B, Dm) float32. The gates come in as they are (the
caller applies the sigmoids); everything after runs in float32.

Modes, both exact and computing the same function and final state:
- "recurrent": the token-by-token lax.scan (reference.py), T sequential steps of O(Dm);
- "parallel": lax.associative_scan over (decay, input) pairs (parallel.py), O(log T) depth.
There is no chunked form and no Pallas kernel (impl="pallas" is refused); impl: "reference" runs the scan
whatever the mode, "xla" and "auto" the mode's form.

Document starts: beyond the zoo's rule (kernels/__init__.py: the state restarts from zero at each change
of segment id), the RG-LRU also replaces the multiplier sqrt(1 - a_t²) by 1 at a document's first token,
as recurrentgemma does. Whether token 0 of the call begins a document is `first_starts` (B,): True drops
`initial_state` there and takes the multiplier 1; the default is True when initial_state is None (the call
begins the sequence) and False when a state is given (the call continues it).

Under a mesh whose context axis splits the call (kernels/context.py), the op runs split along time
(`context.split_diagonal`), each device's span in the mode's form: h decays by M = Π_t a_t = exp(Σ_t log a_t)
(B, Dm) over a span, 0 where its first token begins a document (the call's first, or one at a boundary).
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels import check_mode, check_no_pallas, context
from kernels.rglru.parallel import rglru_parallel
from kernels.rglru.reference import log_decay, rglru_recurrent, rglru_step
from kernels.segments import document_starts, entering_state

MODES = ("recurrent", "parallel")


def rglru(x: Float[Array, "B T Dm"], gate_a: Float[Array, "B T Dm"], gate_x: Float[Array, "B T Dm"],
          a_param: Float[Array, " Dm"], *, c: float = 8.0, segment_ids: Int[Array, "B T"] | None = None,
          initial_state: Float[Array, "B Dm"] | None = None, first_starts: Bool[Array, " B"] | None = None,
          output_final_state: bool = False, mode: str = "recurrent", impl: str = "auto"):
    """Returns (y (B, T, Dm) in x's dtype, final state (B, Dm) float32 or None). gate_a, gate_x: r_t, i_t in
    (0, 1); a_param: Λ, a = σ(Λ); c: the exponent's constant (8 in the paper)."""
    check_mode(mode, 1, "rglru", MODES)
    check_no_pallas(impl, "rglru")
    Bsz, T, Dm = x.shape
    if gate_a.shape != x.shape or gate_x.shape != x.shape or a_param.shape != (Dm,):
        raise ValueError(f"rglru: expected x, gate_a, gate_x (B, T, Dm), a_param (Dm,); got x {x.shape}, gate_a "
                         f"{gate_a.shape}, gate_x {gate_x.shape}, a_param {a_param.shape}")
    starts = jnp.zeros((Bsz, T), bool) if segment_ids is None else document_starts(segment_ids)
    first = jnp.full((Bsz,), initial_state is None) if first_starts is None else first_starts
    starts = starts.at[:, 0].set(first)
    if context.active(T):  # each span's first token begins a document where `starts` says so
        run = lambda x, r, i, starts, a, **kw: rglru(x, r, i, a, c=c, first_starts=starts[:, 0], mode=mode, impl=impl,
                                                     output_final_state=True, **kw)
        decay = lambda x, r, i, starts, a: jnp.where(starts[:, :1], 0.0, jnp.exp(jnp.sum(
            log_decay(r.astype(jnp.float32), a.astype(jnp.float32), float(c)), axis=1)))  # (B, Dm)
        y, h = context.split_diagonal(run, (x, gate_a, gate_x, starts), (a_param,), decay=decay,
                                      segment_ids=segment_ids, initial_state=initial_state)
        return y, (h if output_final_state else None)
    h0 = entering_state(initial_state, (Bsz, Dm))
    f32 = lambda a: a.astype(jnp.float32)
    form = rglru_recurrent if impl == "reference" or mode == "recurrent" else rglru_parallel
    y, h = form(f32(x), f32(gate_a), f32(gate_x), f32(a_param), float(c), starts, h0)
    return y.astype(x.dtype), (h if output_final_state else None)


__all__ = ["MODES", "rglru", "rglru_step"]
