// A fixed program of compiled kernel launches as a differentiable torch op, with its autograd node
// in C++ (see triton_program.py). Knows nothing about what the kernels compute.
//
// Buffers of one run are numbered: forward: the inputs, then the forward's allocations; backward:
// the saved buffers, then the gradients of the outputs, then the backward's allocations. A launch
// passes buffers' data pointers (argument >= 0) or constants (argument -1 - k: constants[k], the
// pointer of a tensor the caller keeps alive or the value of a runtime integer). Two kinds of launch:
// a Triton kernel through cuLaunchKernel, its arguments followed by the two scratch pointers Triton's
// kernels take (null: programs are built only for kernels that need no scratch memory); and a kernel
// whose compiled host program launches it (JAX's Mosaic GPU kernels compiled for torch), called as
// entry(function, stream, pointers of its arguments).

#include <torch/extension.h>
#include <torch/csrc/Dtype.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

typedef int (*LaunchKernelFn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                              void**, void**);
typedef int (*ErrorStringFn)(int, const char**);
typedef void (*HostProgramFn)(void*, void*, void**);

struct Driver {
  LaunchKernelFn launch = nullptr;
  ErrorStringFn error_string = nullptr;
};

const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY);
    TORCH_CHECK(lib != nullptr, "triton_program: cannot open libcuda.so.1");
    out.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    out.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    TORCH_CHECK(out.launch != nullptr, "triton_program: libcuda.so.1 has no cuLaunchKernel");
    return out;
  }();
  return d;
}

struct Launch {
  uint64_t entry = 0;  // a host program's entry point; 0: a Triton kernel launched here
  uint64_t function;   // the CUfunction, or the host program's compiled-module handle
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<int64_t> args;
};

struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct Program {
  int64_t num_inputs = 0;
  std::vector<Alloc> forward_allocs, backward_allocs;
  std::vector<Launch> forward_launches, backward_launches;
  std::vector<int64_t> outputs;      // forward buffers returned
  std::vector<int64_t> saved;        // forward buffers kept for the backward
  std::vector<Alloc> grad_layouts;   // the layout each output's gradient is read in
  std::vector<int64_t> grads;        // per input: backward buffer of its gradient, or -1
  std::vector<uint64_t> constants;   // kept tensors' pointers, runtime integers' values
  std::string second_order_error;
};

std::mutex programs_mutex;
std::vector<std::shared_ptr<const Program>> programs;  // never freed: one small entry per signature

std::shared_ptr<const Program> program(int64_t id) {
  std::lock_guard<std::mutex> lock(programs_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(programs.size()), "triton_program: unknown program ", id);
  return programs[id];
}

void* current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
}

void run(const Program& p, const std::vector<Launch>& launches, const std::vector<at::Tensor>& buffers,
         const c10::Device& device) {
  if (launches.empty()) return;
  // Off CUDA only host programs run (tests pass host functions on CPU tensors): no stream.
  void* stream = device.is_cuda() ? current_stream(device) : nullptr;
  std::vector<uint64_t> values;
  std::vector<void*> params;
  for (const Launch& l : launches) {
    if (l.entry != 0) {
      params.resize(l.args.size());
      for (size_t i = 0; i < l.args.size(); ++i) {
        int64_t a = l.args[i];
        params[i] = a >= 0 ? buffers[a].data_ptr() : reinterpret_cast<void*>(p.constants[-1 - a]);
      }
      reinterpret_cast<HostProgramFn>(l.entry)(reinterpret_cast<void*>(l.function), stream, params.data());
      continue;
    }
    values.resize(l.args.size() + 2);
    params.resize(l.args.size() + 2);
    for (size_t i = 0; i < l.args.size(); ++i) {
      int64_t a = l.args[i];
      values[i] = a >= 0 ? reinterpret_cast<uint64_t>(buffers[a].data_ptr()) : p.constants[-1 - a];
    }
    values[l.args.size()] = 0;      // global scratch
    values[l.args.size() + 1] = 0;  // profile scratch
    for (size_t i = 0; i < values.size(); ++i) params[i] = &values[i];
    if (l.grid[0] * l.grid[1] * l.grid[2] == 0) continue;
    int rc = driver().launch(reinterpret_cast<void*>(l.function), l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1,
                             l.shared, stream, params.data(), nullptr);
    if (rc != 0) {
      const char* text = "unknown error";
      if (driver().error_string != nullptr) driver().error_string(rc, &text);
      TORCH_CHECK(false, "triton_program: cuLaunchKernel failed: ", text, " (", rc, ")");
    }
  }
}

at::Tensor allocate(const Alloc& a, const at::TensorOptions& options) {
  return at::empty_strided(a.sizes, a.strides, options.dtype(a.dtype));
}

// The forward's buffers after its launches: the inputs, then the forward's allocations.
std::vector<at::Tensor> run_forward(const Program& p, at::TensorList inputs) {
  TORCH_CHECK(static_cast<int64_t>(inputs.size()) == p.num_inputs, "triton_program: expected ", p.num_inputs,
              " inputs, got ", inputs.size());
  c10::DeviceGuard guard(inputs[0].device());
  std::vector<at::Tensor> buffers(inputs.begin(), inputs.end());
  buffers.reserve(inputs.size() + p.forward_allocs.size());
  const at::TensorOptions options = inputs[0].options();
  for (const Alloc& a : p.forward_allocs) buffers.push_back(allocate(a, options));
  run(p, p.forward_launches, buffers, inputs[0].device());
  return buffers;
}

bool same_layout(const at::Tensor& t, const Alloc& a) {
  if (t.scalar_type() != a.dtype || t.dim() != static_cast<int64_t>(a.sizes.size())) return false;
  if (reinterpret_cast<uint64_t>(t.data_ptr()) & 15) return false;  // kernels were compiled for aligned pointers
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != a.sizes[d]) return false;
    if (a.sizes[d] > 1 && t.stride(d) != a.strides[d]) return false;
  }
  return true;
}

struct ProgramFunction : public torch::autograd::Function<ProgramFunction> {
  static variable_list forward(AutogradContext* ctx, int64_t id, at::TensorList inputs) {
    auto p = program(id);
    std::vector<at::Tensor> buffers = run_forward(*p, inputs);
    variable_list outs, saved;
    for (int64_t i : p->outputs) outs.push_back(buffers[i]);
    for (int64_t i : p->saved) saved.push_back(buffers[i]);
    ctx->save_for_backward(saved);
    ctx->saved_data["id"] = id;
    if (saved.empty()) {  // the backward's allocations follow the inputs' device and options
      ctx->saved_data["like"] = at::empty({0}, inputs[0].options());
    }
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto p = program(ctx->saved_data["id"].toInt());
    if (at::GradMode::is_enabled()) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, p->second_order_error);
    }
    std::vector<at::Tensor> buffers = ctx->get_saved_variables();
    const at::Tensor like = buffers.empty() ? ctx->saved_data["like"].toTensor() : buffers[0];
    c10::DeviceGuard guard(like.device());
    for (size_t i = 0; i < p->grad_layouts.size(); ++i) {
      const Alloc& layout = p->grad_layouts[i];
      at::Tensor g = i < grads.size() ? grads[i] : at::Tensor();
      if (!g.defined()) {
        buffers.push_back(allocate(layout, like.options()).zero_());
      } else if (same_layout(g, layout)) {
        buffers.push_back(g);
      } else {  // the kernels were planned for one gradient layout: other layouts are copied into it
        buffers.push_back(allocate(layout, like.options()).copy_(g));
      }
    }
    for (const Alloc& a : p->backward_allocs) buffers.push_back(allocate(a, like.options()));
    run(*p, p->backward_launches, buffers, like.device());
    variable_list out;
    out.push_back(at::Tensor());  // the program id
    for (int64_t i : p->grads) out.push_back(i >= 0 ? buffers[i] : at::Tensor());
    return out;
  }
};

// Runs `body`; its outputs, or ("oom" | "error", message) when it threw. No C++ exception leaves the
// extension: one crossing pybind11 was seen to crash the process on a CUDA host whose compiler
// differs from torch's, so errors travel as values and triton_program.py raises them.
template <typename Body>
py::object guarded(Body&& body) {
  try {
    return py::cast(body());
  } catch (const c10::OutOfMemoryError& e) {
    return py::make_tuple("oom", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return py::make_tuple("error", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return py::make_tuple("error", e.what());
  }
}

Launch make_launch(uint64_t function, std::vector<int64_t> grid, int64_t block, int64_t shared,
                   std::vector<int64_t> args) {
  TORCH_CHECK(grid.size() == 3, "triton_program: a grid has 3 dims");
  Launch l;
  l.function = function;
  for (int i = 0; i < 3; ++i) l.grid[i] = static_cast<unsigned>(grid[i]);
  l.block = static_cast<unsigned>(block);
  l.shared = static_cast<unsigned>(shared);
  l.args = std::move(args);
  return l;
}

Launch make_host_launch(uint64_t entry, uint64_t function, std::vector<int64_t> args) {
  TORCH_CHECK(entry != 0, "triton_program: a host program needs its entry point");
  Launch l;
  l.entry = entry;
  l.function = function;
  for (int i = 0; i < 3; ++i) l.grid[i] = 1;
  l.block = 0;
  l.shared = 0;
  l.args = std::move(args);
  return l;
}

Alloc make_alloc(std::vector<int64_t> sizes, std::vector<int64_t> strides, py::object dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "triton_program: expected a torch.dtype");
  return Alloc{std::move(sizes), std::move(strides), reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Launch>(m, "Launch").def(py::init(&make_launch));
  m.def("host_launch", &make_host_launch);
  py::class_<Alloc>(m, "Alloc").def(py::init(&make_alloc));
  m.def("register", [](int64_t num_inputs, std::vector<Alloc> forward_allocs, std::vector<Launch> forward_launches,
                       std::vector<int64_t> outputs, std::vector<int64_t> saved, std::vector<Alloc> grad_layouts,
                       std::vector<Alloc> backward_allocs, std::vector<Launch> backward_launches,
                       std::vector<int64_t> grads, std::vector<uint64_t> constants, std::string second_order_error) {
    auto p = std::make_shared<Program>();
    p->num_inputs = num_inputs;
    p->forward_allocs = std::move(forward_allocs);
    p->forward_launches = std::move(forward_launches);
    p->outputs = std::move(outputs);
    p->saved = std::move(saved);
    p->grad_layouts = std::move(grad_layouts);
    p->backward_allocs = std::move(backward_allocs);
    p->backward_launches = std::move(backward_launches);
    p->grads = std::move(grads);
    p->constants = std::move(constants);
    p->second_order_error = std::move(second_order_error);
    std::lock_guard<std::mutex> lock(programs_mutex);
    programs.push_back(p);
    return static_cast<int64_t>(programs.size() - 1);
  });
  // A TensorList argument, not a vector: autograd takes edges from tensors and tensor lists only.
  m.def("apply", [](int64_t id, variable_list inputs) {
    return guarded([&] { return ProgramFunction::apply(id, at::TensorList(inputs)); });
  });
  // Without autograd (no input needs a gradient, or grad mode is off): the forward's outputs only.
  m.def("forward_only", [](int64_t id, variable_list inputs) {
    return guarded([&] {
      auto p = program(id);
      std::vector<at::Tensor> buffers = run_forward(*p, inputs);
      variable_list outs;
      for (int64_t i : p->outputs) outs.push_back(buffers[i]);
      return outs;
    });
  });
}
