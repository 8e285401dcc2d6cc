// The one rule that picks a tensor's scale, shared by the CPU and CUDA kernels
// (and mirrored by minddp/compression_reference.py).
//
// Plain C++ with no torch or CUDA includes, so .cu files built with nvcc alone
// (the CPU-only CI machine) can use it.
#pragma once
#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MINDDP_HOST_DEVICE __host__ __device__
#else
#define MINDDP_HOST_DEVICE
#endif

namespace minddp {

// The largest finite magnitude times the scale lands in [2^14, 2^15): fp16's
// largest value is 65504 < 2^16, so a factor of two is left before rounding
// could reach inf. bf16 shares fp32's exponent range and only needs the scale
// for inputs that are fp32 subnormals; one rule keeps one code path.
constexpr int kTargetExponent = 15;

// Power of two, so multiplying by it (and dividing it back out) is exact.
// amax = 0 (all zeros, empty, or nothing finite) gives 1. The exponent is
// clamped so the scale and its reciprocal are finite fp32 numbers.
MINDDP_HOST_DEVICE inline float scale_from_amax(float amax) {
  if (!(amax > 0.0f)) return 1.0f;
  int e = 0;
  frexpf(amax, &e);  // amax = f * 2^e with f in [0.5, 1)
  int k = kTargetExponent - e;
  k = k < -126 ? -126 : (k > 127 ? 127 : k);
  return ldexpf(1.0f, k);
}

// int8 (compress to torch.int8): a block's scale maps its largest magnitude to
// 127, so values are x * scale rounded to nearest even, in [-127, 127]. Unlike
// the 16-bit formats int8 has no inf or NaN: a block holding one gets a NaN
// scale, its values pack as 0 and all decode as NaN, so an overflow still
// reaches the optimizer (GradScaler skips the step) instead of vanishing.
// amax here counts inf and NaN as infinite (int8_amax_of).
MINDDP_HOST_DEVICE inline float int8_amax_of(float x) {
  float a = fabsf(x);
  return a <= 3.40282347e38f ? a : INFINITY;  // NaN fails the comparison
}

// A largest magnitude under 2^-120 would need a scale past fp32's range: such a
// block packs as zeros (scale 1), an error below 2^-120 per value.
constexpr float kInt8SmallestAmax = 7.52316385e-37f;  // 2^-120

// int8 has one scale per block of kInt8Block elements, not one per tensor:
// with a single scale, one large gradient flattens every small one in its
// chunk to a few levels (measured on the benchmark models: 3-19% relative
// error per million-element chunk, about 1% per 1024-element block), for 4 bytes
// of scale per 1 KiB of values (0.4% more on the wire).
constexpr int64_t kInt8Block = 1024;

// Scales for n values: one per block, at least one (an empty tensor's is 1).
MINDDP_HOST_DEVICE inline int64_t int8_blocks(int64_t n) {
  return n > kInt8Block ? (n + kInt8Block - 1) / kInt8Block : 1;
}

MINDDP_HOST_DEVICE inline float int8_scale_from_amax(float amax) {
  if (amax == INFINITY) return amax - amax;  // NaN
  return amax >= kInt8SmallestAmax ? 127.0f / amax : 1.0f;
}

MINDDP_HOST_DEVICE inline signed char quantize_int8(float x, float scale) {
  float v = x * scale;
  if (!(v == v)) return 0;
  v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
  return static_cast<signed char>(rintf(v));  // round to nearest even
}

}  // namespace minddp
