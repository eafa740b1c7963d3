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
//! Rows are T (float; `__half` or `__nv_bfloat16` on CUDA tensors), the parameters float32 on the
//! rows' device; `fn` gets both as they are (`mlp_expert` casts the parameters to the rows' dtype, so
//! their gradient stays float32: Megatron's bf16 training with float32 main parameters). Called by
//! the layer with its back-end, `fn` runs where that back-end runs (`torch_device::stream_guard`).

#include <moecomm/config.hpp>
#include <moecomm/torch/backend_device.hpp>
#include <moecomm/torch/tensor_views.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <type_traits>
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

  at::Tensor operator()(at::Tensor const& params, at::Tensor const& x) const {
    std::int64_t const h = hidden, i = inner;
    at::Tensor const p = params.scalar_type() == x.scalar_type() ? params : params.to(x.scalar_type());
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

template <class Fn, class T = float>
class torch_experts {
 public:
  using row_type = T;  //!< the rows' element type

  //! `weights`: `[L][P]` float, contiguous, on the device of the rows (the layer's back-end's); P =
  //! the function's parameters per expert. Its storage is the experts' parameters: the optimizer's
  //! updates are what the next step reads.
  torch_experts(Fn fn, at::Tensor weights) : fn_(std::move(fn)), weights_(std::move(weights)) {
    char const* const op = "libtorch::torch_experts";
    moecomm::detail::require(weights_.defined(), op, "tensor 'weights' is undefined");
    static_cast<void>(matrix_of<float>(weights_, "weights", op, -1, -1, weights_.device()));
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

  void forward(float const* p, matrix_view<T const> in, matrix_view<T> out) const {
    if (in.rows == 0) return;
    at::NoGradGuard const no_grad;
    rows(out).copy_(fn_(alias(p, {parameter_count()}), rows(in)));
  }

  void backward(float const* p, matrix_view<T const> in, matrix_view<T const> d_out, matrix_view<T> d_in, float* d_p) const {
    if (in.rows == 0) return;
    at::AutoGradMode const with_grad(true);
    at::Tensor const params = alias(p, {parameter_count()}).detach().requires_grad_(true);
    at::Tensor const x = rows(in).detach().requires_grad_(true);
    at::Tensor const y = fn_(params, x);
    using list = ::torch::autograd::variable_list;
    auto const grads = ::torch::autograd::grad(list{y}, list{x, params}, list{rows(d_out)});
    rows(d_in).copy_(grads[0]);
    alias(d_p, {parameter_count()}).add_(grads[1]);
  }

  //! The same, called by the layer with the back-end the call runs on: torch enqueues there.
  template <class Backend>
  void forward(float const* p, matrix_view<T const> in, matrix_view<T> out, Backend const& be) const {
    [[maybe_unused]] typename torch_device<Backend>::stream_guard const on(be);
    forward(p, in, out);
  }
  template <class Backend>
  void backward(float const* p, matrix_view<T const> in, matrix_view<T const> d_out, matrix_view<T> d_in, float* d_p,
                Backend const& be) const {
    [[maybe_unused]] typename torch_device<Backend>::stream_guard const on(be);
    backward(p, in, d_out, d_in, d_p);
  }

 private:
  template <class U>
  at::Tensor alias(U* data, at::IntArrayRef sizes) const {
    return at::from_blob(const_cast<std::remove_const_t<U>*>(data), sizes,
                         at::TensorOptions().dtype(detail::dtype_of<U>()).device(weights_.device()));
  }
  template <class U>
  at::Tensor rows(matrix_view<U> v) const {
    return alias(v.data, {v.rows, v.hidden});
  }

  Fn fn_;
  at::Tensor weights_;
  at::Tensor gradients_;
};

}  // namespace libtorch
MOECOMM_NAMESPACE_END
