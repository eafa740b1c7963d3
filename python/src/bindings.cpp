// SPDX-License-Identifier: Apache-2.0
// moecomm._C: the torch component for Python. A layer of any pattern over a torch.distributed
// process group (the c10d communicator on the group itself, sub-groups made by the package in Python),
// the router, and the plain dispatcher's dispatch / combine, all as autograd functions on tensors.
// The Python package (python/moecomm/__init__.py) wraps them in torch.nn.Modules.

#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <moecomm/comm/c10d.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/torch/autograd.hpp>
#include <moecomm/torch/backward_errors.hpp>
#include <moecomm/torch/torch_experts.hpp>

#include "capacity_spec.hpp"
#include "dispatcher_handle.hpp"
#include "layer_handle.hpp"
#if defined(MOECOMM_PYTHON_CUDA)
#  include "cuda_layers.hpp"
#endif

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using comm_t = moecomm::c10d_communicator;
using namespace moecomm_python;
using experts_t = moecomm::libtorch::torch_experts<expert_fn>;

// The process group of a split, made by the package's Python function `make_split(name, rank, size)`
// -> (store, group): a Gloo group on a prefix of the default store. Python makes it because torch's
// pip wheels ship no Gloo headers for C++; since torch 2.0 that group is a c10d::Backend, which a
// ProcessGroup over its store wraps.
moecomm::c10d_group_factory split_factory(py::object make_split) {
  return [make = hold_python(std::move(make_split))](std::string const& name, int rank, int size) {
    py::gil_scoped_acquire const gil;
    auto const made = (*make)(name, rank, size).cast<py::tuple>();
#if TORCH_VERSION_MAJOR >= 2
    if (!py::isinstance<c10d::ProcessGroup>(made[1]))
      return moecomm::process_group_over(made[0].cast<c10::intrusive_ptr<c10d::Store>>(),
                                         made[1].cast<c10::intrusive_ptr<c10d::Backend>>(), c10d::ProcessGroup::BackendType::GLOO);
#endif
    return made[1].cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  };
}

// The communicator on a Python process group; its splits are made by `make_split`, named after `name`.
comm_t communicator_of(py::object const& group, py::object make_split, std::string const& name, double timeout) {
  auto const pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  moecomm::c10d_options options;
  options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout * 1000.0));
  options.name = name;
  return comm_t(pg, split_factory(std::move(make_split)), options);
}

// The global expert each local slot of `rank` holds under `pattern`.
std::vector<std::int32_t> slot_experts(std::string const& pattern, std::int32_t rank, std::int32_t ranks,
                                       std::int32_t num_experts) {
  std::vector<std::int32_t> slots;
  if (pattern == "finemoe") {
    auto const p = finemoe_placement(ranks, num_experts);
    for (std::int32_t l = 0; l < p.slots_per_rank(); ++l) slots.push_back(p.expert_at(rank, l));
  } else {
    for (std::int32_t l = 0; l < num_experts / ranks; ++l) slots.push_back(rank * (num_experts / ranks) + l);
  }
  return slots;
}


// `expert` is None for the built-in MLP of `activation`, else `fn(params [P], rows) -> rows`, the
// functional form of the user's expert module, whose P is `experts`' width.
std::unique_ptr<layer_handle> make_layer(std::string const& pattern, py::object const& group, py::object const& make_split,
                                         std::string const& name, std::int32_t num_experts, std::int64_t hidden,
                                         std::int64_t inner, std::string const& activation, py::object const& expert,
                                         at::Tensor const& experts, std::int32_t ranks_per_node, capacity_spec const& capacity,
                                         bool checks, double timeout) {
  char const* const op = "moecomm.MoELayer";
  moecomm::detail::require(pattern == "plain" || pattern == "hierarchical" || pattern == "dedup" || pattern == "fastermoe" ||
                               pattern == "finemoe",
                           op, "pattern = '", pattern, "' is not one of plain, hierarchical, dedup, fastermoe, finemoe");
  moecomm::detail::require(pattern != "finemoe" || capacity.drop == "none", op, "pattern 'finemoe' is dropless (its replicas "
                           "split every expert's tokens): capacity_factor and rank_capacity are not supported with it");
  comm_t comm = communicator_of(group, make_split, name, timeout);
  std::vector<std::int64_t> agreed;  // every rank makes the same pattern (their layers' collectives would not match)
  moecomm::detail::agree_on_text(comm, op, "on the pattern", pattern, agreed);
  moecomm::detail::agree_on_text(comm, op, "on the drop policy", capacity.drop, agreed);
  moecomm::detail::require(num_experts % comm.size() == 0, op, "num_experts = ", num_experts,
                           " is not a multiple of the group's size ", comm.size());
  moecomm::detail::require(ranks_per_node >= 1 && comm.size() % ranks_per_node == 0, op, "ranks_per_node = ", ranks_per_node,
                           " does not divide the group's size ", comm.size());
  experts_t ex(expert_function(op, hidden, inner, activation, expert, experts), experts);
  moecomm::routing_checks const routing_checks{checks, false};
  return with_capacity(capacity, op, [&](auto policy) {
    return pattern_layer<float>(pattern, moecomm::host_backend{}, std::move(comm), ranks_per_node, num_experts, hidden, inner,
                                policy, routing_checks, std::move(ex));
  });
}

std::unique_ptr<dispatcher_handle> make_dispatcher(std::string const& exchange, py::object const& group, py::object const& make_split,
                                                   std::string const& name, std::int32_t num_experts,
                                                   std::int32_t ranks_per_node, capacity_spec const& capacity, bool checks,
                                                   double timeout) {
  char const* const op = "moecomm.Dispatcher";
  require_exchange(exchange, op);
  return make_dispatcher_of(exchange, moecomm::host_backend{}, communicator_of(group, make_split, name, timeout), ranks_per_node, num_experts, capacity,
                            moecomm::routing_checks{checks, false}, op);
}

// moecomm.Error, and the backwards' errors raised as it (moecomm/torch/backward_errors.hpp).
PyObject* error_type = nullptr;
[[noreturn]] void raise_moecomm_error(moecomm::error const& e) {
  py::gil_scoped_acquire const gil;
  PyErr_SetString(error_type, e.what());
  python_error carried;  // torch/csrc/Exceptions.h (global namespace)
  carried.persist();  // the error leaves this thread: the engine carries it to loss.backward()'s caller
  throw carried;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moecomm's torch component: MoE layers and the router as autograd functions over torch.distributed";
  error_type = py::register_exception<moecomm::error>(m, "Error", PyExc_RuntimeError).ptr();
  moecomm::libtorch::backward_error_handler = &raise_moecomm_error;

  bind_router<moecomm::host_backend>(m, "Router", [] { return moecomm::host_backend{}; },
                                     "(topk_weights [T][K], topk_idx [T][K] int32, losses [aux, z]) of logits [T][E]");

  py::class_<layer_handle>(m, "Layer")
      .def("forward", &layer_handle::forward, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::call_guard<py::gil_scoped_release>())
      .def("shadowed", &layer_handle::shadowed);

  py::class_<capacity_spec>(m, "CapacitySpec")
      .def(py::init<>())
      .def_readwrite("drop", &capacity_spec::drop)
      .def_readwrite("factor", &capacity_spec::factor)
      .def_readwrite("min_capacity", &capacity_spec::min_capacity)
      .def_readwrite("pad", &capacity_spec::pad)
      .def_readwrite("seed", &capacity_spec::seed)
      .def_readwrite("layer", &capacity_spec::layer)
      .def_readwrite("rows_per_rank", &capacity_spec::rows_per_rank);
  m.def("make_layer", &make_layer, py::arg("pattern"), py::arg("group"), py::arg("make_split"), py::arg("name"),
        py::arg("num_experts"), py::arg("hidden"), py::arg("inner"), py::arg("activation"), py::arg("expert"), py::arg("experts"),
        py::arg("ranks_per_node"), py::arg("capacity"), py::arg("checks"), py::arg("timeout"));
  py::class_<dispatcher_handle>(m, "Dispatcher")
      .def(
          "dispatch",
          [](dispatcher_handle& d, at::Tensor const& x, at::Tensor const& idx, at::Tensor const& w) {
            auto out = d.dispatch(x, idx, w);
            return std::make_tuple(out[0], out[1]);  // made into Python objects once the GIL is back
          },
          py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::call_guard<py::gil_scoped_release>())
      .def("combine", &dispatcher_handle::combine, py::arg("rows"), py::arg("topk_weights"),
           py::call_guard<py::gil_scoped_release>());

  m.def("make_dispatcher", &make_dispatcher, py::arg("exchange"), py::arg("group"), py::arg("make_split"), py::arg("name"),
        py::arg("num_experts"), py::arg("ranks_per_node"), py::arg("capacity"), py::arg("checks"), py::arg("timeout"));
#if defined(MOECOMM_PYTHON_CUDA)
  bind_cuda(m);
#else
  m.attr("has_cuda") = false;  // torch, or this build, has no CUDA: CPU tensors only
#endif
  m.def(
      "mlp_expert",
      [](at::Tensor const& params, at::Tensor const& rows, std::int64_t hidden, std::int64_t inner, std::string const& activation) {
        return expert_function("moecomm.MoELayer", hidden, inner, activation, py::none(), params.unsqueeze(0))(params, rows);
      },
      py::arg("params"), py::arg("rows"), py::arg("hidden"), py::arg("inner"), py::arg("activation"),
      "the built-in MLP expert of flat parameters `params` [P] on `rows` [n][H], differentiable in both");
  m.def("slot_experts", &slot_experts, py::arg("pattern"), py::arg("rank"), py::arg("ranks"), py::arg("num_experts"),
        "the global expert each local slot of `rank` holds");
}
