// Meta implementations of the ops: the checks every device applies, then empty
// outputs shaped as the CPU and CUDA kernels shape theirs (contiguous, src's
// sizes; scale float32[1], int8: one per block). FakeTensor runs these when
// torch.compile traces a call, so they take symbolic sizes (sym_sizes, never
// sizes()). The mutating ops write nothing: there is no data to write.
#include "compress.h"

namespace minddp {

std::tuple<at::Tensor, at::Tensor> compress_meta(const at::Tensor& src, at::ScalarType dtype) {
  check_compress_args(src, dtype);
  return {at::empty_symint(src.sym_sizes(), src.options().dtype(dtype)),
          at::empty_symint({compress_scales(src.sym_numel(), dtype)}, src.options())};
}

std::tuple<at::Tensor&, at::Tensor&> compress_out_meta(const at::Tensor& src, at::ScalarType dtype,
                                                       at::Tensor& packed, at::Tensor& scale) {
  check_compress_out_args(src, dtype, packed, scale);
  return {packed, scale};
}

std::tuple<at::Tensor, at::Tensor> compress_with_feedback_meta(at::Tensor& src, at::ScalarType dtype,
                                                          at::Tensor& error, bool /*decode*/) {
  check_feedback_args(src, dtype, error);
  return compress_meta(src, dtype);
}

at::Tensor decompress_meta(const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress", at::Tensor(), packed, scale);
  return at::empty_symint(packed.sym_sizes(), packed.options().dtype(at::kFloat));
}

at::Tensor& decompress_out_meta(const at::Tensor& packed, const at::Tensor& scale, at::Tensor& out) {
  check_decompress_args("minddp.decompress.out", out, packed, scale);
  return out;
}

at::Tensor& decompress_add_meta(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& scale) {
  check_decompress_args("minddp.decompress_add_", dst, packed, scale);
  return dst;
}

}  // namespace minddp
