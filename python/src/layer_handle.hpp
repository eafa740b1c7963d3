// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the extension's translation units share (bindings.cpp, and cuda_layers.cu where torch is a
// CUDA build): Python objects kept by C++, Python experts, and one MoE layer behind one interface.

#include <torch/extension.h>

#include <moecomm/comm/communicator.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/torch/autograd.hpp>
#include <moecomm/torch/torch_experts.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moecomm_python {

namespace py = pybind11;

// An expert as a function of its flat parameters and its rows: the built-in MLP, or a Python
// callable (the package's functional form of the user's nn.Module), one type for every pattern.
using expert_fn = std::function<at::Tensor(at::Tensor const&, at::Tensor const&)>;

// A Python object that C++ keeps: dropped with the GIL held, whichever thread drops the last copy.
inline std::shared_ptr<py::object> hold_python(py::object f) {
  return std::shared_ptr<py::object>(new py::object(std::move(f)), [](py::object* o) {
    py::gil_scoped_acquire const gil;
    delete o;
  });
}

// A Python expert function `fn(params [P], rows [n][H]) -> [n][H]`, called from the layer's threads
// (the forward runs with the GIL released, the backward on autograd's thread): it takes the GIL.
struct python_expert {
  std::shared_ptr<py::object> fn;  // from hold_python

  at::Tensor operator()(at::Tensor const& params, at::Tensor const& rows) const {
    py::gil_scoped_acquire const gil;
    py::object const out = (*fn)(params, rows);
    at::Tensor y = out.cast<at::Tensor>();
    moecomm::detail::require(y.dim() == 2 && y.size(0) == rows.size(0) && y.size(1) == rows.size(1) &&
                                 y.scalar_type() == rows.scalar_type(),
                             "moecomm.MoELayer", "the expert returned a ", y.scalar_type(), " tensor of shape ", y.sizes(),
                             " for ", rows.scalar_type(), " rows of shape ", rows.sizes(), ": an expert maps [n][H] rows to [n][H] of their dtype");
    return y;
  }

};

// The experts' function: the built-in MLP of `activation` when `expert` is None (its parameter count
// checked against `experts`' width), else the Python callable.
inline expert_fn expert_function(char const* op, std::int64_t hidden, std::int64_t inner, std::string const& activation,
                                 py::object const& expert, at::Tensor const& experts) {
  moecomm::detail::require(activation == "relu" || activation == "swiglu", op, "activation = '", activation,
                           "' is not one of relu, swiglu");
  if (!expert.is_none()) return python_expert{hold_python(expert)};
  moecomm::libtorch::mlp_expert const mlp{hidden, inner,
                                          activation == "swiglu" ? moecomm::libtorch::mlp_activation::swiglu
                                                                 : moecomm::libtorch::mlp_activation::relu};
  moecomm::detail::require(experts.dim() == 2 && experts.size(1) == mlp.parameter_count(), op, "experts has shape ",
                           experts.sizes(), "; a ", activation, " MLP expert has ",
                           activation == "swiglu" ? "3 H F = " : "2 H F + F + H = ", mlp.parameter_count(), " parameters");
  return mlp;
}

// One MoE layer of any pattern behind one interface, for Python.
class layer_handle {
 public:
  virtual ~layer_handle() = default;
  virtual at::Tensor forward(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) = 0;
  // The experts FasterMoE shadowed in the last step (empty for the other patterns).
  [[nodiscard]] virtual std::vector<std::int32_t> shadowed() const = 0;
};

// The layer `make(groups)` over `comm`, split as `ranks_per_node` says, with its experts.
template <class Comm, class Experts, class Make>
class layer_of final : public layer_handle {
  using layer_t = std::invoke_result_t<Make&, moecomm::exchange_groups<Comm>&>;

 public:
  layer_of(Comm comm, std::int32_t ranks_per_node, Make make, Experts experts)
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

  Comm comm_;
  moecomm::exchange_groups<Comm> groups_;
  layer_t layer_;
  Experts experts_;
};

template <class Comm, class Experts, class Make>
std::unique_ptr<layer_handle> handle(Comm comm, std::int32_t per_node, Make make, Experts experts) {
  return std::make_unique<layer_of<Comm, Experts, Make>>(std::move(comm), per_node, std::move(make), std::move(experts));
}

// The placement of FineMoE's replicated experts: every expert on two ranks, 2 E / R slots a rank.
inline moecomm::replica_placement finemoe_placement(std::int32_t ranks, std::int32_t num_experts) {
  return moecomm::replica_placement::cyclic(ranks, 2 * num_experts / ranks, 2);
}

// The layer of `pattern` (plain, hierarchical, dedup, fastermoe, finemoe; checked by the caller)
// with rows of T on `be` over `comm`, with the capacity policy `capacity` (dropless for finemoe).
template <class T, class Backend, class Comm, class Capacity, class Experts>
std::unique_ptr<layer_handle> pattern_layer(std::string const& pattern, Backend const& be, Comm comm, std::int32_t per_node,
                                            std::int32_t num_experts, std::int64_t hidden, std::int64_t inner, Capacity capacity,
                                            moecomm::routing_checks checks, Experts experts) {
  using groups_t = moecomm::exchange_groups<Comm>;
  auto const with_policy = [&](auto exchange_or_pattern) {
    return handle(std::move(comm), per_node, [=](groups_t& g) {
      return moecomm::make_expert_parallel_layer<T>(be, g, num_experts, hidden, exchange_or_pattern, capacity, checks);
    }, std::move(experts));
  };
  if (pattern == "plain") return with_policy(moecomm::flat{});
  if (pattern == "hierarchical") return with_policy(moecomm::hierarchical_2d{});
  if (pattern == "dedup") return with_policy(moecomm::dedup_per_rank<moecomm::flat>{});
  if (pattern == "fastermoe") {
    moecomm::fastermoe_cost_params model;  // a small machine's model, so that hot experts are shadowed
    model.hidden = hidden;
    model.alpha = static_cast<double>(inner) / static_cast<double>(hidden);
    model.gemm_flops = 1e9;
    model.net_bandwidth = model.local_bandwidth = 1e9;
    return with_policy(moecomm::fastermoe_shadowing<>{model});
  }
  if constexpr (std::is_same_v<Capacity, moecomm::dropless>) {  // "finemoe", the last one: dropless only
    auto const placement = finemoe_placement(comm.size(), num_experts);
    return handle(std::move(comm), per_node, [=](groups_t& g) {
      return moecomm::make_expert_parallel_layer<T>(be, g, num_experts, hidden, moecomm::finemoe{placement}, checks);
    }, std::move(experts));
  } else {
    throw moecomm::error(moecomm::status::internal_error, "moecomm.MoELayer: finemoe with a capacity policy passed the pattern check");
  }
}


// Binds the router of `Backend` as class `name`: `name(top_k, aux_loss_coeff, z_loss_coeff)` on the
// back-end `make_backend()` gives, `.forward(logits)` -> (topk_weights, topk_idx, losses).
template <class Backend, class MakeBackend>
void bind_router(py::module_& m, char const* name, MakeBackend make_backend, char const* forward_doc) {
  using router_t = moecomm::libtorch::basic_router<Backend>;
  py::class_<router_t, c10::intrusive_ptr<router_t>>(m, name)
      .def(py::init([make_backend](std::int32_t top_k, float aux, float z) {
             auto r = c10::make_intrusive<router_t>(make_backend());
             r->config.top_k = top_k;
             r->config.aux_loss_coeff = aux;
             r->config.z_loss_coeff = z;
             return r;
           }),
           py::arg("top_k"), py::arg("aux_loss_coeff") = 0.0f, py::arg("z_loss_coeff") = 0.0f)
      .def(
          "forward",
          [](c10::intrusive_ptr<router_t> const& r, at::Tensor const& logits) {
            auto out = moecomm::libtorch::route(r, logits);
            return py::make_tuple(out[0], out[1], out[2]);
          },
          py::arg("logits"), forward_doc);
}

}  // namespace moecomm_python
