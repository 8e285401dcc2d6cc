// CPU implementations of the ops: checks, then the range kernels of cpu_kernels.h
// split over threads (at::parallel_for) for inputs past a few hundred KiB.
#include <ATen/Parallel.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "compress.h"
#include "cpu_kernels.h"
#include "scale.h"

namespace minddp {
namespace {

// 64K elements (256 KiB of fp32) per task: big enough that the thread pool's
// overhead vanishes, small enough that a 1 MiB bucket already uses 4 threads.
constexpr int64_t kGrain = 1 << 16;
constexpr int64_t kBlock = 1 << 14;  // compress: 64 KiB of fp32, stays in L2 between its two reads

// Outputs from 8 MiB up are written with non-temporal stores (cpu_kernels.h):
// a ring segment (1 MiB) is sent right away and should stay in cache, a
// whole 25 MiB bucket or a benchmark's 64 MiB tensor will not.
constexpr int64_t kStreamBytes = 8 << 20;

bool streams(const void* out, int64_t bytes) {
  return bytes >= kStreamBytes && reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

float amax_range(const float* x, int64_t n) {
#ifdef MINDDP_X86_SIMD
  if (cpu_isa() == Isa::kAvx512) return amax_avx512(x, n);
  if (cpu_isa() == Isa::kAvx2) return amax_avx2(x, n);
#endif
  return amax_scalar(x, n);
}

template <bool BF16>
void pack_range(const float* x, int64_t n, float scale, uint16_t* out, bool stream) {
#ifdef MINDDP_X86_SIMD
  if (cpu_isa() == Isa::kAvx512) return pack_avx512<BF16>(x, n, scale, out, stream);
  if (cpu_isa() == Isa::kAvx2) return pack_avx2<BF16>(x, n, scale, out, stream);
#endif
  pack_scalar<BF16>(x, n, scale, out);
}

template <bool BF16, bool ADD>
void unpack_range(const uint16_t* p, int64_t n, float inv, float* dst, bool stream) {
#ifdef MINDDP_X86_SIMD
  if (cpu_isa() == Isa::kAvx512) return unpack_avx512<BF16, ADD>(p, n, inv, dst, stream);
  if (cpu_isa() == Isa::kAvx2) return unpack_avx2<BF16, ADD>(p, n, inv, dst, stream);
#endif
  unpack_scalar<BF16, ADD>(p, n, inv, dst);
}

void int8_block(const float* x, int64_t n, float* scale, signed char* out) {
#ifdef MINDDP_X86_SIMD
  if (cpu_isa() != Isa::kScalar) {
    *scale = int8_scale_from_amax(int8_amax_avx2(x, n));
    return int8_pack_avx2(x, n, *scale, out);
  }
#endif
  *scale = int8_scale_from_amax(int8_amax_scalar(x, n));
  int8_pack_scalar(x, n, *scale, out);
}

template <bool ADD> void int8_unblock(const signed char* p, int64_t n, float scale, float* dst) {
#ifdef MINDDP_X86_SIMD
  if (cpu_isa() != Isa::kScalar) return int8_unpack_avx2<ADD>(p, n, scale, dst);
#endif
  int8_unpack_scalar<ADD>(p, n, scale, dst);
}

void int8_record(const signed char* p, int64_t n, float scale, const float* fed, float* error,
                 float* decoded) {
#ifdef MINDDP_X86_SIMD
  if (cpu_isa() != Isa::kScalar) {
    return decoded ? int8_record_avx2<true>(p, n, scale, fed, error, decoded)
                   : int8_record_avx2<false>(p, n, scale, fed, error, decoded);
  }
#endif
  decoded ? int8_record_scalar<true>(p, n, scale, fed, error, decoded)
          : int8_record_scalar<false>(p, n, scale, fed, error, decoded);
}

// int8: one scale per kInt8Block values (scale.h), each block's maximum taken and
// its values packed while the block is in L1. With error feedback
// (compress_with_feedback) the block packed is the values minus their error, and
// the error becomes what packing it changed, in the same visit.
void compress_int8(const at::Tensor& src, at::Tensor& packed, at::Tensor& scale,
                   float* error = nullptr, bool decode = false) {
  float* x = src.data_ptr<float>();
  const int64_t n = src.numel(), blocks = int8_blocks(n);
  auto* out = reinterpret_cast<signed char*>(packed.data_ptr());
  float* scales = scale.data_ptr<float>();
  at::parallel_for(0, blocks, kGrain / kInt8Block, [&](int64_t b0, int64_t b1) {
    float fed[kInt8Block];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kInt8Block, len = std::min(kInt8Block, n - begin);
      if (error == nullptr) {
        int8_block(x + begin, len, scales + b, out + begin);
        continue;
      }
      for (int64_t i = 0; i < len; ++i) fed[i] = x[begin + i] - error[begin + i];
      int8_block(fed, len, scales + b, out + begin);
      int8_record(out + begin, len, scales[b], fed, error + begin, decode ? x + begin : nullptr);
    }
  });
}

template <bool ADD>
void unpack_int8(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& dst) {
  const auto* p = reinterpret_cast<const signed char*>(packed.data_ptr());
  float* out = dst.data_ptr<float>();
  const float* scales = scale.data_ptr<float>();
  const int64_t n = packed.numel();
  at::parallel_for(0, int8_blocks(n), kGrain / kInt8Block, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kInt8Block;
      int8_unblock<ADD>(p + begin, std::min(kInt8Block, n - begin), scales[b], out + begin);
    }
  });
}

template <bool ADD> void unpack(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& dst) {
  if (packed.scalar_type() == at::kChar) return unpack_int8<ADD>(packed, scale, dst);
  const auto* p = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* out = dst.data_ptr<float>();
  const float inv = 1.0f / scale.item<float>();  // exact: scales are powers of two
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  // Chunks start at multiples of kGrain elements, so an aligned start stays aligned.
  const bool stream = !ADD && streams(out, dst.nbytes());
  at::parallel_for(0, packed.numel(), kGrain, [&](int64_t b, int64_t e) {
    bf16 ? unpack_range<true, ADD>(p + b, e - b, inv, out + b, stream)
         : unpack_range<false, ADD>(p + b, e - b, inv, out + b, stream);
  });
}


// One pass in the common case: each 64 KiB block is packed right after its
// maximum is taken, while it is still in cache, with the scale of the largest
// magnitude seen so far by any thread. A block packed before a larger value
// turned up is packed again at the end with the final scale, so the result
// is exactly the two-pass one; at worst (growing magnitudes) it costs a second pass.
void compress_16bit(const at::Tensor& src, at::Tensor& packed, at::Tensor& scale_out) {
  const float* x = src.data_ptr<float>();
  const int64_t n = src.numel(), blocks = (n + kBlock - 1) / kBlock;
  auto* out = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const bool bf16 = packed.scalar_type() == at::kBFloat16, stream = streams(out, packed.nbytes());
  std::vector<float> used(blocks);  // the scale each block was packed with
  auto pack_block = [&](int64_t b, float scale) {
    const int64_t begin = b * kBlock, len = std::min(kBlock, n - begin);
    bf16 ? pack_range<true>(x + begin, len, scale, out + begin, stream)
         : pack_range<false>(x + begin, len, scale, out + begin, stream);
    used[b] = scale;
  };
  // Non-negative floats order like their bit patterns: an integer max works.
  std::atomic<uint32_t> seen{0};
  at::parallel_for(0, blocks, kGrain / kBlock, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float m = amax_range(x + b * kBlock, std::min(kBlock, n - b * kBlock));
      uint32_t prev = seen.load(std::memory_order_relaxed);
      while (c10::bit_cast<uint32_t>(m) > prev &&
             !seen.compare_exchange_weak(prev, c10::bit_cast<uint32_t>(m))) {}
      pack_block(b, scale_from_amax(std::max(m, c10::bit_cast<float>(prev))));
    }
  });
  const float scale = scale_from_amax(c10::bit_cast<float>(seen.load()));
  at::parallel_for(0, blocks, kGrain / kBlock, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (used[b] != scale) pack_block(b, scale);
    }
  });
  scale_out.fill_(scale);
}

void compress_into(const at::Tensor& src, at::Tensor& packed, at::Tensor& scale) {
  if (packed.scalar_type() == at::kChar) return compress_int8(src, packed, scale);
  compress_16bit(src, packed, scale);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> compress_cpu(const at::Tensor& src, at::ScalarType dtype) {
  check_compress_args(src, dtype);
  at::Tensor packed = at::empty(src.sizes(), src.options().dtype(dtype));
  at::Tensor scale = at::empty({compress_scales(src.numel(), dtype)}, src.options());
  compress_into(src, packed, scale);
  return {packed, scale};
}

std::tuple<at::Tensor&, at::Tensor&> compress_out_cpu(const at::Tensor& src, at::ScalarType dtype,
                                                      at::Tensor& packed, at::Tensor& scale) {
  check_compress_out_args(src, dtype, packed, scale);
  compress_into(src, packed, scale);
  return {packed, scale};
}

std::tuple<at::Tensor, at::Tensor> compress_with_feedback_cpu(at::Tensor& src, at::ScalarType dtype,
                                                         at::Tensor& error, bool decode) {
  check_feedback_args(src, dtype, error);
  at::Tensor packed = at::empty(src.sizes(), src.options().dtype(at::kChar));
  at::Tensor scale = at::empty({int8_blocks(src.numel())}, src.options());
  compress_int8(src, packed, scale, error.data_ptr<float>(), decode);
  return {packed, scale};
}

at::Tensor decompress_cpu(const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress", at::Tensor(), packed, scale);
  at::Tensor dst = at::empty(packed.sizes(), packed.options().dtype(at::kFloat));
  unpack<false>(packed, scale, dst);
  return dst;
}

at::Tensor& decompress_out_cpu(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& out) {
  check_decompress_args("minddp.decompress.out", out, packed, scale);
  unpack<false>(packed, scale, out);
  return out;
}

at::Tensor& decompress_add_cpu(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress_add_", dst, packed, scale);
  unpack<true>(packed, scale, dst);
  return dst;
}

}  // namespace minddp
