// The compress kernels in minddp._C against candidates, on one GPU: bit for bit equal output,
// and each one's fraction of a plain copy's bandwidth (kernels.py's count: 6 bytes an element for
// fp16, 5 for int8; every call, the copy's too, starts from a cold L2, which kernels.py does not
// arrange, so the two programs' fractions differ a little). A standalone program (no torch, no rebuild of the extension), so a short GPU
// session can try a candidate in seconds before moving it into csrc/cuda/compress_kernels.cu:
//
//   nvcc -O3 -std=c++17 -arch=native benchmarks/compress_variants.cu -o /tmp/variants
//   /tmp/variants            # 64 MiB and 25 MiB of float32
//
// int8: the kernel in the extension loads a warp's 4 KiB block into registers and only then
// finds its maximum and packs it, so a warp has no loads in flight while it works (ncu on an
// H200: 62% of DRAM bandwidth, 0.75 of a copy's rate). The candidate copies each warp's next
// block into shared memory (cp.async) before it packs the current one, two stages a warp.
//
// fp16: the extension reads the tensor twice (its maximum, then the packing), at most 0.6 of a
// copy's rate by this count. Where the tensor fits in the SMs' shared memory together (25 MiB
// on an H100 or H200: 132 SMs x 227 KiB), the candidate reads it once: each block keeps its
// slice on chip, the blocks agree on the maximum at one grid-wide barrier (a cooperative
// launch), then pack from shared memory. Larger tensors: not run ("does not fit").
#include <cooperative_groups.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
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

// fp16 in one read: a block per SM, its slice of the 4-value groups staged in dynamic shared
// memory. Launched cooperatively (every block resident), so grid.sync() is a barrier over all.
__global__ void __launch_bounds__(1024)
compress_fp16_on_chip(const float* x, int64_t n, unsigned int* amax_bits, float* scale_out,
                      __half* out) {
  extern __shared__ float4 slice[];
  __shared__ float warp_max[32];
  const int64_t groups = n / 4, per_block = (groups + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(groups, int64_t(blockIdx.x) * per_block);
  const int64_t end = min(groups, begin + per_block);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t g = begin + threadIdx.x; g < end; g += blockDim.x) {
    __pipeline_memcpy_async(&slice[g - begin], &x4[g], sizeof(float4));
  }
  __pipeline_commit();
  __pipeline_wait_prior(0);  // each thread reads back only the groups it copied
  float m = 0.0f;
  for (int64_t g = begin + threadIdx.x; g < end; g += blockDim.x) {
    const float4 v = slice[g - begin];
    m = fmaxf(fmaxf(m, fmaxf(magnitude(v.x), magnitude(v.y))),
              fmaxf(magnitude(v.z), magnitude(v.w)));
  }
  if (blockIdx.x == 0) {  // the last n % 4 values
    for (int64_t k = groups * 4 + threadIdx.x; k < n; k += blockDim.x) {
      m = fmaxf(m, magnitude(x[k]));
    }
  }
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x / 32); ++w) m = fmaxf(m, warp_max[w]);
    atomicMax(amax_bits, __float_as_uint(m));
  }
  cooperative_groups::this_grid().sync();
  const float scale = scale_from_amax(__uint_as_float(__ldcg(amax_bits)));
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = scale;
  for (int64_t g = begin + threadIdx.x; g < end; g += blockDim.x) {
    const float4 v = slice[g - begin];
    Four<__half> o;
    store(&o.v[0], __fmul_rn(v.x, scale)); store(&o.v[1], __fmul_rn(v.y, scale));
    store(&o.v[2], __fmul_rn(v.z, scale)); store(&o.v[3], __fmul_rn(v.w, scale));
    reinterpret_cast<Four<__half>*>(out)[g] = o;
  }
  if (blockIdx.x == 0) {
    for (int64_t k = groups * 4 + threadIdx.x; k < n; k += blockDim.x) {
      store(&out[k], __fmul_rn(x[k], scale));
    }
  }
}

// Sets *fits (one block an SM, its slice within the opt-in shared memory) and, where it fits,
// launches; returns the launch's error.
cudaError_t launch_fp16_candidate(const float* x, int64_t n, __half* packed, float* scale,
                                  unsigned int* workspace, cudaStream_t stream, bool* fits) {
  int device = 0, sms = 0, most = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  const int64_t per_block = (n / 4 + sms - 1) / sms;
  const size_t bytes = size_t(per_block) * sizeof(float4);
  *fits = bytes <= size_t(most) - 32 * sizeof(float);
  if (!*fits) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(compress_fp16_on_chip,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (err == cudaSuccess) err = cudaMemsetAsync(workspace, 0, sizeof(unsigned int), stream);
  if (err != cudaSuccess) return err;
  void* args[] = {const_cast<float**>(&x), &n, &workspace, &scale, &packed};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(compress_fp16_on_chip), dim3(sms),
                                     dim3(1024), args, bytes, stream);
}

// Reads n floats, run before each timed call: every call starts from a cold L2, and what the
// call before it left there (dirty lines too) is written back outside the timed interval.
__global__ void scrub(const float* buffer, int64_t n, float* sink) {
  float sum = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    sum += buffer[i];
  }
  if (sum == 1234.5f) *sink = sum;  // (never: the buffer is zeros) keeps the loads
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
      std::printf("compress_variants: %s: %s\n", #call, cudaGetErrorString(err_));      \
      std::exit(2);                                                              \
    }                                                                            \
  } while (0)

struct Scrub {
  float* buffer = nullptr;
  int64_t n = 0;
};

template <typename F>
float timed_ms(F run, const Scrub& scrub, cudaStream_t stream) {
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  minddp::scrub<<<1024, 256, 0, stream>>>(scrub.buffer, scrub.n, scrub.buffer);
  minddp::hold<<<1, 1, 0, stream>>>(2000000);
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(start, stream));
  run();
  CHECK(cudaEventRecord(end, stream));
  if (cudaEventQuery(start) != cudaErrorNotReady) {
    std::printf("  (a sample's interval includes host dispatch: the hold ended too soon)\n");
  }
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

// Whether `bytes` of device memory at a and b are equal.
bool same_bytes(const void* a, const void* b, size_t bytes) {
  std::vector<char> ha(bytes), hb(bytes);
  CHECK(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost));
  return std::memcmp(ha.data(), hb.data(), bytes) == 0;
}

// Each kernel's fraction of the copy's rate, printed; returns how many candidates' outputs differ.
int compare_at(int mib, const Scrub& scrub, cudaStream_t stream) {
  const int64_t n = int64_t(mib) << 18;  // float32 values, a multiple of kInt8Block
  const int64_t blocks = n / minddp::kInt8Block;
  float *x, *copy, *scales8[2], *scale16[2];
  signed char* packed8[2];
  __half* packed16[2];
  unsigned int* workspace[2];
  CHECK(cudaMalloc(&x, n * sizeof(float)));
  CHECK(cudaMalloc(&copy, n * sizeof(float)));
  for (int k = 0; k < 2; ++k) {
    CHECK(cudaMalloc(&packed8[k], n));
    CHECK(cudaMalloc(&scales8[k], blocks * sizeof(float)));
    CHECK(cudaMalloc(&packed16[k], n * sizeof(__half)));
    CHECK(cudaMalloc(&scale16[k], sizeof(float)));
    CHECK(cudaMalloc(&workspace[k], sizeof(unsigned int)));
  }
  minddp::fill<<<1024, 256, 0, stream>>>(x, n);
  bool fits = false;
  CHECK(minddp::launch_fp16_candidate(x, n, packed16[1], scale16[1], workspace[1], stream,
                                      &fits));
  CHECK(cudaStreamSynchronize(stream));
  // name, bytes an element kernels.py counts, the call
  const std::vector<std::tuple<const char*, double, std::function<void()>>> runs = {
      {"copy", 8.0, [&] {
         CHECK(cudaMemcpyAsync(copy, x, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
       }},
      {"int8, minddp._C", 5.0, [&] {
         CHECK(minddp::launch_compress_int8(x, n, packed8[0], scales8[0], stream));
       }},
      {"int8, candidate", 5.0, [&] {
         minddp::launch_candidate(x, n, packed8[1], scales8[1], stream);
         CHECK(cudaGetLastError());
       }},
      {"fp16, minddp._C", 6.0, [&] {
         CHECK(minddp::launch_compress(x, n, false, packed16[0], scale16[0], workspace[0],
                                       stream));
       }},
      {"fp16, candidate", 6.0, [&] {
         bool fitted = false;
         CHECK(minddp::launch_fp16_candidate(x, n, packed16[1], scale16[1], workspace[1], stream,
                                             &fitted));
       }},
  };
  const size_t used = fits ? runs.size() : runs.size() - 1;
  std::vector<std::vector<float>> t(used);
  for (int rep = 0; rep < 23; ++rep) {  // interleaved, in a rotating order; two warm up
    for (size_t k = 0; k < used; ++k) {
      const size_t i = (k + rep) % used;
      const float ms = timed_ms(std::get<2>(runs[i]), scrub, stream);
      if (rep >= 2) t[i].push_back(ms);
    }
  }
  const double copy_gbs = 8.0 * n / (median(t[0]) * 1e6);
  std::printf("%d MiB: copy %.1f GB/s (%.1f us); fraction of the copy's rate:\n", mib, copy_gbs,
              median(t[0]) * 1e3);
  for (size_t i = 1; i < runs.size(); ++i) {
    if (i >= used) {
      std::printf("  %-16s does not fit on chip\n", std::get<0>(runs[i]));
      continue;
    }
    std::printf("  %-16s %.2f (%.1f us)\n", std::get<0>(runs[i]),
                std::get<1>(runs[i]) * n / (median(t[i]) * 1e6) / copy_gbs, median(t[i]) * 1e3);
  }
  const bool same8 = same_bytes(packed8[0], packed8[1], n) &&
                     same_bytes(scales8[0], scales8[1], blocks * sizeof(float));
  const bool same16 = !fits || (same_bytes(packed16[0], packed16[1], n * sizeof(__half)) &&
                                same_bytes(scale16[0], scale16[1], sizeof(float)));
  std::printf("  outputs: int8 candidate %s, fp16 candidate %s\n",
              same8 ? "bitwise equal" : "DIFFER",
              !fits ? "not run" : same16 ? "bitwise equal" : "DIFFER");
  for (int k = 0; k < 2; ++k) {
    CHECK(cudaFree(packed8[k]));
    CHECK(cudaFree(scales8[k]));
    CHECK(cudaFree(packed16[k]));
    CHECK(cudaFree(scale16[k]));
    CHECK(cudaFree(workspace[k]));
  }
  CHECK(cudaFree(x));
  CHECK(cudaFree(copy));
  return int(!same8) + int(!same16);
}

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out at once, even into a pipe
  int count = 0;
  const cudaError_t found = cudaGetDeviceCount(&count);
  if (found != cudaSuccess || count == 0) {
    std::printf("compress_variants: no CUDA device (%s)\n", cudaGetErrorString(found));
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("compress_variants on %s, median of 21 interleaved repetitions, each from a cold "
              "L2\n", prop.name);
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  Scrub scrub;
  scrub.n = 2 * int64_t(prop.l2CacheSize) / int64_t(sizeof(float));
  CHECK(cudaMalloc(&scrub.buffer, scrub.n * sizeof(float)));
  CHECK(cudaMemset(scrub.buffer, 0, scrub.n * sizeof(float)));
  const int differ = compare_at(64, scrub, stream) + compare_at(25, scrub, stream);
  CHECK(cudaFree(scrub.buffer));
  CHECK(cudaStreamDestroy(stream));
  return differ == 0 ? 0 : 1;
}
