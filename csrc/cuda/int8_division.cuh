// q / scale correctly rounded, as the reference's division, for an int8 value q and an int8
// block's scale: the one division decompress makes per value, done in three operations.
#pragma once
#include <cuda_runtime.h>

namespace minddp {

// inv = __frcp_rn(scale), once per scale. q * inv is within an ulp of q / scale, so its
// remainder q - scale * (q * inv) is exact in an FMA, and one more FMA rounds the corrected
// quotient (Markstein's theorem): three operations against __fdiv_rn's dozen and a reciprocal.
// The theorem needs no overflow or underflow on the way, so scales outside [2^-100, 2^100]
// (a block's largest magnitude within 2^7 of fp32's ends) and NaN take __fdiv_rn.
// tools/check_int8_division.cu compares the two for every q and every scale in that range.
__device__ __forceinline__ float divide_int8(float q, float scale, float inv) {
  if (!(scale >= 0x1p-100f && scale <= 0x1p100f)) return __fdiv_rn(q, scale);
  const float q0 = __fmul_rn(q, inv);
  return __fmaf_rn(__fmaf_rn(-q0, scale, q), inv, q0);
}

}  // namespace minddp
