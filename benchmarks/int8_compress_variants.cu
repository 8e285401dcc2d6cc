// int8 compress, the kernel in minddp._C against a candidate, on one GPU: bit for bit equal
// output, and each one's fraction of a plain copy's bandwidth (kernels.py's count: 5 bytes an
// element). A standalone program (no torch, no rebuild of the extension), so a short GPU session
// can try the candidate in seconds before moving it into csrc/cuda/compress_kernels.cu:
//
//   nvcc -O3 -std=c++17 -arch=native benchmarks/int8_compress_variants.cu -o /tmp/variants
//   /tmp/variants            # 64 MiB and 25 MiB of float32
//
// The candidate: the kernel in the extension loads a warp's 4 KiB block into registers and only
// then finds its maximum and packs it, so a warp has no loads in flight while it works (ncu on
// an H200: 62% of DRAM bandwidth, 0.75 of a copy's rate). Here each warp copies its next block
// into shared memory (cp.async) before it packs the current one, two stages a warp.
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../csrc/cuda/compress_kernels.cu"

namespace minddp {
namespace {

constexpr int kCandidateThreads = 128;  // 4 warps x 2 stages x 4 KiB = 32 KiB of shared memory
constexpr int kCandidateWarps = kCandidateThreads / 32;
constexpr int kGroups = int(kInt8Block / 4);  // 4-value groups in a block

__device__ __forceinline__ void copy_block(float4* stage, const float* x, int64_t b, int lane) {
  #pragma unroll
  for (int j = 0; j < kGroupsPerLane; ++j) {
    const int g = lane + 32 * j;
    __pipeline_memcpy_async(&stage[g], x + b * kInt8Block + 4 * g, sizeof(float4));
  }
}

// Whole, 16-byte aligned blocks only (n a multiple of kInt8Block): enough to time it.
__global__ void __launch_bounds__(kCandidateThreads)
compress_int8_pipelined(const float* x, int64_t blocks, float* scales, signed char* out) {
  __shared__ float4 staged[2][kCandidateWarps][kGroups];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kCandidateWarps;
  int64_t b = int64_t(blockIdx.x) * kCandidateWarps + warp;
  if (b < blocks) copy_block(staged[0][warp], x, b, lane);
  __pipeline_commit();
  for (int s = 0; b < blocks; b += warps, s ^= 1) {
    if (b + warps < blocks) copy_block(staged[s ^ 1][warp], x, b + warps, lane);
    __pipeline_commit();        // (an empty group at the end keeps the count)
    __pipeline_wait_prior(1);   // this block's copies are done, the next one's in flight
    const float4* mine = staged[s][warp];
    float m = 0.0f;
    #pragma unroll
    for (int j = 0; j < kGroupsPerLane; ++j) {
      const float4 a = mine[lane + 32 * j];
      m = fmaxf(fmaxf(m, fmaxf(int8_amax_of(a.x), int8_amax_of(a.y))),
                fmaxf(int8_amax_of(a.z), int8_amax_of(a.w)));
    }
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float scale = int8_scale_from_amax(m);
    if (lane == 0) scales[b] = scale;
    #pragma unroll
    for (int j = 0; j < kGroupsPerLane; ++j) {
      const int g = lane + 32 * j;
      const float4 a = mine[g];
      *reinterpret_cast<char4*>(out + b * kInt8Block + 4 * g) =
          make_char4(quantize_int8(a.x, scale), quantize_int8(a.y, scale),
                     quantize_int8(a.z, scale), quantize_int8(a.w, scale));
    }
  }
}

void launch_candidate(const float* x, int64_t n, signed char* packed, float* scales,
                      cudaStream_t stream) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaFuncSetAttribute(compress_int8_pipelined, cudaFuncAttributePreferredSharedMemoryCarveout,
                       cudaSharedmemCarveoutMaxShared);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, compress_int8_pipelined,
                                                kCandidateThreads, 0);
  const int64_t blocks = n / kInt8Block;
  const int64_t needed = (blocks + kCandidateWarps - 1) / kCandidateWarps;
  const int grid = int(std::min<int64_t>(needed, int64_t(sms) * std::max(per_sm, 1)));
  compress_int8_pipelined<<<grid, kCandidateThreads, 0, stream>>>(x, blocks, scales, packed);
}

// Holds the stream while the host enqueues what is timed (as kernels.py's torch.cuda._sleep).
__global__ void hold(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Values of very different sizes, a few blocks' maximum far above the rest.
__global__ void fill(float* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    const float unit = float(h & 0xffffff) / float(1 << 24) - 0.5f;
    x[i] = unit * ldexpf(1.0f, int(h >> 27) - 8) * ((i % 100003) == 7 ? 1e4f : 1.0f);
  }
}

}  // namespace
}  // namespace minddp

#define CHECK(call)                                                              \
  do {                                                                           \
    const cudaError_t err_ = (call);                                             \
    if (err_ != cudaSuccess) {                                                   \
      std::printf("int8_compress_variants: %s: %s\n", #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                              \
    }                                                                            \
  } while (0)

template <typename F>
float timed_ms(F run, cudaStream_t stream) {
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  minddp::hold<<<1, 1, 0, stream>>>(2000000);
  CHECK(cudaEventRecord(start, stream));
  run();
  CHECK(cudaEventRecord(end, stream));
  CHECK(cudaEventSynchronize(end));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, start, end));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  return ms;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// 0: outputs equal; 1: they differ.
int compare_at(int mib, cudaStream_t stream) {
  const int64_t n = int64_t(mib) << 18;  // float32 values, a multiple of kInt8Block
  const int64_t blocks = n / minddp::kInt8Block;
  float *x, *copy, *scales[2];
  signed char* packed[2];
  CHECK(cudaMalloc(&x, n * sizeof(float)));
  CHECK(cudaMalloc(&copy, n * sizeof(float)));
  for (int k = 0; k < 2; ++k) {
    CHECK(cudaMalloc(&packed[k], n));
    CHECK(cudaMalloc(&scales[k], blocks * sizeof(float)));
  }
  minddp::fill<<<1024, 256, 0, stream>>>(x, n);
  auto current = [&] {
    CHECK(minddp::launch_compress_int8(x, n, packed[0], scales[0], stream));
  };
  auto candidate = [&] {
    minddp::launch_candidate(x, n, packed[1], scales[1], stream);
    CHECK(cudaGetLastError());
  };
  auto plain_copy = [&] {
    CHECK(cudaMemcpyAsync(copy, x, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  };
  std::vector<float> t[3];
  for (int rep = 0; rep < 23; ++rep) {  // interleaved; the first two warm up
    const float a = timed_ms(plain_copy, stream), b = timed_ms(current, stream),
                c = timed_ms(candidate, stream);
    if (rep >= 2) {
      t[0].push_back(a);
      t[1].push_back(b);
      t[2].push_back(c);
    }
  }
  std::vector<signed char> p0(n), p1(n);
  std::vector<float> s0(blocks), s1(blocks);
  CHECK(cudaMemcpy(p0.data(), packed[0], n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(p1.data(), packed[1], n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(s0.data(), scales[0], blocks * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(s1.data(), scales[1], blocks * sizeof(float), cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(p0.data(), p1.data(), n) == 0 &&
                    std::memcmp(s0.data(), s1.data(), blocks * sizeof(float)) == 0;
  const double copy_gbs = 8.0 * n / (median(t[0]) * 1e6);
  std::printf("%d MiB: copy %.1f GB/s; compress to int8, fraction of the copy's rate: "
              "minddp._C %.2f (%.1f us), candidate %.2f (%.1f us); outputs %s\n",
              mib, copy_gbs, 5.0 * n / (median(t[1]) * 1e6) / copy_gbs, median(t[1]) * 1e3,
              5.0 * n / (median(t[2]) * 1e6) / copy_gbs, median(t[2]) * 1e3,
              same ? "bitwise equal" : "DIFFER");
  for (int k = 0; k < 2; ++k) {
    CHECK(cudaFree(packed[k]));
    CHECK(cudaFree(scales[k]));
  }
  CHECK(cudaFree(x));
  CHECK(cudaFree(copy));
  return same ? 0 : 1;
}

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("int8_compress_variants: no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("int8_compress_variants on %s, median of 21 interleaved repetitions\n", prop.name);
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  const int differ = compare_at(64, stream) + compare_at(25, stream);
  CHECK(cudaStreamDestroy(stream));
  return differ == 0 ? 0 : 1;
}
