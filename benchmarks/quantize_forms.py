"""Which form of a quantized matrix product decodes fastest on this machine (layers/quant.py keeps it).

    python -m benchmarks.quantize_forms [--batches 1 8] [--repeats 7]

The decode-sized products of a d_model 512, 4-layer Transformer with a SwiGLU MLP (per layer 4 of
512x512 and 3 of 512x1376, 12.6M weights: 50 MB in float32, more than this CPU's 32 MB L3; 12.6 MB
in int8) run as a chain inside one jitted `lax.scan` of 32 steps, as a decode loop runs them; the
figure is ms per step, the best of --repeats runs interleaved across the forms. Forms:

    float32            x @ W
    int8 dequantize    x @ (Q * s)                         exact activations
    int8 scale after   (x @ Q) * s                         the scale outside the product
    int8 dot, 1 row    per-token int8 x, int8 x int8 -> int32 dot, scales after (W8A8)
    int8 dot           the same, a single row doubled to two (what layers/quant.py does on CPU)
    int4 dequantize    x @ (Q4 * s_group)                  groups of 32 rows
    int4 group dots    one int8 x int4 dot per group, group scales after
    int4 -> int8 dot   Q4 * s_group requantized to int8 per column (Quantized.as_int8), then the int8 dot

Why the figures are what they are (read from the compiled HLO): the weights are loop invariants, so
XLA hoists `Q * s` (and any other weight-only work) out of the loop and decodes on a float copy;
a one-row int8 dot becomes XLA's own matrix-vector loop on int32-widened weights, while from two
rows on XLA calls YNNPACK's int8 kernel, which reads the int8 weights as they are.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, save_json
from layers.quant import Quantized, absmax_quantize, dequantize_codes, quantize_rows

D, F, LAYERS, STEPS = 512, 1376, 4, 32
SHAPES = [(D, D)] * 4 + [(D, F), (D, F), (F, D)]  # wq, wk, wv, wo, w_gate, w_up, w_down


def int8_dot(x, q, s, double):
    xq, sx = quantize_rows(x)
    M = x.shape[0]
    if double and M == 1:
        xq = jnp.concatenate([xq, xq])
    acc = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc[:M].astype(jnp.float32) * sx * s[0]


def group_dots(x, q, s):
    G = s.shape[0]
    xq, sx = quantize_rows(x.reshape(x.shape[0], G, -1))  # (M, G, g) per token and group
    acc = jax.lax.dot_general(xq, q.reshape(G, -1, q.shape[-1]), (((2,), (1,)), ((1,), (0,))),
                              preferred_element_type=jnp.int32)  # (G, M, Out)
    return jnp.einsum("gmn,mg,gn->mn", acc.astype(jnp.float32), sx[..., 0], s.astype(jnp.float32))


FORMS = {  # name -> (bits, group size, product(x, codes, scale))
    "float32": (None, None, lambda x, w, _: x @ w),
    "int8 dequantize": ("int8", None, lambda x, q, s: x @ dequantize_codes(q, s)),
    "int8 scale after": ("int8", None, lambda x, q, s: (x @ q.astype(jnp.float32)) * s[0]),
    "int8 dot, 1 row": ("int8", None, lambda x, q, s: int8_dot(x, q, s, False)),
    "int8 dot": ("int8", None, lambda x, q, s: int8_dot(x, q, s, True)),
    "int4 dequantize": ("int4", 32, lambda x, q, s: x @ dequantize_codes(q, s)),
    "int4 group dots": ("int4", 32, group_dots),
    "int4 -> int8 dot": ("int4", 32, lambda x, q, s: int8_dot(x, *Quantized(q, s, q.shape).as_int8(), True)),
}


@functools.partial(jax.jit, static_argnums=0)
def chain(form, weights, x):
    """STEPS steps of LAYERS layers of the seven products, each step's output the next one's input."""
    product = FORMS[form][2]

    def step(x, _):
        for layer in weights:
            mm = lambda i, h: product(h, *layer[i])
            attn = sum(mm(i, x) for i in range(4))
            h = jax.nn.silu(mm(4, x)) * mm(5, x)
            x = jnp.tanh(x + 0.1 * attn + 0.1 * mm(6, h))
        return x, None

    return jax.lax.scan(step, x, None, length=STEPS)[0]


def weights_for(form):
    bits, group, _ = FORMS[form]
    key = jax.random.key(0)
    out = []
    for layer in range(LAYERS):
        ws = [jax.random.normal(jax.random.fold_in(key, 10 * layer + i), shape) * shape[0] ** -0.5
              for i, shape in enumerate(SHAPES)]
        out.append([(w, None) if bits is None else absmax_quantize(w, bits, group) for w in ws])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    weights = {f: weights_for(f) for f in FORMS}
    rows = []
    for B in args.batches:
        x = jax.random.normal(jax.random.key(1), (B, D))
        ref = chain("float32", weights["float32"], x)
        err = {f: float(jnp.abs(chain(f, weights[f], x) - ref).max()) for f in FORMS}  # also compiles
        best = {f: float("inf") for f in FORMS}
        for _ in range(args.repeats):
            for f in FORMS:
                t0 = time.perf_counter()
                jax.block_until_ready(chain(f, weights[f], x))
                best[f] = min(best[f], time.perf_counter() - t0)
        rows += [{"batch": B, "form": f, "ms_per_step": round(1000 * best[f] / STEPS, 3),
                  "vs_float32": round(best["float32"] / best[f], 2), "max_abs_err": round(err[f], 4)} for f in FORMS]
        print_table(rows[-len(FORMS):], ["batch", "form", "ms_per_step", "vs_float32", "max_abs_err"])
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}; {STEPS} steps of {LAYERS} layers, "
          f"best of {args.repeats}; max_abs_err: the final output against float32's (values in [-1, 1])")
    save_json("quantize_forms", rows)


if __name__ == "__main__":
    main()
