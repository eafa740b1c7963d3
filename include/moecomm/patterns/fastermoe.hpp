// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FasterMoE's shadowing (PPoPP'22 §4.1) as a policy of `expert_parallel_layer`: each step the
//! planner picks hot experts from the all-gathered token counts (Algorithm 1); their owners
//! broadcast their parameters to every rank; every rank computes its own tokens of them (their rows
//! never cross the network); in the backward their gradients are summed back into the owners'.
//!
//! Switching a layer from plain expert parallelism is one policy type:
//! `expert_parallel_layer<T, B, C, dropless, pairwise, weighted, fastermoe_shadowing<>>`.

#include <moecomm/config.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/placement.hpp>
#include <moecomm/ops/alltoall/exchange_groups.hpp>
#include <moecomm/ops/gradient_reduce.hpp>
#include <moecomm/ops/replica/replica_set.hpp>
#include <moecomm/ops/replica_broadcast.hpp>
#include <moecomm/patterns/expert_parallel.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/patterns/experts.hpp>
#include <moecomm/plan/cost_model.hpp>
#include <moecomm/plan/shadow_selection.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! FasterMoE's Algorithm 1 as the shadowing policy's planner. A planner is any callable
//! `(model, topology, owner, counts, shadow_decision& decision)` that overwrites `decision` the same
//! way on every rank (reusing its vectors, so a steady state allocates nothing).
struct fastermoe_planner {
  void operator()(fastermoe_cost_model const& model, topology const& topo, std::vector<std::int32_t> const& owner,
                  std::int64_t const* counts, shadow_decision& decision) {
    select_shadowed_experts(model, topo, owner, counts, decision, workspace);
  }
  shadow_selection_workspace workspace;  //!< kept between steps
};

//! Shadowing policy: FasterMoE's. `model` is the performance model the planner evaluates (its
//! `hidden` is taken from the layer); `path` moves the parameters and gradients of shadowed experts
//! (`point_to_point_path`, the default, sums gradients in ascending rank order on every transport).
template <class Path = point_to_point_path, class Planner = fastermoe_planner>
struct fastermoe_shadowing {
  static constexpr bool shadows = true;
  static constexpr char const* name = "fastermoe";
  fastermoe_cost_params model{};
  Path path{};
  Planner planner{};

  //! The per-layer state: the last decision, and the replicas' parameters and gradients.
  template <class Backend, class Comm>
  class state {
   public:
    state(fastermoe_shadowing const& policy, Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts,
          std::int64_t hidden)
        : path_(policy.path),
          planner_(policy.planner),
          model_(with_hidden(policy.model, hidden, detail::simulated_scale(be))),
          be_(std::move(be)),
          groups_(&groups),
          placement_(num_experts, groups.world().size()),
          owners_(detail::owners_of("fastermoe_shadowing", placement_, groups.topo())) {}

    //! Algorithm 1 on the gathered `[R][E]` counts; returns the shadowed experts, ascending.
    std::vector<std::int32_t> const& choose(std::vector<std::int64_t> const& counts) {
      counts_.assign(counts.begin(), counts.end());
      planner_(model_, groups_->topo(), owners_, counts_.data(), decision_);
      shadowed_.assign(decision_.shadowed.begin(), decision_.shadowed.end());
      std::sort(shadowed_.begin(), shadowed_.end());
      return shadowed_;
    }

    //! Owners send each shadowed expert's parameters to every other rank (ascending expert id);
    //! and every rank zeroes its gradient accumulators for the experts it does not own.
    template <class Experts>
    void broadcast(Experts& experts) {
      using P = detail::parameter_t<Experts>;
      std::int64_t const count = experts.parameter_count();
      std::size_t const r = shadowed_.size();
      std::int64_t const bytes = static_cast<std::int64_t>(r) * count * std::int64_t(sizeof(P));
      grow(be_, replica_params_, bytes);  // kept from step to step; grows with the shadow set
      grow(be_, replica_grads_, bytes);
      be_.for_each_index(static_cast<std::int64_t>(r) * count,
                         detail::fill_value<P>{reinterpret_cast<P*>(replica_grads_.data()), P(0)});
      [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::parameters);
      for (std::size_t i = 0; i < r; ++i)
        replica_broadcast(be_, groups_->world(), everyone_of(i), count, array_view<P>{parameters(experts, i), count},
                          workspace_, path_);
    }

    //! The parameters shadowed expert `i` (in ascending id) is computed with on this rank.
    template <class Experts>
    detail::parameter_t<Experts>* parameters(Experts& experts, std::size_t i) {
      using P = detail::parameter_t<Experts>;
      if (owns(i)) return experts.parameters(local_index(i));
      return reinterpret_cast<P*>(replica_params_.data()) + static_cast<std::int64_t>(i) * experts.parameter_count();
    }

    //! Where this rank accumulates shadowed expert `i`'s gradient: the owner's own accumulator, or
    //! a zeroed replica buffer that `reduce` sends to the owner.
    template <class Experts>
    detail::parameter_t<Experts>* gradients(Experts& experts, std::size_t i) {
      using P = detail::parameter_t<Experts>;
      if (owns(i)) return experts.gradients(local_index(i));
      return reinterpret_cast<P*>(replica_grads_.data()) + static_cast<std::int64_t>(i) * experts.parameter_count();
    }

    //! Sums every rank's gradient of each shadowed expert into its owner's, in ascending rank.
    template <class Experts>
    void reduce(Experts& experts) {
      [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::parameters);
      for (std::size_t i = 0; i < shadowed_.size(); ++i)
        gradient_reduce(be_, groups_->world(), everyone_of(i), experts.parameter_count(),
                        array_view<detail::parameter_t<Experts>>{gradients(experts, i), experts.parameter_count()}, workspace_,
                        path_);
    }

    //! The last step's decision: shadowed experts, predicted latencies, tokens per rank before and after.
    [[nodiscard]] shadow_decision const& decision() const { return decision_; }
    //! The last step's gathered `[R][E]` counts, before shadowing.
    [[nodiscard]] std::vector<std::int64_t> const& counts() const { return counts_; }
    [[nodiscard]] fastermoe_cost_model const& model() const { return model_; }

   private:
    //! The policy's model for the layer's rows; under simulation, for the model-sized rows they stand for.
    static fastermoe_cost_model with_hidden(fastermoe_cost_params params, std::int64_t hidden, simulation_scale scale) {
      params.hidden = hidden;
      return fastermoe_cost_model(params).scaled(scale.payload, scale.parameters, scale.flops);
    }
    [[nodiscard]] std::int32_t owner_of(std::size_t i) const { return placement_.rank_of(shadowed_[i]); }
    [[nodiscard]] bool owns(std::size_t i) const { return owner_of(i) == groups_->world().rank(); }
    [[nodiscard]] std::int32_t local_index(std::size_t i) const { return placement_.local_index_of(shadowed_[i]); }
    //! Shadowed expert `i`'s set: its owner and every other rank (rebuilt in place).
    [[nodiscard]] replica_set const& everyone_of(std::size_t i) {
      everyone_.assign_everyone(owner_of(i), groups_->world().size());
      return everyone_;
    }

    Path path_;
    Planner planner_;
    fastermoe_cost_model model_;
    Backend be_;
    exchange_groups<Comm>* groups_;
    contiguous_placement placement_;
    std::vector<std::int32_t> owners_;  //!< placement_.rank_of(e) for every e, as the planner takes it
    std::vector<std::int64_t> counts_;
    shadow_decision decision_;
    std::vector<std::int32_t> shadowed_;  //!< ascending, as the dispatcher's home experts
    replica_set everyone_;                //!< `everyone_of`'s set
    typename Backend::template buffer_type<char> replica_params_, replica_grads_;
    workspace<Backend> workspace_;  //!< the replica ops' staging and message lists, kept between steps
  };
};

MOECOMM_NAMESPACE_END
