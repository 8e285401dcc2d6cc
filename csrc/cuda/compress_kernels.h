// Launchers of the CUDA kernels: raw pointers, element counts and a stream, no
// torch types, so compress_kernels.cu compiles with nvcc alone (CI has no CUDA torch).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace minddp {

// packed = src * scale in fp16 (bf16 = false) or bf16, scale from src's largest
// finite magnitude, written to *scale on the device. workspace: one uint32 of
// device memory (the running maximum's bits).
cudaError_t launch_compress(const float* src, int64_t n, bool bf16, void* packed, float* scale,
                            unsigned int* workspace, cudaStream_t stream);

// dst = packed / *scale, or dst += packed / *scale when accumulate is set.
cudaError_t launch_decompress(const void* packed, int64_t n, bool bf16, const float* scale,
                              float* dst, bool accumulate, cudaStream_t stream);

// int8 (scale.h): per block of kInt8Block values, packed = round(src * scale) with
// scale = 127 / the block's largest magnitude (NaN when the block holds inf or
// NaN), written to scales[int8_blocks(n)]; dst = packed / its block's scale, or
// dst += it.
cudaError_t launch_compress_int8(const float* src, int64_t n, signed char* packed, float* scales,
                                 cudaStream_t stream);
// The same with error feedback: packs src - error, then error[n] = decoded minus
// what was packed where finite (0 where it was inf or NaN); with decode, src =
// decoded as well.
cudaError_t launch_compress_int8_with_feedback(float* src, int64_t n, signed char* packed,
                                          float* scales, float* error, bool decode,
                                          cudaStream_t stream);
cudaError_t launch_decompress_int8(const signed char* packed, int64_t n, const float* scales,
                                   float* dst, bool accumulate, cudaStream_t stream);

}  // namespace minddp
