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
//!
//! Scheduled steps (Pro-Prophet's block-wise scheduler, §V): `layer.begin_replica_transfer(experts)`
//! plans the step from the last step's counts (the load prediction) and starts the owners' parameter
//! transfers on a lane, over a communicator of their own, while the caller computes (the previous
//! block's experts, this block's attention); the forward then uses that plan, and waits for the
//! transfers only before its home experts compute. That step's backward leaves the gradients'
//! aggregation on the lane, to overlap the previous block's backward, until
//! `layer.finish_replica_gradients()` (or the layer's next step) waits for it.

#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/core/placement.hpp>
#include <moecomm/core/read_back.hpp>
#include <moecomm/collectives/alltoall/exchange_groups.hpp>
#include <moecomm/collectives/gradient_reduce.hpp>
#include <moecomm/collectives/replica_set.hpp>
#include <moecomm/collectives/replica_broadcast.hpp>
#include <moecomm/patterns/expert_parallel.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/patterns/experts.hpp>
#include <moecomm/planners/fastermoe_cost_model.hpp>
#include <moecomm/planners/shadow_selection.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! FasterMoE's Algorithm 1 as the shadowing policy's planner. A planner is any callable
//! `(model, topology, owner, array_view<std::int64_t const> counts, shadow_decision& decision)`
//! (`counts` the `[R][E]` matrix) that overwrites `decision` the same way on every rank (reusing its
//! vectors, so a steady state allocates nothing).
struct fastermoe_planner {
  void operator()(fastermoe_cost_model const& model, topology const& topo, std::vector<std::int32_t> const& owner,
                  array_view<std::int64_t const> counts, shadow_decision& decision) {
    select_shadowed_experts(model, topo, owner, counts, decision, workspace);
  }
  shadow_selection_workspace workspace;  //!< kept between steps
};

//! Shadowing policy: FasterMoE's. `model` is the performance model the planner evaluates (its
//! `hidden` is taken from the layer); `path` moves the parameters and gradients of shadowed experts
//! (`point_to_point_path`, the default, sums gradients in ascending rank order on every transport).
//! A planner may replicate an expert on a subset of the ranks only (`shadow_decision::subset_offsets`,
//! Pro-Prophet): the owner then sends its parameters to that subset, whose ranks compute their own
//! tokens of it; the other ranks send theirs to the owner as usual; gradients are summed back into
//! the owner's from the subset (ascending rank). On `collective_path` the transfers span every rank
//! (see `replicas_of`).
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
          model_(with_hidden(agreed(groups.world(), policy.model), hidden, detail::simulated_scale(be))),
          be_(std::move(be)),
          groups_(&groups),
          placement_(num_experts, groups.world().size()),
          owners_(detail::owners_of("fastermoe_shadowing", placement_, groups.topo())) {}

    state(state const&) = delete;
    state& operator=(state const&) = delete;
    state(state&&) = default;
    ~state() {
      try {
        finish_lane();  // work begun and never waited for: let the lane go first
      } catch (...) {
      }
    }

    //! The planner on the gathered `[R][E]` counts; returns the shadowed experts, ascending, and
    //! where each is replicated, as the dispatcher's home experts. In a scheduled step, the plan
    //! made ahead (the counts are kept as the next step's prediction).
    home_subsets choose(std::vector<std::int64_t> const& counts) {
      counts_.assign(counts.begin(), counts.end());
      scheduled_ = std::exchange(planned_ahead_, false);  // a step not begun ahead is planned here
      if (!scheduled_) adopt(counts_);
      return {array_view<std::int32_t const>(shadowed_), array_view<std::int32_t const>(subset_offsets_),
              array_view<std::int32_t const>(subset_ranks_)};
    }

    //! Starts a scheduled step (file comment): plans on the last step's counts and starts the
    //! transfers on the lane. Collective; false (nothing begun, the step plans as usual) on the
    //! first step, which has no counts to predict from.
    template <class Experts>
    bool begin_transfer(Experts& experts) {
      finish_lane();
      if (!lane_) {  // once: the lane and its own copy of the world (collective), kept only together
        auto lane = std::make_unique<lane_t<Backend>>(be_);
        lane_comm_.emplace(split_for(groups_->world(), lane_backend(*lane, be_)));
        lane_ = std::move(lane);
      }
      scheduled_ = planned_ahead_ = false;
      if (counts_.empty()) return false;
      adopt(counts_);
      prepare_buffers(experts);
      start_job(&state::template on_lane<Experts, &state::template transfer_all<Experts>>, experts);
      scheduled_ = planned_ahead_ = true;
      return true;
    }

    //! Sizes the replica buffers for `max_shadowed` experts of `experts` (0: every expert) and the
    //! decision's tables for every expert, so that steps within them allocate nothing.
    template <class Experts>
    void reserve(std::int32_t max_shadowed, Experts& experts) {
      using P = detail::parameter_t<Experts>;
      std::size_t const E = owners_.size(), R = static_cast<std::size_t>(groups_->world().size());
      std::int64_t const n = max_shadowed > 0 ? std::min<std::int64_t>(max_shadowed, static_cast<std::int64_t>(E))
                                              : static_cast<std::int64_t>(E);
      std::int64_t const bytes = n * experts.parameter_count() * std::int64_t(sizeof(P));
      grow(be_, replica_params_, bytes);
      grow(be_, replica_grads_, bytes);
      // The planner's workspaces at their largest: a plan on counts that load every expert from
      // every rank (the decision it leaves is cleared: no step has run).
      std::vector<std::int64_t> const everywhere(E * R, 1);
      planner_(model_, groups_->topo(), owners_, everywhere, decision_);
      for (std::vector<std::int32_t>* v : {&shadowed_, &subset_offsets_, &decision_.shadowed, &decision_.subset_offsets}) {
        v->clear();
        v->reserve(E + 1);
      }
      order_.reserve(E);
      subset_ranks_.reserve(E * R);
      decision_.subset_ranks.clear();
      decision_.subset_ranks.reserve(E * R);
      // The replica ops' staging (an owner stages a chunk from each replica) and message lists, on
      // this thread and on the lane.
      for (workspace<Backend>* w : {&workspace_, &lane_workspace_}) {
        (void)w->template get<P>(be_, experts.parameter_count() * static_cast<std::int64_t>(R));
        w->messages().reserve_messages(R);
      }
      be_.synchronize();  // allocated on this stream, used on the lane's too (as prepare_buffers' are)
    }

    //! Waits for the scheduled step's gradient aggregation (or anything else on the lane), rethrowing its failure.
    void finish_lane() {
      if (!lane_busy_) return;
      lane_busy_ = false;
      wait_and_finish(*lane_, 0);
    }

    //! True between `begin_transfer` and the next forward's planning.
    [[nodiscard]] bool planned_ahead() const { return planned_ahead_; }

    //! Why this step cannot be captured into a CUDA graph, or "" when it can (the experts chosen
    //! in the eager step before the capture are kept; the transfers are in stream order).
    [[nodiscard]] std::string capture_blocker() const {
      if constexpr (std::is_same_v<Path, collective_path>)
        return "fastermoe_shadowing<collective_path>: the communicator's broadcast and reduce wait on the host; "
               "point_to_point_path's transfers stay in stream order";
      if (planned_ahead_ || lane_busy_)
        return "a scheduled step (begin_replica_transfer) moves its replicas on the lane: capture a step that is not "
               "scheduled, after finish_replica_gradients()";
      return "";
    }

    //! Owners send each shadowed expert's parameters to its replicas, every other rank or its
    //! subset (ascending expert id). In a scheduled step the lane has begun that: wait for it.
    template <class Experts>
    void broadcast(Experts& experts) {
      if (scheduled_) {
        finish_lane();
        return;
      }
      prepare_buffers(experts);
      transfer_all(experts, be_, groups_->world(), workspace_);
    }

    //! The parameters home expert `e` is computed with on this rank.
    template <class Experts>
    detail::parameter_t<Experts>* parameters(Experts& experts, std::int32_t e) {
      return replica_parameters(experts, index_of(e));
    }

    //! Where this rank accumulates home expert `e`'s gradient: the owner's own accumulator, or a
    //! zeroed replica buffer that `reduce` sends to the owner.
    template <class Experts>
    detail::parameter_t<Experts>* gradients(Experts& experts, std::int32_t e) {
      return replica_gradients(experts, index_of(e));
    }

    //! Zeroes the replicas' gradient buffers: called at every backward's start, so that each
    //! backward of one forward adds its replicas' share to the owner's once (a second backward,
    //! `retain_graph`, adds it once more, as plain expert parallelism's owner does). A scheduled
    //! step's aggregation of the last backward, still on the lane, reads them: it finishes first.
    template <class Experts>
    void begin_gradients(Experts& experts) {
      using P = detail::parameter_t<Experts>;
      finish_lane();
      be_.for_each_index(static_cast<std::int64_t>(shadowed_.size()) * experts.parameter_count(),
                         detail::fill_value<P>{reinterpret_cast<P*>(replica_grads_.data()), P(0)});
      // A scheduled step's lane (another stream) adds to them; a captured step is never scheduled.
      if (!detail::capturing(be_)) be_.synchronize();
    }

    //! Sums the replicas' gradient of each shadowed expert into its owner's, in ascending rank. In
    //! a scheduled step, started on the lane: `finish_lane` waits for it.
    template <class Experts>
    void reduce(Experts& experts) {
      if (scheduled_) {
        scheduled_ = false;
        start_job(&state::template on_lane<Experts, &state::template aggregate_all<Experts>>, experts);
        return;
      }
      aggregate_all(experts, be_, groups_->world(), workspace_);
    }

    //! The last step's decision: shadowed experts (and subsets), predicted latencies, tokens per rank before and after.
    [[nodiscard]] shadow_decision const& decision() const { return decision_; }
    //! The last step's gathered `[R][E]` counts, before shadowing.
    [[nodiscard]] std::vector<std::int64_t> const& counts() const { return counts_; }
    [[nodiscard]] fastermoe_cost_model const& model() const { return model_; }

   private:
    //! Makes `decision_`'s choice for `counts` this step's: shadowed experts ascending, their subsets.
    void adopt(std::vector<std::int64_t> const& counts) {
      planner_(model_, groups_->topo(), owners_, counts, decision_);
      std::size_t const n = decision_.shadowed.size();
      bool const subsets = !decision_.subset_offsets.empty();
      detail::require(!subsets || decision_.subset_offsets.size() == n + 1, "fastermoe_shadowing",
                      "the planner's decision has ", decision_.subset_offsets.size(), " subset offsets for ", n, " experts");
      for (std::size_t i = 0; subsets && i < n; ++i)  // the offsets index subset_ranks below (the ranks: the dispatcher checks them)
        detail::require(decision_.subset_offsets[i] >= 0 && decision_.subset_offsets[i] <= decision_.subset_offsets[i + 1] &&
                            static_cast<std::size_t>(decision_.subset_offsets[i + 1]) <= decision_.subset_ranks.size(),
                        "fastermoe_shadowing", "the planner's decision has subset offsets ", decision_.subset_offsets[i], ", ",
                        decision_.subset_offsets[i + 1], " for expert ", decision_.shadowed[i], " with ", decision_.subset_ranks.size(),
                        " subset ranks");
      order_.resize(n);  // the decision's entries by ascending expert
      for (std::size_t i = 0; i < n; ++i) order_[i] = i;
      std::sort(order_.begin(), order_.end(),
                [&](std::size_t a, std::size_t b) { return decision_.shadowed[a] < decision_.shadowed[b]; });
      shadowed_.clear();
      subset_offsets_.assign(subsets ? 1 : 0, 0);
      subset_ranks_.clear();
      for (std::size_t i : order_) {
        shadowed_.push_back(decision_.shadowed[i]);
        if (!subsets) continue;
        for (std::int32_t k = decision_.subset_offsets[i]; k < decision_.subset_offsets[i + 1]; ++k)
          subset_ranks_.push_back(decision_.subset_ranks[static_cast<std::size_t>(k)]);
        subset_offsets_.push_back(static_cast<std::int32_t>(subset_ranks_.size()));
      }
    }

    //! The replica buffers for this step's shadowed experts (the backward zeroes the gradients').
    template <class Experts>
    void prepare_buffers(Experts& experts) {
      using P = detail::parameter_t<Experts>;
      std::int64_t const bytes = static_cast<std::int64_t>(shadowed_.size()) * experts.parameter_count() * std::int64_t(sizeof(P));
      grow(be_, replica_params_, bytes);  // kept from step to step; grows with the shadow set
      grow(be_, replica_grads_, bytes);
    }

    //! Trans: every shadowed expert from its owner to its replicas, on `be` over `comm` with staging `ws`.
    template <class Experts>
    void transfer_all(Experts& experts, Backend const& be, Comm& comm, workspace<Backend>& ws) {
      using P = detail::parameter_t<Experts>;
      std::int64_t const count = experts.parameter_count();
      [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::parameters);
      for (std::size_t i = 0; i < shadowed_.size(); ++i)
        replica_broadcast(be, comm, replicas_of(i), count, array_view<P>{replica_parameters(experts, i), count},
                          ws, path_);
    }

    //! Agg: every shadowed expert's replica gradients summed into its owner's, over `comm` with staging `ws`.
    template <class Experts>
    void aggregate_all(Experts& experts, Backend const& be, Comm& comm, workspace<Backend>& ws) {
      using P = detail::parameter_t<Experts>;
      [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::parameters);
      for (std::size_t i = 0; i < shadowed_.size(); ++i)
        gradient_reduce(be, comm, replicas_of(i), experts.parameter_count(),
                        array_view<P>{replica_gradients(experts, i), experts.parameter_count()}, ws, path_);
    }

    //! The job the lane runs (a plain struct: starting it allocates nothing).
    struct lane_job {
      state* self = nullptr;
      void* experts = nullptr;
      void (*run)(state&, void*) = nullptr;
      void operator()(std::int32_t) const { run(*self, experts); }
    };
    template <class Experts, void (state::*Work)(Experts&, Backend const&, Comm&, workspace<Backend>&)>
    static void on_lane(state& self, void* experts) {  // the lane's own back-end, communicator and staging
      (self.*Work)(*static_cast<Experts*>(experts), lane_backend(*self.lane_, self.be_), *self.lane_comm_, self.lane_workspace_);
    }
    //! Runs `run(*this, &experts)` on the lane; `experts` must outlive `finish_lane`.
    template <class Experts>
    void start_job(void (*run)(state&, void*), Experts& experts) {
      job_ = {this, &experts, run};
      lane_->start(job_, 1);
      lane_busy_ = true;
      lane_->release(0);
    }

    //! `model`, once every rank has passed the same one: the planner runs on every rank from the
    //! same counts, and ranks with different models would shadow different experts.
    static fastermoe_cost_params const& agreed(Comm& world, fastermoe_cost_params const& model) {
      static constexpr char const* names[] = {"model.alpha",           "model.hidden",          "model.bytes_per_element",
                                              "model.gemm_flops",      "model.net_bandwidth",   "model.local_bandwidth",
                                              "model.model_transfers"};
      double const mine[] = {model.alpha,         static_cast<double>(model.hidden), model.bytes_per_element,
                             model.gemm_flops,    model.net_bandwidth,               model.local_bandwidth,
                             static_cast<double>(model.model_transfers)};
      std::vector<double> all;
      detail::agree_on(world, "fastermoe_shadowing", "on the shadowing policy's cost model", names, mine, all);
      return model;
    }

    //! The policy's model for the layer's rows; under simulation, for the model-sized rows they stand for.
    static fastermoe_cost_model with_hidden(fastermoe_cost_params params, std::int64_t hidden, simulation_scale scale) {
      params.hidden = hidden;
      return fastermoe_cost_model(params).scaled(scale.payload, scale.parameters, scale.flops);
    }
    //! Shadowed expert `i`'s parameters on this rank (`i` in ascending id): the owner's, or the replica buffer.
    template <class Experts>
    detail::parameter_t<Experts>* replica_parameters(Experts& experts, std::size_t i) {
      using P = detail::parameter_t<Experts>;
      if (owns(i)) return experts.parameters(local_index(i));
      return reinterpret_cast<P*>(replica_params_.data()) + static_cast<std::int64_t>(i) * experts.parameter_count();
    }
    template <class Experts>
    detail::parameter_t<Experts>* replica_gradients(Experts& experts, std::size_t i) {
      using P = detail::parameter_t<Experts>;
      if (owns(i)) return experts.gradients(local_index(i));
      return reinterpret_cast<P*>(replica_grads_.data()) + static_cast<std::int64_t>(i) * experts.parameter_count();
    }
    //! The position of shadowed expert `e` in `shadowed_`.
    [[nodiscard]] std::size_t index_of(std::int32_t e) const {
      return static_cast<std::size_t>(std::lower_bound(shadowed_.begin(), shadowed_.end(), e) - shadowed_.begin());
    }
    [[nodiscard]] std::int32_t owner_of(std::size_t i) const { return placement_.rank_of(shadowed_[i]); }
    [[nodiscard]] bool owns(std::size_t i) const { return owner_of(i) == groups_->world().rank(); }
    [[nodiscard]] std::int32_t local_index(std::size_t i) const { return placement_.local_index_of(shadowed_[i]); }
    //! Shadowed expert `i`'s set: its owner and every other rank, or its subset (rebuilt in place).
    //! The collective path moves a subset's parameters and gradients over every rank, as
    //! Pro-Prophet's code does on its global communicator: the ranks outside the subset receive
    //! the parameters without using them and add zero gradients.
    [[nodiscard]] replica_set const& replicas_of(std::size_t i) {
      if (subset_offsets_.empty() || std::is_same_v<Path, collective_path>) {
        replicas_.assign_everyone(owner_of(i), groups_->world().size());
      } else {
        replicas_.owner = owner_of(i);
        replicas_.replicas.assign(subset_ranks_.begin() + subset_offsets_[i], subset_ranks_.begin() + subset_offsets_[i + 1]);
      }
      return replicas_;
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
    std::vector<std::int32_t> subset_offsets_, subset_ranks_;  //!< aligned with shadowed_; empty: every rank
    std::vector<std::size_t> order_;      //!< the decision's entries by ascending expert
    replica_set replicas_;                //!< `replicas_of`'s set
    typename Backend::template buffer_type<char> replica_params_, replica_grads_;
    workspace<Backend> workspace_;  //!< the replica ops' staging and message lists, kept between steps
    // Scheduled steps: the lane, its communicator (a copy of the world's) and staging, its job.
    std::optional<Comm> lane_comm_;
    workspace<Backend> lane_workspace_;
    std::unique_ptr<lane_t<Backend>> lane_;
    lane_job job_;
    bool lane_busy_ = false, scheduled_ = false, planned_ahead_ = false;
  };
};

MOECOMM_NAMESPACE_END
