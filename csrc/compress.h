// Declarations shared by the registration file, the CPU, Meta and CUDA kernels,
// plus the argument checks every device applies before touching memory.
#pragma once
#include <ATen/ATen.h>

#include <string>

#include "scale.h"

namespace minddp {

// Numbers go into error messages as strings: on the GPU image (torch 2.11+cu130
// built by another compiler than this extension's gcc 13), an integer streamed
// into c10::str from here segfaults in std::ostream::_M_insert<long> (seen under
// cuda-gdb), while strings stream fine. std::to_string uses no iostream locale.
inline std::string num(int64_t n) { return std::to_string(n); }
// Under torch.compile the Meta kernels see symbolic sizes (s0, 1024*s1): their name.
inline std::string num(const c10::SymInt& n) {
  if (auto concrete = n.maybe_as_int()) return num(*concrete);
  return n.toSymNodeImplUnowned()->str();
}

// int8_blocks (scale.h) of a size that may be symbolic. The two agree for n >= 0:
// one scale per started block, at least one.
inline c10::SymInt int8_blocks(const c10::SymInt& n) {
  if (auto concrete = n.maybe_as_int()) return int8_blocks(*concrete);
  return ((n + (kInt8Block - 1)) / kInt8Block).max(c10::SymInt(1));
}

std::tuple<at::Tensor, at::Tensor> compress_cpu(const at::Tensor& src, at::ScalarType dtype);
std::tuple<at::Tensor&, at::Tensor&> compress_out_cpu(const at::Tensor& src, at::ScalarType dtype,
                                                      at::Tensor& packed, at::Tensor& scale);
std::tuple<at::Tensor, at::Tensor> compress_with_feedback_cpu(at::Tensor& src, at::ScalarType dtype,
                                                         at::Tensor& error, bool decode);
at::Tensor decompress_cpu(const at::Tensor& packed, const at::Tensor& scale);
at::Tensor& decompress_out_cpu(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& out);
at::Tensor& decompress_add_cpu(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& scale);

// Meta (compress_meta.cpp): the same checks, and outputs with the kernels' shapes, dtypes and
// strides but no data; FakeTensor runs these, so torch.compile can trace the ops.
std::tuple<at::Tensor, at::Tensor> compress_meta(const at::Tensor& src, at::ScalarType dtype);
std::tuple<at::Tensor&, at::Tensor&> compress_out_meta(const at::Tensor& src, at::ScalarType dtype,
                                                       at::Tensor& packed, at::Tensor& scale);
std::tuple<at::Tensor, at::Tensor> compress_with_feedback_meta(at::Tensor& src, at::ScalarType dtype,
                                                          at::Tensor& error, bool decode);
at::Tensor decompress_meta(const at::Tensor& packed, const at::Tensor& scale);
at::Tensor& decompress_out_meta(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& out);
at::Tensor& decompress_add_meta(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& scale);

#ifdef MINDDP_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> compress_cuda(const at::Tensor& src, at::ScalarType dtype);
std::tuple<at::Tensor&, at::Tensor&> compress_out_cuda(const at::Tensor& src, at::ScalarType dtype,
                                                       at::Tensor& packed, at::Tensor& scale);
std::tuple<at::Tensor, at::Tensor> compress_with_feedback_cuda(at::Tensor& src, at::ScalarType dtype,
                                                          at::Tensor& error, bool decode);
at::Tensor decompress_cuda(const at::Tensor& packed, const at::Tensor& scale);
at::Tensor& decompress_out_cuda(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& out);
at::Tensor& decompress_add_cuda(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& scale);
#endif

inline void check_compress_args(const at::Tensor& src, at::ScalarType dtype) {
  TORCH_CHECK(src.scalar_type() == at::kFloat, "minddp.compress: src must be float32, got ",
              src.scalar_type(), "; convert it with .float() (non-float tensors are sent "
              "uncompressed by minddp.compression)");
  TORCH_CHECK(src.is_contiguous(), "minddp.compress: src must be contiguous; call "
              ".contiguous() on it first");
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kChar,
              "minddp.compress: dtype must be torch.float16, torch.bfloat16 or torch.int8, "
              "got ", dtype);
}

// How many scales compress gives src's n values: int8 one per block, the 16-bit formats one.
template <typename N>
N compress_scales(const N& n, at::ScalarType dtype) {
  return dtype == at::kChar ? int8_blocks(n) : N(1);
}

// compress.out: where compress would allocate, buffers of the shapes it would give (a slot
// in a file every rank maps, for the shared-memory all-reduce).
inline void check_compress_out_args(const at::Tensor& src, at::ScalarType dtype,
                                    const at::Tensor& packed, const at::Tensor& scale) {
  check_compress_args(src, dtype);
  TORCH_CHECK(packed.scalar_type() == dtype && packed.is_contiguous() &&
              packed.sym_numel() == src.sym_numel() && packed.device() == src.device(),
              "minddp.compress.out: packed must be a contiguous ", dtype, " tensor of src's ",
              num(src.sym_numel()), " elements on ", src.device(), ", got ",
              packed.scalar_type(), " with ", num(packed.sym_numel()), " elements on ",
              packed.device());
  const c10::SymInt scales = compress_scales(src.sym_numel(), dtype);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.sym_numel() == scales && scale.device() == src.device(),
              "minddp.compress.out: scale must be a contiguous float32 tensor of ", num(scales),
              " element(s) on ", src.device(), " (as compress returns it), got ",
              scale.scalar_type(), " with ", num(scale.sym_numel()), " elements on ",
              scale.device());
}

// compress_with_feedback: int8 only (the codec that error feedback serves), and an error
// buffer that matches src element for element.
inline void check_feedback_args(const at::Tensor& src, at::ScalarType dtype,
                                const at::Tensor& error) {
  check_compress_args(src, dtype);
  TORCH_CHECK(dtype == at::kChar, "minddp.compress_with_feedback: only int8 has error "
              "feedback (fp16 and bf16 travel without it), got ", dtype, "; use "
              "minddp.compress for them");
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous() &&
              error.sym_numel() == src.sym_numel() && error.device() == src.device(),
              "minddp.compress_with_feedback: error must be a contiguous float32 tensor of src's ",
              num(src.sym_numel()), " elements on ", src.device(), ", got ", error.scalar_type(),
              " with ", num(error.sym_numel()), " elements on ", error.device());
}

// dst is undefined for decompress (it allocates its own output); for decompress.out it is `out`.
inline void check_decompress_args(const char* op, const at::Tensor& dst, const at::Tensor& packed,
                                  const at::Tensor& scale) {
  TORCH_CHECK(packed.scalar_type() == at::kHalf || packed.scalar_type() == at::kBFloat16 ||
              packed.scalar_type() == at::kChar, op, ": packed must be float16, bfloat16 or "
              "int8 (the output of minddp.compress), got ", packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous(), op, ": packed must be contiguous; call .contiguous() on "
              "it first");
  // int8 has a scale per block of kInt8Block values; the 16-bit formats one in all.
  const c10::SymInt scales =
      packed.scalar_type() == at::kChar ? int8_blocks(packed.sym_numel()) : c10::SymInt(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.sym_numel() == scales &&
              scale.is_contiguous(), op, ": scale must be the contiguous float32 tensor of ",
              num(scales), " element(s) that minddp.compress returned with packed, got ",
              scale.scalar_type(), " with ", num(scale.sym_numel()), " elements");
  TORCH_CHECK(scale.device() == packed.device(), op, ": scale is on ", scale.device(),
              " but packed is on ", packed.device(), "; move both to the same device");
  if (!dst.defined()) return;
  TORCH_CHECK(dst.scalar_type() == at::kFloat, op, ": dst must be float32 (minddp decodes "
              "into fp32), got ", dst.scalar_type());
  TORCH_CHECK(dst.is_contiguous(), op, ": dst must be contiguous; accumulate into a "
              "contiguous buffer and copy back");
  TORCH_CHECK(dst.device() == packed.device(), op, ": dst is on ", dst.device(),
              " but packed is on ", packed.device(), "; move both to the same device");
  TORCH_CHECK(dst.sym_numel() == packed.sym_numel(), op, ": dst has ", num(dst.sym_numel()),
              " elements but packed has ", num(packed.sym_numel()), "; pass the chunk that was "
              "compressed");
}

}  // namespace minddp
