"""The TPU kernels on two TensorCores: in the TPU interpreter with 2 simulated cores, which split the
"parallel" grid axes between them, and its happens-before race detector on, the forward and backward
of every kernel run without a data race (two cores writing, or one writing what the other reads, the
same block). This is what the dimension semantics promise a megacore TPU (v4, v5p); a kernel that
accumulated across a "parallel" axis would fail here. The values are checked by the other tests.
"""

import functools
import threading

import jax
import jax.numpy as jnp
import pytest
from jax._src import core as jax_core
from jax._src.pallas.mosaic.interpret import interpret_pallas_call, thread_map
from jax._src.pallas.mosaic.interpret.race_detection_state import RaceDetectionState
from jax.experimental.pallas import tpu as pltpu

from kernels.attention import Band
from kernels.attention.pallas_tpu import BlockSizes as AttentionBlocks
from kernels.attention.pallas_tpu import flash_attention_tpu
from kernels.delta_rule.pallas_tpu import BlockSizes as DeltaBlocks
from kernels.delta_rule.pallas_tpu import delta_rule_pallas_tpu
from kernels.gla.pallas_tpu import BlockSizes as GLABlocks
from kernels.gla.pallas_tpu import gla_pallas_tpu
from kernels.selective_scan.pallas_tpu import BlockSizes as ScanBlocks
from kernels.selective_scan.pallas_tpu import selective_scan_pallas_tpu
from kernels.wkv7.pallas_tpu import BlockSizes as WKV7Blocks
from kernels.wkv7.pallas_tpu import wkv7_pallas_tpu

B, T, H, K, Dm, N = 2, 13, 2, 16, 16, 8  # T = 13: two 8-token chunks, the last ragged
SEG = jnp.array([[0] * 5 + [1] + [2] * 7, [0] * 9 + [1] * 4], jnp.int32)  # a one-token document


def _x(i, *shape):
    return jax.random.normal(jax.random.key(i), shape)


def _cases():
    q, k, v, S0 = _x(0, B, T, H, K), _x(1, B, T, H, K), _x(2, B, T, H, K), _x(5, B, H, K, K)
    g, beta = -jax.nn.softplus(_x(3, B, T, H, K)), jax.nn.sigmoid(_x(4, B, T, H))
    kn = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    starts = (SEG != jnp.pad(SEG[:, :-1], ((0, 0), (1, 0)))).at[:, 0].set(False)
    scan = (_x(6, B, T, Dm), jax.nn.softplus(_x(7, B, T, Dm)), -jnp.exp(_x(8, Dm, N)), _x(9, B, T, N),
            _x(10, B, T, N), _x(11, Dm), _x(12, B, Dm, N))
    gla = lambda blocks: lambda *a: gla_pallas_tpu(*a[:4], segment_ids=SEG, initial_state=a[4], block_sizes=blocks,
                                                   interpret=True)
    return {  # kernel, its positional arguments (all differentiated)
        "attention": (lambda *a: flash_attention_tpu(*a, segment_ids=SEG, band=Band(window=9),
                                                     block_sizes=AttentionBlocks(*[8] * 6), interpret=True),
                      (q, k[:, :, :1], v[:, :, :1])),  # both query heads on one kv head
        "gla": (gla(GLABlocks(16, 8, 8)), (q, k, v, g, S0)),
        "gla_scalar": (gla(GLABlocks(8, 8, 8)), (q, k, v, g[..., 0], S0)),
        "delta_rule": (lambda *a: delta_rule_pallas_tpu(*a[:5], scale=0.25, segment_ids=SEG, initial_state=a[5],
                                                        block_sizes=DeltaBlocks(8), interpret=True),
                       (q, kn, v, beta, g[..., 0], S0)),
        "selective_scan": (lambda *a: selective_scan_pallas_tpu(*a[:6], starts, a[6], block_sizes=ScanBlocks(8, 8),
                                                                interpret=True), scan),
        "wkv7": (lambda *a: wkv7_pallas_tpu(*a[:6], segment_ids=SEG, initial_state=a[6], block_sizes=WKV7Blocks(8),
                                            interpret=True), (q, g, k, v, -kn, kn * beta[..., None], S0)),
    }


def _compiled_once():
    """thread_map._run_jaxpr (one simulated core's share of a kernel call), compiling each core program
    once: the interpreter traces, lowers and compiles it anew in each core's thread on every call (a
    fresh jit per call), the same program twice. Both cores run the one executable, with their own
    core id, exactly as before."""
    executables, lock = {}, threading.Lock()

    def run_jaxpr(jaxpr, consts, *args):
        with lock:
            if jaxpr not in executables:  # the callback's own Jaxpr object: both cores get the same one
                def run(consts, *args):
                    jax_core.eval_jaxpr(jaxpr, consts, *args)

                executables[jaxpr] = jax.jit(run).trace(consts, *args).lower().compile()
        executables[jaxpr](consts, *args)

    return run_jaxpr


@pytest.mark.parametrize("kernel", ["attention", "gla", "gla_scalar", "delta_rule", "selective_scan", "wkv7"])
def test_no_races_on_two_cores(kernel, monkeypatch):
    monkeypatch.setattr(pltpu, "InterpretParams",
                        functools.partial(pltpu.InterpretParams, detect_races=True, num_cores_or_threads=2))
    detectors = []  # the interpreter makes one per kernel call: keep them all

    def recording(*args, **kwargs):
        detectors.append(RaceDetectionState(*args, **kwargs))
        return detectors[-1]

    monkeypatch.setattr(interpret_pallas_call, "RaceDetectionState", recording)
    monkeypatch.setattr(thread_map, "_run_jaxpr", _compiled_once())
    f, args = _cases()[kernel]
    loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(f(*a)))
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args))
    assert len(detectors) >= 2, f"{kernel}: the race detector saw {len(detectors)} kernel calls"
    assert not any(d.races_found for d in detectors), f"{kernel}: a data race between the two cores"
