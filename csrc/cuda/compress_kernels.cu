// CUDA kernels for compress / decompress / decompress_add_. Grid-stride loops
// over 4-element groups (one 16-byte load of fp32, one 8-byte access of packed
// data) where the pointers allow it, element by element otherwise (chunks of a
// bucket can start anywhere). The scale never leaves the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../scale.h"
#include "compress_kernels.h"
#include "int8_division.cuh"

namespace minddp {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T> struct alignas(4 * sizeof(T)) Four { T v[4]; };

// 16-bit formats: inf/NaN are skipped, they must not set the scale and pass
// through as themselves.
__device__ __forceinline__ float magnitude(float x) {
  float a = fabsf(x);
  return a < INFINITY ? a : 0.0f;
}

// Independent 16-byte loads a thread keeps in flight in the 16-bit kernels: one at a time
// leaves each SM too few bytes in flight to cover the memory's latency.
constexpr int kLoads = 4;

__global__ void amax_kernel(const float* x, int64_t n, bool vec, unsigned int* amax_bits) {
  __shared__ float warp_max[kThreads / 32];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, start = 0;
  float m = 0.0f;
  if (vec) {
    const int64_t groups = n / 4;
    for (int64_t g = i; g < groups; g += kLoads * stride) {
      float4 v[kLoads];
      #pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t h = g + u * stride;
        v[u] = h < groups ? reinterpret_cast<const float4*>(x)[h] : make_float4(0, 0, 0, 0);
      }
      #pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        m = fmaxf(fmaxf(m, fmaxf(magnitude(v[u].x), magnitude(v[u].y))),
                  fmaxf(magnitude(v[u].z), magnitude(v[u].w)));
      }
    }
    start = groups * 4;
  }
  for (int64_t k = start + i; k < n; k += stride) m = fmaxf(m, magnitude(x[k]));
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    // Non-negative floats order like their bit patterns, so an integer max works.
    atomicMax(amax_bits, __float_as_uint(m));
  }
}

// The second read of the input goes back to front: amax_kernel read the end last, so that
// part may still be in L2 (a gradient bucket, 25 MiB by default, fits the L2 of an H100).
template <typename T>
__global__ void pack_kernel(const float* x, int64_t n, bool vec, const unsigned int* amax_bits,
                            float* scale_out, T* out) {
  const float scale = scale_from_amax(__uint_as_float(*amax_bits));
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = scale;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, start = 0;
  if (vec) {
    const int64_t groups = n / 4, span = kLoads * stride;
    for (int64_t base = groups > 0 ? (groups - 1) / span * span : -1; base >= 0; base -= span) {
      float4 v[kLoads];
      #pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t h = base + i + u * stride;
        if (h < groups) v[u] = reinterpret_cast<const float4*>(x)[h];
      }
      #pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t h = base + i + u * stride;
        if (h >= groups) break;
        Four<T> o;
        store(&o.v[0], __fmul_rn(v[u].x, scale)); store(&o.v[1], __fmul_rn(v[u].y, scale));
        store(&o.v[2], __fmul_rn(v[u].z, scale)); store(&o.v[3], __fmul_rn(v[u].w, scale));
        reinterpret_cast<Four<T>*>(out)[h] = o;
      }
    }
    start = groups * 4;
  }
  for (int64_t k = start + i; k < n; k += stride) store(&out[k], __fmul_rn(x[k], scale));
}

// __fmul_rn/__fadd_rn are never contracted into an FMA: two roundings, exactly
// as torch's `dst.add_(packed.float() / scale)` (the reference).
template <typename T, bool ADD>
__global__ void unpack_kernel(const T* p, int64_t n, bool vec, const float* scale, float* dst) {
  const float inv = 1.0f / *scale;  // exact: scales are powers of two
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, start = 0;
  if (vec) {
    for (int64_t g = i; g < n / 4; g += stride) {
      Four<T> q = reinterpret_cast<const Four<T>*>(p)[g];
      float4 v = make_float4(__fmul_rn(load(&q.v[0]), inv), __fmul_rn(load(&q.v[1]), inv),
                             __fmul_rn(load(&q.v[2]), inv), __fmul_rn(load(&q.v[3]), inv));
      float4* d = reinterpret_cast<float4*>(dst) + g;
      if (ADD) {
        float4 o = *d;
        v = make_float4(__fadd_rn(o.x, v.x), __fadd_rn(o.y, v.y), __fadd_rn(o.z, v.z),
                        __fadd_rn(o.w, v.w));
      }
      *d = v;
    }
    start = n / 4 * 4;
  }
  for (int64_t k = start + i; k < n; k += stride) {
    float v = __fmul_rn(load(&p[k]), inv);
    dst[k] = ADD ? __fadd_rn(dst[k], v) : v;
  }
}

// int8: one warp per int8 block (scale.h) at a time, so a block's maximum needs
// shuffles only, no __syncthreads. Lane t holds the block's 4-value groups t,
// t + 32, ... in registers (each a 16-byte load, 512 contiguous bytes a warp)
// while the maximum is found, then packs them with the block's scale (4-byte
// stores). Where a pointer is misaligned or the block is the short last one,
// the same lanes go value by value.
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kGroupsPerLane = int(kInt8Block / 4 / 32);
static_assert(kInt8Block % 128 == 0, "an int8 block must split into 4-value groups over a warp");

// With FEEDBACK (compress_with_feedback) the values packed are x - error, and error
// becomes decoded - (x - error) where finite, 0 elsewhere (int8_record_scalar);
// with `decode`, x = decoded as well. A template parameter, not a null check, and a register
// bound: the plain compress fits 4 blocks an SM (sm_90: 62 registers, no spills; 2 without),
// the wait on each warp's loads hidden by twice as many warps.
template <bool FEEDBACK>
__global__ void __launch_bounds__(kThreads, FEEDBACK ? 2 : 4)
compress_int8_kernel(float* x, int64_t n, int64_t blocks, bool vec, float* scales,
                     signed char* out, float* error, bool decode) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t b = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; b < blocks;
       b += warps) {
    const int64_t begin = b * kInt8Block;
    const bool whole = vec && begin + kInt8Block <= n;
    float v[kGroupsPerLane][4];
    float m = 0.0f;
    #pragma unroll
    for (int j = 0; j < kGroupsPerLane; ++j) {
      const int64_t k = begin + 4 * (lane + 32 * j);
      if (whole) {
        const float4 a = *reinterpret_cast<const float4*>(x + k);
        v[j][0] = a.x; v[j][1] = a.y; v[j][2] = a.z; v[j][3] = a.w;
        if (FEEDBACK) {
          const float4 e = *reinterpret_cast<const float4*>(error + k);
          v[j][0] = __fsub_rn(a.x, e.x); v[j][1] = __fsub_rn(a.y, e.y);
          v[j][2] = __fsub_rn(a.z, e.z); v[j][3] = __fsub_rn(a.w, e.w);
        }
      } else {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          v[j][e] = k + e < n ? (FEEDBACK ? __fsub_rn(x[k + e], error[k + e]) : x[k + e])
                              : 0.0f;
        }
      }
      #pragma unroll
      for (int e = 0; e < 4; ++e) m = fmaxf(m, int8_amax_of(v[j][e]));
    }
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float scale = int8_scale_from_amax(m);
    if (lane == 0) scales[b] = scale;
    const float inv = FEEDBACK ? __frcp_rn(scale) : 0.0f;
    #pragma unroll
    for (int j = 0; j < kGroupsPerLane; ++j) {
      const int64_t k = begin + 4 * (lane + 32 * j);
      signed char q[4];
      float decoded[4], d[4];
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        q[e] = quantize_int8(v[j][e], scale);
        if (!FEEDBACK) continue;
        decoded[e] = divide_int8(q[e], scale, inv);
        const float diff = __fsub_rn(decoded[e], v[j][e]);
        d[e] = fabsf(diff) <= 3.40282347e38f ? diff : 0.0f;
      }
      if (whole) {
        *reinterpret_cast<char4*>(out + k) = make_char4(q[0], q[1], q[2], q[3]);
        if (FEEDBACK) {
          *reinterpret_cast<float4*>(error + k) = make_float4(d[0], d[1], d[2], d[3]);
          if (decode) {
            *reinterpret_cast<float4*>(x + k) =
                make_float4(decoded[0], decoded[1], decoded[2], decoded[3]);
          }
        }
        continue;
      }
      #pragma unroll
      for (int e = 0; e < 4 && k + e < n; ++e) {
        out[k + e] = q[e];
        if (FEEDBACK) {
          error[k + e] = d[e];
          if (decode) x[k + e] = decoded[e];
        }
      }
    }
  }
}

// Division, correctly rounded (int8 scales are not powers of two; divide_int8), then the add:
// as the reference. The vector path takes groups of 4 values (a 4-byte load of packed data, a
// 16-byte access of float32; 4 divides kInt8Block, so the 4 share a scale), kUnroll groups a
// thread per pass, all loaded (packed values, scales, and dst to add to) before any is used: one
// 4-byte load in flight a thread leaves the kernel waiting on memory latency. Lane t of a warp
// takes group t of each 32, so every load and store instruction of a warp is contiguous
// (sixteen values a thread from one 16-byte load were slower: a warp's stores then land 64 bytes
// apart). Bounded to 6 blocks an SM (3 adding): on sm_90 40 registers (64), no spills.
constexpr int kUnroll = 4;

template <bool ADD>
__global__ void __launch_bounds__(kThreads, ADD ? 3 : 6)
unpack_int8_kernel(const signed char* p, int64_t n, bool vec, const float* scales, float* dst) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t start = 0;
  if (vec) {
    const int64_t groups = n / 4;
    for (int64_t g = i; g < groups; g += kUnroll * stride) {
      char4 q[kUnroll];
      float scale[kUnroll];
      float4 old[kUnroll];
      #pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t h = g + u * stride;
        if (h >= groups) break;
        q[u] = reinterpret_cast<const char4*>(p)[h];
        scale[u] = scales[h * 4 / kInt8Block];
        if (ADD) old[u] = reinterpret_cast<const float4*>(dst)[h];
      }
      #pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t h = g + u * stride;
        if (h >= groups) break;
        const float inv = __frcp_rn(scale[u]);
        float4 v = make_float4(divide_int8(q[u].x, scale[u], inv),
                               divide_int8(q[u].y, scale[u], inv),
                               divide_int8(q[u].z, scale[u], inv),
                               divide_int8(q[u].w, scale[u], inv));
        if (ADD) {
          v = make_float4(__fadd_rn(old[u].x, v.x), __fadd_rn(old[u].y, v.y),
                          __fadd_rn(old[u].z, v.z), __fadd_rn(old[u].w, v.w));
        }
        reinterpret_cast<float4*>(dst)[h] = v;
      }
    }
    start = groups * 4;
  }
  for (int64_t k = start + i; k < n; k += stride) {
    const float v = __fdiv_rn(static_cast<float>(p[k]), scales[k / kInt8Block]);
    dst[k] = ADD ? __fadd_rn(dst[k], v) : v;
  }
}

// Blocks of kThreads that one SM holds at once for `kernel` (its registers decide), asked once.
template <auto kernel>
int resident_blocks() {
  static const int blocks = [] {
    int b = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kThreads, 0);
    return b > 0 ? b : 1;
  }();
  return blocks;
}

// As many blocks as the GPU holds at once (the loops stride over the rest of the work): every
// SM's memory pipeline full, and no second, partial wave of blocks left running at the end.
template <auto kernel>
int grid_for(int64_t work) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t needed = (work + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(sms > 0 ? sms : 1) * resident_blocks<kernel>();
  return int(needed < 1 ? 1 : (needed < cap ? needed : cap));
}

// `kernel` on grid_for(work) blocks of kThreads: every launch here sizes its grid one way.
template <auto kernel, typename... Args>
void launch(int64_t work, cudaStream_t stream, Args... args) {
  kernel<<<grid_for<kernel>(work), kThreads, 0, stream>>>(args...);
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T>
void launch_unpack(const T* packed, int64_t n, bool vec, int64_t work, const float* scale,
                   float* dst, bool accumulate, cudaStream_t stream) {
  if (accumulate) {
    launch<unpack_kernel<T, true>>(work, stream, packed, n, vec, scale, dst);
  } else {
    launch<unpack_kernel<T, false>>(work, stream, packed, n, vec, scale, dst);
  }
}

}  // namespace

cudaError_t launch_compress(const float* src, int64_t n, bool bf16, void* packed, float* scale,
                            unsigned int* workspace, cudaStream_t stream) {
  const bool vec = aligned(src, 16) && aligned(packed, 8);
  const int64_t work = vec ? n / 4 : n;
  cudaMemsetAsync(workspace, 0, sizeof(unsigned int), stream);
  launch<amax_kernel>(work, stream, src, n, vec, workspace);
  if (bf16) {
    launch<pack_kernel<__nv_bfloat16>>(work, stream, src, n, vec, workspace, scale,
                                       static_cast<__nv_bfloat16*>(packed));
  } else {
    launch<pack_kernel<__half>>(work, stream, src, n, vec, workspace, scale,
                                static_cast<__half*>(packed));
  }
  return cudaGetLastError();
}

cudaError_t launch_decompress(const void* packed, int64_t n, bool bf16, const float* scale,
                              float* dst, bool accumulate, cudaStream_t stream) {
  const bool vec = aligned(packed, 8) && aligned(dst, 16);
  const int64_t work = vec ? n / 4 : n;
  if (bf16) {
    launch_unpack<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(packed), n, vec, work, scale,
                                 dst, accumulate, stream);
  } else {
    launch_unpack<__half>(static_cast<const __half*>(packed), n, vec, work, scale, dst,
                          accumulate, stream);
  }
  return cudaGetLastError();
}

cudaError_t launch_compress_int8(const float* src, int64_t n, signed char* packed, float* scales,
                                 cudaStream_t stream) {
  return launch_compress_int8_with_feedback(const_cast<float*>(src), n, packed, scales, nullptr,
                                       false, stream);  // src is written only with decode
}

cudaError_t launch_compress_int8_with_feedback(float* src, int64_t n, signed char* packed,
                                          float* scales, float* error, bool decode,
                                          cudaStream_t stream) {
  const int64_t blocks = int8_blocks(n);
  const bool vec =
      aligned(src, 16) && aligned(packed, 4) && (error == nullptr || aligned(error, 16));
  if (error != nullptr) {
    launch<compress_int8_kernel<true>>(blocks * 32, stream, src, n, blocks, vec, scales, packed,
                                       error, decode);
  } else {
    launch<compress_int8_kernel<false>>(blocks * 32, stream, src, n, blocks, vec, scales,
                                        packed, static_cast<float*>(nullptr), false);
  }
  return cudaGetLastError();
}

cudaError_t launch_decompress_int8(const signed char* packed, int64_t n, const float* scales,
                                   float* dst, bool accumulate, cudaStream_t stream) {
  const bool vec = aligned(packed, 4) && aligned(dst, 16);
  const int64_t work = vec ? n / 4 : n;
  if (accumulate) {
    launch<unpack_int8_kernel<true>>(work, stream, packed, n, vec, scales, dst);
  } else {
    launch<unpack_int8_kernel<false>>(work, stream, packed, n, vec, scales, dst);
  }
  return cudaGetLastError();
}

}  // namespace minddp
