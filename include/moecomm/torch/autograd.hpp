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
#include <moecomm/torch/backward_errors.hpp>
#include <moecomm/rows/router/router.hpp>
#include <moecomm/torch/tensor_views.hpp>
#include <moecomm/torch/torch_experts.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

//! A router's configuration and the state its backward reads. Held by `c10::intrusive_ptr`: the
//! autograd graph of a `route` keeps it alive until the backward has run. It keeps its last forward's
//! state only: backpropagating an older forward's graph is an error naming both (a router per
//! forward, as `moecomm.Router` in Python makes, allows any order).
struct router : ::torch::CustomClassHolder {
  router_config config;
  router_state<host_backend> state;
  host_backend backend;
  std::int64_t forwards = 0;  //!< forwards so far: the one `state` holds
};

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

struct router_function : ::torch::autograd::Function<router_function> {
  static ::torch::autograd::variable_list forward(::torch::autograd::AutogradContext* ctx, at::Tensor logits,
                                                  c10::intrusive_ptr<router> const& r) {
    char const* const op = "libtorch::route";
    logits = logits.contiguous();
    auto const l = matrix_of<float const>(logits, "logits", op);
    std::int32_t const k = r->config.top_k;
    at::Tensor weights = at::empty({l.rows, k}, logits.options());
    at::Tensor idx = at::empty({l.rows, k}, logits.options().dtype(at::kInt));
    at::Tensor losses = at::zeros({2}, logits.options());
    router_losses values;
    router_forward(r->backend, l, matrix_of<std::int32_t>(idx, "topk_idx", op), matrix_of<float>(weights, "topk_weights", op),
                   not_needed, array_view<router_losses>{&values, 1}, r->state, r->config);
    losses[0] = values.aux;
    losses[1] = values.z;
    ctx->mark_non_differentiable({idx, losses});
    ctx->saved_data["router"] = at::IValue::make_capsule(r);
    ctx->saved_data["forward"] = ++r->forwards;
    return {weights, idx, losses};
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    return detail::translating_errors([&]() -> ::torch::autograd::variable_list {
      router& r = *c10::static_intrusive_pointer_cast<router>(ctx->saved_data["router"].toCapsule());
      moecomm::detail::require(r.forwards == ctx->saved_data["forward"].toInt(), "libtorch::route (backward)",
                               "the graph of the router's forward ", ctx->saved_data["forward"].toInt(),
                               " is backpropagated after its forward ", r.forwards, ": a router keeps its last forward's state only");
      std::int64_t const tokens = r.state.num_tokens(), experts = r.state.num_experts();
      at::Tensor d_weights = grads[0].defined() ? grads[0].contiguous() : at::zeros({tokens, r.config.top_k}, at::kFloat);
      at::Tensor d_logits = at::empty({tokens, experts}, at::kFloat);
      char const* const op = "libtorch::route (backward)";
      router_backward(r.backend, r.state, matrix_of<float const>(d_weights, "grad of topk_weights", op),
                      matrix_of<float>(d_logits, "grad of logits", op));
      return {d_logits, at::Tensor()};
    });
  }
};

template <class Layer, class Fn>
struct layer_binding {
  Layer* layer;
  torch_experts<Fn>* experts;
};

template <class Layer, class Fn>
struct layer_function : ::torch::autograd::Function<layer_function<Layer, Fn>> {
  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor topk_weights,
                            at::Tensor expert_weights, at::Tensor topk_idx, layer_binding<Layer, Fn>* b) {
    char const* const op = "libtorch::apply_layer";
    routing_view const routing = routing_of(topk_idx, topk_weights, op);
    auto const in = matrix_of<float const>(x, "x", op, routing.num_tokens);
    moecomm::detail::require(expert_weights.is_same(b->experts->weights()), op,
                             "tensor 'expert_weights' is not the experts' own parameter tensor");
    at::Tensor out = at::empty_like(x);
    b->layer->forward(routing, in, matrix_of<float>(out, "out", op), *b->experts);
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
      torch_experts<Fn>& experts = from_handle<torch_experts<Fn>>(ctx->saved_data["experts"]);
      auto const saved = ctx->get_saved_variables();
      moecomm::detail::require(layer.step() == ctx->saved_data["step"].toInt(), op, "the graph of step ",
                               ctx->saved_data["step"].toInt(), " is backpropagated after step ", layer.step(),
                               "'s forward: a layer keeps the state of its last forward only");
      at::Tensor const d_out = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(saved[0]);
      at::Tensor d_x = ctx->needs_input_grad(0) ? at::empty_like(saved[0]) : at::Tensor();
      at::Tensor d_w = ctx->needs_input_grad(1) ? at::empty_like(saved[1]) : at::Tensor();
      experts.zero_gradients();
      optional_output<matrix_view<float>> dx_view = not_needed;
      if (d_x.defined()) dx_view = matrix_of<float>(d_x, "grad of x", op);
      optional_output<array_view<float>> dw_view = not_needed;
      if (d_w.defined()) dw_view = array_of<float>(d_w, "grad of topk_weights", op);
      layer.backward(matrix_of<float const>(d_out, "grad of out", op, saved[0].size(0), saved[0].size(1)), dx_view, dw_view,
                     experts);
      at::Tensor d_params = ctx->needs_input_grad(2) ? experts.gradient_buffer().clone() : at::Tensor();
      return {d_x, d_w, d_params, at::Tensor(), at::Tensor()};
    });
  }
};

}  // namespace detail

//! `{topk_weights, topk_idx, losses}` of `logits` ([T][E] float), differentiable in the logits.
[[nodiscard]] inline std::vector<at::Tensor> route(c10::intrusive_ptr<router> const& r, at::Tensor const& logits) {
  return detail::router_function::apply(logits, r);
}

//! The layer's output for `x` ([T][H] float) routed by `topk_idx`/`topk_weights` ([T][K]),
//! differentiable in `x`, the weights and `experts.weights()`. Training mode when grad mode is on
//! and an input needs a gradient; inference mode otherwise.
template <class Layer, class Fn>
[[nodiscard]] at::Tensor apply_layer(Layer& layer, torch_experts<Fn>& experts, at::Tensor const& x, at::Tensor const& topk_idx,
                                     at::Tensor const& topk_weights) {
  bool const training = at::GradMode::is_enabled() &&
                        (x.requires_grad() || topk_weights.requires_grad() || experts.weights().requires_grad());
  layer.set_training(training);  // also forgets a forward whose graph was dropped without a backward
  detail::layer_binding<Layer, Fn> binding{&layer, &experts};
  return detail::layer_function<Layer, Fn>::apply(x.contiguous(), topk_weights.contiguous(), experts.weights(),
                                                  topk_idx.contiguous(), &binding);
}

}  // namespace libtorch
MOECOMM_NAMESPACE_END
