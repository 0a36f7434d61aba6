// Causal softmax self-attention on CPU, forward and backward, as XLA FFI custom calls (kernels/attention/cpu.py
// compiles this file on first use and registers the two targets).
//
// Flash attention's blocked forms (Dao et al. 2022; FlashAttention-2's loop order): the forward keeps a
// 64-row block of queries, its running max m, sum l and output, and walks the key blocks up to the diagonal,
// 8 at a time; the backward recomputes each block's probabilities from the forward's log-sum-exp and
// accumulates dK, dV per key block and dQ per head. Nothing of size T x T is ever written to memory. Every product is
// kernels/native.h's register-blocked `gemm`; exp is a vector polynomial. Work is split over (batch, head)
// in the forward and (batch, kv head) in the backward, on XLA's own intra-op thread pool.
//
// Layouts (row-major): q (B, T, H, K), k (B, T, G, K), v (B, T, G, V), segment ids (B, T) int32; outputs
// o (B, T, H, V) and lse (B, H, T) (of the scaled logits), dq, dk, dv as q, k, v. G divides H (query head h
// reads kv head h / (H / G)); K and V are multiples of 16. A query sees key j when j <= i, i - j < window
// and, with segments, seg[j] == seg[i].

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "native.h"

namespace ffi = xla::ffi;

namespace {

using namespace zoo;

constexpr int BLK = 64;  // rows of a query block and of a key block
// The forward's key blocks per pass and its scores' row stride: 8 blocks ran the 4K prefill's head 1.2x
// faster than 1 to 6 (T = 4096, K = 32), and a row off a power of two.
constexpr int CHUNK = 8, LD = CHUNK * BLK + W;

struct Shape {
  int64_t B, T, H, G, K, V, Tp;  // Tp: T rounded up to a whole block
  int64_t window;  // key j is seen by query i when i - j < window
  // The row stride of transposed keys and values: off a power of two, where a product's successive rows
  // would fall into the same few cache sets.
  int64_t lt() const { return Tp + W; }
};

// Each block's segment id where all its tokens share one (and are before T), else MIXED; empty without segments.
constexpr int32_t MIXED = INT32_MIN;
std::vector<int32_t> block_ids(const Shape& s, const int32_t* seg) {
  std::vector<int32_t> ids;
  for (int64_t t0 = 0; seg != nullptr && t0 < s.Tp; t0 += BLK) {
    bool one = t0 + BLK <= s.T && std::all_of(seg + t0, seg + t0 + BLK, [&](int32_t x) { return x == seg[t0]; });
    ids.push_back(one ? seg[t0] : MIXED);
  }
  return ids;
}

// Blocks (qb, kb) need a mask on the diagonal, past T, across segments (unless both blocks lie in one
// document), or where the window ends; elsewhere every key is seen.
inline bool masked(const Shape& s, int qb, int kb, const std::vector<int32_t>& ids) {
  return (!ids.empty() && (ids[qb] == MIXED || ids[qb] != ids[kb])) || kb == qb || (kb + 1) * BLK > s.T ||
         (qb + 1) * BLK > s.T || (qb + 1) * BLK - 1 - kb * BLK >= s.window;
}

// The first key block that a query of block qb sees, and whether query block qb sees any key of block kb.
inline int first_key_block(const Shape& s, int qb) {
  return static_cast<int>(std::max<int64_t>(0, qb * BLK - s.window + 1) / BLK);
}
inline bool sees(const Shape& s, int qb, int kb) { return qb * BLK - (kb * BLK + BLK - 1) < s.window; }

// S[i, j] of block (qb, kb) (rows ld apart) set to -inf where query qb*BLK + i does not see key kb*BLK + j.
inline void mask_block(const Shape& s, int qb, int kb, const int32_t* seg, float* S, int ld = BLK) {
  for (int i = 0; i < BLK; ++i)
    for (int j = 0; j < BLK; ++j) {
      int64_t qi = qb * BLK + i, kj = kb * BLK + j;
      if (!(kj <= qi && qi - kj < s.window && qi < s.T && (seg == nullptr || seg[qi] == seg[kj])))
        S[i * ld + j] = -INFINITY;
    }
}

// Rows [t0, t0 + BLK) of a (T, stride)-strided matrix into a dense (BLK, width) block, zero past T.
void gather_rows(const Shape& s, const float* src, int64_t stride, int64_t t0, int width, float* dst) {
  for (int i = 0; i < BLK; ++i) {
    if (t0 + i < s.T) std::memcpy(dst + i * width, src + (t0 + i) * stride, width * sizeof(float));
    else std::memset(dst + i * width, 0, width * sizeof(float));
  }
}

void forward_head(const Shape& s, float scale, const float* q, const float* k, const float* v, const int32_t* seg,
                  float* o, float* lse) {
  // q, o: (T, H*K|V) strided at the head; k, v at the kv head; seg: this row's ids or null; lse: (T,)
  const int64_t K = s.K, V = s.V, nb = s.Tp / BLK;
  std::vector<float> Kt(K * s.lt()), Vs(s.Tp * V), Q(BLK * K), S(BLK * LD), O(BLK * V), m(BLK), l(BLK);
  std::vector<float> block(BLK * K);
  const std::vector<int32_t> ids = block_ids(s, seg);
  for (int64_t b = 0; b < nb; ++b) {  // keys transposed once: (K, lt)
    gather_rows(s, k, s.G * K, b * BLK, K, block.data());
    transpose(BLK, K, block.data(), K, Kt.data() + b * BLK, s.lt());
    gather_rows(s, v, s.G * V, b * BLK, V, Vs.data() + b * BLK * V);
  }
  for (int qb = 0; qb < nb; ++qb) {
    gather_rows(s, q, s.H * K, qb * BLK, K, Q.data());
    for (auto& x : Q) x *= scale;
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(O.begin(), O.end(), 0.f);
    for (int kb = first_key_block(s, qb); kb <= qb; kb += CHUNK) {  // CHUNK key blocks at once, to the diagonal
      const int n = static_cast<int>(std::min<int64_t>(CHUNK, qb + 1 - kb)) * BLK;
      gemm(BLK, n, K, Q.data(), K, 1, Kt.data() + kb * BLK, s.lt(), S.data(), LD, false);
      for (int c = 0; c < n / BLK; ++c)
        if (masked(s, qb, kb + c, ids)) mask_block(s, qb, kb + c, seg, S.data() + c * BLK, LD);
      for (int i = 0; i < BLK; ++i) {  // the online softmax: m the running max, l the running sum
        float* row = S.data() + i * LD;
        vf mv = splat(m[i]);
        for (int j = 0; j < n; j += W) mv = vmax(mv, load(row + j));
        float mx = lanes_max(mv), base = mx == -INFINITY ? 0.f : mx;  // -inf: the row has seen no key yet
        float alpha = std::exp(m[i] - base);
        vf sum{};
        for (int j = 0; j < n; j += W) {
          vf p = vexp(load(row + j) - base);
          store(row + j, p);
          sum += p;
        }
        l[i] = l[i] * alpha + lanes_sum(sum);
        m[i] = mx;
        if (alpha != 1.f)
          for (float *out = O.data() + i * V, *end = out + V; out < end; out += W) store(out, load(out) * alpha);
      }
      gemm(BLK, V, n, S.data(), LD, 1, Vs.data() + kb * BLK * V, V, O.data(), V, true);
    }
    for (int i = 0; i < BLK && qb * BLK + i < s.T; ++i) {
      float inv = 1.f / l[i];
      float* dst = o + (qb * BLK + i) * s.H * V;
      for (int c = 0; c < V; ++c) dst[c] = O[i * V + c] * inv;
      lse[qb * BLK + i] = m[i] + std::log(l[i]);
    }
  }
}

// dk, dv of kv head g (summed over its query heads) and dq of each of those heads.
void backward_group(const Shape& s, float scale, const float* q, const float* k, const float* v, const int32_t* seg,
                    const float* o, const float* lse, const float* dout, float* dq, float* dk, float* dv, int64_t g) {
  const int64_t K = s.K, V = s.V, nb = s.Tp / BLK, R = s.H / s.G;
  std::vector<float> Ks(s.Tp * K), Kt(K * s.lt()), Vt(V * s.lt()), dK(s.Tp * K, 0.f), dV(s.Tp * V, 0.f);
  std::vector<float> Q(s.Tp * K), dO(s.Tp * V), dQ(s.Tp * K), D(s.Tp), L(s.Tp), block(BLK * std::max(K, V));
  std::vector<float> P(BLK * BLK), dS(BLK * BLK);
  const std::vector<int32_t> ids = block_ids(s, seg);
  for (int64_t b = 0; b < nb; ++b) {
    gather_rows(s, k + g * K, s.G * K, b * BLK, K, Ks.data() + b * BLK * K);
    transpose(BLK, K, Ks.data() + b * BLK * K, K, Kt.data() + b * BLK, s.lt());
    gather_rows(s, v + g * V, s.G * V, b * BLK, V, block.data());
    transpose(BLK, V, block.data(), V, Vt.data() + b * BLK, s.lt());
  }
  for (int64_t h = g * R; h < (g + 1) * R; ++h) {
    for (int64_t b = 0; b < nb; ++b) {
      gather_rows(s, q + h * K, s.H * K, b * BLK, K, Q.data() + b * BLK * K);
      gather_rows(s, dout + h * V, s.H * V, b * BLK, V, dO.data() + b * BLK * V);
    }
    for (int64_t t = 0; t < s.Tp; ++t) {  // D_i = dO_i . O_i, the softmax backward's row term
      float acc = 0;
      if (t < s.T)
        for (int64_t c = 0; c < V; ++c) acc += dout[t * s.H * V + h * V + c] * o[t * s.H * V + h * V + c];
      D[t] = acc;
      L[t] = t < s.T ? lse[h * s.T + t] : 0.f;
    }
    std::fill(dQ.begin(), dQ.end(), 0.f);
    for (int kb = 0; kb < nb; ++kb) {
      for (int qb = kb; qb < nb && sees(s, qb, kb); ++qb) {
        gemm(BLK, BLK, K, Q.data() + qb * BLK * K, K, 1, Kt.data() + kb * BLK, s.lt(), P.data(), BLK, false);
        if (masked(s, qb, kb, ids)) mask_block(s, qb, kb, seg, P.data());
        for (int i = 0; i < BLK; ++i) {
          float* row = P.data() + i * BLK;
          float li = L[qb * BLK + i];
          for (int j = 0; j < BLK; j += W) store(row + j, vexp(load(row + j) * scale - li));
        }
        gemm(BLK, V, BLK, P.data(), 1, BLK, dO.data() + qb * BLK * V, V, dV.data() + kb * BLK * V, V, true);
        gemm(BLK, BLK, V, dO.data() + qb * BLK * V, V, 1, Vt.data() + kb * BLK, s.lt(), dS.data(), BLK, false);  // dP
        for (int i = 0; i < BLK; ++i) {  // dS = P (dP - D) scale
          float* ds = dS.data() + i * BLK;
          const float* p = P.data() + i * BLK;
          vf di = splat(D[qb * BLK + i]);
          for (int j = 0; j < BLK; j += W) store(ds + j, load(p + j) * (load(ds + j) - di) * scale);
        }
        gemm(BLK, K, BLK, dS.data(), BLK, 1, Ks.data() + kb * BLK * K, K, dQ.data() + qb * BLK * K, K, true);
        gemm(BLK, K, BLK, dS.data(), 1, BLK, Q.data() + qb * BLK * K, K, dK.data() + kb * BLK * K, K, true);
      }
    }
    for (int64_t t = 0; t < s.T; ++t) std::memcpy(dq + t * s.H * K + h * K, dQ.data() + t * K, K * sizeof(float));
  }
  for (int64_t t = 0; t < s.T; ++t) {
    std::memcpy(dk + t * s.G * K + g * K, dK.data() + t * K, K * sizeof(float));
    std::memcpy(dv + t * s.G * V + g * V, dV.data() + t * V, V * sizeof(float));
  }
}

Shape shape_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, int32_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  return {qd[0], qd[1], qd[2], kd[2], qd[3], vd[3], (qd[1] + BLK - 1) / BLK * BLK, window};
}

ffi::Error check(const Shape& s) {
  if (s.K % W || s.V % W || s.H % s.G || s.window < 1)
    return ffi::Error::InvalidArgument(
        "zoo attention (cpu.cc): K and V must be multiples of 16, G divide H, the window be positive");
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse,
                   float scale, int32_t segments, int32_t window) {
  Shape s = shape_of(q, k, v, window);
  if (auto e = check(s); e.failure()) return e;
  const float *Q = q.typed_data(), *Kp = k.typed_data(), *Vp = v.typed_data();
  const int32_t* ids = seg.typed_data();
  float *Op = o->typed_data(), *Lp = lse->typed_data();
  parallel_for(pool, s.B * s.H, [&](int64_t task) {
    int64_t b = task / s.H, h = task % s.H, g = h / (s.H / s.G);
    forward_head(s, scale, Q + b * s.T * s.H * s.K + h * s.K, Kp + b * s.T * s.G * s.K + g * s.K,
                 Vp + b * s.T * s.G * s.V + g * s.V, segments ? ids + b * s.T : nullptr,
                 Op + b * s.T * s.H * s.V + h * s.V, Lp + (b * s.H + h) * s.T);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv, float scale, int32_t segments, int32_t window) {
  Shape s = shape_of(q, k, v, window);
  if (auto e = check(s); e.failure()) return e;
  parallel_for(pool, s.B * s.G, [&](int64_t task) {
    int64_t b = task / s.G, g = task % s.G;
    int64_t qo = b * s.T * s.H, ko = b * s.T * s.G;
    backward_group(s, scale, q.typed_data() + qo * s.K, k.typed_data() + ko * s.K, v.typed_data() + ko * s.V,
                   segments ? seg.typed_data() + b * s.T : nullptr, o.typed_data() + qo * s.V,
                   lse.typed_data() + b * s.H * s.T, dout.typed_data() + qo * s.V, dq->typed_data() + qo * s.K,
                   dk->typed_data() + ko * s.K, dv->typed_data() + ko * s.V, g);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("segments")
                                  .Attr<int32_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
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
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("segments")
                                  .Attr<int32_t>("window"));
