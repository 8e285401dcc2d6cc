// A bucket's .grad tensors, read in one call (minddp/buckets.py, Bucket.grads).
//
// The reducer reads every gradient of a bucket twice a step, to copy it in and
// to write the sum back; read from Python, an attribute access and a test per
// parameter cost more than the copy of a small gradient.
#include <torch/extension.h>

#include <vector>

namespace py = pybind11;

namespace minddp {
namespace {

// (each parameter's .grad or None, how many are defined, whether every one is
// defined, strided and not requiring grad: the bucket can be copied whole).
py::tuple gradients(const std::vector<at::Tensor>& params) {
  py::list grads(params.size());
  int64_t defined = 0;
  bool plain = true;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined()) {
      grads[i] = py::none();
      plain = false;
      continue;
    }
    ++defined;
    plain = plain && grad.layout() == at::kStrided && !grad.requires_grad();
    grads[i] = py::cast(grad);
  }
  return py::make_tuple(grads, defined, plain);
}

}  // namespace

void bind_gradients(py::module& m) {
  m.def("gradients", &gradients, py::arg("params"));
}

}  // namespace minddp
