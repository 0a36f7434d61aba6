"""Forward and forward+backward time of every op's forms against sequence length, one table.

    python -m benchmarks.ops [--ops gla mamba ...] [--lengths 512 1024 2048 4096 8192]

B=1, H=4, head dim 64 (Mamba: Dm=256, N=16; SSD and Mamba-3: P=64, N=64; S4D: Dm=256, N=32 complex modes, the
paper's state size 64; long_conv, Hyena's long convolution: D=256), float32, jitted; each figure is the
minimum of 5 runs after a compile, the runs of all of an op's forms and lengths interleaved. fwd+bwd
is the gradient of sum(o) with respect to every floating input. A quadratic form ("parallel", or
long_conv's "masked", the dense Toeplitz it runs for packed documents) is skipped where its (T, T)
intermediates would not fit in memory ("-"). The ratio columns divide by the op's last form (chunk,
or fft for s4d and long_conv) in the same run; chunk_fwdbwd_vs_T/2 (fft_...) is that form's growth from
the previous (half) length, 2.0 when linear.
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, save_json, timeit
from kernels.delta_rule import delta_rule
from kernels.gla import gla
from kernels.linear_attention import linear_attention
from kernels.long_conv import long_conv
from kernels.mamba3 import mamba3
from kernels.retention import retention
from kernels.s4d import s4d
from kernels.selective_scan import selective_scan
from kernels.ssd import ssd
from kernels.wkv6 import wkv6
from kernels.wkv7 import wkv7

B, H, K = 1, 4, 64


def _n(key, *shape, scale=1.0):
    return scale * jax.random.normal(key, shape, jnp.float32)


def _qkv(key, T):
    q, k, v = (_n(kk, B, T, H, K) for kk in jax.random.split(key, 3))
    return q, k / K ** 0.5, v


def _inputs(op, T):
    key, sub = jax.random.split(jax.random.key(0))
    q, k, v = _qkv(key, T)
    if op == "linear_attention":
        return (jax.nn.elu(q) + 1, jax.nn.elu(k) + 1, v)
    if op == "retention":
        return (q, k, v, 1 - 2.0 ** (-5 - jnp.arange(H, dtype=jnp.float32)))
    if op == "gla":
        return (q, k, v, jax.nn.log_sigmoid(_n(sub, B, T, H, K) + 4) / 16)
    if op in ("deltanet", "gated_deltanet", "kda"):
        nq, nk = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
        beta = jax.nn.sigmoid(_n(sub, B, T, H))
        gate_shape = {"gated_deltanet": (B, T, H), "kda": (B, T, H, K)}.get(op)  # kda: one decay per key channel
        g = None if gate_shape is None else jax.nn.log_sigmoid(_n(jax.random.fold_in(sub, 1), *gate_shape) + 4)
        return (nq, nk, v, beta, g)
    if op == "wkv6":
        return (q, k, v, -jnp.exp(_n(sub, B, T, H, K) - 2), _n(jax.random.fold_in(sub, 1), H, K, scale=0.1))
    if op == "wkv7":
        kk = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        a = jax.nn.sigmoid(_n(sub, B, T, H, K))
        return (q, -jnp.exp(_n(jax.random.fold_in(sub, 1), B, T, H, K) - 2) * 0.6, k, v, -kk, kk * a)
    if op == "mamba":
        Dm, N = H * K, 16
        ks = jax.random.split(sub, 4)
        return (_n(ks[0], B, T, Dm), jax.nn.softplus(_n(ks[1], B, T, Dm) - 3),
                -jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.float32), (Dm, N)),
                _n(ks[2], B, T, N), _n(ks[3], B, T, N), jnp.ones((Dm,)))
    if op == "mamba2":
        ks = jax.random.split(sub, 4)
        return (_n(ks[0], B, T, H, K), jax.nn.softplus(_n(ks[1], B, T, H) - 3), -jnp.arange(1, H + 1.0),
                _n(ks[2], B, T, 1, 64), _n(ks[3], B, T, 1, 64), jnp.ones((H,)))
    if op == "mamba3":
        ks = jax.random.split(sub, 7)
        return (_n(ks[0], B, T, H, K), jax.nn.softplus(_n(ks[1], B, T, H) - 3), -jnp.exp(_n(ks[2], B, T, H, scale=0.5)),
                jax.nn.sigmoid(_n(ks[3], B, T, H)), _n(ks[4], B, T, H, 64), _n(ks[5], B, T, H, 64),
                jnp.pi * jnp.tanh(_n(ks[6], B, T, H, 32)), jnp.ones((H,)))
    if op == "s4d":
        Dm, N = H * K, 32
        ks = jax.random.split(sub, 3)
        A_imag = jnp.pi * jnp.broadcast_to(jnp.arange(N, dtype=jnp.float32), (Dm, N))  # S4D-Lin
        A = jax.lax.complex(jnp.full((Dm, N), -0.5), A_imag)
        C = jax.lax.complex(_n(ks[1], Dm, N), _n(ks[2], Dm, N)) * 0.5 ** 0.5
        dt = jnp.exp(jax.random.uniform(ks[0], (Dm,), jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
        return (_n(key, B, T, Dm), A, dt, C, jnp.ones((Dm,)))
    if op == "long_conv":
        t = jnp.arange(T, dtype=jnp.float32)[:, None]
        return (_n(key, B, T, H * K), _n(sub, T, H * K) * jnp.exp(-t / T * jnp.linspace(1, 10, H * K)))
    raise KeyError(op)


def _long_conv(u, k, *, mode):
    """long_conv under the benchmark's (o, state) = fn(..., mode=form): "masked" is its dense form."""
    return long_conv(u, k, impl="reference" if mode == "masked" else "xla"), None


OPS = {  # name -> (function, forms, longest T for the quadratic form)
    "linear_attention": (linear_attention, ("recurrent", "parallel", "chunk"), 8192),
    "retention": (retention, ("recurrent", "parallel", "chunk"), 8192),
    "gla": (gla, ("recurrent", "parallel", "chunk"), 512),
    "deltanet": (delta_rule, ("recurrent", "parallel", "chunk"), 2048),
    "gated_deltanet": (delta_rule, ("recurrent", "parallel", "chunk"), 2048),
    "kda": (delta_rule, ("recurrent", "parallel", "chunk"), 1024),
    "wkv6": (wkv6, ("recurrent", "parallel", "chunk"), 2048),
    "wkv7": (wkv7, ("recurrent", "parallel", "chunk"), 1024),
    "mamba": (selective_scan, ("recurrent", "parallel", "chunk"), 1 << 30),
    "mamba2": (ssd, ("recurrent", "parallel", "chunk"), 1024),
    "mamba3": (mamba3, ("recurrent", "parallel", "chunk"), 1024),
    "s4d": (s4d, ("recurrent", "fft"), 0),
    "long_conv": (_long_conv, ("masked", "fft"), 1024),
}
QUADRATIC = ("parallel", "masked")


def _jitted(fn, args, mode):
    """Jitted forward and forward+backward of one form, compiled, with their float inputs."""
    floats = [i for i, a in enumerate(args) if a is not None]

    def fwd(*xs):
        full = list(args)
        for i, x in zip(floats, xs):
            full[i] = x
        return fn(*full, mode=mode)[0]

    xs = [args[i] for i in floats]
    f = jax.jit(fwd)
    fb = jax.jit(jax.grad(lambda *xs: jnp.sum(fwd(*xs)), argnums=tuple(range(len(xs)))))
    for g in (f, fb):
        jax.block_until_ready(g(*xs))
    return f, fb, xs


def measure(op: str, lengths: list[int], repeats: int = 5) -> list[dict]:
    """One op's forms at every length, the runs interleaved and the minimum of `repeats` taken: on a
    shared machine other work only ever adds time, and interleaving exposes every form to it alike."""
    fn, forms, max_parallel = OPS[op]
    cases = {(T, form): _jitted(fn, _inputs(op, T), form)
             for T in lengths for form in forms if form not in QUADRATIC or T <= max_parallel}
    best = {key: [float("inf")] * 2 for key in cases}
    for _ in range(repeats):
        for key, (f, fb, xs) in cases.items():
            for i, g in enumerate((f, fb)):
                best[key][i] = min(best[key][i], timeit(g, *xs, repeats=1, warmup=False))
    rows = []
    for T in lengths:
        row = {"op": op, "T": T}
        for form in forms:
            f, fb = best.get((T, form), ("-", "-"))
            row[f"{form}_fwd_ms"], row[f"{form}_fwdbwd_ms"] = [x if x == "-" else round(1e3 * x, 2) for x in (f, fb)]
        base = forms[-1]  # chunk, or fft
        for form in forms[:-1]:
            if row[f"{form}_fwdbwd_ms"] != "-":
                row[f"{form}/{base}_fwdbwd"] = round(row[f"{form}_fwdbwd_ms"] / row[f"{base}_fwdbwd_ms"], 2)
        if rows and 2 * rows[-1]["T"] == T:  # linear in T would be 2.0
            row[f"{base}_fwdbwd_vs_T/2"] = round(row[f"{base}_fwdbwd_ms"] / rows[-1][f"{base}_fwdbwd_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    args = p.parse_args()
    rows = [row for op in args.ops for row in measure(op, args.lengths)]
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}, B={B}, H={H}, head dim {K}, float32")
    columns = ["op", "T"] + [c for c in rows[0] if c not in ("op", "T")]
    for c in sorted({c for r in rows for c in r} - set(columns)):
        columns.append(c)
    print_table(rows, columns)
    save_json("ops", rows)


if __name__ == "__main__":
    main()
