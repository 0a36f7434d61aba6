"""Every op of kernels/ under jax_enable_x64 (researchers turn it on to check numerics), in every
XLA impl and mode: forward and gradient run, are finite, keep their dtypes and equal the same call
without x64, and nothing of theirs is float64 (with float32 inputs, x64 changes only the default dtype
of Python numbers and new arrays); and the Pallas kernels still lower to Triton and Mosaic TPU under
x64, and their traces (both families, forward and gradient) hold nothing 64-bit inside a kernel or
its index maps (a Python int meeting an int32 grid index, a loop counter of the default int type, a
float64 tile of constants).

The inputs are float32 in both runs, made by the op tests' helpers: B = 1, T = 21 (ragged against
every chunk: 8 in the XLA chunk forms, 16 and 32 in the kernels), H = 2, head dims 8 (padded to 16
by the GPU kernels), one packed row of documents (one of a single token) and an initial state.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import Band, attention
from kernels.delta_rule import delta_rule
from kernels.gdn2 import gdn2
from kernels.gla import gla
from kernels.linear_attention import linear_attention
from kernels.loglinear import loglinear_ssd
from kernels.mesa import mesa
from kernels.mlstm import mlstm
from kernels.retention import retention
from kernels.rglru import rglru
from kernels.selective_scan import selective_scan
from kernels.slstm import slstm
from kernels.ssd import ssd
from kernels.stickbreaking import stickbreaking
from kernels.ttt import ttt_linear
from kernels.wkv6 import wkv6
from kernels.wkv7 import wkv7
from tests.kernels import (
    test_attention_pallas,
    test_attention_pallas_tpu,
    test_delta_rule_pallas,
    test_delta_rule_pallas_tpu,
    test_gdn2,
    test_gla_pallas,
    test_gla_pallas_tpu,
    test_linear_attention,
    test_loglinear,
    test_mesa,
    test_mlstm,
    test_retention,
    test_rglru,
    test_selective_scan_pallas,
    test_selective_scan_pallas_tpu,
    test_slstm,
    test_ssd_pallas,
    test_stickbreaking,
    test_ttt,
    test_wkv6,
    test_wkv7,
    test_wkv7_pallas,
    test_wkv7_pallas_tpu,
)
from tests.kernels.test_gla_pallas_tpu import SEG
from tests.util import assert_close

B, T, H, K = 1, 21, 2, 8
CHUNK = 8  # chunk_size of the XLA chunk forms
OPS = {"attention": attention, "gla": gla, "retention": retention, "linear_attention": linear_attention,
       "delta_rule": delta_rule, "kda": delta_rule, "ssd": ssd, "selective_scan": selective_scan, "wkv6": wkv6,
       "wkv7": wkv7}  # kda: delta_rule with a gate per key channel

# The ops of the later kinds, whose signatures differ: (modes of impl="xla", their float inputs from the op
# tests' helpers, the call on those inputs with the packed row). Integer state (a count, a position in a
# mini-batch) is closed over, not differentiated.
_ttt_args, _ttt_state = test_ttt.inputs(B, T, H, K)
FRONTIER = {
    "gdn2": (("recurrent", "chunk", "parallel"),
             lambda: dict(zip("q k v g b w initial_state".split(), test_gdn2.inputs(B, T, H, K, K))),
             lambda x, **kw: gdn2(**x, segment_ids=SEG[:B], output_final_state=True, chunk_size=CHUNK, **kw)),
    "mesa": (("recurrent", "chunk", "parallel"), lambda: dict(zip("q k v g beta lamb H0 G0".split(),
                                                                 test_mesa.inputs(B, T, H, K, K))),
             lambda x, **kw: mesa(x["q"], x["k"], x["v"], x["g"], x["beta"], x["lamb"], cg_steps=3,
                                  initial_state=(x["H0"], x["G0"]), segment_ids=SEG[:B], output_final_state=True,
                                  chunk_size=CHUNK, **kw)),
    "mlstm": (("recurrent", "chunk", "parallel"),
              lambda: dict(zip("q k v i_pre f_pre initial_state".split(), test_mlstm.make_inputs(B, T, H, K, K))),
              lambda x, **kw: mlstm(**x, segment_ids=SEG[:B], output_final_state=True, chunk_size=CHUNK, **kw)),
    "rglru": (("recurrent", "parallel"), lambda: test_rglru.make_inputs(0, B, T, 2 * K),
              lambda x, **kw: rglru(**x, segment_ids=SEG[:B], output_final_state=True, **kw)),
    "loglinear": (("recurrent", "parallel"), lambda: test_loglinear.make_inputs(0, B, T, H, K, 1, K, 4),
                  lambda x, **kw: loglinear_ssd(**x, initial_count=jnp.array([5], jnp.int32), segment_ids=SEG[:B],
                                                output_final_state=True, **kw)[0]),
    "ttt": (("recurrent", "chunk"), lambda: {"args": _ttt_args, "state": _ttt_state[:4]},
            lambda x, **kw: ttt_linear(*x["args"], initial_state=(*x["state"], _ttt_state[4]), segment_ids=SEG[:B],
                                       output_final_state=True, **kw)),
    "slstm": ((None,), lambda: dict(zip(("x", "R", "b", "initial_state"), test_slstm.make_inputs(B, T, H, K))),
              lambda x, **kw: slstm(**x, segment_ids=SEG[:B], output_final_state=True, **kw)),
    "stickbreaking": ((None,), lambda: dict(zip("qkv", test_stickbreaking.inputs(B, T, T, H, 1, K, 0))),
                      lambda x, **kw: stickbreaking(**x, segment_ids=SEG[:B], **kw)),
}


@functools.cache
def _inputs(op):
    """The op's float inputs by name, float32, from the helpers of its own tests."""
    if op in FRONTIER:
        return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), FRONTIER[op][1]())
    if op == "attention":
        q, k, v, _ = test_attention_pallas._inputs(B, T, T, H, 1, K, K)  # both heads on one kv head
        x = {"q": q, "k": k, "v": v}
    elif op == "gla":
        q, k, v, g, S0, _, _ = test_gla_pallas._inputs(B, T, H, H, K, K, scalar=False)
        x = {"q": q, "k": k, "v": v, "g": g, "initial_state": S0}
    elif op in ("delta_rule", "kda"):  # kda: the delta rule with a gate per key channel
        gated = "channel" if op == "kda" else True
        q, k, v, beta, g, S0, _, _ = test_delta_rule_pallas._inputs(B, T, H, K, K, gated=gated)
        x = {"q": q, "k": k, "v": v, "beta": beta, "g": g, "initial_state": S0}
    elif op == "retention":
        x = dict(zip(("q", "k", "v", "gamma", "initial_state"), test_retention.make_inputs(B, T, H, K, K)))
    elif op == "linear_attention":
        x = dict(zip(("q", "k", "v", "initial_state"), test_linear_attention.make_inputs(B, T, H, K, K)))
    elif op == "ssd":
        x = dict(zip(test_ssd_pallas.NAMES, test_ssd_pallas._inputs(B, T, H, K, 1, K)[0]))
    elif op == "selective_scan":
        x = dict(zip(test_selective_scan_pallas.NAMES, test_selective_scan_pallas._inputs(B, T, 2 * K, K)[0]))
    else:
        x = (test_wkv6 if op == "wkv6" else test_wkv7).make_inputs(0, B, T, H, K, K)
    return {name: jnp.asarray(a, jnp.float32) for name, a in x.items()}


def _call(op, x, **kw):
    """The op on inputs x with the packed row of documents (and its initial state); its outputs."""
    if op in FRONTIER:
        outs = jax.tree.leaves(FRONTIER[op][2](x, **kw))
        return [o for o in outs if jnp.issubdtype(o.dtype, jnp.floating)]  # not a count or a position
    if op == "attention":
        band = Band(window=9, sinks=2, dilation=(1, 2))
        return (attention(x["q"], x["k"], x["v"], segment_ids=SEG[:B], band=band, **kw),)
    kw |= {"segment_ids": SEG[:B], "output_final_state": True, "chunk_size": CHUNK}
    if op in ("ssd", "selective_scan"):
        return OPS[op](x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], initial_state=x["h0"], **kw)
    return OPS[op](**x, **kw)


def _wide(jaxpr, kernel=False, refs=()):
    """The 64-bit values a jaxpr computes (and a Pallas kernel's 64-bit operands, `refs`): any inside
    a kernel or an index map, float64 ones outside. A Python number in flight (a weakly typed scalar,
    converted where it meets an array) counts only inside a kernel, where it is a loop counter or an
    index."""
    found = set()
    for v in list(refs) + [v for e in jaxpr.eqns for v in e.outvars]:
        aval = v.aval
        dt, in_flight = jnp.dtype(aval.dtype), aval.weak_type and aval.shape == ()
        if dt.itemsize == 8 and (kernel or (jnp.issubdtype(dt, jnp.floating) and not in_flight)):
            found.add(aval.str_short() + (" in a kernel" if kernel else ""))
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            subs = [e.params["jaxpr"]] + [m.index_map_jaxpr.jaxpr for m in e.params["grid_mapping"].block_mappings]
            for sub in subs:
                found |= _wide(sub, True, sub.invars)
            continue
        for p in jax.tree_util.tree_leaves(list(e.params.values()), is_leaf=lambda p: hasattr(p, "eqns")):
            sub = p if hasattr(p, "eqns") else getattr(p, "jaxpr", None)  # a Jaxpr or a ClosedJaxpr
            if hasattr(sub, "eqns"):
                found |= _wide(sub, kernel)
    return found


def _run(op, impl, mode, x, x64):
    """(outputs, gradients of their sum w.r.t. every input) of one call, traced and compiled once;
    and the 64-bit values of its jaxpr."""
    kw = {"impl": impl} if mode is None else {"impl": impl, "mode": mode}

    def loss(x):
        outs = _call(op, x, **kw)
        return sum(jnp.sum(o) for o in outs), outs

    with jax.enable_x64(x64):
        traced = jax.jit(jax.grad(loss, has_aux=True)).trace(x)
        grads, outs = _compile(traced.lower())(x)
    return (outs, grads), _wide(traced.jaxpr.jaxpr)


_COMPILED = {}


def _compile(lowered):
    """lowered.compile(), once per distinct program: on CPU impl="reference" runs the same program
    as mode="recurrent", impl="auto" the same as the default mode (the text holds every constant)."""
    text = lowered.as_text()
    if text not in _COMPILED:
        _COMPILED[text] = lowered.compile()
    return _COMPILED[text]


def check_under_x64(op, impl, mode=None):
    """The call under x64 computes nothing in 64 bits and equals the call without x64."""
    x = _inputs(op)
    got, wide = _run(op, impl, mode, x, x64=True)
    want, _ = _run(op, impl, mode, x, x64=False)
    assert not jax.config.jax_enable_x64
    assert not wide, f"64-bit values under x64: {sorted(wide)}"
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype == jnp.float32, name
        assert np.isfinite(np.asarray(a)).all(), f"{name} not finite"  # numpy: no eager compile per leaf shape
        assert_close(a, b, 1e-4, name)


def _cases():
    """(op, impl, mode) by name: "reference" and each mode of "xla" ("auto" is "xla" on CPU)."""
    modes = {"attention": (None,), "selective_scan": ("recurrent", "chunk", "parallel", "auto")}
    modes |= {op: spec[0] for op, spec in FRONTIER.items()}
    for op in [*OPS, *FRONTIER]:
        calls = [("reference", None)]
        calls += [("xla", mode) for mode in modes.get(op, ("recurrent", "chunk", "parallel"))]
        for impl, mode in calls:
            yield "-".join(filter(None, (op, impl, mode))), (op, impl, mode)


CASES = dict(_cases())


@pytest.mark.parametrize("case", CASES)
def test_op_under_x64_equals_op_without(case):
    check_under_x64(*CASES[case])


@pytest.mark.parametrize("family", ["gpu", "tpu"])
@pytest.mark.parametrize("op", OPS)
def test_kernels_trace_nothing_64_bit_under_x64(op, family, monkeypatch):
    """The forward and gradient of impl="pallas" with the kernels of `family` ("gpu" or "tpu"), traced
    under x64: nothing 64-bit inside a kernel or its index maps, nothing float64 outside, and the same
    output dtypes as without x64. Traced, not run: the kernels' values are the op tests' (in the
    interpreters on CPU), and x64 changes only the types a trace makes, which the jaxpr shows whole.
    ZOO_PALLAS_PLATFORM picks the family on CPU; a GPU or TPU traces its own kernels for both."""
    monkeypatch.setenv("ZOO_PALLAS_PLATFORM", family)  # read when the call is traced
    x = _inputs(op)

    def loss(x):
        outs = _call(op, x, impl="pallas")
        return sum(jnp.sum(o) for o in outs), outs

    traced = {}
    for x64 in (True, False):
        with jax.enable_x64(x64):
            traced[x64] = jax.jit(jax.grad(loss, has_aux=True)).trace(x)
    assert not jax.config.jax_enable_x64
    wide = _wide(traced[True].jaxpr.jaxpr)
    assert not wide, f"64-bit values under x64: {sorted(wide)}"
    got, want = (jax.tree.leaves(traced[x64].out_info) for x64 in (True, False))
    assert [a.dtype for a in got] == [b.dtype for b in want] and all(a.dtype == jnp.float32 for a in got)


# The lowering tests of the kernel files, run again under x64: each lowers the forward and backward
# kernels to Triton (CUDA) or Mosaic TPU at their default block sizes, where the interpreter's
# tolerance of 64-bit values is gone (Mosaic refuses them). Their inputs include arrays made without
# a dtype, float64 under x64 (the selective scan's A and D, initial states).
LOWERING = {
    "attention-gpu": test_attention_pallas.test_lowers_for_cuda_through_triton,
    "attention-tpu": test_attention_pallas_tpu.test_lowers_for_tpu_through_mosaic,
    "gla-gpu": test_gla_pallas.test_lowers_for_cuda_through_triton,
    "gla-tpu": test_gla_pallas_tpu.test_lowers_for_tpu_through_mosaic,
    "ssd-gpu": test_ssd_pallas.test_lowers_for_cuda_through_triton,
    "delta_rule-gpu": functools.partial(test_delta_rule_pallas.test_lowers_for_cuda_through_triton, True,
                                        jnp.bfloat16),
    "delta_rule-tpu": functools.partial(test_delta_rule_pallas_tpu.test_lowers_for_tpu_through_mosaic, True),
    "kda-gpu": functools.partial(test_delta_rule_pallas.test_lowers_for_cuda_through_triton, "channel", jnp.bfloat16),
    "kda-tpu": functools.partial(test_delta_rule_pallas_tpu.test_lowers_for_tpu_through_mosaic, "channel"),
    "selective_scan-gpu": test_selective_scan_pallas.test_lowers_for_cuda_through_triton,
    "selective_scan-tpu": test_selective_scan_pallas_tpu.test_lowers_for_tpu_through_mosaic,
    "wkv7-gpu": test_wkv7_pallas.test_lowers_for_cuda_through_triton,
    "wkv7-tpu": functools.partial(test_wkv7_pallas_tpu.test_lowers_to_mosaic_tpu, 64),
}


@pytest.mark.parametrize("kernel", LOWERING)
def test_kernels_lower_under_x64(kernel):
    with jax.enable_x64(True):
        LOWERING[kernel]()
    assert not jax.config.jax_enable_x64
