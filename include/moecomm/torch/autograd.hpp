// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The router and any expert-parallel layer as libtorch autograd functions, so that a libtorch
//! model calls them on tensors and `loss.backward()` runs their backward passes.
//!
//! - `route(router, logits)` → `{topk_weights [T][K] float, topk_idx [T][K] int32, losses [2]}`:
//!   `router_forward`; the backward is `router_backward` into the logits' gradient. The losses
//!   (aux, z) are returned for logging and are not differentiable: as Megatron-LM's
//!   `MoEAuxLossAutoScaler` does, their gradients enter the logits' gradient in the backward, with
//!   the coefficients of the router's `router_config` (`aux_loss_coeff`, `z_loss_coeff`).
//! - `apply_layer(layer, experts, x, topk_idx, topk_weights)` → `out [T][H]`: the layer's forward with
//!   `torch_experts`; the backward gives the gradients of `x`, of the weights and of the experts'
//!   parameter tensor. Any layer from `make_expert_parallel_layer` (plain, capacity policies, every
//!   exchange, FasterMoE's shadowing) or `replicated_expert_layer`.
//!
//! Both are collective, forward and backward: every rank calls them in the same order, so every
//! rank's loss must depend on the layer's output (or call backward with a zero gradient).
//! A forward under `torch::NoGradGuard`, or on inputs that need no gradient, runs the layer in
//! inference mode. As in torch, a forward's graph may be dropped without a backward; the layer keeps
//! the state of its last forward only, so backpropagating an older step's graph is an error naming
//! both steps. A graph may be backpropagated more than once (`retain_graph`).

#include <moecomm/backend/host.hpp>
#include <moecomm/config.hpp>
#include <moecomm/torch/backend_device.hpp>
#include <moecomm/torch/backward_errors.hpp>
#include <moecomm/rows/router/router.hpp>
#include <moecomm/torch/tensor_views.hpp>
#include <moecomm/torch/torch_experts.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

//! A router's configuration and the state its backward reads, on `Backend` (its logits' device:
//! `torch_device<Backend>`). Held by `c10::intrusive_ptr`: the autograd graph of a `route` keeps it
//! alive until the backward has run. It keeps its last forward's state only: backpropagating an older
//! forward's graph is an error naming both (a router per forward, as `moecomm.Router` in Python
//! makes, allows any order).
template <class Backend>
struct basic_router : ::torch::CustomClassHolder {
  basic_router() = default;
  explicit basic_router(Backend be) : backend(std::move(be)) {}
  router_config config;
  router_state<Backend> state;
  Backend backend;
  std::int64_t forwards = 0;  //!< forwards so far: the one `state` holds
};
//! The router of CPU logits.
using router = basic_router<host_backend>;

namespace detail {

//! A pointer handed to the layer function's backward through `saved_data` (an integer IValue): the
//! layer is the caller's and must outlive the backward.
template <class T>
std::int64_t handle_of(T* p) {
  return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(p));
}
template <class T>
T& from_handle(at::IValue const& v) {
  return *reinterpret_cast<T*>(static_cast<std::intptr_t>(v.toInt()));
}

template <class Backend>
struct router_function : ::torch::autograd::Function<router_function<Backend>> {
  static ::torch::autograd::variable_list forward(::torch::autograd::AutogradContext* ctx, at::Tensor logits,
                                                  c10::intrusive_ptr<basic_router<Backend>> const& r) {
    char const* const op = "libtorch::route";
    c10::Device const device = torch_device<Backend>::of(r->backend);
    logits = logits.contiguous();
    auto const l = matrix_of<float const>(logits, "logits", op, -1, -1, device);
    std::int32_t const k = r->config.top_k;
    at::Tensor weights = at::empty({l.rows, k}, logits.options());
    at::Tensor idx = at::empty({l.rows, k}, logits.options().dtype(at::kInt));
    static_assert(sizeof(router_losses) == 2 * sizeof(float), "losses: a [2] float tensor holds one router_losses");
    at::Tensor losses = at::empty({2}, logits.options());  // written by the back-end, on its device
    {
      [[maybe_unused]] typename torch_device<Backend>::stream_join const joined(r->backend);
      router_forward(r->backend, l, matrix_of<std::int32_t>(idx, "topk_idx", op, -1, -1, device),
                     matrix_of<float>(weights, "topk_weights", op, -1, -1, device), not_needed,
                     array_view<router_losses>{reinterpret_cast<router_losses*>(losses.data_ptr<float>()), 1}, r->state,
                     r->config);
    }
    ctx->mark_non_differentiable({idx, losses});
    ctx->saved_data["router"] = at::IValue::make_capsule(r);
    ctx->saved_data["forward"] = ++r->forwards;
    return {weights, idx, losses};
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    return detail::translating_errors([&]() -> ::torch::autograd::variable_list {
      auto& r = *c10::static_intrusive_pointer_cast<basic_router<Backend>>(ctx->saved_data["router"].toCapsule());
      moecomm::detail::require(r.forwards == ctx->saved_data["forward"].toInt(), "libtorch::route (backward)",
                               "the graph of the router's forward ", ctx->saved_data["forward"].toInt(),
                               " is backpropagated after its forward ", r.forwards, ": a router keeps its last forward's state only");
      std::int64_t const tokens = r.state.num_tokens(), experts = r.state.num_experts();
      c10::Device const device = torch_device<Backend>::of(r.backend);
      auto const on_device = at::TensorOptions().dtype(at::kFloat).device(device);
      at::Tensor d_weights = grads[0].defined() ? grads[0].contiguous() : at::zeros({tokens, r.config.top_k}, on_device);
      at::Tensor d_logits = at::empty({tokens, experts}, on_device);
      char const* const op = "libtorch::route (backward)";
      [[maybe_unused]] typename torch_device<Backend>::stream_join const joined(r.backend);
      router_backward(r.backend, r.state, matrix_of<float const>(d_weights, "grad of topk_weights", op, -1, -1, device),
                      matrix_of<float>(d_logits, "grad of logits", op, -1, -1, device));
      return {d_logits, at::Tensor()};
    });
  }
};

template <class Layer, class Experts>
struct layer_binding {
  Layer* layer;
  Experts* experts;
};

template <class Layer, class Experts>
struct layer_function : ::torch::autograd::Function<layer_function<Layer, Experts>> {
  using T = typename Experts::row_type;
  using backend_t = std::decay_t<decltype(std::declval<Layer const&>().dispatch_state().backend())>;

  static c10::Device device_of(Layer const& layer) { return torch_device<backend_t>::of(layer.dispatch_state().backend()); }

  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor topk_weights,
                            at::Tensor expert_weights, at::Tensor topk_idx, layer_binding<Layer, Experts>* b) {
    char const* const op = "libtorch::apply_layer";
    c10::Device const device = device_of(*b->layer);
    routing_view const routing = routing_of(topk_idx, topk_weights, op, device);
    auto const in = matrix_of<T const>(x, "x", op, routing.num_tokens, -1, device);
    moecomm::detail::require(expert_weights.is_same(b->experts->weights()), op,
                             "tensor 'expert_weights' is not the experts' own parameter tensor");
    at::Tensor out = at::empty_like(x);
    {
      [[maybe_unused]] typename torch_device<backend_t>::stream_join const joined(b->layer->dispatch_state().backend());
      b->layer->forward(routing, in, matrix_of<T>(out, "out", op, -1, -1, device), *b->experts);
    }
    ctx->save_for_backward({x, topk_weights, topk_idx});  // the layer reads them until its backward
    ctx->saved_data["layer"] = handle_of(b->layer);
    ctx->saved_data["step"] = b->layer->step();
    ctx->saved_data["experts"] = handle_of(b->experts);
    return out;
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    return detail::translating_errors([&]() -> ::torch::autograd::variable_list {
      char const* const op = "libtorch::apply_layer (backward)";
      Layer& layer = from_handle<Layer>(ctx->saved_data["layer"]);
      Experts& experts = from_handle<Experts>(ctx->saved_data["experts"]);
      auto const saved = ctx->get_saved_variables();
      moecomm::detail::require(layer.step() == ctx->saved_data["step"].toInt(), op, "the graph of step ",
                               ctx->saved_data["step"].toInt(), " is backpropagated after step ", layer.step(),
                               "'s forward: a layer keeps the state of its last forward only");
      c10::Device const device = device_of(layer);
      at::Tensor const d_out = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(saved[0]);
      at::Tensor d_x = ctx->needs_input_grad(0) ? at::empty_like(saved[0]) : at::Tensor();
      at::Tensor d_w = ctx->needs_input_grad(1) ? at::empty_like(saved[1]) : at::Tensor();
      experts.zero_gradients();
      optional_output<matrix_view<T>> dx_view = not_needed;
      if (d_x.defined()) dx_view = matrix_of<T>(d_x, "grad of x", op, -1, -1, device);
      optional_output<array_view<float>> dw_view = not_needed;
      if (d_w.defined()) dw_view = array_of<float>(d_w, "grad of topk_weights", op, device);
      {
        [[maybe_unused]] typename torch_device<backend_t>::stream_join const joined(layer.dispatch_state().backend());
        layer.backward(matrix_of<T const>(d_out, "grad of out", op, saved[0].size(0), saved[0].size(1), device), dx_view,
                       dw_view, experts);
      }
      at::Tensor d_params = ctx->needs_input_grad(2) ? experts.gradient_buffer().clone() : at::Tensor();
      return {d_x, d_w, d_params, at::Tensor(), at::Tensor()};
    });
  }
};

}  // namespace detail

//! `{topk_weights, topk_idx, losses}` of `logits` ([T][E] float, on the router's device),
//! differentiable in the logits.
template <class Backend>
[[nodiscard]] std::vector<at::Tensor> route(c10::intrusive_ptr<basic_router<Backend>> const& r, at::Tensor const& logits) {
  return detail::router_function<Backend>::apply(logits, r);
}

//! The layer's output for `x` ([T][H], the experts' row type: float, or half / bfloat16 on CUDA)
//! routed by `topk_idx` ([T][K] int32 or int64; an int64 value outside int32 is clamped to one, which
//! the routing check then refuses) and `topk_weights` ([T][K] float), all on the layer's device
//! (`torch_device`), differentiable in `x`, the weights and `experts.weights()`. Training mode when
//! grad mode is on and an input needs a gradient; inference mode otherwise.
template <class Layer, class Fn, class T>
[[nodiscard]] at::Tensor apply_layer(Layer& layer, torch_experts<Fn, T>& experts, at::Tensor const& x, at::Tensor const& topk_idx,
                                     at::Tensor const& topk_weights) {
  bool const training = at::GradMode::is_enabled() &&
                        (x.requires_grad() || topk_weights.requires_grad() || experts.weights().requires_grad());
  layer.set_training(training);  // also forgets a forward whose graph was dropped without a backward
  detail::layer_binding<Layer, torch_experts<Fn, T>> binding{&layer, &experts};
  return detail::layer_function<Layer, torch_experts<Fn, T>>::apply(x.contiguous(), topk_weights.contiguous(), experts.weights(),
                                                                    int32_ids(topk_idx).contiguous(), &binding);
}

}  // namespace libtorch
MOECOMM_NAMESPACE_END
