// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `replicated_expert_layer`: experts held by several ranks (`replica_placement`), each token sent
//! to one replica of its expert (FineMoE/MicroMoE and FlexMoE; reference/systems.md §3, §4).
//!
//! Each step, per forward:
//! 1. this rank's tokens per expert (a dropless permute plan on the real experts), all-gathered
//!    into the `[R][E]` counts, the same on every rank;
//! 2. the split of each expert's tokens over its replicas: `finemoe_split` solves the exact min-max
//!    schedule (`schedule_replicas`, FineMoE eq. 3) and assigns by FineMoE's Algorithm 1;
//!    `even_split` shares each rank's tokens evenly (FlexMoE). `planners/replica_assignment.hpp`;
//! 3. every slot relabeled to its replica's *slot id* `rank · S + local index` (a rank's tokens of
//!    an expert go to the replicas as contiguous runs of their (token, slot) order): the real plan's
//!    runs move to their slot ids (`relabel_permute_plan` by row blocks), no second sort;
//! 4. plain expert parallelism over the `R · S` slots: the library's `dispatcher`, whose combine
//!    adds every token's slots in slot order, so outputs and input gradients are plain EP's bit for
//!    bit whatever the placement and split (an expert's row does not depend on the replica).
//!
//! Backward: the dispatcher's; each replica computes its rows' share of its expert's gradient,
//! then the replicas of each expert all-reduce the shares (`ordered_allreduce`, ascending rank),
//! slot row by slot row in ascending local index, and add the sum to `experts.gradients(l)`, so
//! that every replica's accumulator gains the expert's whole gradient once per backward (also a
//! second backward of one forward, or micro-batches accumulated): plain EP's owner's, bitwise
//! where the sums are exact. With
//! `replica_gradients::left_to_trainer` each replica keeps its own rows' share instead, and the
//! trainer sums it over `replica_group(l)` with its data-parallel reduction, once per iteration.
//! Dropless only (FineMoE drops nothing).
//!
//! The experts object of rank `r` holds the parameters of its slots: `parameters(l)` is the replica
//! in slot `(r, l)` (`placement.expert_at(r, l)`); replicas of an expert must start equal, and stay
//! so when the trainer applies the all-reduced gradients alike.
//!
//! Between steps, `move_replicas(to, experts, state)` changes the placement: the slots that gain an
//! expert receive its parameters and the trainer's optimizer state (`collectives/replica_migration.hpp`),
//! and the replica groups are rebuilt; if any rank fails, every slot and the placement stay as they
//! were. With the `dynamic_placement` policy (FlexMoE, patterns/flexmoe.hpp), `rebalance(experts,
//! state)` plans the moves itself from the loads seen since the last rebalance
//! (`planners/flexmoe_planner.hpp`) and makes them when they pay off.

#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
#include <moecomm/collectives/ordered_allreduce.hpp>
#include <moecomm/rows/permute_plan.hpp>
#include <moecomm/collectives/replica_migration.hpp>
#include <moecomm/patterns/experts.hpp>
#include <moecomm/patterns/layer_arguments.hpp>
#include <moecomm/patterns/layer_steps.hpp>
#include <moecomm/patterns/replica_gradients.hpp>
#include <moecomm/planners/flexmoe_planner.hpp>
#include <moecomm/planners/replica_assignment.hpp>
#include <moecomm/planners/replica_schedule.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! FineMoE's split: the exact min-max schedule, then Algorithm 1.
struct finemoe_split {
  static constexpr char const* name = "finemoe";
};
//! FlexMoE's split: each rank's tokens of an expert shared evenly among its replicas.
struct even_split {
  static constexpr char const* name = "even";
};
//! Each rank's tokens of an expert shared evenly among its replicas in the rank's own domain (the
//! topology's third level; all replicas when none is there): with `replica_placement::per_domain`,
//! expert parallelism inside each domain and expert data parallelism across them.
struct domain_split {
  static constexpr char const* name = "domain";
};

//! The placement stays as built (FineMoE; `move_replicas` still changes it on request).
struct static_placement {
  static constexpr bool plans_moves = false;
};
//! The layer plans replica moves from the loads it sees (FlexMoE): `rebalance(experts, state)`.
struct dynamic_placement {
  static constexpr bool plans_moves = true;
  flexmoe_planner_options planner{};
};

//! The short form's policy (patterns/layer_policies.hpp): experts replicated by `placement`, each
//! token sent to one replica by `Split`'s rule, the placement static or dynamic.
//! `make_expert_parallel_layer<T>(be, groups, E, H, finemoe{placement})` returns a
//! `replicated_expert_layer` (`finemoe`, `flexmoe`: patterns/finemoe.hpp, patterns/flexmoe.hpp).
template <class Split = finemoe_split, class Placement = static_placement>
struct replicated {
  replica_placement placement;
  Split split{};
  Placement rebalancing{};
  replica_gradients gradients = replica_gradients::summed_here;
};

//! What one step of a `replicated_expert_layer` decided and did on this rank.
struct replicated_report {
  std::int64_t busiest_rank_rows = 0;      //!< the largest rank load after the split (the min-max bound with finemoe_split)
  std::vector<std::int64_t> rank_rows;     //!< rows each rank computes this step
  alltoall_stats exchange;                 //!< the dispatcher's
};

namespace detail {

}  // namespace detail

//! One MoE layer over replicated experts (see the file comment).
//! @tparam Split `finemoe_split`, `even_split` or `domain_split`; @tparam Weighting `weighted` or `unweighted`;
//! @tparam Placement `static_placement` or `dynamic_placement`; @tparam Algorithm the exchange over
//! the slots: `flat`, `hierarchical_2d`, `pairwise`, `dedup_per_rank<…>`, `dedup_per_node` (with several slots per
//! rank, a token routed to two slots of one rank crosses once; semantics §10a).
template <class T, class Backend, class Comm, class Split = finemoe_split, class Weighting = weighted,
          class Placement = static_placement, class Algorithm = flat>
class replicated_expert_layer : public detail::layer_mode {
  static_assert(!std::is_same_v<Algorithm, smart_schedule>,
                "moecomm::replicated_expert_layer: the smart schedule pipelines the experts per source rank; the "
                "replicated layer runs them once over every slot: use flat, hierarchical_2d, pairwise, dedup_per_rank or dedup_per_node");

 public:
  //! Collective over the world of `groups` (one communicator per slot row is split off).
  //! @throws error (invalid_argument) naming `placement` when its ranks are not the world's.
  replicated_expert_layer(Backend be, exchange_groups<Comm>& groups, replica_placement placement, std::int64_t hidden,
                          Split = {}, routing_checks checks = {}, Placement rebalancing = {},
                          replica_gradients gradients = replica_gradients::summed_here, Algorithm algorithm = {})
      : detail::layer_mode(groups.world(), "replicated_expert_layer"), be_(be), world_(&groups.world()), placement_(checked(std::move(placement), groups.world().size())),
        sets_(replica_sets_of(placement_)),
        dispatcher_(be, groups, placement_.num_ranks() * placement_.slots_per_rank(), dropless{}, algorithm, unchecked_routing),
        checks_(checks), rebalancing_(rebalancing), gradients_(gradients), hidden_(hidden) {
    detail::require(hidden > 0, "replicated_expert_layer", "hidden = ", hidden, " must be positive");
    // Ranks with different placements would route to different slots and combine wrong rows.
    static constexpr char const* names[] = {"placement", "hidden", "gradients"};
    std::int64_t const mine[] = {placement_.digest(), hidden, static_cast<std::int64_t>(gradients)};
    std::vector<std::int64_t> all;
    detail::agree_on(*world_, "replicated_expert_layer", "on the layer's configuration", names, mine, all);
    replica_groups_ = split_replica_groups(placement_);
  }

  //! `out[t]` = plain expert parallelism's combine (file comment). Collective.
  //! @param x `[>= T][hidden]`; @param out `[>= T][hidden]`.
  template <class Experts>
  void forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts&& experts) {
    if constexpr (detail::check_experts<T, Backend, Experts, true, false>()) {
      char const* op = "replicated_expert_layer::forward";
      auto const call = scope(*world_, detail::layer_call::replicated_forward, steps_.begin_forward(op));
      checked_forward(routing, x, out, experts);
      steps_.forward_done();
    }
  }

  //! The gradients of `x` and of the routing weights, and every replica's expert gradient (all
  //! replicas summed). Collective.
  template <class ExpertsBackward>
  void backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x, optional_output<array_view<float>> d_weights,
                ExpertsBackward&& experts) {
    if constexpr (detail::check_experts<T, Backend, ExpertsBackward, true, true>()) {
      char const* op = "replicated_expert_layer::backward";
      auto const call = scope(*world_, detail::layer_call::replicated_backward, steps_.begin_backward(op));
      checked_backward(d_out, d_x, d_weights, experts);
    }
  }

  //! Sizes every buffer whose size depends on the batch for steps within `bounds` (as
  //! `expert_parallel_layer::reserve`: the plans over the experts and over the slots, the exchange,
  //! the rows, the replica runs), so that such steps allocate nothing. Local: no traffic; call it on
  //! every rank before the first step. `bounds.max_received_rows` bounds the rows one rank's slots
  //! receive (0: every slot of every rank). A placement move keeps the sizes.
  //! @throws error (invalid_argument) naming the field of `bounds` that is out of range; (invalid_usage)
  //!         between a forward and its backward (training mode), whose routing it would drop.
  void reserve(step_bounds const& bounds) {
    steps_.check_reserve("replicated_expert_layer::reserve");
    std::int64_t const received = dispatcher_.template reserve<T>(bounds, hidden_);
    for (rows_t* b : {&expert_in_, &expert_out_, &d_expert_out_, &d_expert_in_}) grow_rows(*b, received);
    std::size_t const R = static_cast<std::size_t>(placement_.num_ranks());
    block_ends_.reserve(R * static_cast<std::size_t>(placement_.slots_per_rank()));  // one run per replica at most
    block_slots_.reserve(block_ends_.capacity());
    // A forward's steps 1 to 3 on the largest routing, as if every rank routed it (every expert
    // loaded from every rank): the plan, the split's and assignment's tables and the relabeling's
    // scratch take their largest sizes.
    detail::largest_routing<Backend> const largest(be_, bounds.max_tokens, bounds.top_k, placement_.num_experts());
    build_permute_plan(be_, largest.view(), placement_.num_experts(), real_plan_, scratch_, unchecked_routing);
    count_rows();
    counts_.clear();
    for (std::size_t r = 0; r < R; ++r) counts_.insert(counts_.end(), mine_.begin(), mine_.end());
    sum_loads();
    split_and_assign();
    move_rows_to_slots(largest.view());
    // The relabeling's scratch for a step whose rows are cut into the most runs (one per replica).
    std::int64_t const runs = static_cast<std::int64_t>(block_ends_.capacity()), ids = placement_.num_ranks() * placement_.slots_per_rank();
    (void)scratch_.template host<std::int32_t>(detail::relabel_host_ints(runs, ids));
    (void)scratch_.template get<std::int32_t>(be_, detail::relabel_device_ints(bounds.max_tokens * bounds.top_k, runs, ids));
    be_.synchronize();  // the largest routing goes
    routed_ = false;    // the plan holds it: a backward needs a new forward
  }

  //! Moves the replicas to placement `to` (file comment): parameters and optimizer `state` into
  //! the slots that gain an expert, then new replica groups. Collective; between steps (a backward
  //! after it needs a new forward). Every rank passes the same `to`.
  //! @throws error naming the bad argument (invalid_argument, on the rank that passed it;
  //!         invalid_usage on the others) or a communication failure; then no slot and no part
  //!         of the layer has changed.
  template <class Experts, class State = no_optimizer_state>
  replica_migration_stats const& move_replicas(replica_placement const& to, Experts& experts, State&& state = {}) {
    static_assert(detail::is_parametric_experts_v<Experts>,
                  "moecomm::replicated_expert_layer::move_replicas: replicas move with parametric experts "
                  "(parameter_count, parameters, gradients: patterns/experts.hpp)");
    routed_ = false;
    auto const call = scope(*world_, detail::layer_call::replicated_move_replicas, steps_.step());
    migration_.exchange(be_, *world_, placement_, to, experts, state);
    std::vector<Comm> groups;
    try {
      groups = split_replica_groups(to);
    } catch (...) {
      migration_.discard();
      throw;
    }
    migration_.commit(be_, world_->rank());
    placement_ = to;
    sets_ = replica_sets_of(placement_);
    replica_groups_ = std::move(groups);
    return migration_.stats();
  }

  //! FlexMoE's step (`dynamic_placement` only): plans moves on the mean expert loads since the last
  //! rebalance (every rank has the same: they are all-gathered each forward) and, when the plan has
  //! moves, makes them (`move_replicas`). Collective. Returns the plan.
  template <class Experts, class State = no_optimizer_state>
  placement_decision const& rebalance(Experts& experts, State&& state = {}) {
    static_assert(Placement::plans_moves,
                  "moecomm::replicated_expert_layer::rebalance: the layer's placement is static; use the "
                  "dynamic_placement policy (flexmoe) or move_replicas");
    std::int64_t const steps = std::max<std::int64_t>(window_steps_, 1);
    for (std::size_t e = 0; e < window_loads_.size(); ++e) window_loads_[e] /= steps;
    window_loads_.resize(static_cast<std::size_t>(placement_.num_experts()), 0);
    plan_replica_moves(placement_, {window_loads_.data(), static_cast<std::int64_t>(window_loads_.size())},
                       rebalancing_.planner, decision_, planner_workspace_);
    std::fill(window_loads_.begin(), window_loads_.end(), 0);
    window_steps_ = 0;
    if (!decision_.moves.empty())
      move_replicas(replica_placement(placement_.num_experts(), placement_.num_ranks(), placement_.slots_per_rank(),
                                      decision_.slot_expert_after),
                    experts, state);
    return decision_;
  }

  [[nodiscard]] replicated_report const& report() const { return report_; }
  [[nodiscard]] replica_placement const& placement() const { return placement_; }
  //! The replicas of slot `l`'s expert (this rank's group of slot row `l`, ascending rank; this rank
  //! alone for an empty slot): where the trainer sums gradients left to it.
  [[nodiscard]] Comm& replica_group(std::int32_t l) {
    detail::require(l >= 0 && l < placement_.slots_per_rank(), "replicated_expert_layer::replica_group", "slot ", l,
                    " is not in [0, ", placement_.slots_per_rank(), ")");
    return replica_groups_[static_cast<std::size_t>(l)];
  }
  //! What the last `move_replicas` moved on this rank.
  [[nodiscard]] replica_migration_stats const& migration() const { return migration_.stats(); }
  //! The last forward's tokens (slots) per expert, over all ranks: the same on every rank (the
  //! loads a re-placement such as `replica_placement::from_loads` is planned on).
  [[nodiscard]] array_view<std::int64_t const> expert_loads() const {
    return {loads_.data(), static_cast<std::int64_t>(loads_.size())};
  }
  //! The dispatcher over the slots (its report: rows received, messages).
  [[nodiscard]] dispatcher<Backend, Comm, dropless, Algorithm> const& dispatch_state() const { return dispatcher_; }

 private:
  [[nodiscard]] array_view<std::int64_t const> counts() const {
    return {counts_.data(), static_cast<std::int64_t>(counts_.size())};
  }

  //! This rank's replica group of each slot row (collective over the world).
  std::vector<Comm> split_replica_groups(replica_placement const& p) {
    std::vector<Comm> groups;
    std::int32_t const me = world_->rank(), E = p.num_experts();
    for (std::int32_t l = 0; l < p.slots_per_rank(); ++l) {
      std::int32_t const e = p.expert_at(me, l);
      groups.push_back(world_->split(e >= 0 ? e : E + me, me));
    }
    return groups;
  }

  static replica_placement checked(replica_placement p, std::int32_t ranks) {
    detail::require(p.num_ranks() == ranks, "replicated_expert_layer", "placement has ", p.num_ranks(),
                    " ranks, the world ", ranks);
    return p;
  }

  template <class Experts>
  void checked_forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts& experts) {
    char const* op = "replicated_expert_layer::forward";
    detail::check_layer_forward_arguments(op, routing, x, out, hidden_);
    routed_ = false;
    std::int32_t const E = placement_.num_experts();
    // 1. This rank's rows per expert, then every rank's.
    build_permute_plan(be_, routing, E, real_plan_, scratch_, checks_);
    count_rows();
    counts_.resize(mine_.size() * static_cast<std::size_t>(placement_.num_ranks()));
    allgather_host(*world_, mine_.data(), counts_.data(), E * std::int64_t(sizeof(std::int64_t)));
    sum_loads();
    if constexpr (Placement::plans_moves) {
      window_loads_.resize(static_cast<std::size_t>(E), 0);
      for (std::int32_t e = 0; e < E; ++e) window_loads_[static_cast<std::size_t>(e)] += loads_[static_cast<std::size_t>(e)];
      ++window_steps_;
    }
    // 2. The split and the assignment; 3. the plan's rows moved to the replicas' slots.
    split_and_assign();
    record_loads();
    move_rows_to_slots(routing);
    // 4. Plain expert parallelism over the slots.
    dispatcher_.route(real_plan_);
    std::int64_t const rows = dispatcher_.received_rows();
    dispatcher_.template dispatch<T>(x, view(grow_rows(expert_in_, rows), rows));
    matrix_view<T> const expert_out = view(grow_rows(expert_out_, rows), rows);
    detail::run_local_experts<T>(experts, dispatcher_.local_expert_offsets(), view(expert_in_, rows), expert_out, be_, group_offsets_);
    dispatcher_.template combine<Weighting, T>(matrix_view<T const>(expert_out), out);
    report_.exchange = dispatcher_.report().exchange;
    routed_ = true;
  }

  template <class Experts>
  void checked_backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x, optional_output<array_view<float>> d_weights,
                        Experts& experts) {
    char const* op = "replicated_expert_layer::backward";
    if (!routed_) detail::fail(status::invalid_usage, op, "called without a successful forward before it");
    routing_view const& routing = dispatcher_.plan().routing();
    detail::check_layer_backward_arguments(op, routing.num_tokens, routing.top_k, detail::is_weighted<Weighting>(), d_out, d_x,
                                           d_weights, hidden_);
    std::int64_t const rows = dispatcher_.received_rows();
    matrix_view<T> const d_expert_out = view(grow_rows(d_expert_out_, rows), rows);
    matrix_view<T> const d_expert_in = view(grow_rows(d_expert_in_, rows), rows);
    dispatcher_.template combine_backward<Weighting, T>(d_out, d_expert_out, d_weights);
    set_aside_replica_gradients(experts);
    detail::run_local_experts_backward<T>(experts, dispatcher_.local_expert_offsets(), view(expert_in_, rows), d_expert_out,
                                          d_expert_in, be_, group_offsets_);
    sum_replica_gradients(experts);
    dispatcher_.template dispatch_backward<T>(matrix_view<T const>(d_expert_in), d_x);
    report_.exchange = dispatcher_.report().exchange;
  }

  //! Whether slot `l`'s gradient is summed over its replicas here.
  [[nodiscard]] bool summed_here(std::int32_t l) const {
    std::int32_t const e = placement_.expert_at(world_->rank(), l);
    return e >= 0 && placement_.replica_count(e) > 1 && gradients_ == replica_gradients::summed_here;
  }

  //! The replicas sum their shares, not their accumulators: an accumulator that already holds a
  //! gradient (a second backward of one forward, micro-batches accumulated) would be added once
  //! per replica. Its content is set aside and the share accumulates from zero; `sum_replica_gradients`
  //! adds the content back (share + content == content + share: plain EP's owner's sum, bit for bit).
  template <class Experts>
  void set_aside_replica_gradients(Experts& experts) {
    using P = detail::parameter_t<Experts>;
    std::int64_t const count = experts.parameter_count();
    P* const saved = reinterpret_cast<P*>(grow(be_, saved_gradients_, placement_.slots_per_rank() * count * std::int64_t(sizeof(P))).data());
    for (std::int32_t l = 0; l < placement_.slots_per_rank(); ++l) {
      if (!summed_here(l)) continue;
      be_.copy(saved + l * count, experts.gradients(l), count);
      be_.for_each_index(count, detail::fill_value<P>{experts.gradients(l), P(0)});
    }
  }

  //! Every replica group's shares summed (`ordered_allreduce`, ascending rank), then each
  //! accumulator's content added back. The groups in ascending local index: a rank's groups come
  //! in the same order as its peers'.
  template <class Experts>
  void sum_replica_gradients(Experts& experts) {
    using P = detail::parameter_t<Experts>;
    std::int64_t const count = experts.parameter_count();
    P const* const saved = reinterpret_cast<P const*>(saved_gradients_.data());
    for (std::int32_t l = 0; l < placement_.slots_per_rank(); ++l) {
      if (!summed_here(l)) continue;
      [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::parameters);
      ordered_allreduce(be_, replica_groups_[static_cast<std::size_t>(l)], array_view<P>{experts.gradients(l), count}, scratch_);
      be_.for_each_index(count, detail::add_into<P>{saved + l * count, experts.gradients(l)});
    }
    be_.synchronize();
  }

  //! `mine_`: this rank's rows per expert in `real_plan_`.
  void count_rows() {
    std::int32_t const E = placement_.num_experts();
    std::int32_t const* const offsets = real_plan_.host_expert_offsets().data;
    mine_.resize(static_cast<std::size_t>(E));
    for (std::int32_t e = 0; e < E; ++e) mine_[static_cast<std::size_t>(e)] = offsets[e + 1] - offsets[e];
  }

  //! `loads_`: every expert's rows over every rank (`counts_`).
  void sum_loads() {
    std::size_t const E = static_cast<std::size_t>(placement_.num_experts());
    loads_.assign(E, 0);
    for (std::size_t i = 0; i < counts_.size(); ++i) loads_[i % E] += counts_[i];
  }

  //! Each replica's run of this rank's rows of an expert moves to the replica's slot id (no second
  //! sort); the slots' ids follow from the moved plan.
  void move_rows_to_slots(routing_view const& routing) {
    build_replica_blocks(world_->rank());
    std::int64_t const slots = routing.num_tokens * routing.top_k;
    std::int32_t const slot_ids = placement_.num_ranks() * placement_.slots_per_rank();
    routing_view by_slot = routing;
    by_slot.topk_idx = grow(be_, relabeled_idx_, slots).data();
    relabel_permute_plan(be_, real_plan_, by_slot,
                         row_blocks{array_view<std::int32_t const>(block_ends_), array_view<std::int32_t const>(block_slots_)},
                         slot_ids, scratch_);
    be_.for_each_index(slots, detail::slot_experts_from_plan{real_plan_.row_of(), real_plan_.expert_offsets(), slot_ids,
                                                             relabeled_idx_.data()});
  }

  //! Each expert's tokens split over its replicas (`loads_`) and assigned from each rank (`counts_`).
  void split_and_assign() {
    if constexpr (std::is_same_v<Split, finemoe_split>) {
      schedule_replicas(sets_, loads_, schedule_, schedule_workspace_);
      assign_tokens_finemoe(sets_, counts(), schedule_.split, assignment_);
    } else if constexpr (std::is_same_v<Split, domain_split>) {
      topology const& topo = dispatcher_.groups().topo();
      assign_tokens_in_domain(sets_, counts(), [&](std::int32_t r) { return topo.domain_of(r); }, assignment_);
    } else {
      assign_tokens_evenly(sets_, counts(), assignment_);
    }
  }

  //! This rank's rows of each expert cut into its replicas' runs (own replica first, then ascending
  //! rank), as row blocks of the real plan: each block's end and slot id.
  void build_replica_blocks(std::int32_t me) {
    std::int32_t const E = placement_.num_experts(), S = placement_.slots_per_rank();
    std::size_t const K = sets_.ranks.size();
    block_ends_.clear();
    block_slots_.clear();
    std::int64_t end = 0;  // this rank's rows are expert-major
    for (std::int32_t e = 0; e < E; ++e) {
      std::int32_t const first = sets_.offsets[static_cast<std::size_t>(e)], n = sets_.offsets[static_cast<std::size_t>(e) + 1] - first;
      std::int32_t const own = replica_assignment::own_replica(sets_, me, e), local = placement_.local_index_of(e);
      auto add = [&](std::int32_t j) {
        std::int64_t const t = assignment_.take[static_cast<std::size_t>(me) * K + static_cast<std::size_t>(first + j)];
        if (t == 0) return;
        end += t;
        block_ends_.push_back(static_cast<std::int32_t>(end));
        block_slots_.push_back(sets_.ranks[static_cast<std::size_t>(first + j)] * S + local);
      };
      if (own >= 0) add(own);
      for (std::int32_t j = 0; j < n; ++j)
        if (j != own) add(j);
    }
  }

  void record_loads() {
    std::int32_t const R = placement_.num_ranks();
    std::size_t const K = sets_.ranks.size();
    report_.rank_rows.assign(static_cast<std::size_t>(R), 0);
    for (std::int32_t s = 0; s < R; ++s)
      for (std::size_t k = 0; k < K; ++k) report_.rank_rows[static_cast<std::size_t>(sets_.ranks[k])] += assignment_.take[static_cast<std::size_t>(s) * K + k];
    report_.busiest_rank_rows = 0;
    for (std::int64_t r : report_.rank_rows) report_.busiest_rank_rows = std::max(report_.busiest_rank_rows, r);
  }

  using rows_t = typename Backend::template buffer_type<T>;
  rows_t& grow_rows(rows_t& b, std::int64_t rows) const { return grow(be_, b, rows * hidden_); }
  matrix_view<T> view(rows_t& b, std::int64_t rows) const { return {b.data(), rows, hidden_}; }

  Backend be_;
  Comm* world_;
  replica_placement placement_;
  replica_sets sets_;
  dispatcher<Backend, Comm, dropless, Algorithm> dispatcher_;
  routing_checks checks_;
  Placement rebalancing_;
  replica_gradients gradients_;
  std::int64_t hidden_;
  std::vector<Comm> replica_groups_;  //!< per slot row: this rank's replica group
  permute_plan<Backend> real_plan_;
  workspace<Backend> scratch_;
  std::vector<std::int64_t> mine_, counts_, loads_;  //!< host: this rank's rows per expert, every rank's, the loads
  std::vector<std::int32_t> block_ends_, block_slots_;  //!< this rank's replica runs in the real plan: end row, slot id
  replica_schedule schedule_;
  replica_schedule_workspace schedule_workspace_;
  replica_assignment assignment_;
  replicated_report report_;
  replica_migration<Backend> migration_;
  std::vector<std::int64_t> window_loads_;  //!< dynamic_placement: expert loads summed since the last rebalance
  std::int64_t window_steps_ = 0;
  placement_decision decision_;
  flexmoe_planner_workspace planner_workspace_;
  typename Backend::template buffer_type<std::int32_t> relabeled_idx_;
  typename Backend::template buffer_type<char> saved_gradients_;  //!< the accumulators' content during a backward
  rows_t expert_in_, expert_out_, d_expert_out_, d_expert_in_;
  std::vector<std::int64_t> group_offsets_;  //!< grouped experts' offsets, relative to their block
  bool routed_ = false;
};

MOECOMM_NAMESPACE_END
