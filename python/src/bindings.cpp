// SPDX-License-Identifier: Apache-2.0
// moecomm._C: the torch component for Python. A layer of any pattern over a torch.distributed
// process group (the c10d communicator on the group itself, sub-groups made on the default store),
// the router, and the plain dispatcher's dispatch / combine, all as autograd functions on tensors.
// The Python package (python/moecomm/__init__.py) wraps them in torch.nn.Modules.

#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <moecomm/comm/c10d.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/torch/autograd.hpp>
#include <moecomm/torch/backward_errors.hpp>
#include <moecomm/torch/token_dispatcher.hpp>
#include <moecomm/torch/torch_experts.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using comm_t = moecomm::c10d_communicator;
using experts_t = moecomm::libtorch::torch_experts<moecomm::libtorch::mlp_expert>;

// One MoE layer of any pattern behind one interface, for Python.
class layer_handle {
 public:
  virtual ~layer_handle() = default;
  virtual at::Tensor forward(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) = 0;
  // The experts FasterMoE shadowed in the last step (empty for the other patterns).
  [[nodiscard]] virtual std::vector<std::int32_t> shadowed() const = 0;
};

template <class Make>
class layer_of final : public layer_handle {
  using layer_t = std::invoke_result_t<Make&, moecomm::exchange_groups<comm_t>&>;

 public:
  layer_of(comm_t comm, std::int32_t ranks_per_node, Make make, experts_t experts)
      : comm_(std::move(comm)),
        groups_(comm_, moecomm::topology(comm_.size(), ranks_per_node)),
        layer_(make(groups_)),
        experts_(std::move(experts)) {}

  at::Tensor forward(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) override {
    return moecomm::libtorch::apply_layer(layer_, experts_, x, topk_idx, topk_weights);
  }

  [[nodiscard]] std::vector<std::int32_t> shadowed() const override {
    if constexpr (shadows<layer_t>::value) return layer_.shadow_state().decision().shadowed;
    else return {};
  }

 private:
  template <class L, class = void>
  struct shadows : std::false_type {};
  template <class L>
  struct shadows<L, std::void_t<decltype(std::declval<L const&>().shadow_state().decision())>> : std::true_type {};

  comm_t comm_;
  moecomm::exchange_groups<comm_t> groups_;
  layer_t layer_;
  experts_t experts_;
};

// The token dispatcher of one exchange behind one interface, for Python.
class dispatcher_handle {
 public:
  virtual ~dispatcher_handle() = default;
  virtual std::vector<at::Tensor> dispatch(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) = 0;
  virtual at::Tensor combine(at::Tensor const& rows, at::Tensor const& topk_weights) = 0;
};

template <class Algorithm>
class dispatcher_of final : public dispatcher_handle {
 public:
  dispatcher_of(comm_t comm, std::int32_t ranks_per_node, std::int32_t num_experts)
      : comm_(std::move(comm)),
        groups_(comm_, moecomm::topology(comm_.size(), ranks_per_node)),
        dispatcher_(moecomm::host_backend{}, groups_, num_experts) {}

  std::vector<at::Tensor> dispatch(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) override {
    return dispatcher_.dispatch(x, topk_idx, topk_weights);
  }
  at::Tensor combine(at::Tensor const& rows, at::Tensor const& topk_weights) override {
    return dispatcher_.combine(rows, topk_weights);
  }

 private:
  comm_t comm_;
  moecomm::exchange_groups<comm_t> groups_;
  moecomm::libtorch::token_dispatcher<moecomm::host_backend, comm_t, moecomm::dropless, Algorithm> dispatcher_;
};

// The communicator on a Python process group; its splits are Gloo groups on `store` named `name`.
comm_t communicator_of(py::object const& group, py::object const& store, std::string const& name, double timeout) {
  auto const pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  auto const st = store.cast<c10::intrusive_ptr<c10d::Store>>();
  auto const wait = std::chrono::milliseconds(static_cast<std::int64_t>(timeout * 1000.0));
  auto gloo = c10d::ProcessGroupGloo::Options::create(wait);
  gloo->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  moecomm::c10d_options options;
  options.timeout = wait;
  options.name = name;
  return comm_t(pg, moecomm::gloo_group_factory(st, gloo), options);
}

// The placement of FineMoE's replicated experts: every expert on two ranks, 2 E / R slots a rank.
moecomm::replica_placement finemoe_placement(std::int32_t ranks, std::int32_t num_experts) {
  return moecomm::replica_placement::cyclic(ranks, 2 * num_experts / ranks, 2);
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

template <class Make>
std::unique_ptr<layer_handle> handle(comm_t comm, std::int32_t per_node, Make make, experts_t experts) {
  return std::make_unique<layer_of<Make>>(std::move(comm), per_node, std::move(make), std::move(experts));
}

std::unique_ptr<layer_handle> make_layer(std::string const& pattern, py::object const& group, py::object const& store,
                                         std::string const& name, std::int32_t num_experts, std::int64_t hidden,
                                         std::int64_t inner, std::string const& activation, at::Tensor const& experts,
                                         std::int32_t ranks_per_node, double timeout) {
  char const* const op = "moecomm.MoELayer";
  moecomm::detail::require(activation == "relu" || activation == "swiglu", op, "activation = '", activation,
                           "' is not one of relu, swiglu");
  moecomm::detail::require(pattern == "plain" || pattern == "hierarchical" || pattern == "dedup" || pattern == "fastermoe" ||
                               pattern == "finemoe",
                           op, "pattern = '", pattern, "' is not one of plain, hierarchical, dedup, fastermoe, finemoe");
  comm_t comm = communicator_of(group, store, name, timeout);
  std::vector<std::int64_t> agreed;  // every rank makes the same pattern (their layers' collectives would not match)
  moecomm::detail::agree_on_text(comm, op, "on the pattern", pattern, agreed);
  moecomm::detail::require(num_experts % comm.size() == 0, op, "num_experts = ", num_experts,
                           " is not a multiple of the group's size ", comm.size());
  moecomm::detail::require(ranks_per_node >= 1 && comm.size() % ranks_per_node == 0, op, "ranks_per_node = ", ranks_per_node,
                           " does not divide the group's size ", comm.size());
  moecomm::libtorch::mlp_expert const mlp{hidden, inner,
                                          activation == "swiglu" ? moecomm::libtorch::mlp_activation::swiglu
                                                                 : moecomm::libtorch::mlp_activation::relu};
  experts_t ex(mlp, experts);
  moecomm::detail::require(ex.parameter_count() == mlp.parameter_count(), op, "experts has ", ex.parameter_count(),
                           " columns; a ", activation, " MLP expert has ",
                           activation == "swiglu" ? "3 H F = " : "2 H F + F + H = ", mlp.parameter_count());
  moecomm::host_backend const be;
  using groups_t = moecomm::exchange_groups<comm_t>;
  if (pattern == "plain")
    return handle(std::move(comm), ranks_per_node, [=](groups_t& g) {
      return moecomm::make_expert_parallel_layer<float>(be, g, num_experts, hidden);
    }, std::move(ex));
  if (pattern == "hierarchical")
    return handle(std::move(comm), ranks_per_node, [=](groups_t& g) {
      return moecomm::make_expert_parallel_layer<float>(be, g, num_experts, hidden, moecomm::hierarchical_2d{});
    }, std::move(ex));
  if (pattern == "dedup")
    return handle(std::move(comm), ranks_per_node, [=](groups_t& g) {
      return moecomm::make_expert_parallel_layer<float>(be, g, num_experts, hidden, moecomm::dedup_per_rank<moecomm::flat>{});
    }, std::move(ex));
  if (pattern == "fastermoe") {
    moecomm::fastermoe_cost_params model;  // a small machine's model, so that hot experts are shadowed
    model.hidden = hidden;
    model.alpha = static_cast<double>(inner) / static_cast<double>(hidden);
    model.gemm_flops = 1e9;
    model.net_bandwidth = model.local_bandwidth = 1e9;
    return handle(std::move(comm), ranks_per_node, [=](groups_t& g) {
      return moecomm::make_expert_parallel_layer<float>(be, g, num_experts, hidden, moecomm::fastermoe_shadowing<>{model});
    }, std::move(ex));
  }
  auto const placement = finemoe_placement(comm.size(), num_experts);  // "finemoe", the last one
  return handle(std::move(comm), ranks_per_node, [=](groups_t& g) {
    return moecomm::make_expert_parallel_layer<float>(be, g, num_experts, hidden, moecomm::finemoe{placement});
  }, std::move(ex));
}

std::unique_ptr<dispatcher_handle> make_dispatcher(std::string const& exchange, py::object const& group, py::object const& store,
                                                   std::string const& name, std::int32_t num_experts,
                                                   std::int32_t ranks_per_node, double timeout) {
  char const* const op = "moecomm.Dispatcher";
  moecomm::detail::require(exchange == "flat" || exchange == "hierarchical" || exchange == "dedup", op, "exchange = '", exchange,
                           "' is not one of flat, hierarchical, dedup");
  comm_t comm = communicator_of(group, store, name, timeout);
  std::vector<std::int64_t> agreed;  // every rank makes the same exchange
  moecomm::detail::agree_on_text(comm, op, "on the exchange", exchange, agreed);
  if (exchange == "flat") return std::make_unique<dispatcher_of<moecomm::flat>>(std::move(comm), ranks_per_node, num_experts);
  if (exchange == "hierarchical")
    return std::make_unique<dispatcher_of<moecomm::hierarchical_2d>>(std::move(comm), ranks_per_node, num_experts);
  return std::make_unique<dispatcher_of<moecomm::dedup_per_rank<moecomm::flat>>>(std::move(comm), ranks_per_node, num_experts);
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

  py::class_<moecomm::libtorch::router, c10::intrusive_ptr<moecomm::libtorch::router>>(m, "Router")
      .def(py::init([](std::int32_t top_k, float aux, float z) {
             auto r = c10::make_intrusive<moecomm::libtorch::router>();
             r->config.top_k = top_k;
             r->config.aux_loss_coeff = aux;
             r->config.z_loss_coeff = z;
             return r;
           }),
           py::arg("top_k"), py::arg("aux_loss_coeff") = 0.0f, py::arg("z_loss_coeff") = 0.0f)
      .def(
          "forward",
          [](c10::intrusive_ptr<moecomm::libtorch::router> const& r, at::Tensor const& logits) {
            auto out = moecomm::libtorch::route(r, logits);
            return py::make_tuple(out[0], out[1], out[2]);
          },
          py::arg("logits"), "(topk_weights [T][K], topk_idx [T][K] int32, losses [aux, z]) of logits [T][E]");

  py::class_<layer_handle>(m, "Layer")
      .def("forward", &layer_handle::forward, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::call_guard<py::gil_scoped_release>())
      .def("shadowed", &layer_handle::shadowed);

  m.def("make_layer", &make_layer, py::arg("pattern"), py::arg("group"), py::arg("store"), py::arg("name"),
        py::arg("num_experts"), py::arg("hidden"), py::arg("inner"), py::arg("activation"), py::arg("experts"),
        py::arg("ranks_per_node"), py::arg("timeout"));
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

  m.def("make_dispatcher", &make_dispatcher, py::arg("exchange"), py::arg("group"), py::arg("store"), py::arg("name"),
        py::arg("num_experts"), py::arg("ranks_per_node"), py::arg("timeout"));
  m.def("slot_experts", &slot_experts, py::arg("pattern"), py::arg("rank"), py::arg("ranks"), py::arg("num_experts"),
        "the global expert each local slot of `rank` holds");
}
