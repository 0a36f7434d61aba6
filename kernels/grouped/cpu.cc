// Grouped matrix products on CPU for a dropless mixture of experts, as XLA FFI custom calls (kernels/grouped
// compiles this file on first use through kernels/native.py):
//
//   ZooGroupedProduct: y (M, N) = x (M, K) w[e] (K, N) for the rows of group e, the groups' rows one after the
//     other (group e: sizes[e] rows from sizes[0] + ... + sizes[e-1]); rows past the groups' total are 0.
//   ZooGroupedWeights: dw[e] (K, N) = x_e^T dy_e, the rows of group e of x (M, K) and dy (M, N): w's gradient.
//
// Each group's rows are multiplied by its own weights alone (no padding to tiles, no masked dense product);
// K and N are multiples of 16 (kernels/grouped/__init__.py pads them). Work is split into 64-row chunks of
// a group (the product) or 16-row strips of K per group (the weights), on XLA's intra-op thread pool.

#include <vector>

#include "native.h"

namespace ffi = xla::ffi;

namespace {

using namespace zoo;

constexpr int CHUNK = 64;  // rows of x per task

// Each group's first row, clamped to M.
std::vector<int64_t> starts(const int32_t* sizes, int64_t E, int64_t M) {
  std::vector<int64_t> at(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) at[e + 1] = std::min<int64_t>(M, at[e] + std::max(0, sizes[e]));
  return at;
}

ffi::Error Product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], E = w.dimensions()[0], N = w.dimensions()[2];
  if (K % W || N % W || w.dimensions()[1] != K)
    return ffi::Error::InvalidArgument("zoo grouped product (cpu.cc): K, N multiples of 16, w (E, K, N)");
  std::vector<int64_t> at = starts(sizes.typed_data(), E, M);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, first row)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = at[e]; r < at[e + 1]; r += CHUNK) tasks.emplace_back(e, r);
  const float *X = x.typed_data(), *Wp = w.typed_data();
  float* Y = y->typed_data();
  std::memset(Y + at[E] * N, 0, (M - at[E]) * N * sizeof(float));
  parallel_for(pool, tasks.size(), [&](int64_t t) {
    auto [e, r] = tasks[t];
    int64_t rows = std::min<int64_t>(CHUNK, at[e + 1] - r), whole = rows / 16 * 16;
    if (whole) gemm(whole, N, K, X + r * K, K, 1, Wp + e * K * N, N, Y + r * N, N, false);
    if (rows > whole) {  // the last rows, through a block of 16 padded with zeros
      std::vector<float> a(16 * K, 0.f), c(16 * N);
      std::memcpy(a.data(), X + (r + whole) * K, (rows - whole) * K * sizeof(float));
      gemm(16, N, K, a.data(), K, 1, Wp + e * K * N, N, c.data(), N, false);
      std::memcpy(Y + (r + whole) * N, c.data(), (rows - whole) * N * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

ffi::Error Weights(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                   ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> dw) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = dy.dimensions()[1], E = sizes.dimensions()[0];
  if (K % W || N % W || dy.dimensions()[0] != M)
    return ffi::Error::InvalidArgument("zoo grouped weights (cpu.cc): K, N multiples of 16, x (M, K), dy (M, N)");
  std::vector<int64_t> at = starts(sizes.typed_data(), E, M);
  const float *X = x.typed_data(), *D = dy.typed_data();
  float* G = dw->typed_data();
  const int64_t strips = K / 16;
  parallel_for(pool, E * strips, [&](int64_t t) {
    int64_t e = t / strips, k0 = t % strips * 16, rows = at[e + 1] - at[e];
    float* out = G + (e * K + k0) * N;
    if (rows == 0) std::memset(out, 0, 16 * N * sizeof(float));
    else gemm(16, N, rows, X + at[e] * K + k0, 1, K, D + at[e] * N, N, out, N, false);  // x_e^T, strip k0
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooGroupedProduct, Product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooGroupedWeights, Weights,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
