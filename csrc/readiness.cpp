// Gradient readiness counted in C++ (minddp/readiness.py says what and why).
//
// One post hook per parameter's gradient accumulator, as torch's reducer.cpp
// registers them. In COUNT mode a hook counts the gradient's arrival here,
// without the GIL, and calls into Python only when that arrival completes a
// bucket (or breaks a rule); in IGNORE mode it only marks the used map; in
// PYTHON mode it hands the gradient to Python's `on_gradient(index, defined)`.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <vector>

namespace py = pybind11;

namespace minddp {
namespace {

constexpr int64_t kNotFull = -1;  // mark(): the arrival completed no bucket
constexpr int64_t kExtra = -2;    // mark(): more arrivals than expected

// What a hook does (readiness.py: PYTHON, COUNT, IGNORE).
enum Mode : int64_t { kPython = 0, kCount = 1, kIgnore = 2 };

struct State {
  std::mutex mutex;
  std::vector<int64_t> bucket_of;   // parameter -> its bucket
  std::vector<int64_t> sizes;       // bucket -> parameters in it
  std::vector<int64_t> left;        // parameter -> arrivals still expected
  std::vector<int64_t> pending;     // bucket -> parameters not yet ready
  Mode mode = kPython;
  int32_t* used = nullptr;          // the local used map a defined gradient marks, or null
  at::Tensor used_tensor;           // keeps `used` alive
  py::object on_gradient, on_bucket, on_extra;

  ~State() {
    if (Py_IsInitialized()) {  // the callbacks are Python objects: drop them with the GIL
      py::gil_scoped_acquire gil;
      on_gradient = py::object();
      on_bucket = py::object();
      on_extra = py::object();
    }
  }

  int64_t mark(int64_t index) {  // caller holds `mutex`
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(left.size()),
                "minddp readiness: parameter index ", index, " out of range");
    if (left[index] == 0) return kExtra;
    if (--left[index] > 0) return kNotFull;
    int64_t b = bucket_of[index];
    return --pending[b] == 0 ? b : kNotFull;
  }
};

// Calls a Python callback from an autograd hook; a Python exception leaves the
// hook as torch's own Python hooks leave it (python_error), so backward raises
// it with its own type.
template <typename... Args>
void call_python(const py::object& fn, Args... args) {
  py::gil_scoped_acquire gil;
  try {
    fn(args...);
  } catch (py::error_already_set& e) {
    e.restore();
    python_error err;
    err.persist();
    throw err;
  }
}

void on_hook(const std::shared_ptr<State>& state, int64_t index, bool defined) {
  int64_t result = kNotFull;
  Mode mode;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    mode = state->mode;
    if (mode != kPython) {
      if (defined && state->used != nullptr) state->used[index] = 1;
      if (mode == kCount) result = state->mark(index);
    }
  }
  if (mode == kPython) {
    call_python(state->on_gradient, index, defined);
  } else if (result >= 0) {
    call_python(state->on_bucket, result);
  } else if (result == kExtra) {
    call_python(state->on_extra, index);
  }
}

class Readiness {
 public:
  Readiness(const std::vector<at::Tensor>& params, py::object on_gradient, py::object on_bucket,
            py::object on_extra)
      : state_(std::make_shared<State>()) {
    state_->left.assign(params.size(), 0);
    state_->on_gradient = std::move(on_gradient);
    state_->on_bucket = std::move(on_bucket);
    state_->on_extra = std::move(on_extra);
    for (size_t i = 0; i < params.size(); i++) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
      TORCH_CHECK(accumulator, "minddp readiness: parameter ", i,
                  " has no gradient accumulator (requires_grad=False or not a leaf)");
      std::weak_ptr<State> weak = state_;
      auto key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, i](const torch::autograd::variable_list& outputs,
                    const torch::autograd::variable_list& inputs) {
            if (auto state = weak.lock()) {
              on_hook(state, static_cast<int64_t>(i), !inputs.empty() && inputs[0].defined());
            }
            return outputs;
          },
          // torch's reducer hooks refuse compiled autograd with these words; so do these.
          [](torch::autograd::CompiledNodeArgs&) {
            TORCH_CHECK(false,
                        "Compiled autograd is not compatible with C++ DDP Reducer, please use "
                        "torch._dynamo.config.optimize_ddp=\"python_reducer\".");
          }));
      hooks_.emplace_back(std::move(accumulator), key);
    }
  }

  ~Readiness() { remove(); }

  // Which bucket each parameter sits in (at start and when the buckets change).
  void set_layout(const std::vector<int64_t>& bucket_of, int64_t buckets) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TORCH_CHECK(bucket_of.size() == state_->left.size(),
                "minddp readiness: one bucket per parameter expected");
    std::vector<int64_t> sizes(buckets, 0);
    for (int64_t b : bucket_of) {
      TORCH_CHECK(b >= 0 && b < buckets, "minddp readiness: bucket ", b, " out of range");
      sizes[b]++;
    }
    state_->bucket_of = bucket_of;
    state_->sizes = sizes;
    state_->pending = std::move(sizes);
  }

  // A new backward: parameter i becomes ready after expected[i] arrivals.
  void reset(const std::vector<int64_t>& expected) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TORCH_CHECK(expected.size() == state_->left.size(),
                "minddp readiness: one expected count per parameter");
    state_->left = expected;
    state_->pending = state_->sizes;
  }

  void set_mode(int64_t mode, std::optional<at::Tensor> used) {
    TORCH_CHECK(mode == kPython || mode == kCount || mode == kIgnore,
                "minddp readiness: unknown mode ", mode);
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->mode = static_cast<Mode>(mode);
    state_->used_tensor = used.has_value() ? *used : at::Tensor();
    if (used.has_value()) {
      TORCH_CHECK(used->device().is_cpu() && used->scalar_type() == at::kInt &&
                      used->is_contiguous() && used->numel() == (int64_t)state_->left.size(),
                  "minddp readiness: the used map must be a contiguous CPU int32 tensor, "
                  "one entry per parameter");
    }
    state_->used = used.has_value() ? used->data_ptr<int32_t>() : nullptr;
  }

  int64_t mark(int64_t index) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->mark(index);
  }

  bool is_ready(int64_t index) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->left.at(index) == 0;
  }

  int64_t pending(int64_t bucket) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->pending.at(bucket);
  }

  void remove() {
    for (auto& [accumulator, key] : hooks_) accumulator->del_post_hook(key);
    hooks_.clear();
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->mode = kPython;
    }
  }

 private:
  std::shared_ptr<State> state_;
  using Accumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()));
  std::vector<std::pair<Accumulator, uintptr_t>> hooks_;
};

}  // namespace

void bind_readiness(py::module& m) {
  py::class_<Readiness>(m, "Readiness")
      .def(py::init<const std::vector<at::Tensor>&, py::object, py::object, py::object>())
      .def("set_layout", &Readiness::set_layout)
      .def("reset", &Readiness::reset)
      .def("set_mode", &Readiness::set_mode, py::arg("mode"), py::arg("used") = py::none())
      .def("mark", &Readiness::mark)
      .def("is_ready", &Readiness::is_ready)
      .def("pending", &Readiness::pending)
      .def("remove", &Readiness::remove);
}

}  // namespace minddp
