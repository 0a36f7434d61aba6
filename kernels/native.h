// What the CPU kernels (kernels/*/cpu.cc) share: GCC vector types, a register-blocked matrix product and a
// parallel loop on XLA's intra-op thread pool. kernels/native.py compiles each kernel with this folder on
// the include path.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace zoo {

namespace ffi = xla::ffi;

constexpr int W = 16;   // floats per vector
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// The largest and the sum of a vector's lanes, by halving.
inline float lanes_max(vf v) {
  v = vmax(v, __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmax(v, __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
  v = vmax(v, __builtin_shuffle(v, vi{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  return std::max(v[0], v[1]);
}
inline float lanes_sum(vf v) {
  v += __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, vi{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
  return v[0] + v[1];
}

// out (cols x rows, leading dimension ldo) = A^T, A (rows x cols, leading dimension lda).
inline void transpose(int rows, int cols, const float* A, int lda, float* out, int ldo) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) out[j * ldo + i] = A[i * lda + j];
}

// e^x to float precision: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite's two-part ln2), e^r by its
// Taylor series to r^7 (error < 5e-9), 2^n through the exponent bits. 0 below -87 (-inf included: the
// masked logits), x clamped to 88 above.
inline vf vexp(vf x) {
  vi zero = x < splat(-87.f);
  x = zero ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  vf n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.f / 5040);
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return zero ? vf{} : p * scale;
}

// C[R rows, NC vectors] (+)= A[R rows, 0:depth] B[0:depth, NC vectors]; A's element (r, d) at A[r * ar + d * ad].
template <int R, int NC>
inline void micro(int64_t depth, const float* A, int64_t ar, int64_t ad, const float* B, int64_t ldb, float* C,
                  int64_t ldc, bool add) {
  vf c[R][NC];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) c[r][j] = add ? load(C + r * ldc + j * W) : vf{};
  for (int64_t d = 0; d < depth; ++d) {
    vf b[NC];
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) b[j] = load(B + d * ldb + j * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vf a = splat(A[r * ar + d * ad]);
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) c[r][j] += a * b[j];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) store(C + r * ldc + j * W, c[r][j]);
}

// Rows [i, i + R) of C, columns from j on, with R x NC accumulators (R * NC = 16 registers).
template <int R, int NC>
inline void strip(int64_t M, int64_t depth, const float* A, int64_t ar, int64_t ad, const float* B, int64_t ldb,
                  float* C, int64_t ldc, bool add) {
  for (int64_t i = 0; i < M; i += R) micro<R, NC>(depth, A + i * ar, ar, ad, B, ldb, C + i * ldc, ldc, add);
}

// C (M x N) (+)= A (M x depth) B (depth x N), B and C row-major with leading dimensions, A's element (i, d) at
// A[i * ar + d * ad] (A or its transpose); M % 16 == 0, N % 16 == 0.
inline void gemm(int64_t M, int64_t N, int64_t depth, const float* A, int64_t ar, int64_t ad, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool add) {
  int64_t j = 0;
  for (; j + 4 * W <= N; j += 4 * W) strip<4, 4>(M, depth, A, ar, ad, B + j, ldb, C + j, ldc, add);
  switch ((N - j) / W) {
    case 3: strip<4, 3>(M, depth, A, ar, ad, B + j, ldb, C + j, ldc, add); break;
    case 2: strip<8, 2>(M, depth, A, ar, ad, B + j, ldb, C + j, ldc, add); break;
    case 1: strip<16, 1>(M, depth, A, ar, ad, B + j, ldb, C + j, ldc, add); break;
    default: break;
  }
}

// Runs task(0 .. n - 1) on the calling thread and XLA's intra-op pool; returns when all are done. The caller
// never waits for a pool thread to start: XLA may run two custom calls at once on its pool's threads, and a
// call that waited for its scheduled helpers would then wait forever. A helper that starts late finds no
// task left and returns; it holds the shared state, never the caller's stack.
struct ParallelFor {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n;
  const std::function<void(int64_t)>* task;
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      (*task)(i);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

inline void parallel_for(ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& task) {
  auto state = std::make_shared<ParallelFor>();
  state->n = n;
  state->task = &task;
  for (int64_t w = 0, helpers = std::min<int64_t>(pool.num_threads(), n - 1); w < helpers; ++w)
    pool.Schedule([state] { state->drain(); });
  state->drain();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() >= n; });
}

}  // namespace zoo
