"""The zoo's ops against flash-linear-attention's naive references, from committed fixtures
(tests/fixtures/fla_ops/<op>.npz, made by tests/fixtures/fla_ops/make_fla_op_fixtures.py with torch 2.14.1 and
flash-linear-attention 0.6.0; no torch here). Each fixture holds fla's inputs (float32) and outputs (float64); the
zoo's token-by-token reference (float32), run on the float32 inputs, must agree to 1e-4 relative (max |ours - fla|
/ max |fla|) on every compared array, and one fast form too. What is mapped, per op:

Softmax-family attention. Both sides use the layout (B, T, heads, D) and the scale K^-1/2, so what is mapped is:

- deltaformer (fla.ops.deltaformer.naive.naive_deltaformer_attn vs kernels/deltaformer): fla's u stage scores
  each token's *query* against the earlier keys, u_i = v_i - β_i Σ_{j<i} softmax_j(q_i.k_j/√D) u_j, which is
  the zoo's write_key="query": `deltaformer(q, k, v, beta, w=q)`. β is passed as it is (fla's op takes β
  itself; the fixture draws it through the sigmoid the zoo's layer applies); kv heads = query heads, as fla's
  op requires. Compared: o.
- path_attn (fla.ops.path_attn.naive.naive_path_attn vs kernels/path): fla takes the per-step log forget gate
  g (B, T, HQ) and adds scale * (G_i - G_j), G = cumsum(g); the zoo's `decay` is that cumulative sum c, also
  multiplied by scale, so decay = cumsum(g, axis=1). w (unit length) and β in (0, 2) are passed as they are
  (H_t = I - β_t w_t w_t^T on both sides); GQA with 4 query heads over 2 kv heads, query head h reading kv
  head h // 2 on both sides. fla's naive ran with chunk_size 8 over T = 19. Compared: o.
- stickbreaking_attn (fla.ops.stickbreaking_attn.naive.naive_stickbreaking_attn vs kernels/stickbreaking):
  nothing to map: fla's default attend_current=False is the zoo's j < i, its `rem` the zoo's `r`; GQA as
  above. Compared: o and rem.

Recurrent (fla's gsa, comba and gdn2 naives compute in float32 whatever the inputs' dtype; log_linear_attn's in
float64):

- gsa (kernels/gsa, layers/gsa.py) vs naive_recurrent_gsa: same layout (B, T, H, .), same g = log alpha per slot
  and s passed apart (both layers tie s = 1 - exp(g), g = logsigmoid(.) / 8), same scale on q. fla keeps the slot
  keys K~ as (B, H, K, M), the zoo as (B, H, M, K): the initial K~ goes in transposed, the final one is compared
  transposed. Compared: o, K~_T, V~_T.
- comba (layers/deltanet2.py `Comba`, on kernels/delta_rule) vs naive_recurrent_comba: the fixture holds the raw
  q, k before the layer's last steps; here, as the zoo's Comba layer, q <- q - D sigmoid(d) k, then q and k are
  L2-normalised (layers.deltanet.normalize_qk, fla's eps) and the gated delta rule runs with beta and g (log
  alpha, one per head). fla's naive got p^ = l2norm(sigmoid(d) k) as its erase key, which is k^ (a positive scale
  cancels; the eps leaves ~1e-7): the claim the zoo's layer rests on. scale K^-1/2 both. Compared: o, S_T.
- gdn2 (kernels/gdn2, layers/deltanet2.py `GatedDeltaNet2`) vs naive_recurrent_gdn2: nothing to map (same
  layout, g log alpha per key channel, erase gate b per key channel, write gate w per value channel, scale
  K^-1/2, state (B, H, K, V)); q, k come unit length. Compared: o, S_T.
- log_linear_attn (kernels/loglinear `loglinear_ssd`, layers/loglinear.py `LogLinearMamba2`) vs
  naive_log_linear_attn: fla's op is fed as its layer feeds it, q = C, k = B, v = x dt, g = A dt, level_scales = λ,
  scale 1; the zoo's op takes x, dt, A, B, C, λ themselves (Mamba-2's convention, Δ inside the op), with D = None
  (fla adds D x outside its op) and no initial state (fla's naive takes none). G = 2 groups of 2 heads: fla's
  repeat_interleave and the zoo's heads_from_groups both give a group's B, C to consecutive heads. L = 6 =
  ceil(log2 19) + 1 levels, so no key is capped at the top level (the zoo's one named departure does not arise).
  Compared: y. fla's loglinear_gated_deltanet has no naive reference, so kernels/loglinear_gdn is not here.

MesaNet, TTT-Linear and AttnRes's depth read:

- mesa_net (fla.ops.mesa_net.naive.naive_mesa_net_CG, 30 CG steps, chunk 5, an initial state): kernels/mesa's
  reference with cg_steps=30 (fla's default count; both run CG from x = 0 with the same 1e-5 in both
  denominators). Same layout (B, T, H, K), g the log decay in both, lambda (H, K) in both, fla's
  (h_kk_init, h_kv_init) the zoo's initial_state (H_0, G_0). Compared: o, H_T (h_kk), G_T (h_kv); the chunk
  form's o too. fla's exact solve (naive_mesa_net_exact) is 5.7e-4 from fla's own 30 CG steps on these inputs
  (the 1e-5 in the denominators stalls CG near |r|^2 ~ 1e-5), so the zoo's o is held to it at 2e-3 only.
- ttt (fla.ops.ttt.naive.chunk_ttt_linear_ref, mini-batch 5, T = 15, an initial state): kernels/ttt's
  reference with its mini-batch 5. Mapped: q -> q K^-1/2 (fla scales q inside); fla's eta (B, T, H, 1), one
  factor per token, is drawn as a_{t mod 5} c, and the zoo takes scale = a (its per-position factor) and eta
  = c repeated over each mini-batch (fla's rate is a per-query factor, its state update uses the mini-batch's
  last eta; the zoo's is a_p times a per-token rate, the same function when the rate is constant within a
  mini-batch); fla's (h0, hb0) the zoo's initial_state (W_s, b_s, 0, 0, pos 0) (W0, b0 unused: no document
  starts); w, b the inner LayerNorm's (ln_w, ln_b). The output differs by design: fla's naive returns
  z + LN(z), z = q W_t + b_t, where the zoo returns q + LN(z) as the official TTT code does (ttt-lm-jax,
  ttt-lm-pytorch: XQW = XQ + LN(Z1_bar)), and no argument of the zoo's op changes its residual. So the test
  takes z from the zoo's own per-token states (its reference step: W_t = W_s - a_p G_t, b_t = b_s - a_p g_t)
  and compares o_zoo - q + z with fla's o, which checks the zoo's LN(z) and z both; and the final state
  (W, b) after the third mini-batch's end with fla's (h, hb) directly. The dual form's o is checked the same
  way.
- attnres (fla.ops.attnres.naive.naive_attnres, scale 1 as fla's layer): layers/residual.py's DepthAttention,
  its query fla's query and its key_norm weight fla's rms_weight (eps 1e-6 both). fla's o with
  output_rms_weight=None is the zoo's read; fla's layer fuses the sublayer's pre-norm into the read
  (output_rms_weight), which the zoo runs inside the sublayer: o_normed is compared with the zoo's RMSNorm
  (weight out_w) of the read.

Left out: titans. fla.ops.titans.naive (chunk_titans_linear_ref, and titans_linear, which it matches) is TTT's
inner loop with momentum and decay added, not the Titans memory the zoo's op (and the paper) computes: fla's
surprise step is -2 theta k^T v_new with v_new the LayerNorm backward of 1/2 |LN(k W_s) - (v - k)|^2 (a learned
LN weight and bias) where the zoo's is -2 theta k^T (k W_s - v), and fla's output is q M_t + LN(q M_t) where
the zoo's is q M_t. The zoo's layers/titans.py names it ("no LayerNorm + residual around the memory model");
the LN makes fla's gradient non-linear in k W_s, so no mapping of the inputs bridges the two (theta / K, the
layer's mean-over-channels loss, is outside the op and beside the point). fla's v_new is moreover not its
loss's gradient: with e = w (LN(k W_s) - (v - k)) it computes D e - (sum e + x_hat sum(e x_hat)) / (sigma D)
(an operator-precedence slip) where TTT's (fla's own ttt naive) has (D e - sum e - x_hat sum(e x_hat)) /
(sigma D).
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels.delta_rule import delta_rule
from kernels.deltaformer import deltaformer
from kernels.gdn2 import gdn2
from kernels.gsa import gsa
from kernels.loglinear import loglinear_ssd
from kernels.mesa import mesa
from kernels.path import path_attention
from kernels.stickbreaking import stickbreaking
from kernels.ttt import layer_norm, ttt_linear, ttt_linear_step
from layers.deltanet import normalize_qk
from layers.norm import RMSNorm
from layers.residual import DepthAttention
from tests.util import assert_close

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "fla_ops"


def load(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as f:
        return dict(f)


def check(ours, fla, what: str):
    """assert_close, the shapes equal first (its measure would broadcast a transposed state)."""
    assert np.shape(ours) == np.shape(fla), f"{what}: shape {np.shape(ours)} vs fla's {np.shape(fla)}"
    assert_close(ours, fla, what=what)


def forms(op, fast: str = "chunk", **kwargs) -> dict:
    """{mode: op jitted}: its token-by-token reference ("recurrent") and its fast form `fast`."""
    return {mode: jax.jit(functools.partial(op, mode=mode, impl="reference" if mode == "recurrent" else "auto",
                                            **kwargs)) for mode in ("recurrent", fast)}


# Softmax-family attention


def test_deltaformer_matches_fla():
    d = load("deltaformer")
    q, k, v, beta = (jnp.asarray(d[key]) for key in ("q", "k", "v", "beta"))
    run = jax.jit(lambda *a: [deltaformer(*a, w=a[0], impl=impl) for impl in ("reference", "xla")])
    for impl, o in zip(("reference", "xla"), run(q, k, v, beta)):
        assert_close(o, d["o"], 1e-4, f"deltaformer {impl}: o")


def test_path_attn_matches_fla():
    d = load("path_attn")
    q, k, v, w, beta = (jnp.asarray(d[key]) for key in ("q", "k", "v", "w", "beta"))
    c = jnp.cumsum(jnp.asarray(d["g"]), axis=1)  # fla's g_cumsum: the zoo's decay c
    run = jax.jit(lambda *a: [path_attention(*a, decay=c, impl=impl, chunk_size=8) for impl in ("reference", "xla")])
    for impl, o in zip(("reference", "xla"), run(q, k, v, w, beta)):
        assert_close(o, d["o"], 1e-4, f"path_attn {impl}: o")


def test_stickbreaking_attn_matches_fla():
    d = load("stickbreaking_attn")
    q, k, v = (jnp.asarray(d[key]) for key in ("q", "k", "v"))
    run = jax.jit(lambda *a: [stickbreaking(*a, impl=impl) for impl in ("reference", "xla")])
    for impl, (o, r) in zip(("reference", "xla"), run(q, k, v)):
        assert_close(o, d["o"], 1e-4, f"stickbreaking_attn {impl}: o")
        assert_close(r, d["rem"], 1e-4, f"stickbreaking_attn {impl}: rem")


# Recurrent


def test_gsa_matches_fla():
    f = load("gsa")
    q, k, v, s, g = (jnp.asarray(f[n]) for n in "qkvsg")
    init = (jnp.asarray(f["hk0"]).swapaxes(-1, -2), jnp.asarray(f["hv0"]))  # fla's K~ (K, M) -> the zoo's (M, K)
    for mode, run in forms(gsa, scale=float(f["scale"]), initial_state=init, output_final_state=True,
                           chunk_size=8).items():
        o, (Ks, Vs) = run(q, k, v, s, g)
        check(o, f["o"], f"gsa {mode} o")
        check(np.swapaxes(Ks, -1, -2), f["hk"], f"gsa {mode} K~")
        check(Vs, f["hv"], f"gsa {mode} V~")


def test_comba_matches_fla():
    f = load("comba")
    q, k, v, beta, g, S0 = (jnp.asarray(f[n]) for n in ("q", "k", "v", "beta", "g", "S0"))
    d, D = jnp.asarray(f["d"]), jnp.asarray(f["D"])
    q = q - D[:, None] * (jax.nn.sigmoid(d)[:, None] * k)  # the Comba layer's output correction, before the norms
    q, k = normalize_qk(q, "l2"), normalize_qk(k, "l2")
    for mode, run in forms(delta_rule, initial_state=S0, output_final_state=True, chunk_size=8).items():
        o, S = run(q, k, v, beta, g)
        check(o, f["o"], f"comba {mode} o")
        check(S, f["S"], f"comba {mode} S")


def test_gdn2_matches_fla():
    f = load("gdn2")
    args = [jnp.asarray(f[n]) for n in ("q", "k", "v", "g", "b", "w")]
    for mode, run in forms(gdn2, initial_state=jnp.asarray(f["S0"]), output_final_state=True, chunk_size=8).items():
        o, S = run(*args)
        check(o, f["o"], f"gdn2 {mode} o")
        check(S, f["S"], f"gdn2 {mode} S")


def test_log_linear_attn_matches_fla():
    f = load("log_linear_attn")
    args = [jnp.asarray(f[n]) for n in ("x", "dt", "A", "B", "C", "lam")]
    for mode, run in forms(loglinear_ssd, "parallel").items():
        y, _ = run(*args)
        check(y, f["y"], f"log_linear_attn {mode} y")


# MesaNet, TTT-Linear, AttnRes


def test_mesa_net_matches_fla():
    d = load("mesa_net")
    args = [jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta", "lamb")]
    S0 = (jnp.asarray(d["h_kk0"]), jnp.asarray(d["h_kv0"]))
    run = jax.jit(lambda mode, *a: mesa(*a, cg_steps=int(d["cg_steps"]), initial_state=S0, output_final_state=True,
                                        mode=mode, chunk_size=8), static_argnums=0)
    o, (Hs, Gs) = run("recurrent", *args)
    assert_close(o, d["o"], what="mesa o")
    assert_close(Hs, d["h_kk"], what="mesa H_T")
    assert_close(Gs, d["h_kv"], what="mesa G_T")
    assert_close(run("chunk", *args)[0], d["o"], what="mesa chunk-form o")
    # finitely many CG steps with the 1e-5 denominators: fla's own CG is 5.7e-4 from its exact solve here
    assert_close(o, d["o_exact"], 2e-3, what="mesa o vs fla's exact solve")


def test_ttt_matches_fla():
    d = load("ttt")
    B, T, H, K = d["q"].shape
    C = d["a"].shape[0]
    q = jnp.asarray(d["q"]) * K ** -0.5  # fla scales q by K^-1/2 inside
    k, v = jnp.asarray(d["k"]), jnp.asarray(d["v"])
    eta = jnp.repeat(jnp.asarray(d["c"]), C, axis=1)  # (B, T, H): fla's eta / a_p, constant per mini-batch
    scale, w, b = jnp.asarray(d["a"]), jnp.asarray(d["w"]), jnp.asarray(d["b"])
    W, bias = jnp.asarray(d["h0"]), jnp.asarray(d["hb0"])[:, :, 0]
    state = (W, bias, jnp.zeros_like(W), jnp.zeros_like(bias), jnp.zeros((B,), jnp.int32))
    start = (jnp.zeros((H, K, K)), jnp.zeros((H, K)))  # W0, b0: no document starts, never read
    run = jax.jit(lambda mode, *a: ttt_linear(*a, eta, *start, w, b, scale, initial_state=state,
                                              output_final_state=True, mode=mode), static_argnums=0)
    o, S = run("recurrent", q, k, v)

    def step(S, x):  # the zoo's reference step, to read z_t = q_t W_t + b_t off its state
        S_next = ttt_linear_step(S, *x, scale, w, b)[1]
        a = scale[S[4]][:, None, None]  # a_{p_t}
        W_t, b_t = S_next[0] - a[..., None] * S_next[2], S_next[1] - a * S_next[3]  # at p = C - 1: G = 0, W = W_t
        return S_next, jnp.einsum("bhi,bhij->bhj", x[0], W_t) + b_t

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, eta))  # time first
    z = jnp.moveaxis(jax.jit(lambda xs: jax.lax.scan(step, state, xs)[1])(xs), 0, 1)
    assert_close(o - q + z, d["o"], what="ttt o (q + LN(z) -> z + LN(z))")
    assert_close(z + layer_norm(z, w, b), d["o"], what="ttt z + LN(z) from the zoo's states")
    np.testing.assert_array_equal(S[4], 0)  # T = 3 C: the last mini-batch ended, W, b are its W_t, b_t
    assert_close(S[0], d["h"], what="ttt final W")
    assert_close(S[1], d["hb"][:, :, 0], what="ttt final b")
    assert_close(run("chunk", q, k, v)[0] - q + z, d["o"], what="ttt dual-form o")


def test_attnres_matches_fla():
    d = load("attnres")
    D = d["query"].shape[0]
    read = DepthAttention(D, eps=1e-6)
    read.query[...] = jnp.asarray(d["query"])
    read.key_norm.weight[...] = jnp.asarray(d["rms_w"])
    o = read(tuple(jnp.asarray(r) for r in d["residuals"]))
    assert_close(o, d["o"], what="attnres o")
    norm = RMSNorm(D, eps=1e-6)  # the sublayer's pre-norm, fused into fla's read as output_rms_weight
    norm.weight[...] = jnp.asarray(d["out_w"])
    assert_close(norm(o), d["o_normed"], what="attnres RMSNorm(o)")
