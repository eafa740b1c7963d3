// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `token_dispatcher`: the dispatcher's steps as two autograd functions on tensors, for a trainer
//! that runs its own experts in torch between them, as with DeepEP's `Buffer` or Megatron-LM's token
//! dispatchers:
//!
//! ```cpp
//! auto [rows, counts] = td.dispatch(x, topk_idx, topk_weights);  // rows grouped by local expert
//! at::Tensor out_rows = my_experts(rows, counts);                   // any torch code, autograd and all
//! at::Tensor y = td.combine(out_rows, topk_weights);               // weighted sum per token
//! ```
//!
//! `dispatch` routes (capacity policy, plan, counts) and sends each kept slot's token row to its
//! expert's rank: `rows` `[received][H]`, local expert l's rows `[offsets[l], offsets[l + 1])` with
//! `counts[l] = offsets[l + 1] - offsets[l]` (int64), each expert's rows ordered by (source rank,
//! source token). `combine` returns the experts' output rows to their tokens and sums them with the
//! weights. Their backward passes are the dispatcher's `combine_backward` (the rows' and the
//! weights' gradients) and `dispatch_backward` (the tokens' gradient). Both are collective, forward
//! and backward. One step at a time: a dispatch's graph belongs to the dispatcher's last step, and
//! backpropagating an older one is an error. The tensors live on the back-end's device
//! (`torch_device`: the CPU for `host_backend`; a GPU for `cuda_backend`, torch/cuda.cuh, whose calls
//! run in stream order with torch's current stream); rows are float32, on CUDA also bfloat16 or
//! float16. Every plain exchange (`flat`, `hierarchical_2d`,
//! `pairwise`, `dedup_per_rank<…>`, `dedup_per_node`) and capacity policy; the patterns that move experts (FasterMoE,
//! replicas) need the layer (torch/autograd.hpp), which calls the experts itself.

#include <moecomm/config.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
#include <moecomm/torch/backend_device.hpp>
#include <moecomm/torch/backward_errors.hpp>
#include <moecomm/torch/tensor_views.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

template <class Backend, class Comm, class Capacity = dropless, class Algorithm = flat>
class token_dispatcher {
  using dispatcher_t = dispatcher<Backend, Comm, Capacity, Algorithm>;
  using device_t = torch_device<Backend>;

 public:
  token_dispatcher(Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, Capacity capacity = {},
                   Algorithm algorithm = {}, routing_checks checks = {})
      : dispatcher_(std::move(be), groups, num_experts, capacity, algorithm, checks) {}

  //! `{rows [received][H], counts [local experts] int64 on the CPU}` for tokens `x` `[T][H]` (float32;
  //! on CUDA also bfloat16 or float16) routed by `topk_idx` (int32 or int64) and `topk_weights`
  //! (float32), `[T][K]`, all on the back-end's device; differentiable in `x`. `rows` has `x`'s dtype.
  [[nodiscard]] std::vector<at::Tensor> dispatch(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) {
    // The weights as they are (a non-contiguous tensor is refused by name): `combine` must be given
    // the very tensor this step routed with.
    return dispatch_function::apply(x.contiguous(), int32_ids(topk_idx), topk_weights, this);
  }

  //! `y [T][H]`: the output rows `rows` (`dispatch`'s layout and dtype) back to their tokens,
  //! weighted by `topk_weights` (the tensor given to this step's `dispatch`); differentiable in both.
  [[nodiscard]] at::Tensor combine(at::Tensor const& rows, at::Tensor const& topk_weights) {
    return combine_function::apply(rows.contiguous(), topk_weights, this);
  }

  [[nodiscard]] dispatcher_t& get() { return dispatcher_; }

 private:
  using context = ::torch::autograd::AutogradContext;
  using tensors = ::torch::autograd::variable_list;

  [[nodiscard]] c10::Device device() const { return device_t::of(dispatcher_.backend()); }

  //! Throws unless `ctx` belongs to the dispatcher's last step.
  void check_step(context* ctx, char const* op) const {
    std::int64_t const step = ctx->saved_data["step"].toInt();
    moecomm::detail::require(step == step_, op, "the graph of step ", step, " is backpropagated after step ", step_,
                             "'s dispatch: the dispatcher keeps the state of its last step only");
  }

  //! The tensor options of this dispatcher's rows of dtype `dtype`.
  [[nodiscard]] at::TensorOptions rows_options(at::ScalarType dtype) const { return at::TensorOptions().dtype(dtype).device(device()); }

  struct dispatch_function : ::torch::autograd::Function<dispatch_function> {
    static tensors forward(context* ctx, at::Tensor x, at::Tensor topk_idx, at::Tensor topk_weights, token_dispatcher* self) {
      char const* const op = "libtorch::token_dispatcher::dispatch";
      c10::Device const device = self->device();
      routing_view const routing = routing_of(topk_idx, topk_weights, op, device);
      dispatcher_t& d = self->dispatcher_;
      at::Tensor rows = with_row_type<Backend>(x.scalar_type(), "x", op, [&](auto row) {
        using T = decltype(row);
        auto const in = matrix_of<T const>(x, "x", op, routing.num_tokens, -1, device);
        [[maybe_unused]] typename device_t::stream_join const joined(d.backend());
        d.route(routing);
        at::Tensor received = at::empty({d.received_rows(), in.hidden}, x.options());
        d.template dispatch<T>(in, matrix_of<T>(received, "rows", op, -1, -1, device));
        return received;
      });
      std::vector<std::int64_t> counts;
      for (std::size_t l = 0; l + 1 < d.local_expert_offsets().size(); ++l)
        counts.push_back(d.local_expert_offsets()[l + 1] - d.local_expert_offsets()[l]);
      at::Tensor count = at::tensor(counts, at::kLong);
      ctx->mark_non_differentiable({count});
      ctx->save_for_backward({topk_idx, topk_weights});  // the dispatcher reads the routing until the step is done
      ctx->saved_data["self"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(self));
      ctx->saved_data["step"] = ++self->step_;
      ctx->saved_data["tokens"] = routing.num_tokens;
      ctx->saved_data["hidden"] = x.size(1);
      ctx->saved_data["dtype"] = static_cast<std::int64_t>(x.scalar_type());
      self->routed_weights_ = topk_weights.data_ptr();
      return {rows, count};
    }

    static tensors backward(context* ctx, tensors grads) {
      return detail::translating_errors([&]() -> tensors {
        char const* const op = "libtorch::token_dispatcher::dispatch (backward)";
        auto& self = *reinterpret_cast<token_dispatcher*>(static_cast<std::intptr_t>(ctx->saved_data["self"].toInt()));
        self.check_step(ctx, op);
        dispatcher_t& d = self.dispatcher_;
        auto const options = self.rows_options(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()));
        std::int64_t const hidden = ctx->saved_data["hidden"].toInt();
        at::Tensor const d_rows = grads[0].defined() ? grads[0].contiguous() : at::zeros({d.received_rows(), hidden}, options);
        at::Tensor d_x = ctx->needs_input_grad(0) ? at::empty({ctx->saved_data["tokens"].toInt(), hidden}, options) : at::Tensor();
        with_row_type<Backend>(options.dtype().toScalarType(), "x", op, [&](auto row) {
          using T = decltype(row);
          optional_output<matrix_view<T>> dx_view = not_needed;
          if (d_x.defined()) dx_view = matrix_of<T>(d_x, "grad of x", op, -1, -1, self.device());
          [[maybe_unused]] typename device_t::stream_join const joined(d.backend());
          d.template dispatch_backward<T>(matrix_of<T const>(d_rows, "grad of rows", op, d.received_rows(), hidden, self.device()),
                                         dx_view);
          return 0;
        });
        return {d_x, at::Tensor(), at::Tensor(), at::Tensor()};
      });
    }
  };

  struct combine_function : ::torch::autograd::Function<combine_function> {
    static at::Tensor forward(context* ctx, at::Tensor rows, at::Tensor topk_weights, token_dispatcher* self) {
      char const* const op = "libtorch::token_dispatcher::combine";
      moecomm::detail::require(self->step_ > 0 && topk_weights.data_ptr() == self->routed_weights_, op,
                               "tensor 'topk_weights' is not the one this step's dispatch was given");
      dispatcher_t& d = self->dispatcher_;
      at::Tensor y = with_row_type<Backend>(rows.scalar_type(), "rows", op, [&](auto row) {
        using T = decltype(row);
        auto const in = matrix_of<T const>(rows, "rows", op, d.received_rows(), -1, self->device());
        at::Tensor out = at::empty({topk_weights.size(0), in.hidden}, rows.options());
        [[maybe_unused]] typename device_t::stream_join const joined(d.backend());
        d.template combine<weighted, T>(in, matrix_of<T>(out, "y", op, -1, -1, self->device()));
        return out;
      });
      ctx->save_for_backward({rows, topk_weights});  // dedup reads the rows again for the weights' gradient
      ctx->saved_data["self"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(self));
      ctx->saved_data["step"] = self->step_;
      return y;
    }

    static tensors backward(context* ctx, tensors grads) {
      return detail::translating_errors([&]() -> tensors {
        char const* const op = "libtorch::token_dispatcher::combine (backward)";
        auto& self = *reinterpret_cast<token_dispatcher*>(static_cast<std::intptr_t>(ctx->saved_data["self"].toInt()));
        self.check_step(ctx, op);
        auto const saved = ctx->get_saved_variables();
        dispatcher_t& d = self.dispatcher_;
        at::Tensor const d_y = grads[0].defined() ? grads[0].contiguous()
                                                  : at::zeros({saved[1].size(0), saved[0].size(1)}, saved[0].options());
        at::Tensor d_rows = at::empty_like(saved[0]);
        at::Tensor d_w = ctx->needs_input_grad(1) ? at::empty_like(saved[1]) : at::Tensor();
        optional_output<array_view<float>> dw_view = not_needed;
        if (d_w.defined()) dw_view = array_of<float>(d_w, "grad of topk_weights", op, self.device());
        with_row_type<Backend>(saved[0].scalar_type(), "rows", op, [&](auto row) {
          using T = decltype(row);
          [[maybe_unused]] typename device_t::stream_join const joined(d.backend());
          d.template combine_backward<weighted, T>(matrix_of<T const>(d_y, "grad of y", op, -1, -1, self.device()),
                                                   matrix_of<T>(d_rows, "grad of rows", op, -1, -1, self.device()), dw_view);
          return 0;
        });
        return {d_rows, d_w, at::Tensor()};
      });
    }
  };

  dispatcher_t dispatcher_;
  std::int64_t step_ = 0;
  void const* routed_weights_ = nullptr;
};

}  // namespace libtorch
MOECOMM_NAMESPACE_END
