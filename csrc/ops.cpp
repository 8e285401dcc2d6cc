// The one registration file: op schemas (TORCH_LIBRARY) and one implementation
// block per device (TORCH_LIBRARY_IMPL). Importing minddp._C runs these.
#include <Python.h>
#include <torch/library.h>

#include "compress.h"

#include "cpu_kernels.h"

// minddp._C is a plain Python module with no functions: its job is to be
// importable so that loading it registers the ops under torch.ops.minddp.
// Its one attribute, cpu_isa, names the CPU kernels in use ("avx512", "avx2"
// or "scalar"), for benchmarks and tests.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m && PyModule_AddStringConstant(m, "cpu_isa", minddp::isa_name(minddp::cpu_isa())) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}

TORCH_LIBRARY(minddp, m) {
  m.def("compress(Tensor src, ScalarType dtype) -> (Tensor packed, Tensor scale)");
  // int8 with error feedback: compress src - error, then error = what that changed;
  // with decode, src becomes the decoding (a finished value leaving its owner).
  m.def("compress_with_feedback(Tensor(a!) src, ScalarType dtype, Tensor(b!) error, bool decode) "
        "-> (Tensor packed, Tensor scale)");
  m.def("decompress(Tensor packed, Tensor scale) -> Tensor");
  // decode into an existing buffer (a bucket's slice): no temporary, no zeroing.
  m.def("decompress.out(Tensor packed, Tensor scale, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("decompress_add_(Tensor(a!) dst, Tensor packed, Tensor scale) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(minddp, CPU, m) {
  m.impl("compress", &minddp::compress_cpu);
  m.impl("compress_with_feedback", &minddp::compress_with_feedback_cpu);
  m.impl("decompress", &minddp::decompress_cpu);
  m.impl("decompress.out", &minddp::decompress_out_cpu);
  m.impl("decompress_add_", &minddp::decompress_add_cpu);
}

#ifdef MINDDP_WITH_CUDA
TORCH_LIBRARY_IMPL(minddp, CUDA, m) {
  m.impl("compress", &minddp::compress_cuda);
  m.impl("compress_with_feedback", &minddp::compress_with_feedback_cuda);
  m.impl("decompress", &minddp::decompress_cuda);
  m.impl("decompress.out", &minddp::decompress_out_cuda);
  m.impl("decompress_add_", &minddp::decompress_add_cuda);
}
#endif
