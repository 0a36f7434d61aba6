// The chunked SSD of Mamba-2 on CPU, forward and backward, as XLA FFI custom calls (kernels/ssd/cpu.py
// compiles this file on first use and registers the two targets).
//
// chunk.py's algorithm for one head at a time, h_t = exp(g_t) h_{t-1} + v_t k_t^T, y_t = h_t q_t: per chunk
// of L tokens, with cum_t the chunk's cumulative sum of g and Lmat[t, s] = exp(cum_t - cum_s) for s <= t in
// one document (else 0),
//   y = (Lmat o Q K^T) V + diag(f) Q h_in^T,  f_t = exp(cum_t) while t is in the carried document (else 0),
//   h_out = f_{L-1} h_in + sum_s Lmat[L-1, s] v_s k_s^T.
// The forward keeps each chunk's entering state for the backward, which walks the chunks in reverse with
// the gradient of the leaving state. Every product is kernels/native.h's `gemm`; the states are held
// transposed, (N, P). Work is split over (batch, head) on XLA's intra-op thread pool.
//
// Layouts (row-major): q, k (B, T, G, N) (head h reads group h / (H / G)); v (B, T, H, P); g (B, T, H);
// starts (B, T) int32 (1 where a document starts: the state restarts from zero); h0 and the final state
// (B, H, P, N); the entering states (B, H, chunks, N, P). The gradients of q and k are per head,
// (B, T, H, N): cpu.py sums each group's. L, N and P are multiples of 16.

#include <cmath>
#include <vector>

#include "native.h"

namespace ffi = xla::ffi;

namespace {

using namespace zoo;

struct Dims {
  int64_t B, T, H, G, N, P, L, chunks;
};

// One chunk of one head: its rows gathered (zero past T, where g = 0 and v = 0 leave the state unchanged)
// and its decays.
struct Chunk {
  const Dims& d;
  std::vector<float> q, k, kt, v, cum, f, lmat;  // q, k (L, N); kt (N, L); v (L, P); cum, f (L); lmat (L, L)
  std::vector<int32_t> doc;                      // (L) documents started in the chunk up to t
  bool carry = true;                             // no document starts in the chunk: f_{L-1} = exp(cum_{L-1})

  explicit Chunk(const Dims& d)
      : d(d), q(d.L * d.N), k(d.L * d.N), kt(d.N * d.L), v(d.L * d.P), cum(d.L), f(d.L), lmat(d.L * d.L),
        doc(d.L) {}

  void gather(const float* Q, const float* K, const float* V, const float* G, const int32_t* starts, int64_t b,
            int64_t h, int64_t c) {
    const int64_t L = d.L, N = d.N, P = d.P, group = h / (d.H / d.G);
    float running = 0;
    int32_t docs = 0;
    for (int64_t i = 0; i < L; ++i) {
      int64_t t = c * L + i;
      bool in = t < d.T;
      int64_t row = b * d.T + t;
      if (in) {
        std::memcpy(&q[i * N], Q + (row * d.G + group) * N, N * sizeof(float));
        std::memcpy(&k[i * N], K + (row * d.G + group) * N, N * sizeof(float));
        std::memcpy(&v[i * P], V + (row * d.H + h) * P, P * sizeof(float));
        running += G[row * d.H + h];
        docs += starts[row] != 0;
      } else {
        std::fill_n(&q[i * N], N, 0.f);
        std::fill_n(&k[i * N], N, 0.f);
        std::fill_n(&v[i * P], P, 0.f);
      }
      cum[i] = running;
      doc[i] = docs;
      f[i] = docs == 0 ? std::exp(running) : 0.f;
    }
    carry = docs == 0;
    transpose(L, N, k.data(), N, kt.data(), L);
    vi iota;
    for (int j = 0; j < W; ++j) iota[j] = j;
    for (int64_t i = 0; i < L; ++i) {
      vf ci = splat(cum[i]);
      vi di = vi{} + doc[i], ii = vi{} + static_cast<int32_t>(i);
      for (int64_t j = 0; j < L; j += W) {
        vi dj;
        std::memcpy(&dj, &doc[j], sizeof dj);
        vi keep = (iota + static_cast<int32_t>(j) <= ii) & (dj == di);
        store(&lmat[i * L + j], keep ? vexp(ci - load(&cum[j])) : vf{});
      }
    }
  }

  float e(int64_t s) const { return lmat[(d.L - 1) * d.L + s]; }  // Lmat[L-1, s]: v_s k_s^T into h_out
};

inline float dot(const float* a, const float* b, int64_t n) {
  vf acc{};
  for (int64_t i = 0; i < n; i += W) acc += load(a + i) * load(b + i);
  return lanes_sum(acc);
}

// Rows of `a` (rows x n) scaled by `by`, into out.
inline void scale_rows(const float* a, const float* by, int64_t rows, int64_t n, float* out) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; j += W) store(out + i * n + j, load(a + i * n + j) * by[i]);
}

void forward_head(const Dims& d, const float* Q, const float* K, const float* V, const float* G,
                  const int32_t* starts, const float* h0, float* y, float* hT_final, float* entering, int64_t b,
                  int64_t h) {
  const int64_t L = d.L, N = d.N, P = d.P;
  Chunk ch(d);
  std::vector<float> hT(N * P), S(L * L), Y(L * P), Qf(L * N), eV(L * P);
  transpose(P, N, h0 + (b * d.H + h) * P * N, N, hT.data(), P);
  for (int64_t c = 0; c < d.chunks; ++c) {
    ch.gather(Q, K, V, G, starts, b, h, c);
    std::copy(hT.begin(), hT.end(), entering + ((b * d.H + h) * d.chunks + c) * N * P);
    gemm(L, L, N, ch.q.data(), N, 1, ch.kt.data(), L, S.data(), L, false);
    for (int64_t i = 0; i < L * L; i += W) store(&S[i], load(&S[i]) * load(&ch.lmat[i]));
    gemm(L, P, L, S.data(), L, 1, ch.v.data(), P, Y.data(), P, false);
    scale_rows(ch.q.data(), ch.f.data(), L, N, Qf.data());
    gemm(L, P, N, Qf.data(), N, 1, hT.data(), P, Y.data(), P, true);
    for (int64_t i = 0; i < L && c * L + i < d.T; ++i)
      std::memcpy(y + ((b * d.T + c * L + i) * d.H + h) * P, &Y[i * P], P * sizeof(float));
    for (int64_t s = 0; s < L; ++s)
      for (int64_t p = 0; p < P; p += W) store(&eV[s * P + p], load(&ch.v[s * P + p]) * ch.e(s));
    float decay = ch.f[L - 1];
    for (int64_t i = 0; i < N * P; i += W) store(&hT[i], load(&hT[i]) * decay);
    gemm(N, P, L, ch.k.data(), 1, N, eV.data(), P, hT.data(), P, true);  // + K^T (e o V)
  }
  transpose(N, P, hT.data(), P, hT_final + (b * d.H + h) * P * N, N);
}

void backward_head(const Dims& d, const float* Q, const float* K, const float* V, const float* G,
                   const int32_t* starts, const float* entering, const float* dy, const float* dh_final, float* dq,
                   float* dk, float* dv, float* dg, float* dh0, int64_t b, int64_t h) {
  const int64_t L = d.L, N = d.N, P = d.P;
  Chunk ch(d);
  std::vector<float> dhT(N * P), next(N * P), dh(P * N), h_in(P * N), S(L * L), dP(L * L), vt(P * L), dY(L * P),
      dQ(L * N), dK(L * N), dV(L * P), Qf(L * N), Yoff(L * P), tmp(L * N), KD(L * P), dcum(L), cols(L);
  transpose(P, N, dh_final + (b * d.H + h) * P * N, N, dhT.data(), P);
  for (int64_t c = d.chunks - 1; c >= 0; --c) {
    ch.gather(Q, K, V, G, starts, b, h, c);
    const float* hT = entering + ((b * d.H + h) * d.chunks + c) * N * P;
    for (int64_t i = 0; i < L; ++i) {
      int64_t t = c * L + i;
      if (t < d.T) std::memcpy(&dY[i * P], dy + ((b * d.T + t) * d.H + h) * P, P * sizeof(float));
      else std::fill_n(&dY[i * P], P, 0.f);
    }
    std::fill(dcum.begin(), dcum.end(), 0.f);
    // Inside the chunk: S = Q K^T, dP = dY V^T; dS = dP o Lmat; d log Lmat = dS o S.
    gemm(L, L, N, ch.q.data(), N, 1, ch.kt.data(), L, S.data(), L, false);
    transpose(L, P, ch.v.data(), P, vt.data(), L);
    gemm(L, L, P, dY.data(), P, 1, vt.data(), L, dP.data(), L, false);
    std::fill(cols.begin(), cols.end(), 0.f);
    for (int64_t t = 0; t < L; ++t) {  // cum_t gains d log Lmat[t, s], cum_s loses it
      vf row{};
      for (int64_t s = 0; s < L; s += W) {
        int64_t i = t * L + s;
        vf lm = load(&ch.lmat[i]), ds = load(&dP[i]) * lm, sc = load(&S[i]), dlog = ds * sc;
        store(&dP[i], ds);
        store(&S[i], sc * lm);
        row += dlog;
        store(&cols[s], load(&cols[s]) + dlog);
      }
      dcum[t] += lanes_sum(row);
    }
    for (int64_t s = 0; s < L; ++s) dcum[s] -= cols[s];
    gemm(L, N, L, dP.data(), L, 1, ch.k.data(), N, dQ.data(), N, false);   // dS K
    gemm(L, N, L, dP.data(), 1, L, ch.q.data(), N, dK.data(), N, false);   // dS^T Q
    gemm(L, P, L, S.data(), 1, L, dY.data(), P, dV.data(), P, false);      // (Lmat o S)^T dY
    // The entering state's output diag(f) Q h_in^T.
    scale_rows(ch.q.data(), ch.f.data(), L, N, Qf.data());
    gemm(L, P, N, Qf.data(), N, 1, hT, P, Yoff.data(), P, false);
    for (int64_t t = 0; t < L; ++t) dcum[t] += dot(&dY[t * P], &Yoff[t * P], P);
    transpose(N, P, hT, P, h_in.data(), N);
    gemm(L, N, P, dY.data(), P, 1, h_in.data(), N, tmp.data(), N, false);  // dY h_in
    for (int64_t t = 0; t < L; ++t)
      for (int64_t n = 0; n < N; n += W) store(&dQ[t * N + n], load(&dQ[t * N + n]) + load(&tmp[t * N + n]) * ch.f[t]);
    // The leaving state f_{L-1} h_in + K^T (e o V), its gradient dhT.
    gemm(L, P, N, ch.k.data(), N, 1, dhT.data(), P, KD.data(), P, false);  // K dh^T
    transpose(N, P, dhT.data(), P, dh.data(), N);
    gemm(L, N, P, ch.v.data(), P, 1, dh.data(), N, tmp.data(), N, false);  // V dh
    for (int64_t s = 0; s < L; ++s) {
      float e = ch.e(s), de = dot(&KD[s * P], &ch.v[s * P], P) * e;
      dcum[L - 1] += de;
      dcum[s] -= de;
      for (int64_t p = 0; p < P; p += W) store(&dV[s * P + p], load(&dV[s * P + p]) + load(&KD[s * P + p]) * e);
      for (int64_t n = 0; n < N; n += W) store(&dK[s * N + n], load(&dK[s * N + n]) + load(&tmp[s * N + n]) * e);
    }
    float decay = ch.f[L - 1];
    if (ch.carry) dcum[L - 1] += decay * dot(dhT.data(), hT, N * P);
    for (int64_t i = 0; i < N * P; i += W) store(&next[i], load(&dhT[i]) * decay);
    gemm(N, P, L, Qf.data(), 1, N, dY.data(), P, next.data(), P, true);  // + (diag(f) Q)^T dY
    std::swap(dhT, next);
    // g enters cum_t for every t >= its own step.
    float acc = 0;
    for (int64_t i = L - 1; i >= 0; --i) {
      acc += dcum[i];
      int64_t t = c * L + i;
      if (t >= d.T) continue;
      int64_t row = (b * d.T + t) * d.H + h;
      dg[row] = acc;
      std::memcpy(dq + row * N, &dQ[i * N], N * sizeof(float));
      std::memcpy(dk + row * N, &dK[i * N], N * sizeof(float));
      std::memcpy(dv + row * P, &dV[i * P], P * sizeof(float));
    }
  }
  transpose(N, P, dhT.data(), P, dh0 + (b * d.H + h) * P * N, N);
}

// The shapes checked, then run(d, b, h) for every (batch, head) on XLA's pool.
template <typename Run>
ffi::Error each_head(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& v, int64_t L, Run run) {
  auto qd = q.dimensions(), vd = v.dimensions();
  Dims d{qd[0], qd[1], vd[2], qd[2], qd[3], vd[3], L, (qd[1] + L - 1) / L};
  if (d.L % W || d.N % W || d.P % W || d.H % d.G || d.L < W)
    return ffi::Error::InvalidArgument("zoo ssd (cpu.cc): L, N and P must be multiples of 16, G divide H");
  parallel_for(pool, d.B * d.H, [&](int64_t task) { run(d, task / d.H, task % d.H); });
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::F32> h0,
                   ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> h_final,
                   ffi::ResultBuffer<ffi::F32> entering, int32_t chunk) {
  return each_head(pool, q, v, chunk, [&](const Dims& d, int64_t b, int64_t h) {
    forward_head(d, q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(), starts.typed_data(),
                 h0.typed_data(), y->typed_data(), h_final->typed_data(), entering->typed_data(), b, h);
  });
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::F32> entering,
                    ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> dh_final, ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, ffi::ResultBuffer<ffi::F32> dg,
                    ffi::ResultBuffer<ffi::F32> dh0, int32_t chunk) {
  return each_head(pool, q, v, chunk, [&](const Dims& d, int64_t b, int64_t h) {
    backward_head(d, q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(), starts.typed_data(),
                  entering.typed_data(), dy.typed_data(), dh_final.typed_data(), dq->typed_data(),
                  dk->typed_data(), dv->typed_data(), dg->typed_data(), dh0->typed_data(), b, h);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooSsdForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("chunk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooSsdBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("chunk"));
