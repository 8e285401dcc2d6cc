// CUDA glue: checks, device guard, current stream, then the raw-pointer
// launchers of compress_kernels.cu. Builds only where torch has CUDA.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "../compress.h"
#include "compress_kernels.h"

namespace minddp {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

static void compress_into(const at::Tensor& src, at::Tensor& packed, at::Tensor& scale,
                          const char* op) {
  const c10::cuda::CUDAGuard guard(src.device());
  if (packed.scalar_type() == at::kChar) {
    check_launch(launch_compress_int8(src.data_ptr<float>(), src.numel(),
                                      reinterpret_cast<signed char*>(packed.data_ptr()),
                                      scale.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
                 op);
    return;
  }
  at::Tensor workspace = at::empty({1}, src.options().dtype(at::kInt));
  check_launch(launch_compress(src.data_ptr<float>(), src.numel(),
                               packed.scalar_type() == at::kBFloat16, packed.data_ptr(),
                               scale.data_ptr<float>(),
                               reinterpret_cast<unsigned int*>(workspace.data_ptr<int>()),
                               c10::cuda::getCurrentCUDAStream()),
               op);
}

std::tuple<at::Tensor, at::Tensor> compress_cuda(const at::Tensor& src, at::ScalarType dtype) {
  check_compress_args(src, dtype);
  at::Tensor packed = at::empty(src.sizes(), src.options().dtype(dtype));
  at::Tensor scale = at::empty({compress_scales(src.numel(), dtype)}, src.options());
  compress_into(src, packed, scale, "minddp.compress");
  return {packed, scale};
}

std::tuple<at::Tensor&, at::Tensor&> compress_out_cuda(const at::Tensor& src, at::ScalarType dtype,
                                                       at::Tensor& packed, at::Tensor& scale) {
  check_compress_out_args(src, dtype, packed, scale);
  compress_into(src, packed, scale, "minddp.compress.out");
  return {packed, scale};
}

std::tuple<at::Tensor, at::Tensor> compress_with_feedback_cuda(at::Tensor& src, at::ScalarType dtype,
                                                          at::Tensor& error, bool decode) {
  check_feedback_args(src, dtype, error);
  const c10::cuda::CUDAGuard guard(src.device());
  at::Tensor packed = at::empty(src.sizes(), src.options().dtype(at::kChar));
  at::Tensor scales = at::empty({int8_blocks(src.numel())}, src.options());
  check_launch(launch_compress_int8_with_feedback(src.data_ptr<float>(), src.numel(),
                                             reinterpret_cast<signed char*>(packed.data_ptr()),
                                             scales.data_ptr<float>(), error.data_ptr<float>(),
                                             decode, c10::cuda::getCurrentCUDAStream()),
               "minddp.compress_with_feedback");
  return {packed, scales};
}

static void unpack(const char* op, const at::Tensor& packed, const at::Tensor& scale,
                   at::Tensor& dst, bool accumulate) {
  const c10::cuda::CUDAGuard guard(packed.device());
  if (packed.scalar_type() == at::kChar) {
    check_launch(launch_decompress_int8(reinterpret_cast<const signed char*>(packed.data_ptr()),
                                        packed.numel(), scale.data_ptr<float>(),
                                        dst.data_ptr<float>(), accumulate,
                                        c10::cuda::getCurrentCUDAStream()),
                 op);
    return;
  }
  check_launch(launch_decompress(packed.data_ptr(), packed.numel(),
                                 packed.scalar_type() == at::kBFloat16, scale.data_ptr<float>(),
                                 dst.data_ptr<float>(), accumulate,
                                 c10::cuda::getCurrentCUDAStream()),
               op);
}

at::Tensor decompress_cuda(const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress", at::Tensor(), packed, scale);
  at::Tensor dst = at::empty(packed.sizes(), packed.options().dtype(at::kFloat));
  unpack("minddp.decompress", packed, scale, dst, false);
  return dst;
}

at::Tensor& decompress_out_cuda(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& out) {
  check_decompress_args("minddp.decompress.out", out, packed, scale);
  unpack("minddp.decompress.out", packed, scale, out, false);
  return out;
}

at::Tensor& decompress_add_cuda(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress_add_", dst, packed, scale);
  unpack("minddp.decompress_add_", packed, scale, dst, true);
  return dst;
}

}  // namespace minddp
