// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `expert_parallel_layer`: plain expert parallelism (DeepSpeed-MoE / Megatron-LM style): dispatch
//! -> the user's experts -> combine, and the backward, over any back-end, communicator, capacity
//! policy and all-to-all algorithm.

#include <moecomm/config.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/ops/alltoall.hpp>
#include <moecomm/ops/capacity.hpp>
#include <moecomm/ops/dispatcher.hpp>
#include <moecomm/ops/unpermute.hpp>

#include <cstdint>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! One MoE layer's communication, with the experts supplied by the caller.
//! @tparam T element type of the token rows.
//! @tparam Capacity `dropless` or `capacity<rule>`; @tparam Algorithm `flat`, `hierarchical_2d`,
//! `pairwise`; @tparam Weighting `weighted` (weights applied at combine) or `unweighted`.
//!
//! Experts are callables `experts(local_expert, rows_in, rows_out)` with `matrix_view<T const>` /
//! `matrix_view<T>` of that expert's rows in the back-end's memory; their backward is
//! `experts_backward(local_expert, rows_in, d_rows_out, d_rows_in)`. Local expert `l` of rank `r`
//! is global expert `r * E / R + l`.
template <class T, class Backend, class Comm, class Capacity = dropless, class Algorithm = flat, class Weighting = weighted>
class expert_parallel_layer {
 public:
  expert_parallel_layer(Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, std::int64_t hidden,
                        Capacity capacity = {}, Algorithm algorithm = {}, routing_checks checks = {})
      : dispatcher_(std::move(be), groups, num_experts, capacity, algorithm, checks), hidden_(hidden) {}

  //! `out[t] = combine over t's kept slots of expert(e)(x[t])`. Collective. `routing` and `x` must
  //! stay alive and unchanged until `backward` is done.
  template <class Experts>
  void forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts&& experts) {
    dispatcher_.route(routing);
    std::int64_t const rows = dispatcher_.received_rows();
    expert_in_ = allocate(rows);
    auto expert_out = allocate(rows);
    dispatcher_.template dispatch<T>(x, view(expert_in_, rows));
    for_each_expert([&](std::int32_t l, std::int64_t begin, std::int64_t n) {
      experts(l, matrix_view<T const>{expert_in_.data() + begin * hidden_, n, hidden_},
              matrix_view<T>{expert_out.data() + begin * hidden_, n, hidden_});
    });
    dispatcher_.template combine<Weighting, T>(view(expert_out, rows), out);
  }

  //! The gradient of `x` (and, with `weighted`, of the routing weights; `d_weights` `[T][K]`,
  //! optional) from that of `out`. Collective.
  template <class ExpertsBackward>
  void backward(matrix_view<T const> d_out, matrix_view<T> d_x, float* d_weights, ExpertsBackward&& experts_backward) {
    std::int64_t const rows = dispatcher_.received_rows();
    auto d_expert_out = allocate(rows);
    auto d_expert_in = allocate(rows);
    dispatcher_.template combine_backward<Weighting, T>(d_out, view(d_expert_out, rows), d_weights);
    for_each_expert([&](std::int32_t l, std::int64_t begin, std::int64_t n) {
      experts_backward(l, matrix_view<T const>{expert_in_.data() + begin * hidden_, n, hidden_},
                       matrix_view<T const>{d_expert_out.data() + begin * hidden_, n, hidden_},
                       matrix_view<T>{d_expert_in.data() + begin * hidden_, n, hidden_});
    });
    dispatcher_.template dispatch_backward<T>(view(d_expert_in, rows), d_x);
  }

  //! The dispatcher: the step's report (capacity, drops, received rows, messages), counts, plan.
  [[nodiscard]] dispatcher<Backend, Comm, Capacity, Algorithm> const& dispatch_state() const { return dispatcher_; }

 private:
  using rows_t = typename Backend::template buffer_type<T>;

  rows_t allocate(std::int64_t rows) const { return dispatcher_.backend().template allocate<T>(rows * hidden_); }
  matrix_view<T> view(rows_t& b, std::int64_t rows) const { return {b.data(), rows, hidden_}; }

  template <class F>
  void for_each_expert(F&& f) const {
    auto const& offsets = dispatcher_.local_expert_offsets();
    for (std::int32_t l = 0; l < dispatcher_.num_local_experts(); ++l)
      f(l, offsets[static_cast<std::size_t>(l)], offsets[static_cast<std::size_t>(l) + 1] - offsets[static_cast<std::size_t>(l)]);
  }

  dispatcher<Backend, Comm, Capacity, Algorithm> dispatcher_;
  std::int64_t hidden_;
  rows_t expert_in_;  //!< the experts' input rows, kept for their backward
};

MOECOMM_NAMESPACE_END
