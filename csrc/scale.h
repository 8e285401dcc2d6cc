// The one rule that picks a tensor's scale, shared by the CPU and CUDA kernels
// (and mirrored by minddp/compression_reference.py).
//
// Plain C++ with no torch or CUDA includes, so .cu files built with nvcc alone
// (the CPU-only CI machine) can use it.
#pragma once
#include <cmath>

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

}  // namespace minddp
