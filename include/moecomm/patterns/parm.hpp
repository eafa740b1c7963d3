// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `parm_layer`: an MoE layer under model parallelism (MP), expert parallelism (EP) and expert
//! slicing (ESP), with its schedule as one policy type (Parm, INFOCOM'24; `parallel_groups` gives
//! the layout; semantics §16):
//!
//! | schedule | forward |
//! |---|---|
//! | `deepspeed_mp` | every MP rank dispatches all T tokens (identical within the MP group) → EP all-to-all → expert slices → ESP all-reduce (ordered reduce-scatter + all-gather) → EP all-to-all → combine |
//! | `parm_s1` | PauseMP with separate collectives: MP split (T/MP tokens each, no traffic) → EP all-to-all → ESP all-gather → expert slices → ESP reduce-scatter → EP all-to-all → combine → MP all-gather |
//! | `parm_s2` | PauseMP with unified collectives: the same, with the all-to-all ∥ ESP all-gather and the ESP reduce-scatter ∥ all-to-all pipelined in `pieces` (collectives/pipelined_collectives.hpp) |
//! | `parm_auto` | Parm's rule, every step: the ranks agree on the step's shape, `parm_cost_model` prices S1 and S2 for it, and the cheaper runs |
//!
//! With ESP = MP (Parm's setting) the ESP all-gather is the MP all-gather of Parm's fused kernel;
//! with ESP < MP only the ESP group gathers (the rest of the MP group holds the same slices and
//! computes other tokens). PauseMP divides the rows each rank dispatches by MP and the rows each
//! rank computes by MP / ESP; it adds the MP all-gather of the output.
//! The gathered rows arrive by (ESP member, source); with several local experts PauseMP reorders
//! them by expert (`sort_chunks`, and back before the reduce-scatter), so that each expert runs
//! once over all its rows, as in the baseline, rather than once per (member, source) segment,
//! each a GEMM that reads the whole expert.
//!
//! Equal by construction, and tested bit for bit: every schedule gives the baseline's output, input
//! gradient and weight gradient, because every token's slots are combined by the same unpermute in
//! slot order, and every slice sum is added in ascending slice order. Capacity drops are decided on
//! the whole token set (the same on every MP rank) before the MP split, so every schedule drops the
//! same slots. Parameter gradients: every rank ends with its slice's gradient over all the tokens
//! of its MP group, as in the baseline, where MP peers compute it redundantly; under PauseMP the
//! MP peers that hold the same slice (MP / ESP of them) each compute their tokens' share and sum
//! the shares in ascending rank (`ordered_allreduce`), so the trainer's data-parallel reduction is
//! the same for every schedule. Its bits equal the baseline's when the sums are exact (the tests
//! use dyadic values); otherwise they differ by the reassociation of one sum.
//!
//! Backward: the mirror collectives (the all-to-all ∥ all-gather carries the output gradient to
//! the slices, the reduce-scatter ∥ all-to-all brings their input gradient back), then the MP
//! all-gather of `d_x` and `d_weights` (PauseMP).
//!
//! Padded capacity (`pad_to_capacity`), the step a CUDA graph can capture (`capture_blocker`): every
//! MP rank routes all T tokens to a plan of C rows per expert (the EP dispatcher's padded route), so
//! every collective's sizes follow from C. PauseMP then splits the plan's rows, not the tokens: MP
//! rank m moves rows [m·s, (m + 1)·s) of each expert's block, s = ⌈C / MP⌉ (a row past C is a zero
//! row), through the same collectives, and the MP group all-gathers the returned rows (E·s each)
//! instead of the output: every MP rank then combines all T tokens, and the backward's weight
//! gradient and `d_x` need no MP all-gather. The MP all-gather carries E·C rows instead of T, about
//! top_k · capacity factor times the bytes: the price of sizes known when the graph is built.

#include <moecomm/comm/parallel_groups.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/read_back.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/rows/content_digest.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/collectives/ordered_allreduce.hpp>
#include <moecomm/collectives/pipelined_collectives.hpp>
#include <moecomm/collectives/row_collectives.hpp>
#include <moecomm/rows/sort_chunks.hpp>
#include <moecomm/rows/kernels/row_kernels.hpp>
#include <moecomm/patterns/experts.hpp>
#include <moecomm/patterns/replica_gradients.hpp>
#include <moecomm/patterns/layer_arguments.hpp>
#include <moecomm/patterns/layer_steps.hpp>
#include <moecomm/models/parm_cost_model.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! The baseline: DeepSpeed-MoE under MP (every MP rank dispatches the same tokens).
struct deepspeed_mp {
  static constexpr char const* name = "deepspeed_mp";
};

//! PauseMP with separate collectives.
struct parm_s1 {
  static constexpr char const* name = "parm_s1";
  replica_gradients gradients = replica_gradients::summed_here;
};
//! PauseMP with unified (pipelined) collectives.
struct parm_s2 {
  static constexpr char const* name = "parm_s2";
  std::int32_t pieces = 4;  //!< pipeline depth: each block is cut into this many row slices
  replica_gradients gradients = replica_gradients::summed_here;
};

//! Parm's selection rule as a schedule: every forward prices S1 and S2 for the step's shape with
//! `model` (models/parm_cost_model.hpp) and runs the one of the smaller predicted step. The shape is
//! agreed over the world (one all-gather of three integers per rank): the largest MP group's
//! tokens and top-k, and the share of all slots the capacity kept; so every rank runs the same
//! schedule. Under a simulated back-end the model prices the model-sized rows the real ones stand
//! for (`simulation_scale`).
struct parm_auto {
  static constexpr char const* name = "parm_auto";
  parm_cost_model model{};  //!< the cluster's figures: `parm_cost_params::from_cluster`, or fitted (`to_parm_cost_params`)
  //! F, the experts' whole inner width (H -> F -> H): prices the expert GEMMs. S1 and S2 compute
  //! the same rows, so it changes the predicted steps but not the choice.
  std::int64_t ffn = 0;
  std::int32_t pieces = 4;  //!< S2's pipeline depth, priced and run when S2 is chosen
  replica_gradients gradients = replica_gradients::summed_here;
};

//! What one step of a `parm_layer` did on this rank (forward).
struct parm_report {
  char const* schedule = "";      //!< the schedule the step ran (`parm_auto` runs "parm_s1" or "parm_s2")
  std::int32_t pieces = 1;        //!< its pipeline depth (1: no overlap)
  std::int64_t capacity = 0;      //!< C agreed across the EP group, or 0 when dropless
  std::int64_t dropped_slots = 0; //!< valid slots of the MP group's tokens dropped by capacity
  std::int64_t rows_dispatched = 0;  //!< rows this rank sent in the dispatch all-to-all (its own included)
  std::int64_t rows_computed = 0;    //!< rows this rank's expert slices computed
  alltoall_stats alltoall;        //!< the two EP all-to-alls
  alltoall_stats expert_slicing;  //!< the ESP all-gather and reduce-scatter (or all-reduce)
  alltoall_stats model_gather;    //!< the MP all-gather of the output
  bool automatic = false;         //!< `parm_auto` chose the schedule: `shape` and `choice` say how
  parm_layer_shape shape;         //!< the agreed shape `parm_auto` priced (tokens 0: no rows anywhere, S1 without pricing)
  parm_choice choice;             //!< both predictions (seconds) and the pick
};

namespace detail {

template <class Schedule>
inline constexpr bool pauses_mp_v = !std::is_same_v<Schedule, deepspeed_mp>;
template <class Schedule>
inline constexpr bool pipelines_v = std::is_same_v<Schedule, parm_s2> || std::is_same_v<Schedule, parm_auto>;

//! PauseMP padded: row r of MP rank m's share (`[E][s]`, s = `share`) is row (e, first + j) of the
//! padded plan (`[E][capacity]`), e = r / s, j = r % s, `first` = m · s; a zero row past capacity.
struct mp_share_rows {
  std::int64_t capacity, share, first;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t r) const {
    std::int64_t const j = first + r % share;
    return j < capacity ? (r / share) * capacity + j : -1;
  }
};
//! The inverse: row (e, j) of the padded plan from the MP group's all-gathered shares, `[MP][E][s]`.
struct mp_gathered_rows {
  std::int64_t capacity, share;
  std::int32_t experts;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t r) const {
    std::int64_t const e = r / capacity, j = r % capacity;
    return ((j / share) * experts + e) * share + j % share;
  }
};

}  // namespace detail

//! One MoE layer under MP + EP + ESP (see the file comment).
//! @tparam Schedule `deepspeed_mp`, `parm_s1`, `parm_s2` or `parm_auto`; @tparam Capacity `dropless` or
//! `capacity<rule>` (`pad_to_capacity` with any schedule but `parm_auto`); @tparam Weighting `weighted`
//! or `unweighted`.
//!
//! Local expert `l` of EP rank `ep` is global expert `ep * E / EP + l`. With ESP > 1 the experts
//! must be sliced (patterns/experts.hpp, 3.) with `slices() = ESP` and `slice()` = the rank's ESP
//! index; with ESP = 1 any experts do (parametric ones when MP > 1 under PauseMP, whose gradients
//! the MP peers sum).
template <class T, class Backend, class Comm, class Schedule = parm_s1, class Capacity = dropless, class Weighting = weighted>
class parm_layer : public detail::layer_mode {
  static_assert(!detail::is_receiver_budget_v<Capacity>,
                "moecomm::parm_layer: receiver_budget is not supported (its drops depend on the MP split); use "
                "dropless or capacity<rule>");

 public:
  //! Collective over the world of `groups`.
  //! @throws error (invalid_argument) unless `num_experts` is a positive multiple of EP.
  parm_layer(Backend be, parallel_groups<Comm>& groups, std::int32_t num_experts, std::int64_t hidden,
             Schedule schedule = {}, Capacity capacity = {}, routing_checks checks = {})
      : detail::layer_mode(groups.world(), "parm_layer"),
        groups_(&groups),
        ep_groups_(groups.ep(), topology(groups.ep().size(), 1)),
        dispatcher_(be, ep_groups_, num_experts, dropless{}, flat{}, unchecked_routing),
        replicas_(groups.mp().split(groups.coordinates().esp, groups.coordinates().mp)),
        schedule_(schedule), capacity_(capacity), checks_(checks), num_experts_(num_experts), hidden_(hidden) {
    detail::require(hidden > 0, "parm_layer", "hidden = ", hidden, " must be positive");
    if constexpr (detail::pipelines_v<Schedule>)
      detail::require(schedule.pieces >= 1, "parm_layer", "schedule.pieces = ", schedule.pieces, " must be at least 1");
    if constexpr (std::is_same_v<Schedule, parm_auto>) {
      detail::require(schedule.ffn >= 1, "parm_layer", "schedule.ffn = ", schedule.ffn,
                      " must be the experts' inner width (at least 1): parm_auto prices their GEMMs");
      simulation_scale const scale = detail::simulated_scale(be);
      schedule_.model = schedule.model.scaled(scale.payload, scale.parameters, scale.flops);
    }
    if constexpr (!detail::is_dropless_v<Capacity>) {
      validate_capacity_policy(capacity, "parm_layer");
      detail::require(!std::is_same_v<Schedule, parm_auto> || !capacity.pad_to_capacity, "parm_layer",
                      "capacity.pad_to_capacity with parm_auto: padding is for a captured step, and parm_auto agrees on each "
                      "step's shape on the host and prices unpadded rows; pad with parm_s1 or parm_s2");
      padded_.emplace(be, ep_groups_, num_experts, capacity, flat{}, checks);  // collective, as every rank's capacity type is
    }
  }

  //! `out[t]` = the combine of t's kept slots' expert outputs, for all T tokens of the MP group.
  //! Collective over the world. `routing` and `x` must be the same on every rank of an MP group and
  //! stay alive and unchanged until `backward` is done.
  //! @param x `[>= T][hidden]`; @param out `[>= T][hidden]` (the MP all-gather writes it last; after
  //!        an error its rows are unspecified).
  //! @throws error (invalid_argument) naming the argument, before any communication.
  template <class Experts>
  void forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts&& experts) {
    if constexpr (detail::check_experts<T, Backend, Experts, false, false>()) {
      char const* op = "parm_layer::forward";
      auto const call = scope(groups_->world(), detail::layer_call::parm_forward, steps_.begin_forward(op));
      checked_forward(routing, x, out, experts);
      steps_.forward_done();
    }
  }

  //! The gradients of `x` and (weighted) of the routing weights for the last forward, and the
  //! experts' parameter gradients (added to theirs). Collective over the world; `d_out` must be the
  //! same on every rank of an MP group.
  //! @param d_x `[>= T][hidden]` or `not_needed`; @param d_weights `[>= T * K]` or `not_needed`.
  template <class ExpertsBackward>
  void backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                optional_output<array_view<float>> d_weights, ExpertsBackward&& experts) {
    if constexpr (detail::check_experts<T, Backend, ExpertsBackward, false, true>()) {
      char const* op = "parm_layer::backward";
      auto const call = scope(groups_->world(), detail::layer_call::parm_backward, steps_.begin_backward(op));
      checked_backward(d_out, d_x, d_weights, experts);
    }
  }

  //! Sizes every buffer whose size depends on the batch for steps within `bounds` (`max_tokens`: an
  //! MP group's tokens), as `expert_parallel_layer::reserve`: the plans of all tokens, the EP
  //! dispatcher's, the rows each schedule moves (a slice's gathered rows under PauseMP, the ESP
  //! all-reduce's in the baseline) and the collectives' staging. `max_received_rows` bounds the rows
  //! one rank's experts receive over the EP group (0: every slot of every EP rank). The staged
  //! parameter gradients depend on the experts: the first step sizes them. Local: no traffic; call
  //! it on every rank before the first step.
  //! @throws error (invalid_argument) naming the field of `bounds` that is out of range; (invalid_usage)
  //!         between a forward and its backward (training mode), whose routing it would drop.
  void reserve(step_bounds const& bounds) {
    steps_.check_reserve("parm_layer::reserve");
    std::int64_t const slots = bounds.max_tokens * bounds.top_k;
    std::int64_t received = 0;
    if constexpr (!detail::is_dropless_v<Capacity>) {
      if (padded()) {  // the padded dispatcher's plans and rows; PauseMP's shares of them
        received = padded_->template reserve<T>(bounds, hidden_);
        std::int64_t const c = expert_capacity(bounds.max_tokens, bounds.top_k, num_experts_, capacity_.factor, capacity_.min_capacity);
        std::int64_t const share = mp_share(c);
        for (rows_t* b : {&share_rows_, &d_returned_}) grow_rows(*b, num_experts_ * share);
        grow_rows(mp_rows_, mp_size() * num_experts_ * share);
        grow_rows(d_whole_, num_experts_ * c);
      }
    }
    if (!padded()) {
      received = dispatcher_.template reserve<T>(bounds, hidden_);
      detail::largest_routing<Backend> const largest(be(), bounds.max_tokens, bounds.top_k, num_experts_);
      build_permute_plan(be(), largest.view(), num_experts_, all_plan_, scratch_, unchecked_routing);
      if constexpr (!detail::is_dropless_v<Capacity>) {
        grow(be(), kept_idx_, slots);
        build_kept_permute_plan(be(), all_plan_, largest.view(), kept_plan_, scratch_, unchecked_routing);
      }
    }
    std::int64_t const gathered = received * esp_size();
    for (rows_t* b : {&expert_in_, &partial_out_, &d_expert_out_, &d_partial_in_}) grow_rows(*b, gathered);
    if (pauses_mp && dispatcher_.num_local_experts() > 1) {  // the chunks' reordering: its rows and its table
      grow_rows(gathered_, gathered);
      std::int64_t const chunks = std::int64_t{esp_size()} * groups_->ep().size() * dispatcher_.num_local_experts();
      (void)sort_scratch_.template host<std::int64_t>(4 * chunks + 1);
      (void)sort_scratch_.template get<std::int64_t>(be(), 2 * chunks + 1);
    }
    for (rows_t* b : {&expert_out_, &d_expert_in_, &esp_slice_}) grow_rows(*b, received);
    for (rows_t* b : {&out_slice_, &d_x_slice_, &d_x_unwanted_}) grow_rows(*b, bounds.max_tokens);
    grow_rows(d_returned_, slots);
    for (auto* b : {&d_weights_slice_, &d_weights_unwanted_}) grow(be(), *b, slots);
    // Staging: the ESP reduce-scatter's slices (a slice is at most one row over an even share), and
    // the pipelined collectives' packed rows (every slice's, and this rank's pieces from every member).
    (void)scratch_.template get<T>(be(), (received + esp_size()) * hidden_);
    (void)pipe_.first().template get<T>(be(), 2 * gathered * hidden_);
    (void)pipe_.second().template get<T>(be(), received * hidden_);
    std::size_t const peers = static_cast<std::size_t>(groups_->ep().size() + esp_size());  // a piece's messages, at most
    for (workspace<Backend>* w : {&pipe_.first(), &pipe_.second()}) w->messages().reserve_messages(peers);
    be().synchronize();  // the largest routing goes
    routed_ = false;     // the plans hold it: a backward needs a new forward
  }

  //! Why a step of this layer cannot be captured into a CUDA graph, or "" when it can: with a padded
  //! capacity policy under `deepspeed_mp`, `parm_s1` or `parm_s2`, over a communicator that enqueues
  //! on the stream (NCCL's), every size follows from C, and a captured forward and backward wait for
  //! nothing on the host. A captured step replays the capacity of the eager step before it (of the
  //! same shape); it does not compare its MP group's inputs (`routing_checks::scan_values`' digest is
  //! a host all-gather: the eager steps do), and its routing's value scan stays on the device
  //! (`check_captured_routing`). A forward or backward called while the back-end's stream captures
  //! is refused with this reason, before it enqueues anything.
  [[nodiscard]] std::string capture_blocker() const {
    if (std::string why = detail::host_driven_exchanges<Comm>(); !why.empty()) return why;
    if constexpr (std::is_same_v<Schedule, parm_auto>) {
      return "parm_auto: every step agrees on its shape over the world on the host and prices S1 and S2 for it; a captured "
             "step runs parm_s1 or parm_s2 with a padded capacity";
    } else if constexpr (detail::is_dropless_v<Capacity>) {
      return "dropless: the rows each rank sends and receives depend on every rank's routing, which the host reads; a captured "
             "step needs capacity<rule> with pad_to_capacity = true";
    } else {
      if (!capacity_.pad_to_capacity)
        return detail::concat("capacity<", Capacity::name, "> without pad_to_capacity: the rows kept per expert vary with the "
                              "routing; with pad_to_capacity = true every expert's block is C rows and every collective's sizes "
                              "are known when the graph is built");
      if (sums_replica_gradients())
        return "replica_gradients::summed_here with sizes.model / sizes.expert_slicing > 1: the MP peers that hold this rank's "
               "slice sum their gradients with ordered_allreduce, which agrees on the sizes on the host; with "
               "replica_gradients::left_to_trainer the trainer's data-parallel reduction sums them";
      return "";
    }
  }

  //! After a captured step's graph ran (outside the capture: one host wait): raises the value scan's
  //! verdict on that step's routing, which a captured step leaves on the device (an id out of range is
  //! masked meanwhile), as `dispatcher::check_captured_routing`. Nothing to check without padding.
  void check_captured_routing() const {
    if constexpr (!detail::is_dropless_v<Capacity>)
      if (padded()) padded_->check_captured_routing();
  }

  [[nodiscard]] parm_report const& report() const { return report_; }
  [[nodiscard]] parallel_groups<Comm>& groups() const { return *groups_; }

 private:
  using rows_t = typename Backend::template buffer_type<T>;
  static constexpr bool pauses_mp = detail::pauses_mp_v<Schedule>;

  [[nodiscard]] Backend const& be() const { return dispatcher_.backend(); }

  void refuse_capture(char const* op) const {
    if (!detail::capturing(be())) return;
    if (std::string const why = capture_blocker(); !why.empty())
      detail::fail(status::invalid_usage, op, "called while the back-end's stream captures a CUDA graph, but this step is not "
                   "capturable: ", why);
  }
  //! With a padded capacity policy: `padded_` routes all T tokens to C rows per expert.
  [[nodiscard]] bool padded() const {
    if constexpr (detail::is_dropless_v<Capacity>) return false;
    else return capacity_.pad_to_capacity;
  }
  //! The rows of each expert's block of `capacity` that one MP rank moves under PauseMP, padded.
  [[nodiscard]] std::int64_t mp_share(std::int64_t capacity) const { return (capacity + mp_size() - 1) / mp_size(); }
  [[nodiscard]] std::int32_t mp_size() const { return groups_->sizes().model; }
  [[nodiscard]] std::int32_t esp_size() const { return groups_->sizes().expert_slicing; }
  [[nodiscard]] std::int32_t pieces() const {
    if constexpr (std::is_same_v<Schedule, parm_s2>) return schedule_.pieces;
    else if constexpr (std::is_same_v<Schedule, parm_auto>) return chosen_pieces_;
    else return 1;
  }
  //! PauseMP with MP peers holding this rank's slice, whose gradients the layer sums.
  [[nodiscard]] bool sums_replica_gradients() const {
    if constexpr (pauses_mp) return mp_size() / esp_size() > 1 && schedule_.gradients == replica_gradients::summed_here;
    else return false;
  }

  template <class Experts>
  void check_experts_slicing(Experts const& experts, char const* op) const {
    std::int32_t const n = esp_size(), me = groups_->coordinates().esp;
    if constexpr (detail::is_sliced_experts_v<Experts>) {
      detail::require(experts.slices() == n && experts.slice() == me, op, "argument 'experts' holds slice ", experts.slice(),
                      " of ", experts.slices(), ", this rank needs slice ", me, " of sizes.expert_slicing = ", n);
    } else {
      detail::require(n == 1, op, "sizes.expert_slicing = ", n, " needs sliced experts (slices() and slice(), patterns/experts.hpp)");
      detail::require(!pauses_mp || mp_size() == 1 || detail::is_parametric_experts_v<Experts>, op,
                      "under PauseMP with sizes.model = ", mp_size(),
                      " the MP peers sum their experts' gradients, so the experts must be parametric");
    }
  }

  // ---- parm_auto --------------------------------------------------------------------------------
  //! Agrees on the step's shape over the world and picks S1 or S2 by `parm_cost_model::choose`.
  template <class Experts>
  void choose_schedule(routing_view const& routing, Experts const& experts) {
    Comm& world = groups_->world();
    std::int64_t const kept_rows = all_plan_.num_rows() - report_.dropped_slots;
    std::int64_t const mine[3] = {routing.num_tokens, routing.top_k, kept_rows};
    shapes_.resize(static_cast<std::size_t>(3 * world.size()));
    allgather_host(world, mine, shapes_.data(), static_cast<std::int64_t>(sizeof mine));
    parm_layer_shape& shape = report_.shape;
    double slots = 0, kept = 0;
    for (std::size_t r = 0; r < shapes_.size(); r += 3) {
      shape.tokens = std::max(shape.tokens, shapes_[r]);
      shape.top_k = std::max(shape.top_k, static_cast<std::int32_t>(shapes_[r + 1]));
      slots += static_cast<double>(shapes_[r]) * static_cast<double>(shapes_[r + 1]);
      kept += static_cast<double>(shapes_[r + 2]);
    }
    report_.automatic = true;
    chosen_pieces_ = 1;
    report_.schedule = parm_s1::name;
    if (kept == 0) {  // no rows anywhere: nothing to price, and S1 sends the fewest messages
      shape.tokens = 0;
      return;
    }
    shape.hidden = hidden_;
    shape.ffn = schedule_.ffn;
    shape.element_bytes = static_cast<std::int32_t>(sizeof(T));
    shape.kept_fraction = kept / slots;
    shape.num_experts = num_experts_;
    if constexpr (detail::is_parametric_experts_v<Experts>)
      if (sums_replica_gradients())
        shape.parameter_bytes_per_expert = experts.parameter_count() * static_cast<std::int64_t>(sizeof(detail::parameter_t<Experts>)) *
                                         esp_size();
    shape.sizes = groups_->sizes();
    shape.ranks_per_node = groups_->nodes().ranks_per_node();
    shape.pieces = schedule_.pieces;
    report_.choice = schedule_.model.choose(shape);
    if (report_.choice.schedule == parm_schedule::s2) {
      chosen_pieces_ = schedule_.pieces;
      report_.schedule = parm_s2::name;
    }
  }

  //! Every rank of this rank's MP group passed inputs of digest `mine` (one all-gather of 8 bytes),
  //! or every one of them throws `invalid_usage` naming two ranks: Parm's ranks of an MP group hold
  //! identical tokens, and a rank whose inputs differ (another step's, after a skipped one) would
  //! mix them into the others' results.
  void require_same_over_mp(char const* op, char const* what, std::uint64_t mine) {
    Comm& mp = groups_->mp();
    mp_digests_.resize(static_cast<std::size_t>(mp.size()));
    allgather_host(mp, &mine, mp_digests_.data(), std::int64_t(sizeof(mine)));
    for (std::int32_t r = 1; r < mp.size(); ++r)
      if (mp_digests_[static_cast<std::size_t>(r)] != mp_digests_[0])
        detail::fail(status::invalid_usage, op, "the ranks of an MP group pass different ", what, " (MP ranks 0 and ", r,
                     "): every rank of an MP group must pass the same token rows, routing and output gradient");
  }

  // ---- forward ----------------------------------------------------------------------------------
  template <class Experts>
  void checked_forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts& experts) {
    char const* op = "parm_layer::forward";
    refuse_capture(op);
    detail::check_layer_forward_arguments(op, routing, x, out, hidden_);
    check_experts_slicing(experts, op);
    routed_ = false;
    if (checks_.scan_values && !detail::capturing(be())) {  // the MP group's ranks must pass the same rows and routing
      std::int64_t const slots = routing.num_tokens * routing.top_k;
      require_same_over_mp(op, "x and routing",
                           detail::content_digest(be(), x.data, routing.num_tokens * hidden_, routing.topk_idx, slots,
                                                  routing.topk_weights, routing.topk_weights != nullptr ? slots : 0));
    }
    report_ = {};
    report_.schedule = Schedule::name;
    tokens_ = routing.num_tokens;
    top_k_ = routing.top_k;
    if constexpr (!detail::is_dropless_v<Capacity>) {
      if (padded()) {
        report_.pieces = pieces();
        padded_->route(routing);  // the capacity over all T tokens (an eager step agrees on C, a captured one replays it)
        report_.capacity = padded_->report().capacity;
        report_.dropped_slots = padded_->report().dropped_slots;
        if constexpr (pauses_mp) paused_padded_forward(x, out, experts);
        else baseline_forward(*padded_, x, out, experts);
        routed_ = true;
        return;
      }
    }
    routing_view const kept = apply_capacity(routing);
    if constexpr (std::is_same_v<Schedule, parm_auto>) choose_schedule(routing, experts);
    report_.pieces = pieces();
    if constexpr (pauses_mp) {
      paused_forward(kept, x, out, experts);
    } else {
      if constexpr (detail::is_dropless_v<Capacity>) {  // the plan of all T tokens is the dispatcher's: no second sort
        dispatcher_.route(all_plan_);
      } else {
        build_kept_permute_plan(be(), all_plan_, kept, kept_plan_, scratch_, unchecked_routing);  // a masking by construction
        dispatcher_.route(kept_plan_);
      }
      baseline_forward(dispatcher_, x, out, experts);
    }
    routed_ = true;
  }

  //! The capacity policy's drops over all T tokens (identical on every MP rank), as the
  //! dispatcher takes them; returns the kept routing.
  routing_view apply_capacity(routing_view const& routing) {
    if constexpr (detail::is_dropless_v<Capacity> && pauses_mp && !std::is_same_v<Schedule, parm_auto>) {
      validate_routing(be(), routing, num_experts_, checks_, "parm_layer::forward");  // the slice's plan is all it sorts
      return routing;
    } else if constexpr (detail::is_dropless_v<Capacity>) {
      build_permute_plan(be(), routing, num_experts_, all_plan_, scratch_, checks_);  // validates
      return routing;
    } else {
      build_permute_plan(be(), routing, num_experts_, all_plan_, scratch_, checks_);
      std::int64_t const c = detail::agree_on_capacity(
          groups_->ep(), capacity_,
          expert_capacity(routing.num_tokens, routing.top_k, num_experts_, capacity_.factor, capacity_.min_capacity), scratch_,
          "parm_layer::forward");
      std::int64_t const slots = routing.num_tokens * routing.top_k;
      array_view<std::int32_t> const kept_idx{grow(be(), kept_idx_, slots).data(), slots};
      capacity_result const result = drop_to_capacity(be(), all_plan_, c, kept_idx, scratch_, capacity_.rule,
                                                          detail::first_token(groups_->ep(), capacity_, routing.num_tokens, scratch_));
      report_.capacity = c;
      report_.dropped_slots = result.dropped_slots;
      routing_view kept = routing;
      kept.topk_idx = kept_idx.data;
      return kept;
    }
  }

  //! The baseline after `d.route`: `d` is the dispatcher of the kept slots, or the padded one.
  template <class Dispatcher, class Experts>
  void baseline_forward(Dispatcher& d, matrix_view<T const> x, matrix_view<T> out, Experts& experts) {
    std::int64_t const rows = d.received_rows();
    report_.rows_dispatched = d.plan().num_rows();
    report_.rows_computed = rows;
    d.template dispatch<T>(x, view(grow_rows(expert_in_, rows), rows));
    matrix_view<T> const partial = view(grow_rows(partial_out_, rows), rows);
    detail::run_local_experts<T>(experts, d.local_expert_offsets(), view(expert_in_, rows), partial, be(), group_offsets_);
    matrix_view<T> const summed = esp_allreduce(partial, expert_out_);
    record_baseline_traffic(d);
    d.template combine<Weighting, T>(matrix_view<T const>(summed), out);
  }

  template <class Experts>
  void paused_forward(routing_view const& kept, matrix_view<T const> x, matrix_view<T> out, Experts& experts) {
    std::int32_t const mp = groups_->coordinates().mp;
    row_range const mine = row_slice(kept.num_tokens, mp_size(), mp);
    slice_ = mine;
    dispatcher_.route(slice_routing(kept, mine));
    exchange_block_counts();
    matrix_view<T const> const x_mine{x.data + mine.begin * hidden_, mine.count, hidden_};
    matrix_view<T const> const sent = dispatcher_.template permuted<T>(x_mine);
    report_.rows_dispatched = sent.rows;
    run_sliced_experts(sent, dispatcher_.template returned_rows<T>(hidden_), experts);
    matrix_view<T> const out_mine = view(grow_rows(out_slice_, mine.count), mine.count);
    dispatcher_.template combine_returned<Weighting, T>(out_mine);
    model_gather_rows_ = mine.count;
    record_paused_traffic();
    row_allgather(be(), groups_->mp(), matrix_view<T const>(out_mine), matrix_view<T>{out.data, kept.num_tokens, hidden_}, scratch_);
  }

  //! PauseMP padded (file comment): this rank's share of the padded plan's rows through the sliced
  //! experts, the MP group's returned shares all-gathered, and all T tokens combined.
  template <class Experts>
  void paused_padded_forward(matrix_view<T const> x, matrix_view<T> out, Experts& experts) {
    auto& d = *padded_;
    plan_padded_shares(d.report().capacity);
    matrix_view<T const> const sent = take_share(d.template permuted<T>(x));
    report_.rows_dispatched = sent.rows;
    matrix_view<T> const returned = view(grow_rows(d_returned_, sent.rows), sent.rows);
    run_sliced_experts(sent, returned, experts);
    gather_shares(matrix_view<T const>(returned), d.template returned_rows<T>(hidden_));
    d.template combine_returned<Weighting, T>(out);
    model_gather_rows_ = sent.rows;
    record_paused_traffic();
  }

  //! PauseMP's middle: `sent` (this rank's rows for each EP rank in turn) to the ESP group's expert
  //! slices, and their outputs, summed over the slices, back into `returned` (as `sent`).
  template <class Experts>
  void run_sliced_experts(matrix_view<T const> sent, matrix_view<T> returned, Experts& experts) {
    std::int64_t const rows = gathered_rows_;
    report_.rows_computed = rows;
    matrix_view<T> const in = view(grow_rows(expert_in_, rows), rows);  // expert-major, kept for the backward
    matrix_view<T> const arrived = rank_major_rows(in);
    alltoall_allgather(be(), groups_->ep(), groups_->esp(), sent, send_rows(), recv_rows(), arrived, pipe_, pieces());
    reorder_chunks(arrived, in, chunk_order::rank_major_to_expert_major);
    matrix_view<T> const partial = view(grow_rows(partial_out_, rows), rows);
    for_each_local_expert([&](std::int32_t l, std::int64_t b, std::int64_t n) {
      detail::run_local_expert<T>(experts, l, rows_at(expert_in_, b, n), rows_at(partial_out_, b, n), be());
      detail::charge_expert_flops(be(), experts, n, 1);
    });
    matrix_view<T> const leaving = rank_major_rows(partial);
    reorder_chunks(partial, leaving, chunk_order::expert_major_to_rank_major);
    reduce_scatter_alltoall(be(), groups_->esp(), groups_->ep(), matrix_view<T const>(leaving), recv_rows(), send_rows(), returned,
                            pipe_, pieces());
  }

  // ---- backward ---------------------------------------------------------------------------------
  template <class Experts>
  void checked_backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                        optional_output<array_view<float>> d_weights, Experts& experts) {
    char const* op = "parm_layer::backward";
    refuse_capture(op);
    if (!routed_) detail::fail(status::invalid_usage, op, "called without a successful forward before it");
    detail::check_layer_backward_arguments(op, tokens_, top_k_, detail::is_weighted<Weighting>(), d_out, d_x, d_weights, hidden_);
    check_experts_slicing(experts, op);
    if (checks_.scan_values && !detail::capturing(be()))
      require_same_over_mp(op, "d_out", detail::content_digest(be(), d_out.data, tokens_ * hidden_));
    if constexpr (!detail::is_dropless_v<Capacity>) {
      if (padded()) {
        if constexpr (pauses_mp) paused_padded_backward(d_out, d_x, d_weights, experts);
        else baseline_backward(*padded_, d_out, d_x, d_weights, experts);
        return;
      }
    }
    if constexpr (pauses_mp) paused_backward(d_out, d_x, d_weights, experts);
    else baseline_backward(dispatcher_, d_out, d_x, d_weights, experts);
  }

  template <class Dispatcher, class Experts>
  void baseline_backward(Dispatcher& d, matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                         optional_output<array_view<float>> d_weights, Experts& experts) {
    std::int64_t const rows = d.received_rows();
    d.template combine_backward<Weighting, T>(d_out, view(grow_rows(d_expert_out_, rows), rows), d_weights);
    detail::run_local_experts_backward<T>(experts, d.local_expert_offsets(), view(expert_in_, rows), view(d_expert_out_, rows),
                                          view(grow_rows(d_partial_in_, rows), rows), be(), group_offsets_);
    matrix_view<T> const summed = esp_allreduce(view(d_partial_in_, rows), d_expert_in_);
    d.template dispatch_backward<T>(matrix_view<T const>(summed), d_x);
  }

  template <class Experts>
  void paused_backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                       optional_output<array_view<float>> d_weights, Experts& experts) {
    row_range const mine = slice_;
    std::int32_t const k = top_k_;
    float* const d_w_mine = grow(be(), d_weights_slice_, mine.count * k).data();
    matrix_view<T const> const d_out_mine{d_out.data + mine.begin * hidden_, mine.count, hidden_};
    matrix_view<T const> const d_sent = dispatcher_.template combine_gradient<Weighting, T>(
        d_out_mine, d_weights.wanted() ? optional_output<array_view<float>>(array_view<float>{d_w_mine, mine.count * k})
                                       : optional_output<array_view<float>>(not_needed));
    matrix_view<T> const d_returned = view(grow_rows(d_returned_, dispatcher_.plan().num_rows()), dispatcher_.plan().num_rows());
    run_sliced_experts_backward(d_sent, d_returned, experts);
    matrix_view<T> const d_x_mine = view(grow_rows(d_x_slice_, mine.count), mine.count);
    dispatcher_.template dispatch_gradient<T>(matrix_view<T const>(d_returned), d_x_mine);
    // Every rank takes part in the MP all-gathers: its peers need its slice.
    matrix_view<T> const d_x_all = d_x.wanted() ? d_x.view() : view(grow_rows(d_x_unwanted_, tokens_), tokens_);
    row_allgather(be(), groups_->mp(), matrix_view<T const>(d_x_mine), matrix_view<T>{d_x_all.data, tokens_, hidden_}, scratch_);
    if constexpr (detail::is_weighted<Weighting>()) {
      float* const d_w_all = d_weights.wanted() ? d_weights.view().data : grow(be(), d_weights_unwanted_, tokens_ * k).data();
      if (!d_weights.wanted()) be().for_each_index(mine.count * k, detail::fill_value<float>{d_w_mine, 0.0f});
      row_allgather(be(), groups_->mp(), matrix_view<float const>{d_w_mine, mine.count, k}, matrix_view<float>{d_w_all, tokens_, k},
                    scratch_);
    }
  }

  //! PauseMP padded: every MP rank has the gradient of all T tokens' slot rows (and the weight
  //! gradient) from `d_out`; its share goes through the sliced experts, and the MP group's returned
  //! shares, all-gathered, give every rank all T tokens' `d_x`.
  template <class Experts>
  void paused_padded_backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                              optional_output<array_view<float>> d_weights, Experts& experts) {
    auto& d = *padded_;
    matrix_view<T const> const d_sent = take_share(d.template combine_gradient<Weighting, T>(d_out, d_weights));
    matrix_view<T> const d_returned = view(grow_rows(d_returned_, d_sent.rows), d_sent.rows);
    run_sliced_experts_backward(d_sent, d_returned, experts);
    std::int64_t const whole = d.plan().num_rows();
    matrix_view<T> const d_rows = view(grow_rows(d_whole_, whole), whole);
    gather_shares(matrix_view<T const>(d_returned), d_rows);  // every MP rank takes part: its peers need its share
    if (d_x.wanted()) d.template dispatch_gradient<T>(matrix_view<T const>(d_rows), d_x.view());
  }

  //! The mirror of `run_sliced_experts`: the output gradient `d_sent` to the slices, the experts'
  //! backward (their parameter gradients summed over the MP peers that hold the slice, when the
  //! layer sums them), and the input gradient, summed over the slices, back into `d_returned`.
  template <class Experts>
  void run_sliced_experts_backward(matrix_view<T const> d_sent, matrix_view<T> d_returned, Experts& experts) {
    std::int64_t const rows = gathered_rows_;
    matrix_view<T> const d_expert_out = view(grow_rows(d_expert_out_, rows), rows);
    matrix_view<T> const d_arrived = rank_major_rows(d_expert_out);
    alltoall_allgather(be(), groups_->ep(), groups_->esp(), d_sent, send_rows(), recv_rows(), d_arrived, pipe_, pieces());
    reorder_chunks(d_arrived, d_expert_out, chunk_order::rank_major_to_expert_major);
    bool const replicated = sums_replica_gradients();
    stage_gradients(experts, replicated);
    matrix_view<T> const d_partial_in = view(grow_rows(d_partial_in_, rows), rows);
    for_each_local_expert([&](std::int32_t l, std::int64_t b, std::int64_t n) {
      matrix_view<T> const d_in = rows_at(d_partial_in_, b, n);
      if constexpr (detail::is_parametric_experts_v<Experts>) {
        detail::expert_backward<T>(experts, experts.parameters(l), rows_at(expert_in_, b, n), rows_at(d_expert_out_, b, n), d_in,
                                   replicated ? staged_gradient(experts, l) : experts.gradients(l), be());
      } else {
        detail::run_local_expert_backward<T>(experts, l, rows_at(expert_in_, b, n), rows_at(d_expert_out_, b, n), d_in, be());
      }
      detail::charge_expert_flops(be(), experts, n, 2);
    });
    matrix_view<T> const d_leaving = rank_major_rows(d_partial_in);
    reorder_chunks(d_partial_in, d_leaving, chunk_order::expert_major_to_rank_major);
    reduce_scatter_alltoall(be(), groups_->esp(), groups_->ep(), matrix_view<T const>(d_leaving), recv_rows(), send_rows(), d_returned,
                            pipe_, pieces());
    if (replicated) sum_gradients_over_replicas(experts);
  }

  //! Under PauseMP the MP peers that hold the same slice see different tokens: each adds its share
  //! into a staged gradient, and the shares are summed in ascending rank into the experts' own.
  template <class Experts>
  void stage_gradients(Experts& experts, bool replicated) {
    if constexpr (detail::is_parametric_experts_v<Experts>) {
      if (!replicated) return;
      using P = detail::parameter_t<Experts>;
      std::int64_t const n = experts.parameter_count() * dispatcher_.num_local_experts();
      P* const staged = grad_scratch_.template get<P>(be(), n);
      be().for_each_index(n, detail::fill_value<P>{staged, P{0}});
    }
  }
  template <class Experts>
  auto staged_gradient(Experts& experts, std::int32_t l) {
    using P = detail::parameter_t<Experts>;
    return grad_scratch_.template get<P>(be(), experts.parameter_count() * dispatcher_.num_local_experts()) +
           l * experts.parameter_count();
  }
  template <class Experts>
  void sum_gradients_over_replicas(Experts& experts) {
    if constexpr (detail::is_parametric_experts_v<Experts>) {
      using P = detail::parameter_t<Experts>;
      std::int64_t const count = experts.parameter_count(), n = count * dispatcher_.num_local_experts();
      P* const staged = grad_scratch_.template get<P>(be(), n);
      [[maybe_unused]] auto const payload = detail::payload_scope(be(), detail::payload_kind::parameters);
      ordered_allreduce(be(), replicas_, array_view<P>{staged, n}, replica_scratch_);
      for (std::int32_t l = 0; l < dispatcher_.num_local_experts(); ++l)
        be().for_each_index(count, detail::add_into<P>{staged + l * count, experts.gradients(l)});
      be().synchronize();
    }
  }

  // ---- shared pieces ----------------------------------------------------------------------------
  //! The ESP all-reduce of the baseline's slice outputs: rows identical on the ESP group, summed in
  //! ascending slice order (ordered reduce-scatter, then all-gather). With ESP = 1, `partial` itself.
  matrix_view<T> esp_allreduce(matrix_view<T> partial, rows_t& summed) {
    if (esp_size() == 1) return partial;
    Comm& esp = groups_->esp();
    row_range const own = row_slice(partial.rows, esp_size(), esp.rank());
    matrix_view<T> const own_sum = view(grow_rows(esp_slice_, own.count), own.count);
    ordered_reduce_scatter(be(), esp, matrix_view<T const>(partial), own_sum, scratch_);
    matrix_view<T> const all = view(grow_rows(summed, partial.rows), partial.rows);
    row_allgather(be(), esp, matrix_view<T const>(own_sum), all, scratch_);
    for (std::int32_t g = 0; g < esp_size(); ++g) {
      if (g == esp.rank()) continue;
      record(report_.expert_slicing, groups_->esp_member(g), row_slice(partial.rows, esp_size(), g).count * partial.row_bytes());
      record(report_.expert_slicing, groups_->esp_member(g), own.count * partial.row_bytes());  // all-gather
    }
    return all;
  }

  //! The tokens of `mine` as a routing of their own.
  static routing_view slice_routing(routing_view const& routing, row_range mine) {
    routing_view s = routing;
    std::int64_t const first = mine.begin * routing.top_k;
    s.topk_idx = routing.topk_idx == nullptr ? nullptr : routing.topk_idx + first;
    s.topk_weights = routing.topk_weights == nullptr ? nullptr : routing.topk_weights + first;
    s.num_tokens = mine.count;
    return s;
  }

  //! `send_rows_` `[EP]`, and, all-gathered over the ESP group, `chunk_counts_` `[ESP][EP][L]`,
  //! `recv_rows_` `[ESP][EP]` and `expert_offsets_` `[L + 1]`: what the pipelined collectives, the
  //! chunks' reordering and the experts need.
  void exchange_block_counts() {
    std::int32_t const peers = groups_->ep().size(), members = esp_size(), locals = dispatcher_.num_local_experts();
    std::int64_t const mine = std::int64_t{peers} * locals;
    send_rows_.resize(static_cast<std::size_t>(peers));
    for (std::int32_t p = 0; p < peers; ++p) send_rows_[static_cast<std::size_t>(p)] = dispatcher_.rows_to(p);
    chunk_counts_.resize(static_cast<std::size_t>((members + 1) * mine));
    std::int64_t* const own = chunk_counts_.data() + members * mine;
    auto const& offsets = dispatcher_.rank_major_offsets();
    for (std::int64_t i = 0; i < mine; ++i) own[i] = offsets[static_cast<std::size_t>(i) + 1] - offsets[static_cast<std::size_t>(i)];
    allgather_host(groups_->esp(), own, chunk_counts_.data(), mine * static_cast<std::int64_t>(sizeof(std::int64_t)));
    recv_rows_.assign(static_cast<std::size_t>(members) * peers, 0);
    expert_offsets_.assign(static_cast<std::size_t>(locals) + 1, 0);
    sort_counts_.resize(static_cast<std::size_t>(members * mine));
    for (std::int64_t i = 0; i < members * mine; ++i) {
      std::int64_t const n = chunk_counts_[static_cast<std::size_t>(i)];
      recv_rows_[static_cast<std::size_t>(i / locals)] += n;
      expert_offsets_[static_cast<std::size_t>(i % locals) + 1] += n;
      sort_counts_[static_cast<std::size_t>(i)] =
          detail::checked_int32(n, "parm_layer", "a gathered block's rows", "sort_chunks counts rows in int32");
    }
    for (std::int32_t l = 0; l < locals; ++l) expert_offsets_[static_cast<std::size_t>(l) + 1] += expert_offsets_[static_cast<std::size_t>(l)];
    gathered_rows_ = expert_offsets_.back();
  }
  //! The padded counts of PauseMP (file comment): every EP rank gets `L · s` rows from every other,
  //! every gathered chunk is `s` rows, s = ⌈C / MP⌉: the same on every rank, known from C alone.
  void plan_padded_shares(std::int64_t capacity) {
    std::int32_t const peers = groups_->ep().size(), members = esp_size(), locals = dispatcher_.num_local_experts();
    std::int64_t const share = mp_share(capacity);
    send_rows_.assign(static_cast<std::size_t>(peers), locals * share);
    recv_rows_.assign(static_cast<std::size_t>(members) * peers, locals * share);
    sort_counts_.assign(static_cast<std::size_t>(members) * peers * locals,
                        detail::checked_int32(share, "parm_layer", "a gathered block's rows", "sort_chunks counts rows in int32"));
    expert_offsets_.resize(static_cast<std::size_t>(locals) + 1);
    for (std::int32_t l = 0; l <= locals; ++l) expert_offsets_[static_cast<std::size_t>(l)] = l * std::int64_t{members} * peers * share;
    gathered_rows_ = expert_offsets_.back();
  }
  //! This MP rank's share of the padded plan's rows `whole` (`[E][C]`): `[E][s]` (padded).
  matrix_view<T const> take_share(matrix_view<T const> whole) {
    std::int64_t const capacity = padded_->report().capacity, share = mp_share(capacity), rows = num_experts_ * share;
    matrix_view<T> const out = view(grow_rows(share_rows_, rows), rows);
    detail::gather_rows_by<Backend, T>(be(), whole, out, rows, detail::mp_share_rows{capacity, share, groups_->coordinates().mp * share});
    return out;
  }
  //! The MP group's shares, each rank's `mine`, all-gathered and put back in the padded plan's order
  //! (`[E][C]`) into `whole`.
  void gather_shares(matrix_view<T const> mine, matrix_view<T> whole) {
    std::int64_t const capacity = padded_->report().capacity, share = mp_share(capacity), rows = mp_size() * mine.rows;
    matrix_view<T> const all = view(grow_rows(mp_rows_, rows), rows);
    row_allgather(be(), groups_->mp(), mine, all, scratch_);
    detail::gather_rows_by<Backend, T>(be(), matrix_view<T const>(all), whole, whole.rows,
                                       detail::mp_gathered_rows{capacity, share, num_experts_});
  }
  [[nodiscard]] array_view<std::int64_t const> send_rows() const { return {send_rows_.data(), static_cast<std::int64_t>(send_rows_.size())}; }
  [[nodiscard]] array_view<std::int64_t const> recv_rows() const { return {recv_rows_.data(), static_cast<std::int64_t>(recv_rows_.size())}; }

  //! `f(l, first row, rows)` for every local expert with rows, in the expert-major order: one call
  //! (one GEMM) per expert over the rows of every ESP member and source, as `deepspeed_mp` runs it.
  template <class F>
  void for_each_local_expert(F&& f) const {
    for (std::size_t l = 0; l + 1 < expert_offsets_.size(); ++l)
      if (expert_offsets_[l + 1] > expert_offsets_[l])
        f(static_cast<std::int32_t>(l), expert_offsets_[l], expert_offsets_[l + 1] - expert_offsets_[l]);
  }

  //! The collectives deliver and take the gathered rows rank-major, `[ESP][EP][L]`; the experts
  //! want them expert-major, `[L][ESP][EP]`. With one local expert the two orders are one, and the
  //! collectives use `expert_major` itself; otherwise `gathered_` stages the rank-major rows.
  matrix_view<T> rank_major_rows(matrix_view<T> expert_major) {
    if (dispatcher_.num_local_experts() == 1) return expert_major;
    return view(grow_rows(gathered_, expert_major.rows), expert_major.rows);
  }
  //! `from` -> `to` in `order` (`sort_chunks`), unless they are the same rows (one local expert).
  void reorder_chunks(matrix_view<T> from, matrix_view<T> to, chunk_order order) {
    if (from.data == to.data) return;
    sort_chunks(be(), matrix_view<T const>(from), array_view<std::int32_t const>{sort_counts_.data(), static_cast<std::int64_t>(sort_counts_.size())},
                esp_size() * groups_->ep().size(), dispatcher_.num_local_experts(), to, sort_scratch_, order);
  }

  // ---- traffic report ---------------------------------------------------------------------------
  void record(alltoall_stats& stats, std::int32_t to, std::int64_t bytes, std::int64_t messages = 1) const {
    if (bytes == 0) return;
    std::int32_t const me = groups_->world().rank();
    stats.record(groups_->nodes(), me, to, bytes);
    if (me == to || messages <= 1) return;
    (groups_->nodes().same_node(me, to) ? stats.intra_messages : stats.inter_messages) += messages - 1;
  }
  //! The baseline's all-to-alls over `d` (the ESP all-reduce is recorded where it runs).
  template <class Dispatcher>
  void record_baseline_traffic(Dispatcher const& d) {
    std::int64_t const row_bytes = hidden_ * static_cast<std::int64_t>(sizeof(T));
    std::int32_t const me = groups_->ep().rank(), locals = d.num_local_experts();
    for (std::int32_t p = 0; p < groups_->ep().size(); ++p) {
      std::int64_t back = 0;
      for (std::int32_t l = 0; l < locals; ++l) back += d.rows_from(p, me * locals + l);
      record(report_.alltoall, groups_->ep_member(p), d.rows_to(p) * row_bytes);  // dispatch
      record(report_.alltoall, groups_->ep_member(p), back * row_bytes);                   // combine
    }
  }
  void record_paused_traffic() {
    std::int64_t const row_bytes = hidden_ * static_cast<std::int64_t>(sizeof(T));
    std::int32_t const w = pieces(), me_g = groups_->esp().rank(), peers = groups_->ep().size();
    auto pieces_of = [&](std::int64_t rows) { return rows < w ? rows : std::int64_t{w}; };
    for (std::int32_t p = 0; p < peers; ++p) {
      std::int64_t const out = send_rows_[static_cast<std::size_t>(p)], back = recv_rows_[static_cast<std::size_t>(me_g * peers + p)];
      record(report_.alltoall, groups_->ep_member(p), out * row_bytes, pieces_of(out));
      record(report_.alltoall, groups_->ep_member(p), back * row_bytes, pieces_of(back));
    }
    std::int64_t own = 0;
    for (std::int32_t p = 0; p < peers; ++p) own += recv_rows_[static_cast<std::size_t>(me_g * peers + p)];
    for (std::int32_t g = 0; g < esp_size(); ++g) {
      if (g == me_g) continue;
      std::int64_t theirs = 0;
      for (std::int32_t p = 0; p < peers; ++p) theirs += recv_rows_[static_cast<std::size_t>(g * peers + p)];
      record(report_.expert_slicing, groups_->esp_member(g), own * row_bytes, pieces_of(own));        // all-gather
      record(report_.expert_slicing, groups_->esp_member(g), theirs * row_bytes, pieces_of(theirs));  // reduce-scatter
    }
    for (std::int32_t m = 0; m < mp_size(); ++m)
      if (m != groups_->coordinates().mp) record(report_.model_gather, groups_->mp_member(m), model_gather_rows_ * row_bytes);
  }

  rows_t& grow_rows(rows_t& b, std::int64_t rows) const { return grow(be(), b, rows * hidden_); }
  matrix_view<T> view(rows_t& b, std::int64_t rows) const { return {b.data(), rows, hidden_}; }
  matrix_view<T> rows_at(rows_t& b, std::int64_t begin, std::int64_t n) const { return {b.data() + begin * hidden_, n, hidden_}; }

  parallel_groups<Comm>* groups_;
  exchange_groups<Comm> ep_groups_;
  dispatcher<Backend, Comm, dropless, flat> dispatcher_;  //!< over the EP group; capacity is applied before it
  //! With a capacity policy: over the EP group, routing all T tokens when it pads (`padded()`).
  std::optional<dispatcher<Backend, Comm, Capacity, flat>> padded_;
  Comm replicas_;  //!< the MP peers that hold this rank's slice (MP / ESP of them)
  Schedule schedule_;
  Capacity capacity_;
  routing_checks checks_;
  std::vector<std::uint64_t> mp_digests_;  //!< the MP group's input digests (`require_same_over_mp`)
  std::int32_t num_experts_;
  std::int64_t hidden_;
  permute_plan<Backend> all_plan_;  //!< the plan of all T tokens: validation and capacity
  permute_plan<Backend> kept_plan_;  //!< the baseline's plan of the kept slots
  typename Backend::template buffer_type<std::int32_t> kept_idx_;
  workspace<Backend> scratch_, grad_scratch_, replica_scratch_, sort_scratch_;
  pipeline_workspace<Backend> pipe_;
  std::vector<std::int64_t> send_rows_, recv_rows_, chunk_counts_, expert_offsets_;  //!< kept between steps
  std::vector<std::int32_t> sort_counts_;  //!< `chunk_counts_`' gathered blocks, as `sort_chunks` takes them
  std::vector<std::int64_t> shapes_;  //!< parm_auto: `[world][3]` tokens, top-k and kept rows
  std::int32_t chosen_pieces_ = 1;    //!< parm_auto: the pieces of the schedule the last forward chose
  std::int64_t gathered_rows_ = 0, tokens_ = 0;
  std::int64_t model_gather_rows_ = 0;  //!< PauseMP: rows this rank gives the MP all-gather (its tokens, or its padded share)
  std::int32_t top_k_ = 0;
  row_range slice_;  //!< this rank's tokens under PauseMP
  rows_t expert_in_, partial_out_, expert_out_, esp_slice_, out_slice_;
  rows_t gathered_;  //!< PauseMP with several local experts: the gathered rows in the collectives' (rank-major) order
  rows_t share_rows_, mp_rows_, d_whole_;  //!< PauseMP padded: this rank's share, the MP group's, all T tokens' slot gradients
  std::vector<std::int64_t> group_offsets_;  //!< grouped experts' offsets, relative to their block
  rows_t d_expert_out_, d_partial_in_, d_expert_in_, d_returned_, d_x_slice_, d_x_unwanted_;
  typename Backend::template buffer_type<float> d_weights_slice_, d_weights_unwanted_;
  parm_report report_;
  bool routed_ = false;
};

MOECOMM_NAMESPACE_END
