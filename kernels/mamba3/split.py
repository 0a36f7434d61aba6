"""Mamba-3's op split along time over the context axis (kernels/context.py), exactly, SISO and MIMO alike.

Its carry is not one state linear in the state it starts from, so `context.split_recurrence` does not
apply: besides h, which is, it holds the angles Θ, which every token's rotation reads, and the previous
token's B̄ and x, the trapezoid's second tap. Per device, inside one shard_map over the axis:

1. the angles its span starts from: Θ_in(d + 1) = c(d + 1) (m(d) Θ_in(d) + Θ_loc(d)), Θ_loc the span's own
   sum of Δ θ since its last document start, m = 0 if one starts inside the span, else 1, and c = 0 where
   a document starts at the boundary (`context.scan_devices`, split_recurrence's exchange);
2. the second tap: each device's last B̄ = R(Θ_end) B and x (Θ_end = m Θ_in + Θ_loc, mod 2π), passed to
   the right (`context.from_left`);
3. h: the op over the span from h = 0 and the (Θ, B̄, x) above gives the span's own end state h_loc; the
   h it starts from only decays through it, by M = Π α = exp(Σ Δ A) per head (0 if a document starts
   inside), so h_in(d + 1) = c(d + 1) (M(d) h_in(d) + h_loc(d)), the same exchange;
4. the op again from the whole carry: the outputs, and on the last device the sequence's end carry.

It costs the op twice, as split_recurrence, but at the op's own width (h's transition is a scalar per
head, so no identity columns ride along), plus all-gathers of every device's h_loc (B, H, P, N), Θ_loc
(B, H, N/2) and M (B, H) and one ppermute of (B̄, x) per layer. The angles each device starts from are
sums of the spans' wrapped sums, equal to the single-device sum up to float32 rounding (as trapezoid.py's
own).
"""

import jax.numpy as jnp

from kernels import context
from kernels.mamba3.reference import Mamba3Carry, rotate, wrap_angle
from kernels.mamba3.trapezoid import cumulative_angle
from kernels.segments import document_starts


def mamba3_split(run, seq: tuple, rest: tuple, *, segment_ids, carry: Mamba3Carry):
    """The op run(*seq, *rest, segment_ids=, initial_state=) -> (y, end carry) over the whole sequence, split
    over the context axis (module docstring). seq: (x, dt, A, lam, B, C, theta), split along time; rest:
    what follows them (MIMO's x_proj, D), held whole; carry: the caller's, float32. Returns (y, end carry)."""

    def local(seq, rest, seg, carry):
        x, dt, A, _, B, _, theta = seq
        starts = jnp.zeros(x.shape[:2], bool) if seg is None else document_starts(seg)  # (B, T / n)
        span = cumulative_angle(dt[..., None] * theta, starts, jnp.zeros_like(carry.angle))[:, -1]  # (B, H, N/2)
        scale = lambda m, s: m * s
        angle = context.scan_devices(jnp.float32(1), span, carry.angle, seg, scale)  # (B, H, N/2): Θ_in
        through = 1.0 if seg is None else context.carried(seg)[:, None, None]  # the span's start reaches its end
        end = wrap_angle(through * angle + span)  # Θ at the span's last token
        b_end = rotate(B[:, -1], end[:, :, None] if B.ndim == 5 else end)  # (B, H, N); MIMO (B, H, Mr, N), one Θ
        b, x_prev = context.from_left((b_end, x[:, -1]), (carry.b, carry.x), seg)
        entering = Mamba3Carry(jnp.zeros_like(carry.h), angle, b, x_prev)
        h_loc = run(*seq, *rest, segment_ids=seg, initial_state=entering)[1].h  # (B, H, P, N)
        decay = jnp.exp(jnp.sum(dt * A, axis=1))[..., None, None]  # (B, H, 1, 1): M
        h = context.scan_devices(decay, h_loc, carry.h, seg, scale)
        y, final = run(*seq, *rest, segment_ids=seg, initial_state=entering._replace(h=h))
        return y, context.last(final)

    return context.over_spans(local, seq, rest, segment_ids, carry)
