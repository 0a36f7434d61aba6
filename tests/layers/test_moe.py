import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels import grouped
from layers.mlp import MLP
from layers.moe import DISPATCHES, MoE, RouterBias, default_expert_dim, expert_capacity, total_aux_loss
from tests.util import NEEDS_CXX, assert_close, assert_tree_close, randn

# flax 0.12.8 deprecates sow outside nnx.capture; the layer documents both ways of collecting.
pytestmark = pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")

D, E, F = 16, 4, 8
X, R = randn(0, (2, 8, D)), randn(1, (2, 8, D))  # one shape for most tests: eager ops compile once


def moe(**kw):
    kw = {"num_experts": E, "hidden_dim": F, **kw}
    return MoE(D, rngs=nnx.Rngs(kw.pop("seed", 0)), **kw)


def metrics(model):
    """The dict the model's last eager call sowed (and clear the collection)."""
    return nnx.pop(model, nnx.Intermediate)["moe"].get_value()[-1]


def expert_outputs(m, xf):
    """Every expert on every token, (N, E, D), straight from the SwiGLU definition."""
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", xf, m.w_gate[...])) * jnp.einsum("nd,edf->nef", xf, m.w_up[...])
    return jnp.einsum("nef,efd->ned", h, m.w_down[...])


def run(models, x, r=None):
    """Outputs, sown metrics (None in eval mode) and, given r, d sum(y * r) / d params of several
    layers under ONE jit (one compile). Bias/RNG updates are not written back."""
    graphdef, params, rest = nnx.split(nnx.List(models), nnx.Param, ...)

    def loss(params):
        ms = nnx.merge(graphdef, params, rest, copy=True)
        ys = [m(x) for m in ms]
        total = 0.0 if r is None else sum(jnp.sum(y.astype(jnp.float32) * r) for y in ys)
        return total, (ys, nnx.pop(ms, nnx.Intermediate))

    if r is None:
        (_, (ys, sown)), grads = jax.jit(loss)(params), None
    else:
        (_, (ys, sown)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    sown = [sown[i]["moe"].get_value()[-1] if i in sown else None for i in range(len(models))]
    return ys, sown, grads and [grads[i] for i in range(len(models))]


def test_identical_experts_equal_the_dense_mlp():
    mlp = MLP(D, hidden_dim=F, rngs=nnx.Rngs(1))
    names, models, scales = [], [], []
    for order in ("softmax_then_topk", "topk_then_softmax"):
        for dispatch in ("capacity", "dropless"):
            for renormalize in (True, False):
                m = moe(score_order=order, dispatch=dispatch, renormalize=renormalize, capacity_factor=E)
                for w in ("w_gate", "w_up", "w_down"):
                    getattr(m, w)[...] = jnp.broadcast_to(getattr(mlp, w)[...], getattr(m, w).shape)
                m.eval()
                scale = jnp.ones((2, 8, 1))  # gates of the chosen experts sum to 1 ...
                if order == "softmax_then_topk" and not renormalize:  # ... or to the chosen probabilities
                    p = jax.nn.softmax(X.reshape(-1, D) @ m.w_router[...], axis=-1)
                    scale = jnp.sum(jax.lax.top_k(p, 2)[0], -1).reshape(2, 8, 1)
                    assert float(jnp.max(scale)) < 0.99
                names.append(f"{order} {dispatch} renormalize={renormalize}")
                models.append(m)
                scales.append(scale)
    ys, sown, _ = run(models, X)
    assert sown == [None] * len(models)  # eval mode sows nothing
    dense = mlp(X)
    for name, y, scale in zip(names, ys, scales):
        assert_close(y, scale * dense, 1e-5, name)


def test_training_dispatch_of_identical_experts_is_the_dense_mlp_input_gradient_too():
    """In training (capacity dropping nothing, dropless; the grouped kernels on CPU), identical experts with
    renormalised gates are the dense MLP, and so is the gradient w.r.t. the input: each token's k copies summed
    back from their groups."""
    mlp = MLP(D, hidden_dim=F, rngs=nnx.Rngs(1))
    want_y, want_dx = jax.value_and_grad(lambda x: jnp.sum(mlp(x) * R))(X)
    for dispatch in DISPATCHES:
        m = moe(dispatch=dispatch, capacity_factor=E)
        for w in ("w_gate", "w_up", "w_down"):
            getattr(m, w)[...] = jnp.broadcast_to(getattr(mlp, w)[...], getattr(m, w).shape)
        graphdef, state = nnx.split(m)
        y, dx = jax.jit(jax.value_and_grad(lambda x: jnp.sum(nnx.merge(graphdef, state, copy=True)(x) * R)))(X)
        assert_close(y, want_y, 1e-5, dispatch)
        assert_close(dx, want_dx, 1e-5, f"{dispatch} d/dx")


def test_relu2_experts_equal_the_dense_relu2_mlp():
    """activation relu2 (Nemotron-H's experts): no w_gate; identical experts and a shared expert of the same
    weights give twice the dense relu2 MLP (the gates sum to 1), in training through either dispatch."""
    mlp = MLP(D, hidden_dim=F, activation="relu2", rngs=nnx.Rngs(1))
    models = [moe(activation="relu2", dispatch=d, capacity_factor=E, num_shared_experts=1) for d in DISPATCHES]
    for m in models:
        assert m.w_gate is None and m.shared.w_gate is None
        for w in ("w_up", "w_down"):
            getattr(m, w)[...] = jnp.broadcast_to(getattr(mlp, w)[...], getattr(m, w).shape)
            getattr(m.shared, w)[...] = getattr(mlp, w)[...]
    ys, sown, _ = run(models, X)
    for y, s in zip(ys, sown):
        assert s["dropped_fraction"] == 0
        assert_close(y, 2 * mlp(X), 1e-5, "relu2 experts")


def test_dropless_equals_capacity_when_nothing_is_dropped():
    deepseek = dict(scoring="sigmoid", num_groups=2, top_groups=1, routed_scale=2.0, balance="bias")
    models = [moe(router=rt, top_k=k, dispatch=d, capacity_factor=E / k, **kw)
              for rt, k, kw in (("topk", 2, {}), ("switch", 1, {}), ("topk", 2, deepseek)) for d in DISPATCHES]
    ys, sown, grads = run(models, X, R)
    for i in (0, 2, 4):
        assert sown[i]["dropped_fraction"] == 0
        assert_close(ys[i], ys[i + 1], 1e-5, "outputs")
        assert_tree_close(grads[i], grads[i + 1], 1e-5, "grads")


@NEEDS_CXX
def test_xla_forms_equal_the_grouped_kernels(monkeypatch):
    """On CPU both dispatches run kernels/grouped's products; their XLA forms (other backends, other dtypes: dropless
    tiled, capacity in (E, C, D) buffers) give the same outputs and gradients: 320 assignments over 4 experts,
    groups longer than the 64-row tile, an expert that no token chooses (its selection bias -1e9), and capacities
    that drop a tenth and a half of the assignments."""
    models = [moe(dispatch=d, balance="bias", capacity_factor=cf, seed=s)
              for d, cf, s in (("dropless", 1, 0), ("dropless", 1, 1), ("capacity", 0.9, 2), ("capacity", 0.5, 0))]
    for i in (0, 3):
        models[i].bias.value = jnp.array([0.0, 0.0, 0.0, -1e9])
    x, r = randn(2, (4, 40, D)), randn(3, (4, 40, D))
    assert grouped.supports(x, models[0].w_up[...])
    with_kernels = run(models, x, r)
    assert 0.05 < with_kernels[1][2]["dropped_fraction"] < 0.2 and with_kernels[1][3]["dropped_fraction"] > 0.4
    monkeypatch.setattr(grouped, "supports", lambda *_: False)
    xla = run(models, x, r)
    for i in range(4):
        assert_close(with_kernels[0][i], xla[0][i], 1e-5, "outputs")
        assert_tree_close(with_kernels[2][i], xla[2][i], 1e-5, "grads")


def test_small_capacity_drops_exactly_the_overflow_in_queue_order():
    B, T, k, cf = 2, 8, 2, 0.5
    N = B * T
    m = moe(top_k=k, capacity_factor=cf, seed=3)
    C = expert_capacity(N, E, k, cf)
    assert C == math.ceil(cf * N * k / E) == 4
    ys, (sown,), _ = run([m], X)
    y, xf = ys[0].reshape(N, D), X.reshape(N, D)
    p = jax.nn.softmax(xf @ m.w_router[...], axis=-1)
    gates, experts = jax.lax.top_k(p, k)
    gates = np.asarray(gates / gates.sum(-1, keepdims=True))
    experts = np.asarray(experts)
    kept, used = np.zeros((N, k), bool), np.zeros(E, int)
    for j in range(k):  # all first choices in flattened (b, t) order, then all second choices
        for n in range(N):
            e = experts[n, j]
            kept[n, j], used[e] = used[e] < C, used[e] + 1
    want = np.einsum("nk,nkd->nd", gates * kept, np.take_along_axis(
        np.asarray(expert_outputs(m, xf)), experts[:, :, None], axis=1))
    assert_close(y, want, 1e-5, "capacity output")
    assert 0 < (~kept).sum() < N * k and (~kept[:, 0]).any()  # some first choices overflow too
    assert np.all(np.asarray(y)[~kept.any(1)] == 0) and (~kept.any(1)).any()  # fully dropped: exact 0
    assert_close(sown["dropped_fraction"], (~kept).mean(), 1e-6, "dropped_fraction")
    assert np.array_equal(np.asarray(sown["tokens_per_expert"]), np.bincount(experts.ravel(), minlength=E))


def test_balance_and_z_loss_by_hand():
    routed, uniform = moe(num_experts=2, top_k=1, router="switch"), moe(num_experts=2, top_k=1, router="switch")
    w = np.zeros((D, 2), np.float32)
    w[0, 0] = w[1, 1] = 1.0
    routed.w_router[...] = jnp.asarray(w)
    uniform.w_router[...] = jnp.zeros((D, 2))  # uniform routing: the minimum, 1
    x = np.zeros((1, 4, D), np.float32)
    x[0, :3, 0] = x[0, 3, 1] = math.log(3)  # p = (3/4, 1/4) three times, then (1/4, 3/4)
    _, (s, u), _ = run([routed, uniform], jnp.asarray(x))
    f, P = np.array([3, 1]) / 4, np.array([3 * 0.75 + 0.25, 3 * 0.25 + 0.75]) / 4
    balance = 2 * np.sum(f * P)  # = 1.125
    z = math.log(4) ** 2  # logsumexp(log 3, 0) = log 4 for every token
    assert_close(s["balance_loss"], balance, 1e-6, "balance")
    assert_close(s["z_loss"], z, 1e-6, "z")
    assert_close(s["aux_loss"], 0.01 * balance + 0.001 * z, 1e-6, "aux")
    assert_close(s["router_entropy"], -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), 1e-6, "entropy")
    assert_close(u["balance_loss"], 1.0, 1e-6, "uniform")


def test_gradients_reach_router_and_selected_experts_only():
    x, r = X[:1, :2], R[:1, :2]  # 2 tokens, top-2 of 8 experts: at least 4 experts unselected
    ys, sown, grads = run([moe(num_experts=8, dispatch=d, capacity_factor=4) for d in ("capacity", "dropless")], x, r)
    for s, g in zip(sown, grads):
        chosen = np.asarray(s["tokens_per_expert"]) > 0
        assert 0 < chosen.sum() <= 4
        assert float(jnp.abs(g["w_router"][...]).max()) > 0
        for w in ("w_gate", "w_up", "w_down"):
            per_expert = np.asarray(jnp.abs(g[w][...]).max(axis=(1, 2)))
            assert np.all(per_expert[chosen] > 0) and np.all(per_expert[~chosen] == 0), w


def test_bias_balances_load_outside_the_gradient():
    m = moe(balance="bias", bias_update_rate=0.02)
    u = randn(5, (D,))
    m.w_router[...] = m.w_router[...].at[:, 0].add(u / 16)  # every token leans to expert 0
    x = randn(0, (2, 16, D)) + u

    @nnx.jit
    def step(m, x):
        m(x)
        return nnx.pop(m, nnx.Intermediate)["moe"].get_value()[-1]["tokens_per_expert"]

    first = step(m, x)
    assert_close(m.bias[...], 0.02 * jnp.sign(first.mean() - first), 1e-6, "one update")
    for _ in range(30):
        last = step(m, x)
    assert float(first.max()) > 1.5 * float(last.max()) and float(last.min()) > float(first.min())
    assert isinstance(m.bias, RouterBias) and "bias" not in nnx.state(m, nnx.Param)
    m.eval()  # no update in eval; the bias changes selection only, never the gates' values
    g, p, bias = nnx.split(m, nnx.Param, RouterBias)
    b = bias["bias"][...]
    fwd = lambda b: nnx.merge(g, p, jax.tree.map(lambda _: b, bias))(x)

    @jax.jit
    def check(b):
        return jax.grad(lambda b: jnp.sum(fwd(b)))(b), fwd(b + 1e-4), fwd(b)
    grad, nudged, y = check(b)
    assert float(jnp.abs(grad).max()) == 0
    assert_close(nudged, y, 1e-7, "gates ignore the bias")
    nnx.jit(lambda m, x: m(x))(m, x)
    assert jnp.array_equal(m.bias[...], b)


def test_jitter_only_in_training_and_eval_toggles_submodules():
    outer = nnx.List([moe(router_jitter=0.5)])
    plain = moe()
    x = X
    y1, y2 = outer[0](x), outer[0](x)
    assert float(jnp.abs(y1 - y2).max()) > 1e-3  # fresh noise on each training call
    outer.eval()
    assert outer[0].deterministic
    plain.eval()
    assert jnp.array_equal(outer[0](x), plain(x))  # eval: no noise, same function as without jitter
    outer.train()
    assert not outer[0].deterministic
    view = nnx.view(outer, deterministic=True)  # an eval view; the original stays in training mode
    assert view[0].deterministic and not outer[0].deterministic


def test_decoding_step_never_drops():
    m = moe(capacity_factor=0.05)
    _, (s,), _ = run([m], X)
    assert s["dropped_fraction"] > 0.5  # T > 1: the tiny capacity drops
    ec = moe(router="expert_choice")  # T=1 falls back to token-choice top-k on the same scores
    step = X[:, :1]
    ys, sown, _ = run([m, moe(dispatch="dropless"), ec, moe(renormalize=False)], step)
    assert sown[0]["dropped_fraction"] == 0
    assert_close(ys[0], ys[1], 1e-6, "T=1 is dropless")
    assert_close(ys[2], ys[3], 1e-6, "expert choice at T=1")


def test_outside_training_each_token_is_routed_alone():
    """Eval: capacity dispatch and expert choice become dropless token choice, so a row's outputs do
    not depend on the other rows nor on later tokens (in training, capacity drops decide otherwise)."""
    for kw in (dict(capacity_factor=0.05), dict(router="expert_choice", capacity_factor=0.5)):
        m = moe(**kw)
        training = nnx.jit(lambda m, x: m(x))
        assert not jnp.allclose(training(m, X)[1:], training(m, X[1:]), atol=1e-4), kw  # drops differ
        nnx.pop(m, nnx.Intermediate)
        m.eval()
        y = nnx.jit(lambda m, x: m(x))(m, X)
        assert_close(nnx.jit(lambda m, x: m(x))(m, X[1:]), y[1:], 1e-5, f"{kw}: one row alone")
        assert_close(nnx.jit(lambda m, x: m(x))(m, X[:, :3]), y[:, :3], 1e-5, f"{kw}: causal")


def test_expert_choice_each_expert_takes_its_top_tokens():
    m = moe(router="expert_choice", capacity_factor=0.5)
    ys, (s,), _ = run([m], X)
    y, xf = ys[0].reshape(16, D), X.reshape(16, D)
    p = jax.nn.softmax(xf @ m.w_router[...], axis=-1)  # (N, E)
    C = expert_capacity(16, E, 2, 0.5)
    top = np.argsort(-np.asarray(p), axis=0, kind="stable")[:C]  # (C, E)
    G = np.zeros((16, E), np.float32)
    for e in range(E):
        G[top[:, e], e] = np.asarray(p)[top[:, e], e]
    assert_close(y, jnp.einsum("ne,ned->nd", G, expert_outputs(m, xf)), 1e-5, "expert choice")
    assert_close(s["dropped_fraction"], (G.sum(1) == 0).mean(), 1e-6, "dropped")


def test_shared_experts_are_always_on():
    m = moe(num_shared_experts=2)
    assert m.shared.w_gate.shape == (D, 2 * F)
    m.w_down[...] = jnp.zeros_like(m.w_down[...])
    assert_close(run([m], X)[0][0], m.shared(X), 1e-6, "routed part zero")
    assert default_expert_dim(256, 2) == 352  # the dense width 704 over 2 active experts
    assert nnx.eval_shape(lambda: MoE(256, num_shared_experts=1, rngs=nnx.Rngs(0))).hidden_dim == 240


def test_sigmoid_group_limited_choice_is_deepseek_v3s_router():
    """scoring sigmoid, num_groups / top_groups, a bias in the choice only, renormalize and routed_scale, against
    DeepSeek-V3's router written out in numpy (transformers' DeepseekV3TopkRouter)."""
    kw = dict(num_experts=8, top_k=3, scoring="sigmoid", num_groups=4, top_groups=2, balance="bias")
    models = [moe(**kw, renormalize=n, routed_scale=2.5, seed=4) for n in (True, False)] + [moe(**kw, seed=4)]
    bias = np.asarray(randn(6, (8,))) * 0.3
    for m in models:
        m.bias[...] = jnp.asarray(bias)
        m.eval()
    ys, _, _ = run(models, X)
    xf = np.asarray(X).reshape(-1, D)
    s = 1 / (1 + np.exp(-(xf @ np.asarray(models[0].w_router[...]))))  # (N, E)
    choice = (s + bias).reshape(-1, 4, 2)  # (N, groups, experts per group)
    best = np.argsort(-np.sort(choice, -1)[..., -2:].sum(-1), -1)[:, :2]  # each token's top 2 groups by top-2 sums
    masked = np.full_like(choice, -np.inf)
    np.put_along_axis(masked, best[..., None], np.take_along_axis(choice, best[..., None], 1), 1)
    experts = np.argsort(-masked.reshape(-1, 8), -1)[:, :3]  # (N, k)
    assert not np.array_equal(np.sort(experts), np.sort(np.argsort(-(s + bias), -1)[:, :3], -1))  # groups matter
    outs = np.take_along_axis(np.asarray(expert_outputs(models[0], jnp.asarray(xf))), experts[..., None], 1)
    g = np.take_along_axis(s, experts, -1)  # (N, k): the gates never see the bias
    renormalized = g / g.sum(-1, keepdims=True)
    for y, gates in ((ys[0], 2.5 * renormalized), (ys[1], 2.5 * g), (ys[2], renormalized)):
        assert_close(y.reshape(-1, D), np.einsum("nk,nkd->nd", gates, outs), 1e-5, "DeepSeek-V3 routing")
    models[0].train()  # training: the metrics use the scores normalised per token (DeepSeek-V3's s')
    _, (sown,), _ = run(models[:1], X)
    assert_close(sown["router_probs"], (s / s.sum(-1, keepdims=True)).mean(0), 1e-6, "P_e of sigmoid scores")


def test_sow_recipe_under_jit_and_grad():
    m = moe(balance="bias")
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    x = X

    @jax.jit
    def step(params, rest, x):
        def loss_fn(params):
            model = nnx.merge(graphdef, params, rest, copy=True)
            y = model(x)
            found = nnx.pop(model, nnx.Intermediate)
            return jnp.mean(y ** 2) + total_aux_loss(found), (found, nnx.state(model, nnx.Not(nnx.Param)))
        (loss, (found, rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, found, rest, grads

    loss, found, new_rest, grads = step(params, rest, x)
    sown = found["moe"].get_value()[0]
    assert set(sown) == {"aux_loss", "balance_loss", "z_loss", "tokens_per_expert", "dropped_fraction",
                         "router_entropy", "router_probs"} and sown["tokens_per_expert"].shape == (E,)
    assert_close(sown["router_probs"], jnp.mean(jax.nn.softmax(x.reshape(-1, x.shape[-1]) @ params["w_router"][...]),
                                                0), 1e-6, "P_e")
    assert_close(total_aux_loss(found), 0.001 * sown["z_loss"], 1e-6, "aux = z only with bias balance")
    assert not jnp.array_equal(new_rest["bias"][...], rest["bias"][...])  # the update comes back out
    _, captured = nnx.capture(m, nnx.Intermediate)(x)
    assert_close(total_aux_loss(captured), total_aux_loss(found), 1e-6, "nnx.capture")

    m.eval()  # eval mode is pure: callable inside a loop on a module merged outside it
    g, s = nnx.split(m)

    @jax.jit
    def loop(s, x):
        model = nnx.merge(g, s)
        return jax.lax.fori_loop(0, 2, lambda i, h: model(h), x)
    assert loop(s, x[:, :1]).shape == (2, 1, D)


def test_every_router_score_order_and_dispatch_runs():
    configs = [dict(router="topk", score_order="softmax_then_topk", dispatch=d, renormalize=n)
               for d in ("capacity", "dropless") for n in (True, False)]
    configs += [dict(router="topk", score_order="topk_then_softmax", dispatch=d) for d in ("capacity", "dropless")]
    configs += [dict(router="switch", top_k=1, dispatch=d, balance="bias") for d in ("capacity", "dropless")]
    configs += [dict(router="expert_choice", balance="none")]  # dispatch does not apply to expert choice
    configs += [dict(num_shared_experts=1, router_jitter=0.1, dtype=jnp.bfloat16)]
    configs += [dict(scoring="sigmoid", num_groups=2, top_groups=1, routed_scale=2.0, dispatch=d) for d in DISPATCHES]
    ys, sown, grads = run([moe(**cfg) for cfg in configs], X, R)
    for cfg, y, s, g in zip(configs, ys, sown, grads):
        assert y.shape == X.shape and y.dtype == cfg.get("dtype", jnp.float32), cfg
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in s.values()), cfg
        assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(g)), cfg
        assert float(jnp.abs(g["w_router"][...]).max()) > 0, cfg


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=5), "top_k=5 must be between 1 and num_experts=4"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(num_experts=0, num_shared_experts=2), "num_experts=0 must be >= 1; num_shared_experts=2"),
    (dict(router="hash"), "router='hash' is not one of 'topk', 'switch', 'expert_choice'"),
    (dict(dispatch="sparse"), "dispatch='sparse' is not one of"),
    (dict(balance="loss"), "balance='loss' is not one of"),
    (dict(score_order="softmax"), "score_order='softmax' is not one of"),
    (dict(router="switch"), "router='switch' routes each token to one expert; set top_k=1"),
    (dict(top_k=1), "gets no gradient"),
    (dict(router="expert_choice", balance="bias"), "balance='bias' does nothing"),
    (dict(router_jitter=1.0), "router_jitter=1.0 must be in"),
    (dict(scoring="sigmoid", score_order="topk_then_softmax"), "sigmoid scoring chooses on its scores"),
    (dict(num_groups=3), "num_groups=3 must divide num_experts=4"),
    (dict(num_groups=2, top_groups=3), "top_groups=3 must be between 1 and num_groups"),
    (dict(num_groups=4, top_groups=1), "num_groups=4 limits each token's top_k=2 experts to its top_groups=1 groups"),
    (dict(router="expert_choice", num_groups=2), "(token choice only)"),
    (dict(activation="gelu"), "activation='gelu' is not one of 'swiglu', 'relu2', 'geglu'"),
])
def test_bad_configs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        moe(**kwargs)
