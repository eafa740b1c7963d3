// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `expert_parallel_layer`: expert parallelism (DeepSpeed-MoE / Megatron-LM style): dispatch ->
//! the user's experts -> combine, and the backward, over any back-end, communicator, capacity
//! policy and all-to-all algorithm; with `fastermoe_shadowing` (patterns/fastermoe.hpp) as the
//! shadowing policy it becomes FasterMoE's layer.

#include <moecomm/config.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/ops/alltoall.hpp>
#include <moecomm/ops/capacity.hpp>
#include <moecomm/ops/dispatcher.hpp>
#include <moecomm/ops/unpermute.hpp>
#include <moecomm/patterns/experts.hpp>

#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Shadowing policy: every expert is computed on its owner (plain expert parallelism).
struct no_shadowing {
  static constexpr bool shadows = false;
  static constexpr char const* name = "none";
  template <class Backend, class Comm>
  struct state {
    state(no_shadowing, Backend const&, exchange_groups<Comm>&, std::int32_t, std::int64_t) {}
  };
};

//! One MoE layer's communication, with the experts supplied by the caller (patterns/experts.hpp).
//! @tparam T element type of the token rows.
//! @tparam Capacity `dropless`, `capacity<rule>` or `receiver_budget`; @tparam Algorithm `flat`,
//! `hierarchical_2d`, `pairwise`; @tparam Weighting `weighted` (weights applied at combine) or
//! `unweighted`; @tparam Shadowing `no_shadowing` or `fastermoe_shadowing<Path>`, which needs
//! parametric experts.
//!
//! Experts see `matrix_view`s of their rows in the back-end's memory. Local expert `l` of rank `r`
//! is global expert `r * E / R + l`.
template <class T, class Backend, class Comm, class Capacity = dropless, class Algorithm = flat,
          class Weighting = weighted, class Shadowing = no_shadowing>
class expert_parallel_layer {
 public:
  expert_parallel_layer(Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, std::int64_t hidden,
                        Capacity capacity = {}, Algorithm algorithm = {}, routing_checks checks = {},
                        Shadowing shadowing = {})
      : dispatcher_(be, groups, num_experts, capacity, algorithm, checks),
        shadow_(shadowing, be, groups, num_experts, hidden),
        hidden_(hidden) {}

  //! `out[t] = combine over t's kept slots of expert(e)(x[t])`. Collective. `routing` and `x` must
  //! stay alive and unchanged until `backward` is done.
  template <class Experts>
  void forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts&& experts) {
    static_assert(!Shadowing::shadows || detail::is_parametric_experts_v<Experts>,
                  "moecomm: a shadowing layer needs parametric experts (parameter_count, parameters, gradients, "
                  "forward, backward; see patterns/experts.hpp)");
    if constexpr (Shadowing::shadows) {
      dispatcher_.route(routing, [&](std::vector<std::int64_t> const& counts) { return shadow_.choose(counts); });
      shadow_.broadcast(experts);
    } else {
      dispatcher_.route(routing);
    }
    std::int64_t const rows = dispatcher_.received_rows(), home = dispatcher_.home_rows();
    expert_in_ = allocate(rows);
    home_in_ = allocate(home);
    auto expert_out = allocate(rows);
    auto home_out = allocate(home);
    dispatcher_.template dispatch<T>(x, view(expert_in_, rows), view(home_in_, home));
    for_each_expert([&](std::int32_t l, std::int64_t begin, std::int64_t n) {
      detail::run_local_expert<T>(experts, l, rows_at(expert_in_, begin, n), rows_at(expert_out, begin, n));
    });
    if constexpr (Shadowing::shadows)
      for_each_home_expert([&](std::size_t i, std::int64_t begin, std::int64_t n) {
        experts.forward(shadow_.parameters(experts, i), matrix_view<T const>(rows_at(home_in_, begin, n)),
                        rows_at(home_out, begin, n));
      });
    dispatcher_.template combine<Weighting, T>(view(expert_out, rows), view(home_out, home), out);
  }

  //! The gradient of `x` (and, with `weighted`, of the routing weights; `d_weights` `[T][K]`,
  //! optional) from that of `out`; parametric experts also get their parameter gradients (the
  //! replicas' summed into the owner's, when shadowed). Collective.
  template <class ExpertsBackward>
  void backward(matrix_view<T const> d_out, matrix_view<T> d_x, float* d_weights, ExpertsBackward&& experts) {
    std::int64_t const rows = dispatcher_.received_rows(), home = dispatcher_.home_rows();
    auto d_expert_out = allocate(rows);
    auto d_expert_in = allocate(rows);
    auto d_home_out = allocate(home);
    auto d_home_in = allocate(home);
    dispatcher_.template combine_backward<Weighting, T>(d_out, view(d_expert_out, rows), view(d_home_out, home), d_weights);
    for_each_expert([&](std::int32_t l, std::int64_t begin, std::int64_t n) {
      detail::run_local_expert_backward<T>(experts, l, rows_at(expert_in_, begin, n), rows_at(d_expert_out, begin, n),
                                        rows_at(d_expert_in, begin, n));
    });
    if constexpr (Shadowing::shadows) {
      for_each_home_expert([&](std::size_t i, std::int64_t begin, std::int64_t n) {
        experts.backward(shadow_.parameters(experts, i), matrix_view<T const>(rows_at(home_in_, begin, n)),
                         matrix_view<T const>(rows_at(d_home_out, begin, n)), rows_at(d_home_in, begin, n),
                         shadow_.gradients(experts, i));
      });
      shadow_.reduce(experts);
    }
    dispatcher_.template dispatch_backward<T>(view(d_expert_in, rows), view(d_home_in, home), d_x);
  }

  //! The dispatcher: the step's report (capacity, drops, received and home rows, messages), counts, plan.
  [[nodiscard]] dispatcher<Backend, Comm, Capacity, Algorithm> const& dispatch_state() const { return dispatcher_; }
  //! The shadowing policy's state of the last step (for `fastermoe_shadowing`: the decision and the counts).
  [[nodiscard]] auto const& shadow_state() const { return shadow_; }

 private:
  using rows_t = typename Backend::template buffer_type<T>;

  rows_t allocate(std::int64_t rows) const { return dispatcher_.backend().template allocate<T>(rows * hidden_); }
  matrix_view<T> view(rows_t& b, std::int64_t rows) const { return {b.data(), rows, hidden_}; }
  matrix_view<T> rows_at(rows_t& b, std::int64_t begin, std::int64_t n) const { return {b.data() + begin * hidden_, n, hidden_}; }

  template <class F>
  void for_each_expert(F&& f) const {
    auto const& offsets = dispatcher_.local_expert_offsets();
    for (std::int32_t l = 0; l < dispatcher_.num_local_experts(); ++l)
      f(l, offsets[static_cast<std::size_t>(l)], offsets[static_cast<std::size_t>(l) + 1] - offsets[static_cast<std::size_t>(l)]);
  }

  template <class F>
  void for_each_home_expert(F&& f) const {
    auto const& offsets = dispatcher_.home_expert_offsets();
    for (std::size_t i = 0; i + 1 < offsets.size(); ++i) f(i, offsets[i], offsets[i + 1] - offsets[i]);
  }

  dispatcher<Backend, Comm, Capacity, Algorithm> dispatcher_;
  typename Shadowing::template state<Backend, Comm> shadow_;
  std::int64_t hidden_;
  rows_t expert_in_;  //!< the experts' input rows, kept for their backward
  rows_t home_in_;    //!< the home (shadowed) experts' input rows, likewise
};

MOECOMM_NAMESPACE_END
