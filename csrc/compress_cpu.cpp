// CPU implementations of the ops: checks, then the range kernels of cpu_kernels.h
// split over threads (at::parallel_for) for inputs past a few hundred KiB.
#include <ATen/Parallel.h>

#include "compress.h"
#include "cpu_kernels.h"
#include "scale.h"

namespace minddp {
namespace {

// 64K elements (256 KiB of fp32) per task: big enough that the thread pool's
// overhead vanishes, small enough that a 1 MiB bucket already uses 4 threads.
constexpr int64_t kGrain = 1 << 16;

float amax_range(const float* x, int64_t n) {
#ifdef MINDDP_X86_AVX512
  if (cpu_has_avx512()) return amax_avx512(x, n);
#endif
  return amax_scalar(x, n);
}

template <bool BF16> void pack_range(const float* x, int64_t n, float scale, uint16_t* out) {
#ifdef MINDDP_X86_AVX512
  if (cpu_has_avx512()) return pack_avx512<BF16>(x, n, scale, out);
#endif
  pack_scalar<BF16>(x, n, scale, out);
}

template <bool BF16, bool ADD> void unpack_range(const uint16_t* p, int64_t n, float inv, float* dst) {
#ifdef MINDDP_X86_AVX512
  if (cpu_has_avx512()) return unpack_avx512<BF16, ADD>(p, n, inv, dst);
#endif
  unpack_scalar<BF16, ADD>(p, n, inv, dst);
}

template <bool ADD> void unpack(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& dst) {
  const auto* p = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* out = dst.data_ptr<float>();
  const float inv = 1.0f / scale.item<float>();  // exact: scales are powers of two
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  at::parallel_for(0, packed.numel(), kGrain, [&](int64_t b, int64_t e) {
    bf16 ? unpack_range<true, ADD>(p + b, e - b, inv, out + b)
         : unpack_range<false, ADD>(p + b, e - b, inv, out + b);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> compress_cpu(const at::Tensor& src, at::ScalarType dtype) {
  check_compress_args(src, dtype);
  const float* x = src.data_ptr<float>();
  const int64_t n = src.numel();
  const float amax = at::parallel_reduce(
      0, n, kGrain, 0.0f,
      [&](int64_t b, int64_t e, float m) { return std::max(m, amax_range(x + b, e - b)); },
      [](float a, float b) { return std::max(a, b); });
  const float scale = scale_from_amax(amax);
  at::Tensor packed = at::empty(src.sizes(), src.options().dtype(dtype));
  auto* out = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const bool bf16 = dtype == at::kBFloat16;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    bf16 ? pack_range<true>(x + b, e - b, scale, out + b)
         : pack_range<false>(x + b, e - b, scale, out + b);
  });
  return {packed, at::full({1}, scale, src.options())};
}

at::Tensor decompress_cpu(const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress", at::Tensor(), packed, scale);
  at::Tensor dst = at::empty(packed.sizes(), packed.options().dtype(at::kFloat));
  unpack<false>(packed, scale, dst);
  return dst;
}

at::Tensor& decompress_add_cpu(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress_add_", dst, packed, scale);
  unpack<true>(packed, scale, dst);
  return dst;
}

}  // namespace minddp
