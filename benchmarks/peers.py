"""The zoo against plain PyTorch implementations of the same models on this CPU: training steps,
a long prefill and the first step (compile), alternating in one run.

    python -m benchmarks.peers [--repeats 5] [--only nanogpt mha ...] [--profile]

Needs torch (install it by hand for this benchmark, e.g. `pip install torch==2.13.0` in a separate
venv with this project: it is never part of `make test`). The PyTorch models are written here for
the benchmark, the same architecture and shapes as the zoo's LanguageModel: token embedding tied to
the LM head, pre-norm blocks of RMSNorm, a mixer (causal attention with rotary positions and
GQA, through F.scaled_dot_product_attention; or Mamba-2's SSD in its chunked form) and a SwiGLU FFN
(or a top-2 MoE of SwiGLU experts, dropless, tokens gathered per expert as Mixtral's code does), the
final norm; AdamW with the zoo's defaults (lr 3e-3, betas 0.9/0.99, weight decay 0.1 on matrices
but the embedding) and global-norm clipping at 1. Both in float32, torch on the machine's threads.

Each figure is the minimum over `repeats` alternating runs; the ratio is zoo / peer speed (>= 1:
the zoo is at least as fast). MFU (train/utilisation.py) is the model's training FLOPs per second over
the products' rate measured at the start (jnp.dot at 1024^3), the same for both sides. The products
alone are timed at the steps' shapes too (jnp.dot against torch.matmul), so a claim that they are the
limit is measured in the same run. `--profile` adds each training step's time by category, the zoo's
from JAX's profiler over the compiled HLO (benchmarks/xla_profile.py), PyTorch's from torch.profiler.
"""

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import xla_profile
from benchmarks.attention import _fn as attention_pass
from benchmarks.common import cpu_model, print_table, save_json
from infer.generate import DECODE_OPTIONS
from kernels.attention import attention, attention_xla, fresh_caches
from train import optim
from train.step import make_train_step
from train.utilisation import flops_per_token, products_rate
from zoo import LanguageModel
from zoo.config import from_dict

WORKLOADS = {  # name: (model section, batch, length)
    "nanogpt": ({"d_model": 128, "num_layers": 4, "mixer": {"kind": "attention", "num_heads": 4}}, 12, 64),
    "mha": ({"d_model": 128, "num_layers": 4, "mixer": {"kind": "attention", "num_heads": 4}}, 8, 256),
    "gqa": ({"d_model": 128, "num_layers": 4, "mixer": {"kind": "attention", "num_heads": 4, "num_kv_heads": 1}},
            8, 256),
    "moe": ({"d_model": 128, "num_layers": 4, "mixer": {"kind": "attention", "num_heads": 4},
             "ffn": {"kind": "moe", "num_experts": 8, "top_k": 2}}, 8, 256),
    "moe_dropless": ({"d_model": 128, "num_layers": 4, "mixer": {"kind": "attention", "num_heads": 4},
                      "ffn": {"kind": "moe", "num_experts": 8, "top_k": 2, "dispatch": "dropless"}}, 8, 256),
    "mamba2": ({"d_model": 128, "num_layers": 4, "mixer": {"kind": "mamba2", "head_dim": 64, "state_size": 64,
                                                          "chunk_size": 64}}, 8, 256),
}
PREFILL = ({"d_model": 128, "num_layers": 4, "mixer": {"kind": "attention", "num_heads": 4, "num_kv_heads": 1}},
           1, 4096)


# ---------------------------------------------------------------------------------------------- zoo

def zoo_train(model: dict, B: int, T: int):
    """A closure running one zoo training step on a fixed random batch (blocking), the parameter count,
    the model's FLOPs per token (train/utilisation.py) and a function giving the step's compiled HLO."""
    cfg = from_dict({"model": {**model, "max_seq_len": T}, "train": {"batch_size": B, "seq_len": T}})
    lm = LanguageModel(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(lm, nnx.Param, ...)
    tx = optim.optimizer(cfg.train)
    step = make_train_step(graphdef, tx)
    tokens = np.random.default_rng(0).integers(0, 256, (1, B, T + 1)).astype(np.int32)
    batch = {"x": jnp.asarray(tokens[..., :-1]), "y": jnp.asarray(tokens[..., 1:]), "mask": jnp.ones((1, B, T))}
    state = [params, rest, tx.init(params)]

    def run():
        state[0], state[1], state[2], m = step(*state, batch)
        jax.block_until_ready(m["loss"])

    hlo = lambda: step.func.lower(*state, batch, **step.keywords).compile().as_text()
    return run, sum(x.size for x in jax.tree.leaves(params)), flops_per_token(lm, T), hlo


def zoo_prefill(model: dict, B: int, T: int):
    cfg = from_dict({"model": {**model, "max_seq_len": T}, "train": {"seq_len": T}})
    graphdef, params = nnx.split(LanguageModel(cfg.model, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, T)), jnp.int32)

    @functools.partial(jax.jit, compiler_options=DECODE_OPTIONS)  # as infer.generate compiles its prefill
    def prefill(params, tokens):
        m = nnx.merge(graphdef, params)
        with fresh_caches():
            return m.decode(tokens, m.init_state(B, T))[0][:, -1]

    return lambda: jax.block_until_ready(prefill(params, tokens))


# -------------------------------------------------------------------------------------------- torch

def torch_models():
    """The PyTorch side, built only when torch is importable."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, d, eps=1e-6):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rotary(x, base=10000.0):  # (B, H, T, K), rotate-half
        T, K = x.shape[-2], x.shape[-1]
        inv = base ** (-torch.arange(K // 2, dtype=torch.float32) / (K // 2))
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., :K // 2], x[..., K // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    class Attention(nn.Module):
        def __init__(self, d, num_heads, num_kv_heads=None, **_):
            super().__init__()
            self.H, self.G, self.K = num_heads, num_kv_heads or num_heads, d // num_heads
            self.wq = nn.Linear(d, self.H * self.K, bias=False)
            self.wk = nn.Linear(d, self.G * self.K, bias=False)
            self.wv = nn.Linear(d, self.G * self.K, bias=False)
            self.wo = nn.Linear(self.H * self.K, d, bias=False)

        def forward(self, x):
            B, T, _ = x.shape
            q = rotary(self.wq(x).view(B, T, self.H, self.K).transpose(1, 2))
            k = rotary(self.wk(x).view(B, T, self.G, self.K).transpose(1, 2))
            v = self.wv(x).view(B, T, self.G, self.K).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.G != self.H)
            return self.wo(o.transpose(1, 2).reshape(B, T, -1))

    def hidden(d):  # layers.mlp.default_hidden_dim
        return -(-8 * d // 3 // 32) * 32

    class MLP(nn.Module):
        def __init__(self, d, F_=None, **_):
            super().__init__()
            F_ = F_ or hidden(d)
            self.gate, self.up, self.down = (nn.Linear(d, F_, bias=False), nn.Linear(d, F_, bias=False),
                                             nn.Linear(F_, d, bias=False))

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class MoE(nn.Module):
        """Top-k softmax routing, renormalised gates, dropless: each expert runs on its own tokens."""

        def __init__(self, d, num_experts, top_k, **_):
            super().__init__()
            F_ = -(-hidden(d) // top_k // 8) * 8  # layers.moe.default_expert_dim
            self.router = nn.Linear(d, num_experts, bias=False)
            self.experts = nn.ModuleList(MLP(d, F_) for _ in range(num_experts))
            self.k = top_k

        def forward(self, x):
            shape, x = x.shape, x.reshape(-1, x.shape[-1])
            gates, experts = torch.topk(F.softmax(self.router(x), -1), self.k, dim=-1)
            gates = gates / gates.sum(-1, keepdim=True)
            y = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(experts == e)
                if token.numel():
                    y.index_add_(0, token, expert(x[token]) * gates[token, slot, None])
            return y.reshape(shape)

    def segsum(a):  # (..., L) -> (..., L, L): sum of a over (j, i], -inf above the diagonal
        L = a.shape[-1]
        c = torch.cumsum(a, -1)
        s = c[..., :, None] - c[..., None, :]
        return s.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool)), -math.inf)

    class Mamba2(nn.Module):
        """in_proj -> conv1d over [x, B, C] -> SSD by chunks (the paper's chunked algorithm) ->
        gated RMSNorm -> out_proj, as layers/mamba2.py."""

        def __init__(self, d, head_dim=64, state_size=64, chunk_size=64, expand=2, conv_size=4, **_):
            super().__init__()
            self.Di, self.P, self.N, self.C = expand * d, head_dim, state_size, chunk_size
            self.H = self.Di // head_dim
            conv_dim = self.Di + 2 * state_size
            self.in_proj = nn.Linear(d, 2 * self.Di + 2 * state_size + self.H, bias=False)
            self.conv = nn.Conv1d(conv_dim, conv_dim, conv_size, groups=conv_dim, padding=conv_size - 1)
            self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.zeros(self.H)) for _ in range(3))
            self.norm = RMSNorm(self.Di, 1e-5)
            self.out_proj = nn.Linear(self.Di, d, bias=False)

        def forward(self, u):
            Bsz, T, _ = u.shape
            z, xBC, dt = torch.split(self.in_proj(u), [self.Di, self.Di + 2 * self.N, self.H], -1)
            xBC = F.silu(self.conv(xBC.transpose(1, 2))[..., :T].transpose(1, 2))
            x, B, C = torch.split(xBC, [self.Di, self.N, self.N], -1)
            dt = F.softplus(dt + self.dt_bias)  # (B, T, H)
            A = -torch.exp(self.A_log)
            L, c = self.C, T // self.C
            x = (x.view(Bsz, c, L, self.H, self.P) * dt.view(Bsz, c, L, self.H, 1))  # Δ x
            a = (dt * A).view(Bsz, c, L, self.H).permute(0, 3, 1, 2)  # (B, H, c, L)
            B, C = B.view(Bsz, c, L, self.N), C.view(Bsz, c, L, self.N)
            a_cum = torch.cumsum(a, -1)
            y = torch.einsum("bcln,bcsn,bhcls,bcshp->bclhp", C, B, torch.exp(segsum(a)), x)  # inside chunks
            states = torch.einsum("bcln,bhcl,bclhp->bchpn", B, torch.exp(a_cum[..., -1:] - a_cum), x)
            states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
            decay = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # (B, H, c+1, c+1)
            states = torch.einsum("bhzc,bchpn->bzhpn", decay, states)[:, :-1]
            y = y + torch.einsum("bcln,bchpn,bhcl->bclhp", C, states, torch.exp(a_cum))
            y = y.reshape(Bsz, T, self.H, self.P) + xBC[..., :self.Di].view(Bsz, T, self.H, self.P) \
                * self.D[:, None]
            y = self.norm(y.reshape(Bsz, T, self.Di)) * F.silu(z)
            return self.out_proj(y)

    MIXERS = {"attention": Attention, "mamba2": Mamba2}

    class Block(nn.Module):
        def __init__(self, d, mixer, ffn):
            super().__init__()
            self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
            self.mixer = MIXERS[mixer.pop("kind")](d, **mixer)
            self.ffn = MoE(d, **{k: v for k, v in ffn.items() if k != "kind"}) if ffn.get("kind") == "moe" else MLP(d)

        def forward(self, x):
            x = x + self.mixer(self.n1(x))
            return x + self.ffn(self.n2(x))

    class LM(nn.Module):
        def __init__(self, model):
            super().__init__()
            d = model["d_model"]
            self.embed = nn.Embedding(256, d)
            self.blocks = nn.ModuleList(Block(d, dict(model["mixer"]), dict(model.get("ffn", {"kind": "mlp"})))
                                        for _ in range(model["num_layers"]))
            self.norm = RMSNorm(d)

        def forward(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.norm(x) @ self.embed.weight.T

    def train(model: dict, B: int, T: int):
        torch.manual_seed(0)
        lm = LM(model)
        decay = [p for n, p in lm.named_parameters() if p.ndim >= 2 and "embed" not in n]
        rest = [p for n, p in lm.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.9, 0.99))
        tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (B, T + 1)))

        def run():
            loss = F.cross_entropy(lm(tokens[:, :-1]).reshape(-1, 256), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            with torch.profiler.record_function("optimiser"):  # for --profile's breakdown
                torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
                opt.step()
            loss.item()

        return run, sum(p.numel() for p in lm.parameters())

    def prefill(model: dict, B: int, T: int):
        torch.manual_seed(0)
        lm = LM(model).eval()
        tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (B, T)))

        def run():
            with torch.no_grad():
                lm(tokens)[:, -1].sum().item()

        return run

    return train, prefill, torch.__version__, torch.get_num_threads()


TORCH_PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
TORCH_COPIES = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::_to_copy", "aten::t",
                "aten::transpose", "aten::view", "aten::reshape", "aten::permute", "aten::expand", "aten::as_strided",
                "aten::slice", "aten::split", "aten::select", "aten::unsqueeze", "aten::_unsafe_view", "aten::empty",
                "aten::zeros", "aten::zero_", "aten::fill_", "aten::empty_strided", "aten::narrow",
                "aten::index_select"}


def torch_breakdown(run, calls: int = 5) -> dict:
    """PyTorch's side of benchmarks/xla_profile.breakdown: each aten op's own time on the calling thread
    (intra-op threads included in it) by category, from torch.profiler; "idle" is the step's wall time
    outside every aten op (Python, the autograd engine, dispatch)."""
    import torch

    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        wall = (time.perf_counter() - t0) / calls
    out = dict.fromkeys(xla_profile.CATEGORIES, 0.0)
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        names, parent = [], e.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if "optimiser" in names:
            category = "optimiser"
        elif any("scaled_dot_product" in n.lower() for n in [e.name, *names]):
            category = "attention bwd" if any("Backward" in n for n in names) else "attention fwd"
        else:
            category = "products" if e.name in TORCH_PRODUCTS else "copies" if e.name in TORCH_COPIES else "fusions"
        out[category] += e.self_cpu_time_total / 1e3 / calls
    out["idle"] = wall * 1e3 - sum(out.values())
    return {**{c: round(v, 1) for c, v in out.items()}, "wall": round(wall * 1e3, 1)}


def attention_alone(repeats: int) -> list[dict]:
    """Causal softmax attention alone, forward+backward at the training workloads' shapes (B=8, T=256, 4 heads
    of 32; MHA and one kv head): kernels.attention.attention (on CPU the fused kernels of
    kernels/attention/cpu.cc) and its XLA form attention_xla, each against F.scaled_dot_product_attention,
    alternating, the best of `repeats`."""
    import torch
    import torch.nn.functional as F

    rows = []
    for G in (4, 1):
        q, k, v = (np.random.default_rng(i).standard_normal(shape, np.float32)
                   for i, shape in enumerate([(8, 256, 4, 32), (8, 256, G, 32), (8, 256, G, 32)]))
        args = tuple(map(jnp.asarray, (q, k, v)))
        tq, tk, tv = (torch.from_numpy(x.transpose(0, 2, 1, 3).copy()).requires_grad_() for x in (q, k, v))

        def peer():
            o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=G != 4)
            (o * tq[..., :1]).sum().backward()

        ms = {}
        for form, fn in (("zoo", attention), ("zoo XLA form", attention_xla)):
            grad = attention_pass(fn, backward=True)  # benchmarks/attention.py's forward+backward
            zoo = lambda: jax.block_until_ready(grad(*args))
            zoo(), peer()
            ms[form], peer_s = alternate(zoo, peer, repeats)
            ms["peer"] = min(ms.get("peer", math.inf), peer_s)
        rows.append({"attention fwd+bwd": f"B=8 T=256 H=4 G={G} K=32",
                     **{f"{form} ms": round(s * 1e3, 2) for form, s in ms.items()},
                     "zoo/peer speed": round(ms["peer"] / ms["zoo"], 2)})
    return rows


def products(shapes: list[tuple], repeats: int) -> list[dict]:
    """GFLOP/s of jax.jit(jnp.dot) and torch.matmul at (M, K, N), alternating, the best of `repeats`."""
    import torch

    rows = []
    for M, K, N in shapes:
        a, b = np.random.default_rng(0).standard_normal((2, max(M, K), max(K, N)), np.float32)
        ja, jb, ta, tb = jnp.asarray(a[:M, :K]), jnp.asarray(b[:K, :N]), torch.from_numpy(a[:M, :K].copy()), \
            torch.from_numpy(b[:K, :N].copy())
        dot = jax.jit(jnp.dot)
        jax_run, torch_run = lambda: dot(ja, jb).block_until_ready(), lambda: torch.matmul(ta, tb)
        jax_run(), torch_run()
        best = alternate(jax_run, torch_run, repeats)
        rate = [2 * M * K * N / t / 1e9 for t in best]
        rows.append({"(M x K) @ (K x N)": f"{M}x{K} @ {K}x{N}", "jnp.dot GFLOP/s": round(rate[0]),
                     "torch.matmul GFLOP/s": round(rate[1]), "jax / torch": round(rate[0] / rate[1], 2)})
    return rows


# ------------------------------------------------------------------------------------------ measure

def _first(make):
    t0 = time.perf_counter()
    run, *rest = make()
    run()
    return time.perf_counter() - t0, run, rest


PAUSE = 0.02  # seconds between timed runs (see `alternate`)


def alternate(zoo_run, peer_run, repeats: int) -> tuple[float, float]:
    """The best seconds of each, run in turn, each after a pause of PAUSE. Without it the zoo's run starts
    while PyTorch's OpenMP threads still spin after its run and takes their cores: attention alone
    (`attention_alone`, MHA) measured 12.7 ms right after PyTorch, 9.4 after 20 ms, 9.8 with no PyTorch
    run between; PyTorch's 8.3 either way. Longer pauses let both runtimes' threads fall asleep (after
    200 ms: 17.4 and 8.9)."""
    best = [math.inf, math.inf]
    for _ in range(repeats):
        for i, run in enumerate((zoo_run, peer_run)):
            time.sleep(PAUSE)
            t0 = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", nargs="*", default=[*WORKLOADS, "prefill"])
    p.add_argument("--profile", action="store_true", help="each training step's time by category, both sides")
    args = p.parse_args()
    try:
        peer_train, peer_prefill, version, threads = torch_models()
    except ImportError:
        raise SystemExit("benchmarks.peers needs torch: pip install torch==2.13.0 (in a venv of its own)") from None
    print(f"CPU: {cpu_model()}; zoo: jax {jax.__version__}; peer: torch {version}, {threads} threads")
    rate = products_rate(repeats=20)
    print(f"products' rate (jnp.dot 1024^3, the MFU denominator of both sides): {rate / 1e9:.0f} GFLOP/s")
    BT = 8 * 256  # the training workloads' tokens per step, at width 128 (FFN 352, QKV 384, vocabulary 256)
    table = products([(BT, 128, 384), (BT, 128, 352), (BT, 352, 128), (BT, 128, 256), (128, BT, 384),
                      (1024, 1024, 1024)], args.repeats * 4)
    alone = attention_alone(args.repeats * 4)
    rows, shares = [], []
    for name, (model, B, T) in WORKLOADS.items():
        if name not in args.only:
            continue
        zoo_first, zoo_run, (zoo_params, flops, hlo) = _first(lambda: zoo_train(model, B, T))
        peer_first, peer_run, (peer_params,) = _first(lambda: peer_train(model, B, T))
        zoo_s, peer_s = alternate(zoo_run, peer_run, args.repeats)
        work = f"train {name} (B={B}, T={T})"
        rows.append({"work": work, "params zoo/peer": f"{zoo_params:,}/{peer_params:,}",
                     "zoo ms": round(zoo_s * 1e3, 1), "peer ms": round(peer_s * 1e3, 1),
                     "zoo tok/s": round(B * T / zoo_s), "peer tok/s": round(B * T / peer_s),
                     "zoo/peer speed": round(peer_s / zoo_s, 2),
                     "MFU zoo/peer": f"{B * T * flops / zoo_s / rate:.2f}/{B * T * flops / peer_s / rate:.2f}",
                     "first step zoo/peer s": f"{zoo_first:.2f}/{peer_first:.2f}"})
        print(rows[-1], flush=True)
        if args.profile:
            shares += [{"work": work, "side": "zoo", **xla_profile.breakdown(zoo_run, hlo())},
                       {"work": work, "side": "peer", **torch_breakdown(peer_run)}]
            print(shares[-2], shares[-1], sep="\n", flush=True)
    if "prefill" in args.only:
        model, B, T = PREFILL
        zoo_run, peer_run = zoo_prefill(model, B, T), peer_prefill(model, B, T)
        zoo_run(), peer_run()
        zoo_s, peer_s = alternate(zoo_run, peer_run, args.repeats)
        rows.append({"work": f"prefill GQA (B={B}, T={T})", "zoo ms": round(zoo_s * 1e3, 1),
                     "peer ms": round(peer_s * 1e3, 1), "zoo/peer speed": round(peer_s / zoo_s, 2)})
        print(rows[-1], flush=True)
    print(f"\nminimum of {args.repeats} alternating runs; ratio = zoo speed / PyTorch speed")
    print_table(rows, ["work", "params zoo/peer", "zoo ms", "peer ms", "zoo tok/s", "peer tok/s", "zoo/peer speed",
                       "MFU zoo/peer", "first step zoo/peer s"])
    print("\nthe products alone, at the steps' shapes (best of alternating runs):")
    print_table(table, list(table[0]))
    print("\nsoftmax attention alone (best of alternating runs):")
    print_table(alone, list(alone[0]))
    if shares:
        print("\nms per training step by category (benchmarks/xla_profile.py; zoo: summed over XLA's threads, "
              "peer: torch.profiler's aten ops on the calling thread); idle = wall outside any op")
        print_table(shares, ["work", "side", *xla_profile.CATEGORIES, "wall"])
        for row in shares[::2]:
            print(f"{row['work']}, zoo's largest places:", "; ".join(f"{p[0]} {p[1]} {p[2]} {ms}" for p, ms in
                                                                row["places"][:6]))
    save_json("peers", rows + table + alone + shares)


if __name__ == "__main__":
    main()
