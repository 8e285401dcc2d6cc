// Exhaustive check of divide_int8 (csrc/cuda/int8_division.cuh): for every int8 value q and
// every fp32 scale in [2^-100, 2^100] (1.7e9 scales, the range where it skips the division),
// its result has the bits of __fdiv_rn(q, scale), the correctly rounded quotient. Needs a GPU;
// under a second on an H100. make gpu-check runs it (step 2):
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/check_int8_division.cu -o /tmp/check && /tmp/check
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "../csrc/cuda/int8_division.cuh"

__global__ void compare(uint32_t first, uint32_t count, unsigned long long* wrong,
                        uint32_t* example) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t k = blockIdx.x * blockDim.x + threadIdx.x; k < count; k += stride) {
    const float scale = __uint_as_float(first + k);
    const float inv = __frcp_rn(scale);
    for (int q = -128; q <= 127; ++q) {
      const float got = minddp::divide_int8(float(q), scale, inv);
      if (__float_as_uint(got) != __float_as_uint(__fdiv_rn(float(q), scale)) &&
          atomicAdd(wrong, 1ull) == 0) {
        example[0] = first + k;
        example[1] = uint32_t(q);
      }
    }
  }
}

int main() {
  const uint32_t first = 27u << 23, last = 227u << 23;  // the bits of 2^-100 and 2^100
  unsigned long long* wrong = nullptr;
  uint32_t* example = nullptr;
  if (cudaMallocManaged(&wrong, sizeof *wrong) != cudaSuccess ||
      cudaMallocManaged(&example, 2 * sizeof *example) != cudaSuccess) {
    std::printf("check_int8_division: no CUDA device\n");
    return 2;
  }
  *wrong = 0;
  compare<<<4096, 256>>>(first, last - first + 1, wrong, example);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("check_int8_division: %s\n", cudaGetErrorString(err));
    return 2;
  }
  const double pairs = double(last - first + 1) * 256;
  if (*wrong != 0) {
    float scale;
    std::memcpy(&scale, &example[0], sizeof scale);
    std::printf("check_int8_division: FAIL: %llu of %.3g quotients differ from __fdiv_rn, "
                "e.g. q = %d, scale = %a\n", *wrong, pairs, int(example[1]), scale);
    return 1;
  }
  std::printf("check_int8_division: PASS: all %.3g quotients (q in [-128, 127], scale in "
              "[2^-100, 2^100]) equal __fdiv_rn's bit for bit\n", pairs);
  return 0;
}
