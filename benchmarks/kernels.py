"""Pallas kernels against the machine's ceilings and against the XLA / vendor forms, one table.

    python -m benchmarks.kernels [--kernels flash_attention] [--lengths 1024 2048 4096 8192 16384]

First the ceilings: a large bfloat16 matmul (TFLOP/s) and a large elementwise copy (GB/s read +
written). Then every entry of KERNELS: it checks its kernel against the reference (max relative
error of the output and of every gradient at the shortest length) and times forward and
forward+backward (jitted, median of 5 after a compile), printing TFLOP/s and % of the measured
matmul rate. A measurement that fails (out of memory, no cuDNN, ...) prints its error in its row
instead of stopping the run. On GPU it is sized to finish in under 5 minutes on one H200 (an
estimate: compiles dominate; not yet run on a GPU).

Without a GPU it is a smoke run: tiny shapes, the kernels in Pallas interpret mode, so the numbers
only show that the script works.

Adding a kernel (GLA chunk, selective scan, SSD, ...): write `bench_<name>(ceilings, smoke,
lengths) -> rows` that builds its inputs, calls `_check` once and `_time_pass` per (impl, T, pass),
and add it to KERNELS.
"""

import argparse
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import print_table, save_json, timeit
from kernels.attention import attention_reference, flash_attention

COLUMNS = ["kernel", "impl", "T", "pass", "ms", "TFLOP/s", "% matmul", "max rel err"]


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


def _time_pass(row: dict, fn, args, flops: float, ceil: Ceilings) -> dict:
    try:
        t = timeit(fn, *args, repeats=5)
    except Exception as e:  # noqa: BLE001 - one failed measurement must not end the run
        return {**row, "ms": f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"}
    tflops = flops / t / 1e12
    return {**row, "ms": f"{1e3 * t:.2f}", "TFLOP/s": f"{tflops:.3g}",
            "% matmul": f"{100 * tflops / ceil.matmul_tflops:.0f}"}


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
        for impl, f in impls.items():
            row = {"kernel": "flash_attention", "impl": impl, "T": T}
            if impl == "pallas" and n == 0:
                row["max rel err"] = f"{_check(f, attention_reference, (q, k, v), do):.1e}"
            rows.append(_time_pass({**row, "pass": "fwd"}, jax.jit(f), (q, k, v), flops, ceil))
            # The backward does 5 matmuls to the forward's 2: 3.5x the forward's FLOPs in all.
            rows.append(_time_pass({**row, "pass": "fwd+bwd"}, _with_grads(f, do), (q, k, v),
                                   3.5 * flops, ceil))
            for r in rows[-2:]:
                print("  ".join(f"{c}={r[c]}" for c in COLUMNS if c in r), flush=True)
    return rows


KERNELS = {"flash_attention": bench_flash_attention}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    args = p.parse_args()
    smoke = jax.default_backend() != "gpu"
    lengths = args.lengths or ([64, 128] if smoke else [1024, 2048, 4096, 8192, 16384])
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}"
          + (" (smoke run: no GPU, Pallas in interpret mode)" if smoke else ""))
    ceil = measure_ceilings(smoke)
    rows = [r for name in args.kernels for r in KERNELS[name](ceil, smoke, lengths)]
    print()
    print_table(rows, COLUMNS)
    save_json("kernels", [{**r, **dataclasses.asdict(ceil)} for r in rows])


if __name__ == "__main__":
    main()
