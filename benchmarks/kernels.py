"""Pallas kernels against the machine's ceilings and against the XLA / vendor forms, one table.

    python -m benchmarks.kernels [--kernels flash_attention sinks_window gla delta_rule kda selective_scan wkv6 wkv7]
                                 [--lengths 1024 ...]

First the ceilings: a large bfloat16 matmul (TFLOP/s) and a large elementwise copy (GB/s read +
written). Then every entry of KERNELS: it checks its kernel against the reference (max relative
error of the output and of every gradient at the shortest length) and times forward and
forward+backward (jitted, median of 5 after a compile), printing TFLOP/s and % of the measured
matmul rate, or for memory-bound kernels (selective scan) GB/s of compulsory traffic and % of the
measured copy rate. A measurement that fails (out of memory, no cuDNN, ...) prints its error in
its row instead of stopping the run. On GPU it is sized to finish in under 5 minutes on one H200
(an estimate made for flash_attention alone, compiles dominating; the other entries are not
estimated; nothing here has run on a GPU yet). On a
TPU the same script times the TPU kernels (impl="pallas" picks them, kernels.pallas_platform()),
also not run yet.

Without a GPU or TPU it is a smoke run: tiny shapes, the kernels in Pallas interpret mode, so the
numbers only show that the script works (ZOO_PALLAS_PLATFORM=tpu smoke-runs the TPU kernels).

Adding a kernel (SSD, ...): write `bench_<name>(ceilings, smoke, lengths) -> rows` that builds its
inputs and calls `_passes` per (impl, T) (the reference check where given, then both passes), and add it to
KERNELS.
"""

import argparse
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import print_table, save_json, timeit
from kernels.attention import Band, attention, attention_reference
from kernels.delta_rule import delta_rule
from kernels.gla import gla
from kernels.selective_scan import selective_scan
from kernels.wkv6 import wkv6
from kernels.wkv7 import wkv7

COLUMNS = ["kernel", "impl", "T", "pass", "ms", "TFLOP/s", "% matmul", "GB/s", "% copy", "max rel err"]


@dataclasses.dataclass(frozen=True)
class Ceilings:
    matmul_tflops: float
    copy_gbs: float


def measure_ceilings(smoke: bool) -> Ceilings:
    n = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    t = timeit(jax.jit(lambda a, b: a @ b), a, a, repeats=10)
    x = jnp.ones((1 << (20 if smoke else 30),), jnp.bfloat16)  # 2 GiB on GPU
    t_copy = timeit(jax.jit(lambda x: x + 1), x, repeats=10)
    c = Ceilings(2 * n ** 3 / t / 1e12, 2 * x.nbytes / t_copy / 1e9)
    print(f"ceilings: bf16 matmul {n}^3 {c.matmul_tflops:.1f} TFLOP/s, copy {c.copy_gbs:.0f} GB/s")
    return c


def _with_grads(f, cotangent):
    """(q, k, v) -> (o, dq, dk, dv): the forward and its vjp in one jitted function."""
    def run(*args):
        o, vjp = jax.vjp(f, *args)
        return (o, *vjp(cotangent))
    return jax.jit(run)


def _check(fast, ref, args, cotangent) -> float:
    """Max over the output and each gradient of max|fast - ref| / max|ref|, ref in float32."""
    got = _with_grads(fast, cotangent)(*args)
    want = _with_grads(ref, cotangent.astype(jnp.float32))(*(a.astype(jnp.float32) for a in args))
    errs = [np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() /
            np.abs(np.asarray(b, np.float64)).max() for a, b in zip(got, want)]
    return float(max(errs))


def _time_pass(row: dict, fn, args, flops: float | None, ceil: Ceilings, nbytes: float | None = None) -> dict:
    """Times fn(*args); reports TFLOP/s for `flops` and GB/s for `nbytes` (either may be None)."""
    try:
        t = timeit(fn, *args, repeats=5)
    except Exception as e:  # noqa: BLE001 - one failed measurement must not end the run
        return {**row, "ms": f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"}
    row = {**row, "ms": f"{1e3 * t:.2f}"}
    if flops is not None:
        tflops = flops / t / 1e12
        row.update({"TFLOP/s": f"{tflops:.3g}", "% matmul": f"{100 * tflops / ceil.matmul_tflops:.0f}"})
    if nbytes is not None:
        gbs = nbytes / t / 1e9
        row.update({"GB/s": f"{gbs:.4g}", "% copy": f"{100 * gbs / ceil.copy_gbs:.0f}"})
    return row


def _passes(row: dict, f, args, cotangent, ceil: Ceilings, flops: float | None = None, bwd_times: float = 3.5,
            ref=None, nbytes: tuple | None = None) -> list[dict]:
    """The fwd and fwd+bwd rows of f(*args) (bwd_times the forward's FLOPs in all; nbytes the two passes'
    traffic), with the max relative error against `ref` where given; printed as they come."""
    if ref is not None:
        row = {**row, "max rel err": f"{_check(f, ref, args, cotangent):.1e}"}
    fwd_bytes, bwd_bytes = nbytes or (None, None)
    rows = [_time_pass({**row, "pass": "fwd"}, jax.jit(f), args, flops, ceil, fwd_bytes),
            _time_pass({**row, "pass": "fwd+bwd"}, _with_grads(f, cotangent), args,
                       None if flops is None else bwd_times * flops, ceil, bwd_bytes)]
    _print(rows)
    return rows


def _output(op, **kw):
    """A recurrent op's output alone (not its final state), called with `kw`."""
    return lambda *args: op(*args, **kw)[0]


def _print(rows):
    for r in rows:
        print("  ".join(f"{c}={r[c]}" for c in COLUMNS if c in r), flush=True)


def _vendor_attention(args):
    """jax.nn.dot_product_attention with cuDNN where it compiles here, else its default (XLA)."""
    for impl in ("cudnn", None):
        f = partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl)
        try:
            jax.jit(f).lower(*args).compile()
            return f"jax.nn[{impl or 'xla'}]", f
        except Exception:  # noqa: BLE001 - cuDNN absent or the shape unsupported: use the default
            continue
    raise RuntimeError("jax.nn.dot_product_attention does not compile")


flash_attention = partial(attention, impl="pallas")  # the GPU or TPU kernels, by kernels.pallas_platform()


def bench_flash_attention(ceil: Ceilings, smoke: bool, lengths: list[int]) -> list[dict]:
    """Causal MHA, bf16 (float32 in the smoke run), B=4, H=16, D=128, layout (B, T, H, D)."""
    B, H, D, dtype = (1, 2, 16, jnp.float32) if smoke else (4, 16, 128, jnp.bfloat16)
    max_ref_T = 4096  # the reference's (B, H, T, T) float32 scores: 16 GiB each at 8K
    rows, vendor = [], None
    for n, T in enumerate(lengths):
        keys = jax.random.split(jax.random.key(T), 4)
        q, k, v, do = (jax.random.normal(key, (B, T, H, D), dtype) for key in keys)
        impls = {"pallas": flash_attention}
        if T <= max_ref_T:
            impls["xla reference"] = attention_reference
        vendor = vendor or _vendor_attention((q, k, v))
        impls[vendor[0]] = vendor[1]
        flops = 4 * B * H * T * T * D / 2  # two (T, T, D) matmuls, half the blocks under causal
        for impl, f in impls.items():  # the backward does 5 matmuls to the forward's 2: 3.5x the FLOPs in all
            ref = attention_reference if impl == "pallas" and n == 0 else None
            rows += _passes({"kernel": "flash_attention", "impl": impl, "T": T}, f, (q, k, v), do, ceil, flops, ref=ref)
    return rows


def bench_sinks_window(ceil: Ceilings, smoke: bool, lengths: list[int]) -> list[dict]:
    """StreamingLLM's mask (4 sinks + a window of W = T / 8 keys), the same shapes as flash_attention:
    the Pallas kernels (key blocks outside the window skipped, the sink blocks visited) against the XLA
    blocked form and against the Pallas kernels' plain causal call (the work the skipping saves).
    TFLOP/s count the visible pairs only."""
    B, H, D, dtype = (1, 2, 16, jnp.float32) if smoke else (4, 16, 128, jnp.bfloat16)
    rows = []
    for n, T in enumerate(lengths):
        keys = jax.random.split(jax.random.key(T), 4)
        q, k, v, do = (jax.random.normal(key, (B, T, H, D), dtype) for key in keys)
        W, sinks = max(1, T // 8), 4
        band = partial(attention, band=Band(window=W, sinks=sinks))
        impls = {"pallas": partial(band, impl="pallas"), "xla": partial(band, impl="xla"),
                 "pallas causal (no mask)": flash_attention}
        pairs = sum(min(t + 1, W + sinks) for t in range(T))  # each query's visible keys
        flops = 4 * B * H * pairs * D
        for impl, f in impls.items():
            ref = partial(attention_reference, band=Band(window=W, sinks=sinks)) if impl == "pallas" and not n else None
            rows += _passes({"kernel": "flash_attention sinks+window", "impl": impl, "T": T}, f, (q, k, v), do, ceil,
                            flops, ref=ref)
    return rows


def bench_gla(ceil: Ceilings, smoke: bool, lengths: list[int]) -> list[dict]:
    """Gated linear attention, per-channel gates, bf16 (float32 in the smoke run), B=4, H=16,
    K=V=128: the Pallas kernels against the XLA chunk form and against causal flash attention of
    the same shape, forward and forward+backward (gradients w.r.t. q, k, v, g; and q, k, v)."""
    B, H, D, dtype = (1, 2, 16, jnp.float32) if smoke else (4, 16, 128, jnp.bfloat16)
    max_ref_T = 2048  # the reference scan's backward keeps every step's (B, H, K, V) state
    rows = []
    for n, T in enumerate(lengths):
        keys = jax.random.split(jax.random.key(T), 5)
        q, k, v, do = (jax.random.normal(key, (B, T, H, D), dtype) for key in keys[:4])
        g = jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, H, D), jnp.float32) + 4).astype(dtype)
        impls = {"pallas": _output(gla, impl="pallas"), "xla chunk": _output(gla, impl="xla", mode="chunk")}
        # State products: q S and k^T v, 2 K V FLOPs each per token and head (the intra-chunk terms
        # add O(C / K) to this); the backward does 5 such products to the forward's 2.
        flops = 4 * B * T * H * D * D
        ref = _output(gla, impl="reference") if n == 0 and T <= max_ref_T else None
        for impl, f in impls.items():
            rows += _passes({"kernel": "gla", "impl": impl, "T": T}, f, (q, k, v, g), do, ceil, flops, ref=ref)
        rows += _passes({"kernel": "gla", "impl": "flash attention (pallas)", "T": T}, flash_attention, (q, k, v), do,
                        ceil, 4 * B * H * T * T * D / 2)
    return rows


def bench_delta_rule(ceil: Ceilings, smoke: bool, lengths: list[int], channel: bool = False) -> list[dict]:
    """Gated delta rule (Gated DeltaNet's op; with `channel`, Kimi Delta Attention's gate per key
    channel), bf16 (float32 in the smoke run), B=4, H=16, K=V=128: the Pallas kernels against the
    XLA chunk form, forward and forward+backward (gradients w.r.t. q, k, v, beta, g)."""
    B, H, D, dtype = (1, 2, 16, jnp.float32) if smoke else (4, 16, 128, jnp.bfloat16)
    max_ref_T = 2048  # the reference scan's backward keeps every step's (B, H, K, V) state
    rows = []
    for n, T in enumerate(lengths):
        keys = jax.random.split(jax.random.key(T), 6)
        l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True))  # as the layers feed the op
        q, k = (l2(jax.random.normal(key, (B, T, H, D), jnp.float32)).astype(dtype) for key in keys[:2])
        v, do = (jax.random.normal(key, (B, T, H, D), dtype) for key in keys[2:4])
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H), jnp.float32)).astype(dtype)
        g_shape = (B, T, H, D) if channel else (B, T, H)
        g = jax.nn.log_sigmoid(jax.random.normal(keys[5], g_shape, jnp.float32) + 4).astype(dtype)
        args = (q, k, v, beta, g)
        impls = {"pallas": _output(delta_rule, impl="pallas"),
                 "xla chunk": _output(delta_rule, impl="xla", mode="chunk")}
        # State products: q S, W S and K^T U, 2 K V FLOPs each per token and head (the intra-chunk
        # terms add O(C / K)); the backward recomputes the states and does 6 more: 4x in all.
        flops = 6 * B * T * H * D * D
        ref = _output(delta_rule, impl="reference") if n == 0 and T <= max_ref_T else None
        for impl, f in impls.items():
            rows += _passes({"kernel": "kda" if channel else "delta_rule", "impl": impl, "T": T}, f, args, do, ceil,
                            flops, 4, ref)
    return rows


def bench_selective_scan(ceil: Ceilings, smoke: bool, lengths: list[int]) -> list[dict]:
    """Mamba-1 selective scan, x, Δ, B, C in bf16 (float32 in the smoke run), B=4, Dm=1536 (d_model
    768 expanded twice), N=16: the Pallas kernels against the XLA chunk form. The scan is
    memory-bound, so rows report GB/s of compulsory traffic (every input read once, every output
    written once; the saved chunk states and partial sums are not counted) against the copy rate."""
    Bsz, Dm, N, dtype = (1, 32, 16, jnp.float32) if smoke else (4, 1536, 16, jnp.bfloat16)
    size = jnp.dtype(dtype).itemsize
    rows = []
    for n, T in enumerate(lengths):
        keys = jax.random.split(jax.random.key(T), 6)
        x, dy = (jax.random.normal(key, (Bsz, T, Dm), dtype) for key in keys[:2])
        dt = jax.nn.softplus(jax.random.normal(keys[2], (Bsz, T, Dm), jnp.float32) - 2).astype(dtype)
        A = -jnp.exp(jax.random.normal(keys[3], (Dm, N), jnp.float32))
        B, C = (jax.random.normal(key, (Bsz, T, N), dtype) for key in keys[4:])
        D = jnp.ones((Dm,), jnp.float32)
        fwd_bytes = size * Bsz * T * (3 * Dm + 2 * N)  # x, Δ, B, C read; y written
        bwd_bytes = size * Bsz * T * (5 * Dm + 4 * N)  # x, Δ, B, C, dy read; dx, dΔ, dB, dC written
        ref = _output(selective_scan, impl="reference") if n == 0 else None
        for impl, kw in (("pallas", dict(impl="pallas")), ("xla chunk", dict(impl="xla", mode="chunk"))):
            rows += _passes({"kernel": "selective_scan", "impl": impl, "T": T}, _output(selective_scan, **kw),
                            (x, dt, A, B, C, D), dy, ceil, ref=ref, nbytes=(fwd_bytes, fwd_bytes + bwd_bytes))
    return rows


def bench_wkv6(ceil: Ceilings, smoke: bool, lengths: list[int]) -> list[dict]:
    """RWKV-6's WKV6, bf16 (float32 in the smoke run), B=4, H=16, K=V=128: the GLA Pallas kernels on
    shifted inputs against the XLA chunk form, forward and forward+backward (gradients w.r.t. r, k, v,
    log w, u)."""
    B, H, D, dtype = (1, 2, 16, jnp.float32) if smoke else (4, 16, 128, jnp.bfloat16)
    max_ref_T = 2048  # the reference scan's backward keeps every step's (B, H, K, V) state
    rows = []
    for n, T in enumerate(lengths):
        keys = jax.random.split(jax.random.key(T), 6)
        r, k, v, do = (jax.random.normal(key, (B, T, H, D), dtype) for key in keys[:4])
        log_w = (-jnp.exp(jax.random.normal(keys[4], (B, T, H, D), jnp.float32) - 2)).astype(dtype)
        u = 0.1 * jax.random.normal(keys[5], (H, D), jnp.float32)
        args = (r, k, v, log_w, u)
        impls = {"pallas": _output(wkv6, impl="pallas"), "xla chunk": _output(wkv6, impl="xla", mode="chunk")}
        flops = 4 * B * T * H * D * D  # as GLA: r S and k^T v per token and head
        ref = _output(wkv6, impl="reference") if n == 0 and T <= max_ref_T else None
        for impl, f in impls.items():
            rows += _passes({"kernel": "wkv6", "impl": impl, "T": T}, f, args, do, ceil, flops, ref=ref)
    return rows


def bench_wkv7(ceil: Ceilings, smoke: bool, lengths: list[int]) -> list[dict]:
    """RWKV-7's WKV7, bf16 (float32 in the smoke run), B=4, H=16, K=V=64 (RWKV-7's head size): the
    Pallas kernels against the XLA chunk form, forward and forward+backward (gradients w.r.t. r,
    w_log, k, v, a, b), on inputs shaped like the layer's (a = -kappa^, b = kappa^ * a_icl)."""
    B, H, D, dtype = (1, 2, 16, jnp.float32) if smoke else (4, 16, 64, jnp.bfloat16)
    max_ref_T = 2048  # the reference scan's backward keeps every step's (B, H, K, V) state
    rows = []
    for n, T in enumerate(lengths):
        keys = jax.random.split(jax.random.key(T), 7)
        r, k, v, do = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in keys[:4])
        kappa = jax.random.normal(keys[4], (B, T, H, D), jnp.float32)
        kappa = kappa * jax.lax.rsqrt(jnp.sum(kappa * kappa, axis=-1, keepdims=True))
        icl = jax.nn.sigmoid(jax.random.normal(keys[5], (B, T, H, D), jnp.float32))
        w_log = -np.exp(-0.5) * jax.nn.sigmoid(jax.random.normal(keys[6], (B, T, H, D), jnp.float32))
        args = tuple(x.astype(dtype) for x in (r, w_log, 0.5 * k, v, -kappa, kappa * icl))
        do = do.astype(dtype)
        impls = {"pallas": _output(wkv7, impl="pallas"), "xla chunk": _output(wkv7, impl="xla", mode="chunk")}
        # State products: r S, W S, K^T V and B^T SA, 2 K V FLOPs each per token and head (the
        # intra-chunk terms add O(C / K)); the backward recomputes the states and does about 3x more.
        flops = 8 * B * T * H * D * D
        ref = _output(wkv7, impl="reference") if n == 0 and T <= max_ref_T else None
        for impl, f in impls.items():
            rows += _passes({"kernel": "wkv7", "impl": impl, "T": T}, f, args, do, ceil, flops, 4, ref)
    return rows


KERNELS = {"flash_attention": bench_flash_attention, "sinks_window": bench_sinks_window, "gla": bench_gla,
           "delta_rule": bench_delta_rule, "kda": partial(bench_delta_rule, channel=True),
           "selective_scan": bench_selective_scan, "wkv6": bench_wkv6, "wkv7": bench_wkv7}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    args = p.parse_args()
    smoke = jax.default_backend() not in ("gpu", "tpu")
    lengths = args.lengths or ([64, 128] if smoke else [1024, 2048, 4096, 8192, 16384])
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}"
          + (" (smoke run: no GPU or TPU, Pallas in interpret mode)" if smoke else ""))
    ceil = measure_ceilings(smoke)
    rows = [r for name in args.kernels for r in KERNELS[name](ceil, smoke, lengths)]
    print()
    print_table(rows, COLUMNS)
    save_json("kernels", [{**r, **dataclasses.asdict(ceil)} for r in rows])


if __name__ == "__main__":
    main()
