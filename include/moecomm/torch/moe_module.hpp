// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `moe_module`: a whole MoE layer as a `torch::nn::Module`, for a libtorch model: the router on the
//! caller's gate logits, then any moecomm layer with torch experts. `moe(x, logits)` returns the
//! output, `loss.backward()` reaches the logits, the tokens and the experts' parameters (registered
//! as the module's parameter "experts", `[L][P]`, so `parameters()` hands them to an optimizer).
//!
//! ```cpp
//! auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, E, H);  // any pattern
//! auto moe = std::make_shared<moecomm::libtorch::moe_module<decltype(layer), moecomm::libtorch::mlp_expert>>(
//!     std::move(layer), moecomm::libtorch::mlp_expert{H, F}, initial_weights /*[E/R][P]*/, router_config);
//! at::Tensor y = moe->forward(x, gate->forward(x));
//! ```

#include <moecomm/config.hpp>
#include <moecomm/torch/autograd.hpp>
#include <moecomm/torch/torch_experts.hpp>

#include <torch/torch.h>

#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

template <class Layer, class Fn>
class moe_module : public ::torch::nn::Module {
 public:
  //! `initial_weights`: `[L][P]` float, this rank's local experts' flat parameters (copied).
  moe_module(Layer layer, Fn fn, at::Tensor const& initial_weights, router_config config)
      : layer_(std::move(layer)),
        experts_(std::move(fn), register_parameter("experts", initial_weights.detach().clone().contiguous())),
        router_(c10::make_intrusive<router>()) {
    router_->config = config;
  }

  //! The layer's output for tokens `x` ([T][H]) routed by `logits` ([T][E]).
  at::Tensor forward(at::Tensor const& x, at::Tensor const& logits) {
    auto const routed = route(router_, logits);
    losses_ = routed[2];
    topk_idx_ = routed[1];
    return apply_layer(layer_, experts_, x, routed[1], routed[0]);
  }

  //! `[2]` the last forward's router losses (aux, z), for logging; their gradients are in the
  //! backward already (router_config's coefficients).
  [[nodiscard]] at::Tensor const& losses() const { return losses_; }
  //! `[T][K]` int32 the experts the last forward routed each token to.
  [[nodiscard]] at::Tensor const& topk_idx() const { return topk_idx_; }
  [[nodiscard]] Layer& layer() { return layer_; }
  [[nodiscard]] torch_experts<Fn>& experts() { return experts_; }

 private:
  Layer layer_;
  torch_experts<Fn> experts_;
  c10::intrusive_ptr<router> router_;
  at::Tensor losses_, topk_idx_;
};

}  // namespace libtorch
MOECOMM_NAMESPACE_END
