// The one registration file: the Python module, op schemas (TORCH_LIBRARY) and
// one implementation block per device or dispatch key (TORCH_LIBRARY_IMPL: CPU,
// Meta, Autograd, CUDA).
#include <torch/extension.h>

#include "compress.h"

#include "cpu_kernels.h"

namespace minddp {
void bind_readiness(pybind11::module& m);  // readiness.cpp
void bind_gradients(pybind11::module& m);  // gradients.cpp
void bind_shm_flags(pybind11::module& m);  // shm_flags.cpp
}

// Importing minddp._C registers the ops under torch.ops.minddp. The module
// itself holds cpu_isa, the CPU kernels in use ("avx512", "avx2" or
// "scalar"), for benchmarks and tests, and Readiness, the reducer's gradient
// hooks in C++ (minddp/readiness.py), gradients, a bucket's .grad tensors read in one
// call (gradients.cpp), and flag_arrive / flag_wait, the shared-memory all-reduce's phase
// flags (shm_flags.cpp; Linux only).
PYBIND11_MODULE(_C, m) {
  m.attr("cpu_isa") = minddp::isa_name(minddp::cpu_isa());
  minddp::bind_readiness(m);
  minddp::bind_gradients(m);
  minddp::bind_shm_flags(m);
}

namespace {
// at::Tag gained out and inplace after torch 2.11: detect them, so older torch builds the ops
// without them (there torch.compile cannot functionalize the two aliasing ops; eager is alike).
template <typename T, typename = void>
struct HasAliasTags : std::false_type {};
template <typename T>
struct HasAliasTags<T, std::void_t<decltype(T::out), decltype(T::inplace)>> : std::true_type {};

template <typename Tag = at::Tag>
std::vector<at::Tag> aliasing_tags(bool out) {
  std::vector<at::Tag> tags = {Tag::pt2_compliant_tag};
  if constexpr (HasAliasTags<Tag>::value) tags.push_back(out ? Tag::out : Tag::inplace);
  return tags;
}
}  // namespace

// pt2_compliant_tag: tests/test_opcheck.py runs torch.library.opcheck on every op (schema,
// Meta/fake, autograd registration, AOT dispatch with dynamic shapes). The out and inplace
// tags tell torch.compile's functionalization that the returned Tensor(a!) is the buffer
// passed in, which it needs to trace an op whose return aliases an argument.
TORCH_LIBRARY(minddp, m) {
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  const std::vector<at::Tag> out = aliasing_tags(/*out=*/true);
  const std::vector<at::Tag> inplace = aliasing_tags(/*out=*/false);
  m.def("compress(Tensor src, ScalarType dtype) -> (Tensor packed, Tensor scale)", pt2);
  // encode into existing buffers (a slot in a shared file): no temporary, no copy.
  m.def("compress.out(Tensor src, ScalarType dtype, *, Tensor(a!) packed, Tensor(b!) scale) "
        "-> (Tensor(a!), Tensor(b!))", out);
  // int8 with error feedback: compress src - error, then error = what that changed;
  // with decode, src becomes the decoding (a finished value leaving its owner).
  m.def("compress_with_feedback(Tensor(a!) src, ScalarType dtype, Tensor(b!) error, bool decode) "
        "-> (Tensor packed, Tensor scale)", pt2);
  m.def("decompress(Tensor packed, Tensor scale) -> Tensor", pt2);
  // decode into an existing buffer (a bucket's slice): no temporary, no zeroing.
  m.def("decompress.out(Tensor packed, Tensor scale, *, Tensor(a!) out) -> Tensor(a!)",
        out);
  m.def("decompress_add_(Tensor(a!) dst, Tensor packed, Tensor scale) -> Tensor(a!)",
        inplace);
}

TORCH_LIBRARY_IMPL(minddp, CPU, m) {
  m.impl("compress", &minddp::compress_cpu);
  m.impl("compress.out", &minddp::compress_out_cpu);
  m.impl("compress_with_feedback", &minddp::compress_with_feedback_cpu);
  m.impl("decompress", &minddp::decompress_cpu);
  m.impl("decompress.out", &minddp::decompress_out_cpu);
  m.impl("decompress_add_", &minddp::decompress_add_cpu);
}

TORCH_LIBRARY_IMPL(minddp, Meta, m) {
  m.impl("compress", &minddp::compress_meta);
  m.impl("compress.out", &minddp::compress_out_meta);
  m.impl("compress_with_feedback", &minddp::compress_with_feedback_meta);
  m.impl("decompress", &minddp::decompress_meta);
  m.impl("decompress.out", &minddp::decompress_out_meta);
  m.impl("decompress_add_", &minddp::decompress_add_meta);
}

// Not differentiable: they encode and decode gradients, which are never themselves
// differentiated, and a rounding to 8 or 16 bits has no useful derivative. A fallthrough
// at Autograd says so, as torch asks of non-differentiable ops: outputs do not require
// grad. Without it torch's autograd fallback marks them as requiring grad and only warns,
// at backward, that no autograd kernel exists.
TORCH_LIBRARY_IMPL(minddp, Autograd, m) {
  for (const char* op : {"compress", "compress.out", "compress_with_feedback", "decompress",
                         "decompress.out", "decompress_add_"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}

#ifdef MINDDP_WITH_CUDA
TORCH_LIBRARY_IMPL(minddp, CUDA, m) {
  m.impl("compress", &minddp::compress_cuda);
  m.impl("compress.out", &minddp::compress_out_cuda);
  m.impl("compress_with_feedback", &minddp::compress_with_feedback_cuda);
  m.impl("decompress", &minddp::decompress_cuda);
  m.impl("decompress.out", &minddp::decompress_out_cuda);
  m.impl("decompress_add_", &minddp::decompress_add_cuda);
}
#endif
