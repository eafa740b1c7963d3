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
//! backpropagating an older one is an error. Every plain exchange (`flat`, `hierarchical_2d`,
//! `pairwise`, `dedup_per_rank<…>`, `dedup_per_node`) and capacity policy; the patterns that move experts (FasterMoE,
//! replicas) need the layer (torch/autograd.hpp), which calls the experts itself.

#include <moecomm/config.hpp>
#include <moecomm/torch/backward_errors.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
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

 public:
  token_dispatcher(Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, Capacity capacity = {},
                   Algorithm algorithm = {}, routing_checks checks = {})
      : dispatcher_(std::move(be), groups, num_experts, capacity, algorithm, checks) {}

  //! `{rows [received][H], counts [local experts] int64}` for tokens `x` `[T][H]` routed by
  //! `topk_idx` (int32) and `topk_weights` (float), `[T][K]`; differentiable in `x`.
  [[nodiscard]] std::vector<at::Tensor> dispatch(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) {
    // The routing tensors as they are (a non-contiguous one is refused by name): `combine` must be
    // given the very tensor this step routed with.
    return dispatch_function::apply(x.contiguous(), topk_idx, topk_weights, this);
  }

  //! `y [T][H]`: the output rows `rows` (`dispatch`'s layout) back to their tokens, weighted by
  //! `topk_weights` (the tensor given to this step's `dispatch`); differentiable in both.
  [[nodiscard]] at::Tensor combine(at::Tensor const& rows, at::Tensor const& topk_weights) {
    return combine_function::apply(rows.contiguous(), topk_weights, this);
  }

  [[nodiscard]] dispatcher_t& get() { return dispatcher_; }

 private:
  using context = ::torch::autograd::AutogradContext;
  using tensors = ::torch::autograd::variable_list;

  //! Throws unless `ctx` belongs to the dispatcher's last step.
  void check_step(context* ctx, char const* op) const {
    std::int64_t const step = ctx->saved_data["step"].toInt();
    moecomm::detail::require(step == step_, op, "the graph of step ", step, " is backpropagated after step ", step_,
                             "'s dispatch: the dispatcher keeps the state of its last step only");
  }

  struct dispatch_function : ::torch::autograd::Function<dispatch_function> {
    static tensors forward(context* ctx, at::Tensor x, at::Tensor topk_idx, at::Tensor topk_weights, token_dispatcher* self) {
      char const* const op = "libtorch::token_dispatcher::dispatch";
      routing_view const routing = routing_of(topk_idx, topk_weights, op);
      auto const in = matrix_of<float const>(x, "x", op, routing.num_tokens);
      dispatcher_t& d = self->dispatcher_;
      d.route(routing);
      at::Tensor rows = at::empty({d.received_rows(), in.hidden}, x.options());
      d.template dispatch<float>(in, matrix_of<float>(rows, "rows", op));
      std::vector<std::int64_t> counts;
      for (std::size_t l = 0; l + 1 < d.local_expert_offsets().size(); ++l)
        counts.push_back(d.local_expert_offsets()[l + 1] - d.local_expert_offsets()[l]);
      at::Tensor count = at::tensor(counts, at::kLong);
      ctx->mark_non_differentiable({count});
      ctx->save_for_backward({topk_idx, topk_weights});  // the dispatcher reads the routing until the step is done
      ctx->saved_data["self"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(self));
      ctx->saved_data["step"] = ++self->step_;
      ctx->saved_data["tokens"] = in.rows;
      self->routed_weights_ = topk_weights.data_ptr();
      return {rows, count};
    }

    static tensors backward(context* ctx, tensors grads) {
      return detail::translating_errors([&]() -> tensors {
        char const* const op = "libtorch::token_dispatcher::dispatch (backward)";
        auto& self = *reinterpret_cast<token_dispatcher*>(static_cast<std::intptr_t>(ctx->saved_data["self"].toInt()));
        self.check_step(ctx, op);
        dispatcher_t& d = self.dispatcher_;
        std::int64_t const hidden = grads[0].defined() ? grads[0].size(1) : 0;
        at::Tensor const d_rows = grads[0].defined() ? grads[0].contiguous() : at::zeros({d.received_rows(), hidden});
        at::Tensor d_x = ctx->needs_input_grad(0) ? at::empty({ctx->saved_data["tokens"].toInt(), d_rows.size(1)}) : at::Tensor();
        optional_output<matrix_view<float>> dx_view = not_needed;
        if (d_x.defined()) dx_view = matrix_of<float>(d_x, "grad of x", op);
        d.template dispatch_backward<float>(matrix_of<float const>(d_rows, "grad of rows", op, d.received_rows()), dx_view);
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
      auto const in = matrix_of<float const>(rows, "rows", op, d.received_rows());
      at::Tensor y = at::empty({topk_weights.size(0), in.hidden}, rows.options());
      d.template combine<weighted, float>(in, matrix_of<float>(y, "y", op));
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
                                                  : at::zeros({saved[1].size(0), saved[0].size(1)});
        at::Tensor d_rows = at::empty_like(saved[0]);
        at::Tensor d_w = ctx->needs_input_grad(1) ? at::empty_like(saved[1]) : at::Tensor();
        optional_output<array_view<float>> dw_view = not_needed;
        if (d_w.defined()) dw_view = array_of<float>(d_w, "grad of topk_weights", op);
        d.template combine_backward<weighted, float>(matrix_of<float const>(d_y, "grad of y", op), matrix_of<float>(d_rows, "grad of rows", op),
                                                     dw_view);
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
