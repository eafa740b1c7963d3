// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `torch_experts`: parametric experts (patterns/experts.hpp) written as a torch function of one
//! expert's flat parameters and its rows, `fn(params [P], rows [n][H]) -> [n][H]`, over a `[L][P]`
//! parameter tensor that a torch optimizer trains. Since every layer (shadowed, replicated, plain)
//! calls parametric experts, any pattern runs torch experts.
//!
//! The forward runs `fn` without autograd (the layer keeps no graph between its calls). The
//! backward runs it again with autograd on the rows it is handed and takes the gradients of the rows
//! and of the parameters with `torch::autograd::grad`: recomputation, as the plain-loop experts of
//! the examples do, so that an expert may be called on any parameters (a shadowed expert's copy) and
//! any split of its rows. The parameter gradients go to `gradients(l)`, a `[L][P]` buffer the
//! layer's autograd function (torch/autograd.hpp) hands back to torch as the parameters' gradient.
//!
//! `fn` must be row-wise (a row's output depends on its own input row only), as the layers require.
//! Float only.

#include <moecomm/config.hpp>
#include <moecomm/torch/tensor_views.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

//! The activation of an `mlp_expert`.
enum class mlp_activation { relu, swiglu };

//! A 2-layer MLP expert. `relu`: `relu(x W1 + b1) W2 + b2` with W1 `[H][I]`, W2 `[I][H]`, its flat
//! parameters in the order W1, b1, W2, b2 (the layout of the examples' plain-loop experts).
//! `swiglu`: `(silu(x Wg) * (x Wu)) W2` without biases (Megatron-LM's `--swiglu` with
//! `--disable-bias-linear`), W1 = [Wg | Wu] `[H][2I]`, W2 `[I][H]`, flat in the order W1, W2.
struct mlp_expert {
  std::int64_t hidden = 0, inner = 0;
  mlp_activation activation = mlp_activation::relu;

  [[nodiscard]] std::int64_t parameter_count() const {
    return activation == mlp_activation::swiglu ? 3 * hidden * inner : 2 * hidden * inner + inner + hidden;
  }

  at::Tensor operator()(at::Tensor const& p, at::Tensor const& x) const {
    std::int64_t const h = hidden, i = inner;
    if (activation == mlp_activation::swiglu) {
      at::Tensor const w1 = p.narrow(0, 0, h * 2 * i).view({h, 2 * i});
      at::Tensor const w2 = p.narrow(0, h * 2 * i, i * h).view({i, h});
      at::Tensor const a = at::mm(x, w1);
      return at::mm(at::silu(a.narrow(1, 0, i)) * a.narrow(1, i, i), w2);
    }
    at::Tensor const w1 = p.narrow(0, 0, h * i).view({h, i});
    at::Tensor const b1 = p.narrow(0, h * i, i);
    at::Tensor const w2 = p.narrow(0, h * i + i, i * h).view({i, h});
    at::Tensor const b2 = p.narrow(0, 2 * h * i + i, h);
    return at::addmm(b2, at::relu(at::addmm(b1, x, w1)), w2);
  }
};

template <class Fn>
class torch_experts {
 public:
  //! `weights`: `[L][P]` float, contiguous, on the CPU; P = the function's parameters per expert.
  //! Its storage is the experts' parameters: the optimizer's updates are what the next step reads.
  torch_experts(Fn fn, at::Tensor weights) : fn_(std::move(fn)), weights_(std::move(weights)) {
    static_cast<void>(matrix_of<float>(weights_, "weights", "libtorch::torch_experts"));
    gradients_ = at::zeros_like(weights_, at::TensorOptions().requires_grad(false));
  }

  [[nodiscard]] std::int64_t parameter_count() const { return weights_.size(1); }
  [[nodiscard]] std::int32_t local_experts() const { return static_cast<std::int32_t>(weights_.size(0)); }
  float* parameters(std::int32_t l) { return weights_.data_ptr<float>() + l * parameter_count(); }
  float* gradients(std::int32_t l) { return gradients_.data_ptr<float>() + l * parameter_count(); }

  //! `[L][P]` the parameters (a leaf the optimizer trains) and the gradient buffer the backward fills.
  [[nodiscard]] at::Tensor const& weights() const { return weights_; }
  [[nodiscard]] at::Tensor const& gradient_buffer() const { return gradients_; }
  void zero_gradients() { gradients_.zero_(); }

  void forward(float const* p, matrix_view<float const> in, matrix_view<float> out) const {
    if (in.rows == 0) return;
    at::NoGradGuard const no_grad;
    rows(out).copy_(fn_(alias(p, {parameter_count()}), rows(in)));
  }

  void backward(float const* p, matrix_view<float const> in, matrix_view<float const> d_out, matrix_view<float> d_in,
                float* d_p) const {
    if (in.rows == 0) return;
    at::AutoGradMode const with_grad(true);
    at::Tensor const params = alias(p, {parameter_count()}).detach().requires_grad_(true);
    at::Tensor const x = rows(in).detach().requires_grad_(true);
    at::Tensor const y = fn_(params, x);
    auto const grads = ::torch::autograd::grad({y}, {x, params}, {rows(d_out)});
    rows(d_in).copy_(grads[0]);
    alias(d_p, {parameter_count()}).add_(grads[1]);
  }

 private:
  template <class T>
  static at::Tensor alias(T* data, at::IntArrayRef sizes) {
    return at::from_blob(const_cast<float*>(data), sizes, at::TensorOptions().dtype(at::kFloat));
  }
  template <class T>
  static at::Tensor rows(matrix_view<T> v) {
    return alias(v.data, {v.rows, v.hidden});
  }

  Fn fn_;
  at::Tensor weights_;
  at::Tensor gradients_;
};

}  // namespace libtorch
MOECOMM_NAMESPACE_END
