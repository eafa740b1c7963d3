// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `dispatcher`: moves token rows to the ranks that hold their experts and back (semantics §10),
//! composed from the primitives: capacity -> permute plan -> count exchange -> permute ->
//! all-to-all -> sort_chunks, and the exact inverse for the combine; plus both backward passes.

#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/step_bounds.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/dispatch/dedup_node_plan.hpp>
#include <moecomm/dispatch/dedup_plan.hpp>
#include <moecomm/rows/permute.hpp>
#include <moecomm/rows/permute_plan.hpp>
#include <moecomm/rows/sort_chunks.hpp>
#include <moecomm/rows/unpermute.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `out[i]` = the new label of slot i's expert (invalid and masked ids unchanged).
struct relabel_experts {
  std::int32_t const* idx;
  std::int32_t const* label;  //!< `[E]`
  std::int32_t num_experts;
  std::int32_t* out;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int32_t const e = idx[i];
    out[i] = is_valid_expert(e, num_experts) ? label[e] : e;
  }
};

//! A rank's row of an all-gather, after its head (host values the caller copies in first, such as a
//! capacity agreement's fields): `[E counts][R dedup counts][piece counts][top_k][first bad
//! slot][ids out of range]`, the dedup counts only with a deduplicated exchange whose source map
//! rides along, the piece counts (`dedup_node_plan::piece_rows`) only per node, top_k only
//! deduplicated. The counts come from the plans' device offsets; the two status words from a plan
//! whose value scan is still on the device (`status`: the first bad slot, or `slots` when none, and
//! the ids out of range), else -1 and 0.
struct pack_count_row {
  std::int32_t const* expert_offsets;  //!< `[E + 1]`
  std::int32_t num_experts;
  std::int32_t const* rank_offsets;  //!< `[R + 1]` the deduplicated rows to each rank (or relay), or null
  std::int32_t const* piece_rows;    //!< `dedup_node_plan::piece_rows`, or null
  std::int64_t piece_words;          //!< their number, or 0
  std::int32_t ranks;                //!< R with `rank_offsets`, else 0
  std::int64_t top_k;                //!< written after them with a deduplicated exchange, else -1: not written
  std::int64_t const* status;        //!< `[2]`, or null
  std::int64_t slots;
  std::int64_t* row;  //!< where the counts start
  [[nodiscard]] MOECOMM_HOST_DEVICE std::int64_t words() const {
    return num_experts + ranks + piece_words + (top_k >= 0 ? 1 : 0) + 2;
  }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int64_t const status_at = words() - 2, pieces_at = num_experts + ranks;
    if (i < num_experts) row[i] = expert_offsets[i + 1] - expert_offsets[i];
    else if (i < pieces_at) row[i] = rank_offsets[i - num_experts + 1] - rank_offsets[i - num_experts];
    else if (i < pieces_at + piece_words) row[i] = piece_rows[i - pieces_at];
    else if (i < status_at) row[i] = top_k;
    else if (i == status_at) row[i] = status != nullptr && status[0] < slots ? status[0] : -1;
    else row[i] = status != nullptr ? status[1] : 0;
  }
};

}  // namespace detail

//! What one routing decision did on this rank (host values, valid after `route`).
struct dispatch_report {
  std::int64_t capacity = 0;       //!< C agreed across ranks, the receiver budget, or 0 when dropless
  std::int64_t kept_slots = 0;     //!< slots sent to an expert (-1 after a captured route: on the device only)
  std::int64_t dropped_slots = 0;  //!< valid slots dropped by the capacity policy (likewise)
  std::int64_t received_rows = 0;  //!< rows this rank's experts get (padding included)
  std::int64_t home_rows = 0;      //!< rows of this rank's tokens computed here by home experts
  alltoall_stats exchange;         //!< messages and bytes sent, accumulated over the step's all-to-alls
  //! `dedup_per_rank` only: the slot lists (`route`, 8·K bytes per row) and the weight-gradient dots
  //! returned (`combine_backward`, 4·K bytes per row); `exchange` counts the rows alone.
  alltoall_stats slot_metadata;
  //! The narrowest access, in bytes, the step's row kernels made on the caller's rows (x, out, d_out,
  //! d_x): 16 at full width; 8 or one element when a row (hidden · sizeof(T) bytes) or a pointer is
  //! not 16-byte aligned, which costs bandwidth on a GPU (pad hidden to a multiple of 16 bytes).
  int row_access_bytes = detail::max_access_bytes;
};

//! The dispatch and combine of one expert-parallel group (experts placed contiguously, `E / R`
//! per rank). Every member is collective over the group. Call `route` once per routing decision,
//! then `dispatch` / `combine` (and, for training, `combine_backward` / `dispatch_backward`) for
//! that routing, with rows of any supported element type.
//!
//! Home experts (FasterMoE's shadowed experts): `route` may name experts whose rows are computed
//! where their tokens are, on every rank (FasterMoE) or on their owner and a subset of the ranks
//! (Pro-Prophet: `home_subsets`), instead of being sent to the owner. On a rank where an expert is
//! home its rows skip the exchange and appear in the `home_rows` arguments, grouped by home expert
//! (ascending id, `home_experts()`, `home_expert_offsets()`), each expert's rows in (token, slot)
//! order; other ranks send theirs to the owner as usual. The combine still sums every slot of a
//! token in slot order, so outputs are bit for bit those of plain dispatch.
//! @tparam Capacity `dropless`, `capacity<drop_by_position | drop_by_probability | drop_random>` or
//!         `receiver_budget`.
//! @tparam Algorithm `flat`, `hierarchical_2d`, `pairwise` or `smart_schedule` (which adds the
//!         pipelined calls); or `dedup_per_rank<flat | hierarchical_2d | pairwise>`, which sends each
//!         token once per destination rank and sums its expert outputs there (semantics §10a): the
//!         experts see the same rows, the combine and `dispatch_backward` add per rank first; or
//!         `dedup_per_node`, once per destination node through a relay there (per rank, then per node).
//! Home experts on subsets of the ranks, as `route`'s chooser may return them: `experts` ascending
//! and distinct; expert `experts[i]` is home on its owner and on the ranks
//! `ranks[offsets[i] .. offsets[i + 1])` (the owner excluded); `offsets` empty: on every rank.
struct home_subsets {
  array_view<std::int32_t const> experts;
  array_view<std::int32_t const> offsets;
  array_view<std::int32_t const> ranks;
};

template <class Backend, class Comm, class Capacity = dropless, class Algorithm = flat>
class dispatcher {
 public:
  //! @param groups the group's communicators and topology; must outlive the dispatcher.
  //! @throws error (invalid_argument) unless `num_experts` is a positive multiple of the ranks.
  dispatcher(Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, Capacity capacity = {},
             Algorithm algorithm = {}, routing_checks checks = {})
      : be_(std::move(be)), groups_(&groups), capacity_(capacity), algorithm_(algorithm), checks_(checks),
        num_experts_(num_experts), ranks_(groups.world().size()) {
    detail::require_one_stream(be_, groups.world(), "dispatcher");
    detail::require(num_experts > 0 && num_experts % ranks_ == 0, "dispatcher", "num_experts = ", num_experts,
                    " must be a positive multiple of the ", ranks_, " ranks");
    local_experts_ = num_experts / ranks_;
    if constexpr (std::is_same_v<Algorithm, dedup_per_node>) {
      detail::require(algorithm_.pieces >= 1, "dispatcher", "algorithm.pieces = ", algorithm_.pieces, " must be at least 1 (dedup_per_node)");
      dedup_.cut_into(algorithm_.pieces, groups.topo());
    }
    // Ranks with different algorithms would exchange rows their peers do not expect.
    std::vector<std::int64_t> all;
    detail::agree_on_text(groups.world(), "dispatcher", "on the exchange algorithm", algorithm_label(), all);
  }

  //! Sizes every buffer a step within `bounds` needs, with rows of `hidden` elements of T (plans,
  //! scratch, rows, the exchange's staging and message lists, the count tables), so that such steps
  //! allocate nothing (`grow` keeps them). Local: no traffic. Returns the received rows it sized for
  //! (`bounds.max_received_rows` or the policy's bound).
  //! @throws error (invalid_argument) naming the field of `bounds` that is out of range.
  template <class T>
  std::int64_t reserve(step_bounds const& bounds, std::int64_t hidden) {
    char const* op = "dispatcher::reserve";
    detail::require(bounds.max_tokens >= 0, op, "step_bounds.max_tokens = ", bounds.max_tokens, " is negative");
    detail::require(bounds.top_k > 0 && bounds.top_k <= num_experts_, op, "step_bounds.top_k = ", bounds.top_k,
                    " must be in [1, num_experts = ", num_experts_, "]");
    detail::require(bounds.max_received_rows >= 0, op, "step_bounds.max_received_rows = ", bounds.max_received_rows, " is negative");
    detail::require(hidden > 0, op, "hidden = ", hidden, " must be positive");
    std::int64_t const slots = detail::checked_mul(bounds.max_tokens, bounds.top_k, op, "max_tokens * top_k");
    std::int64_t capacity = 0, received = std::int64_t{ranks_} * slots;  // dropless: every slot of every rank
    if constexpr (detail::is_receiver_budget_v<Capacity>) {
      received = capacity_.rows_per_rank;
    } else if constexpr (!detail::is_dropless_v<Capacity>) {
      capacity = expert_capacity(bounds.max_tokens, bounds.top_k, num_experts_, capacity_.factor, capacity_.min_capacity);
      received = std::int64_t{ranks_} * local_experts_ * capacity;
    }
    if (bounds.max_received_rows > 0) received = bounds.max_received_rows;
    // The plans and their scratch: built once, here, on a routing of the largest step.
    detail::largest_routing<Backend> const largest(be_, bounds.max_tokens, bounds.top_k, num_experts_);
    reserve_plans(largest.view(), capacity, received, hidden * static_cast<std::int64_t>(sizeof(T)));
    reserve_tables();
    // The rows: this rank's (one per slot, or per padded row), and those its experts receive.
    std::int64_t const padded = capacity_pads() ? std::int64_t{num_experts_} * capacity : 0;
    std::int64_t const source_rows = std::max(slots, padded);
    for (bytes_t* b : {&sent_, &returned_, &d_back_}) rows_buffer<T>(*b, source_rows, hidden);
    for (bytes_t* b : {&arrived_, &rank_major_}) rows_buffer<T>(*b, received, hidden);
    std::int64_t const row_bytes = hidden * static_cast<std::int64_t>(sizeof(T));
    detail::reserve_exchange(algorithm_, be_, groups_->topo(), source_rows * row_bytes, received * row_bytes, exchange_scratch_);
    be_.synchronize();  // the largest routing goes
    begin_route();      // the plans hold that routing: nothing may use them before a route
    return received;
  }

  //! Applies the capacity policy, builds the permute plan and exchanges the counts. Collective.
  //! The routing arrays must stay alive and unchanged until the step is done.
  void route(routing_view const& routing) { route(routing, no_home_experts{}); }

  //! As `route`, then `choose_home(counts)` names the home experts from the gathered `[R][E]`
  //! matrix of rows each rank sends each expert (after capacity): a `std::vector<std::int32_t>`
  //! (home on every rank) or `home_subsets`. It runs on every rank with the same matrix and must
  //! return the same choice on every rank (a pure function does).
  template <class ChooseHome>
  void route(routing_view const& routing, ChooseHome&& choose_home) {
    begin_route();
    if (detail::capturing(be_)) {
      refuse_capture_unless_capturable("route");
      route_captured(routing);
      return;
    }
    // Checked and counted with every rank's counts: the first all-gather brings the plan's host side.
    detail::enqueue_permute_plan(be_, routing, num_experts_, dropless_plan(), scratch_, checks_, status_words());
    finish_route(std::forward<ChooseHome>(choose_home), true);
  }

  //! As `route(routing)`, for a caller that already holds the routing's plan (`build_permute_plan`,
  //! unpadded, over the dispatcher's experts; or one derived from it, e.g. by `relabel_permute_plan`):
  //! the dispatcher takes its arrays instead of sorting the routing again, and hands `plan` its own
  //! previous arrays in exchange, so a caller that rebuilds `plan` every step allocates nothing.
  //! @throws error (invalid_argument) naming `plan` when its experts are not the dispatcher's or it is padded.
  void route(permute_plan<Backend>& plan) { route(plan, no_home_experts{}); }

  //! As `route(plan)`, with home experts (`route(routing, choose_home)`).
  template <class ChooseHome>
  void route(permute_plan<Backend>& plan, ChooseHome&& choose_home) {
    begin_route();
    if (detail::capturing(be_))
      detail::fail(status::invalid_usage, "dispatcher::route", "route(plan) is not capturable in a CUDA graph (the plan's host side "
                   "comes from an eager build); a captured step calls route(routing)");
    detail::require(plan.num_experts() == num_experts_, "dispatcher::route",
                    "argument 'plan' is over ", plan.num_experts(), " experts; the dispatcher's num_experts = ", num_experts_);
    detail::require(plan.padded_capacity() == 0, "dispatcher::route", "argument 'plan' is padded to ",
                    plan.padded_capacity(), " rows per expert; route takes the routing's unpadded plan (the capacity policy pads)");
    std::swap(dropless_plan(), plan);
    finish_route(std::forward<ChooseHome>(choose_home), false);
  }

  //! Sends each kept slot's token row to its expert's rank. `expert_rows` receives
  //! `received_rows()` rows, grouped by local expert (`local_expert_offsets()`), each expert's rows
  //! ordered by (source rank, source token). Collective.
  template <class T>
  void dispatch(matrix_view<std::add_const_t<T>> x, matrix_view<T> expert_rows) {
    dispatch<T>(x, expert_rows, no_home_rows<T>(x.hidden));
  }
  //! With home experts: their rows go to `home_rows` (`home_rows()` rows) instead.
  template <class T>
  void dispatch(matrix_view<std::add_const_t<T>> x, matrix_view<T> expert_rows, matrix_view<T> home) {
    require_routed("dispatch");
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::rows);
    bytes_t& sent = permuted_rows<T>(x, home, "dispatch");
    if constexpr (deduplicated) {
      detail::check_rows(expert_rows, received_rows(), "dispatch", "expert_rows", "dispatcher.received_rows()");
      permute(be_, dedup_.receive(), dedup_arrivals<T>(sent.data(), x.hidden), expert_rows);
    } else {
      exchange_forward<T>(sent.data(), expert_rows, "dispatch");
    }
  }

  //! Returns the experts' output rows to their tokens and combines them (`Weighting`). Keeps the
  //! returned rows for `combine_backward`. With `dedup_per_rank` and `weighted`, `expert_rows` must
  //! stay unchanged until `combine_backward`, whose weight gradient reads them there (as the layer's
  //! do). Collective.
  template <class Weighting = weighted, class T>
  void combine(matrix_view<std::add_const_t<T>> expert_rows, matrix_view<T> out) {
    combine<Weighting, T>(expert_rows, no_home_rows<T const>(out.hidden), out);
  }
  //! With home experts: their output rows come from `home_rows`.
  template <class Weighting = weighted, class T>
  void combine(matrix_view<std::add_const_t<T>> expert_rows, matrix_view<std::add_const_t<T>> home, matrix_view<T> out) {
    require_routed("combine");
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::rows);
    if constexpr (deduplicated) {
      dedup_exchange_back<Weighting, T>(expert_rows, returned_, "combine", "expert_rows");
      combined_rows_ = expert_rows.data;  // the receiver's part of the weight gradient reads them
    } else {
      exchange_back<T>(expert_rows, returned_, "combine");
    }
    combined_ = true;
    be_.copy(home_tail<T>(returned_, home, out.hidden, "combine", "home_rows"), home.data, home_rows() * out.hidden);
    note_row_access<T>(out.hidden, out.data);
    unpermute<Weighting>(be_, source_plan(), returned_view<T>(out.hidden), out);
  }

  //! The backward of `combine`: the gradient of the experts' output rows (in `dispatch`'s layout)
  //! and, when `Weighting` is `weighted`, of the routing weights (`d_weights`, `[T][K]`, optional;
  //! 0 for dropped and masked slots). Collective.
  template <class Weighting = weighted, class T>
  void combine_backward(matrix_view<std::add_const_t<T>> d_out, matrix_view<T> d_expert_rows,
                        optional_output<array_view<float>> d_weights = not_needed) {
    combine_backward<Weighting, T>(d_out, d_expert_rows, no_home_rows<T>(d_out.hidden), d_weights);
  }
  //! With home experts: the gradient of their output rows goes to `d_home_rows`.
  template <class Weighting = weighted, class T>
  void combine_backward(matrix_view<std::add_const_t<T>> d_out, matrix_view<T> d_expert_rows, matrix_view<T> d_home,
                        optional_output<array_view<float>> d_weights) {
    require_routed("combine_backward");
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::rows);
    bytes_t& d_rows = combine_gradient_rows<Weighting, T>(d_out, d_home, d_weights, "combine_backward");
    if constexpr (deduplicated) {
      dedup_combine_backward<Weighting, T>(d_rows.data(), d_expert_rows, d_weights);
    } else {
      exchange_forward<T>(d_rows.data(), d_expert_rows, "combine_backward");
    }
  }

  //! The backward of `dispatch`: the gradient of the token rows from that of the expert input rows.
  //! With `d_x = not_needed` the rank still takes part in the exchange (its peers need it).
  template <class T>
  void dispatch_backward(matrix_view<std::add_const_t<T>> d_expert_rows, optional_output<matrix_view<T>> d_x) {
    dispatch_backward<T>(d_expert_rows, no_home_rows<T const>(d_expert_rows.hidden), d_x);
  }
  //! With home experts: the gradient of their input rows comes from `d_home_rows`.
  template <class T>
  void dispatch_backward(matrix_view<std::add_const_t<T>> d_expert_rows, matrix_view<std::add_const_t<T>> d_home,
                         optional_output<matrix_view<T>> d_x) {
    char const* op = "dispatch_backward";
    require_routed(op);
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::rows);
    std::int64_t const hidden = d_expert_rows.hidden;
    check_token_rows(d_x, hidden, op, "d_x");
    bytes_t* d_rows = nullptr;
    if constexpr (deduplicated) d_rows = &dedup_exchange_back<unweighted, T>(d_expert_rows, d_back_, op, "d_expert_rows");
    else d_rows = &exchange_back<T>(d_expert_rows, d_back_, op);
    be_.copy(home_tail<T>(*d_rows, d_home, hidden, op, "d_home_rows"), d_home.data, home_rows() * hidden);
    if (d_x.wanted()) {
      note_row_access<T>(hidden, d_x.view().data);
      permute_backward(be_, source_plan(), matrix_view<T const>(as_rows<T>(*d_rows, source_plan().num_rows(), hidden)), d_x.view());
    }
  }

  //! The smart schedule (`Algorithm` = `smart_schedule`): `dispatch`, the experts and `combine`
  //! as one call, whose exchanges run in pairwise steps while the experts work on the rows of
  //! earlier steps (FasterMoE §4.2). `arrived` and `produced` hold `received_rows()` rows in
  //! rank-major order (by source rank, then local expert; `rank_major_offsets()`). The back-end's
  //! lane (`lane_t<Backend>`, core/lane.hpp) runs, in order, `compute_home(on)` (`home` ->
  //! `home_out`) and, once step j's rows are in, `compute(first_source, sources, on)` (their rows of
  //! `arrived` -> `produced`), `on` being the back-end to run them on (the lane's); each step's
  //! results go back as soon as they are computed. Collective.
  template <class Weighting = weighted, class T, class ComputeHome, class Compute>
  void forward_pipelined(matrix_view<std::add_const_t<T>> x, matrix_view<T> arrived, matrix_view<T> produced,
                         matrix_view<T> home, matrix_view<T> home_out, matrix_view<T> out, ComputeHome&& compute_home,
                         Compute&& compute) {
    static_assert(!deduplicated, "moecomm::dispatcher: the pipelined calls move slot rows; they do not take dedup_per_rank");
    require_routed("forward_pipelined");
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::rows);
    bytes_t& sent = permuted_rows<T>(x, home, "forward_pipelined");
    rows_buffer<T>(returned_, plan_.num_rows(), x.hidden);
    combined_ = true;
    pipelined_exchange<T>(sent.data(), arrived, produced, returned_.data(), compute_home, compute, "forward_pipelined");
    be_.copy(home_tail<T>(returned_, home_out, x.hidden, "forward_pipelined", "home_out"), home_out.data,
             home_rows() * x.hidden);
    note_row_access<T>(out.hidden, out.data);
    unpermute<Weighting>(be_, plan_, returned_view<T>(out.hidden), out);
  }

  //! The backward of `forward_pipelined`, pipelined the same way: `combine_backward`, the experts'
  //! backward (`compute_home(on)`: `d_home_out` -> `d_home_in`; `compute(first_source, sources, on)`:
  //! `d_arrived` -> `d_produced`) and `dispatch_backward`. Collective.
  template <class Weighting = weighted, class T, class ComputeHome, class Compute>
  void backward_pipelined(matrix_view<std::add_const_t<T>> d_out, matrix_view<T> d_arrived, matrix_view<T> d_produced,
                          matrix_view<T> d_home_out, matrix_view<T> d_home_in, optional_output<matrix_view<T>> d_x,
                          optional_output<array_view<float>> d_weights, ComputeHome&& compute_home, Compute&& compute) {
    char const* op = "backward_pipelined";
    require_routed(op);
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::rows);
    std::int64_t const hidden = d_out.hidden;
    check_token_rows(d_x, hidden, op, "d_x");
    bytes_t& d_rows = combine_gradient_rows<Weighting, T>(d_out, d_home_out, d_weights, op);
    bytes_t& d_back = rows_buffer<T>(d_back_, plan_.num_rows(), hidden);
    pipelined_exchange<T>(d_rows.data(), d_arrived, d_produced, d_back.data(), compute_home, compute, op);
    be_.copy(home_tail<T>(d_back, d_home_in, hidden, op, "d_home_in"), d_home_in.data, home_rows() * hidden);
    if (d_x.wanted()) {
      note_row_access<T>(hidden, d_x.view().data);
      permute_backward(be_, plan_, matrix_view<T const>(as_rows<T>(d_back, plan_.num_rows(), hidden)), d_x.view());
    }
  }

  // ---- for schedules that move the rows themselves (Parm's pipelined collectives, patterns/parm.hpp)
  //! This rank's kept rows in plan order: `rows_to(0)` rows for rank 0, then rank 1's, ... No traffic.
  template <class T>
  [[nodiscard]] matrix_view<T const> permuted(matrix_view<std::add_const_t<T>> x) {
    static_assert(!deduplicated, "moecomm::dispatcher: schedules that move the rows themselves take slot rows, not dedup_per_rank");
    require_routed("permuted");
    bytes_t& sent = permuted_rows<T>(x, no_home_rows<T>(x.hidden), "permuted");
    return as_rows<T>(sent, plan_.num_rows(), x.hidden);
  }
  //! Rows this rank sends rank `rank` (after capacity).
  [[nodiscard]] std::int64_t rows_to(std::int32_t rank) const {
    std::int64_t n = 0;
    for (std::int32_t l = 0; l < local_experts_; ++l) n += rows_from(groups_->world().rank(), rank * local_experts_ + l);
    return n;
  }
  //! Where such a schedule puts the experts' output rows of this rank's slots (plan order), then
  //! `combine_returned`, which combines them (and keeps them for `combine_backward`'s weight gradient).
  template <class T>
  [[nodiscard]] matrix_view<T> returned_rows(std::int64_t hidden) {
    require_routed("returned_rows");
    return as_rows<T>(rows_buffer<T>(returned_, plan_.num_rows(), hidden), plan_.num_rows(), hidden);
  }
  template <class Weighting = weighted, class T>
  void combine_returned(matrix_view<T> out) {
    require_routed("combine_returned");
    combined_ = true;
    note_row_access<T>(out.hidden, out.data);
    unpermute<Weighting>(be_, plan_, returned_view<T>(out.hidden), out);
  }
  //! The gradient of this rank's slot rows (plan order) from that of the combined tokens, and the
  //! weight gradient, as `combine_backward` computes them, without the exchange.
  template <class Weighting = weighted, class T>
  [[nodiscard]] matrix_view<T const> combine_gradient(matrix_view<std::add_const_t<T>> d_out,
                                                      optional_output<array_view<float>> d_weights) {
    require_routed("combine_gradient");
    bytes_t& d_rows = combine_gradient_rows<Weighting, T>(d_out, no_home_rows<T>(d_out.hidden), d_weights, "combine_gradient");
    return as_rows<T>(d_rows, plan_.num_rows(), d_out.hidden);
  }
  //! The gradient of the token rows from that of this rank's slot rows (plan order), as
  //! `dispatch_backward` computes it after its exchange.
  template <class T>
  void dispatch_gradient(matrix_view<std::add_const_t<T>> d_rows, matrix_view<T> d_x) {
    require_routed("dispatch_gradient");
    detail::check_rows(d_rows, plan_.num_rows(), "dispatch_gradient", "d_rows", "one row per kept slot");
    check_token_rows(optional_output<matrix_view<T>>(d_x), d_rows.hidden, "dispatch_gradient", "d_x");
    note_row_access<T>(d_x.hidden, d_x.data);
    permute_backward(be_, plan_, d_rows, d_x);
  }

  //! Rows this rank's experts receive (padding rows included).
  [[nodiscard]] std::int64_t received_rows() const { return report_.received_rows; }
  //! Rows of this rank's tokens for the home experts (padding included).
  [[nodiscard]] std::int64_t home_rows() const { return report_.home_rows; }
  //! This rank's home experts of this routing, ascending (empty for plain dispatch).
  [[nodiscard]] std::vector<std::int32_t> const& home_experts() const { return home_; }
  //! `[home_experts().size() + 1]` host offsets of each home expert's rows in `home_rows`.
  [[nodiscard]] std::vector<std::int64_t> const& home_expert_offsets() const { return home_offsets_; }
  //! `[L + 1]` host offsets of each local expert's rows in `expert_rows`.
  [[nodiscard]] std::vector<std::int64_t> const& local_expert_offsets() const { return local_offsets_; }
  //! The communicators it exchanges over.
  [[nodiscard]] exchange_groups<Comm>& groups() const { return *groups_; }
  //! `[R * L + 1]` host offsets of the rows from source rank s for local expert l (index s * L + l)
  //! in the rank-major order of the pipelined calls.
  [[nodiscard]] std::vector<std::int64_t> const& rank_major_offsets() const { return rank_major_offsets_; }
  //! `rows_from(s, e)`: rows source rank s sends global expert e (after capacity, with padding;
  //! 0 for home experts, whose rows stay at their source).
  [[nodiscard]] std::int64_t rows_from(std::int32_t source, std::int32_t expert) const {
    return counts_[static_cast<std::size_t>(source) * num_experts_ + expert];
  }
  [[nodiscard]] dispatch_report const& report() const { return report_; }

  //! Why a step of this dispatcher cannot be captured into a CUDA graph, or "" when it can: with a
  //! padded capacity policy over flat, hierarchical_2d or pairwise, and a communicator that enqueues
  //! on the stream (NCCL's), every size is known when the graph is built. Such a route, called while the back-end's stream captures, waits for nothing and
  //! reads nothing back (a chooser of home experts is not called: the home experts of the eager route
  //! before the capture are kept); any other is refused then with this reason.
  [[nodiscard]] std::string capture_blocker() const {
    if (std::string why = detail::host_driven_exchanges<Comm>(); !why.empty()) return why;
    if constexpr (detail::is_dropless_v<Capacity> || detail::is_receiver_budget_v<Capacity>) {
      return detail::concat(Capacity::name, ": the rows each rank receives depend on every rank's routing, which the host reads "
                            "(one wait a step); a captured step needs capacity<rule> with pad_to_capacity = true");
    } else {
      if (!capacity_.pad_to_capacity)
        return detail::concat("capacity<", Capacity::name, "> without pad_to_capacity: the rows kept per expert vary with the "
                              "routing; with pad_to_capacity = true every expert's block is C rows and the exchange's sizes are "
                              "known when the graph is built");
      if (deduplicated)
        return detail::concat(algorithm_label(), ": the rows sent to each rank depend on the routing, which the host reads");
      if (std::is_same_v<Algorithm, smart_schedule>)
        return "smart_schedule: the experts run on a host lane between the pairwise exchanges";
      return "";
    }
  }

  //! After a captured route's graph ran (outside the capture: one host wait): raises the value
  //! scan's verdict on that routing, which a captured step leaves on the device (an id out of range
  //! was treated as masked there, a NaN weight went through). Eager routes raise it themselves.
  //! @throws error (invalid_argument) naming the token, slot and value, as an eager route does.
  void check_captured_routing() const {
    std::int64_t const* const scan = count_row_.data();
    routing_view const& routing = dropless_plan_.routing();
    std::int64_t status[1] = {0};
    if (scan == nullptr || routing.num_tokens == 0) return;
    detail::read_back(be_, status, scan, 1);
    if (status[0] < routing.num_tokens * routing.top_k)
      detail::report_slot_problem(be_, routing, num_experts_, status[0], "dispatcher::check_captured_routing");
  }
  [[nodiscard]] permute_plan<Backend> const& plan() const { return plan_; }
  [[nodiscard]] std::int32_t num_local_experts() const { return local_experts_; }
  [[nodiscard]] Backend const& backend() const { return be_; }

 private:
  using bytes_t = typename Backend::template buffer_type<char>;
  static constexpr bool deduplicated = detail::is_dedup_v<Algorithm>;
  //! Host words at the head of a gathered row: the capacity agreement's fields and the tokens.
  static constexpr std::int32_t max_head_words = detail::capacity_fields + 1;

  //! The widest gathered row (`gather_row`), and before it the status words of a plan whose value
  //! scan is still on the device: device memory kept between steps.
  std::int64_t* status_words() {
    return grow(be_, count_row_, 2 + static_cast<std::int64_t>(max_row_words())).data();
  }

  void require_routed(char const* op) const {
    if (!routed_) detail::fail(status::invalid_usage, "dispatcher", op, " was called before route()");
  }

  //! A wanted token-row output holds a row per token of the routing.
  template <class T>
  void check_token_rows(optional_output<matrix_view<T>> const& rows, std::int64_t hidden, char const* op,
                        char const* name) const {
    if (!rows.wanted()) return;
    detail::check_rows(rows.view(), plan_.routing().num_tokens, op, name, "one row per token");
    detail::require(rows.view().hidden == hidden, op, "argument '", name, "' has hidden = ", rows.view().hidden,
                    ", the gradient rows ", hidden);
  }

  template <class T>
  static matrix_view<T> no_home_rows(std::int64_t hidden) {
    return {nullptr, 0, hidden};
  }

  //! The home rows are the tail of a permuted buffer, after the rows that are exchanged.
  template <class T>
  T* home_tail(bytes_t& permuted, matrix_view<T const> home, std::int64_t hidden, char const* op, char const* name) const {
    detail::check_rows(home, home_rows(), op, name, "dispatcher.home_rows()");
    detail::require(home.hidden == hidden, op, "argument '", name, "' has hidden = ", home.hidden, ", the token rows ", hidden);
    return reinterpret_cast<T*>(permuted.data()) + (source_plan().num_rows() - home_rows()) * home.hidden;
  }

  //! This rank's rows in plan order (the exchanged ones, then the home ones), the home ones also
  //! copied to `home`.
  template <class T>
  bytes_t& permuted_rows(matrix_view<std::add_const_t<T>> x, matrix_view<T> home, char const* op) {
    permute_plan<Backend> const& plan = source_plan();
    bytes_t& sent = rows_buffer<T>(sent_, plan.num_rows(), x.hidden);
    note_row_access<T>(x.hidden, x.data);
    permute(be_, plan, x, as_rows<T>(sent, plan.num_rows(), x.hidden));
    be_.copy(home.data, home_tail<T>(sent, home, x.hidden, op, "home_rows"), home_rows() * x.hidden);
    return sent;
  }

  //! The gradient of every row in plan order from that of the combined tokens (and the weight
  //! gradient), the home ones also copied to `d_home`.
  template <class Weighting, class T>
  bytes_t& combine_gradient_rows(matrix_view<std::add_const_t<T>> d_out, matrix_view<T> d_home,
                                 optional_output<array_view<float>> d_weights, char const* op) {
    detail::require(!d_weights.wanted() || detail::is_weighted<Weighting>(), "dispatcher::", op,
                    ": argument 'd_weights' was given, but an unweighted combine has no weight gradient");
    detail::require(!d_weights.wanted() || combined_ || plan_.num_rows() == 0, "dispatcher::", op,
                    ": the weight gradient needs the rows of a previous combine");
    permute_plan<Backend> const& plan = source_plan();  // with dedup, its home slots' dots are the final ones
    std::int64_t const rows = plan.num_rows(), hidden = d_out.hidden;
    bytes_t& d_rows = rows_buffer<T>(sent_, rows, hidden);  // dispatch is done with sent_
    note_row_access<T>(hidden, d_out.data);
    if constexpr (detail::is_weighted<Weighting>()) {
      if (d_weights.wanted()) {
        unpermute_backward(be_, plan, d_out, returned_view<T>(hidden), as_rows<T>(d_rows, rows, hidden), d_weights.view());
      } else {
        unpermute_backward<Weighting>(be_, plan, d_out, as_rows<T>(d_rows, rows, hidden));
      }
    } else {
      unpermute_backward<Weighting>(be_, plan, d_out, as_rows<T>(d_rows, rows, hidden));
    }
    be_.copy(d_home.data, home_tail<T>(d_rows, d_home, hidden, op, "d_home_rows"), home_rows() * hidden);
    return d_rows;
  }

  //! The smart schedule's exchanges: S_0 .. S_{n-1} (rows to the experts' ranks, pairwise steps),
  //! each followed by its compute on the worker; then R_0 .. R_{n-1} (results back), R_j as soon
  //! as step j's compute is done. Computes run one at a time, in order, after `compute_home`.
  template <class T, class ComputeHome, class Compute>
  void pipelined_exchange(char const* send, matrix_view<T> arrived, matrix_view<T> produced, char* returned,
                          ComputeHome& compute_home, Compute& compute, char const* op) {
    static_assert(std::is_same_v<Algorithm, smart_schedule>,
                  "moecomm::dispatcher: the pipelined calls need the smart_schedule algorithm");
    detail::check_rows(arrived, received_rows(), op, "arrived", "dispatcher.received_rows()");
    detail::check_rows(produced, received_rows(), op, "produced", "dispatcher.received_rows()");
    std::int32_t const group_size = algorithm_.group_size;
    detail::validate_group_size(op, group_size, ranks_);
    std::int32_t const me = groups_->world().rank(), steps = ranks_ / group_size;
    byte_matrix const& there = row_matrix(arrived.row_bytes(), forward_matrix_);
    back_matrix_.assign_transposed(there);
    byte_matrix const& back = back_matrix_;
    detail::copy_self_block(be_, there, me, send, arrived.data);
    if (!lane_) lane_ = std::make_unique<lane_t<Backend>>(be_);  // once: kept between steps
    lane_t<Backend>& lane = *lane_;
    Backend const& on = lane_backend(lane, be_);
    auto job = [&](std::int32_t unit) {  // unit 0: the home experts; unit j + 1: pairwise step j
      if (unit == 0) return compute_home(on);
      compute(detail::pairwise_source(me, group_size, steps, unit - 1), group_size, on);
    };
    lane.start(job, steps + 1);
    struct finish_job {  // on every exit, the lane lets go of `job` before it goes out of scope
      lane_t<Backend>& l;
      ~finish_job() { l.finish(); }
    } const finish{lane};
    lane.release(0);
    for (std::int32_t step = 0; step < steps; ++step) {
      detail::pairwise_step(group_size, *groups_, there, send, arrived.data, step, report_.exchange, exchange_scratch_);
      lane.release(step + 1);
    }
    for (std::int32_t step = 0; step < steps; ++step) {
      lane.wait(step + 1);  // rethrows the experts' failure
      if (step == 0) detail::copy_self_block(be_, back, me, produced.data, returned);
      // R_j returns to the group whose rows step j brought: pairwise step (n - j) mod n.
      detail::pairwise_step(group_size, *groups_, back, produced.data, returned, (steps - step) % steps, report_.exchange,
                            exchange_scratch_);
    }
  }

  //! Makes `chosen` the home experts: relabels them to sort after every other expert (so their
  //! rows form the permuted buffer's tail), rebuilds the plan on the relabeled routing, and takes
  //! their rows out of the exchange.
  void keep_home(home_subsets const& chosen) {
    char const* op = "dispatcher::route";
    std::int64_t const n = chosen.experts.size;
    home_.clear();
    for (std::int64_t i = 0; i < n; ++i) {  // checked before anything changes
      std::int32_t const e = chosen.experts.data[i];
      detail::require(e >= 0 && e < num_experts_, op, "home expert ", e, " is not an expert of ", num_experts_);
      detail::require(i == 0 || chosen.experts.data[i - 1] != e, op, "home expert ", e, " is named twice");
      detail::require(i == 0 || chosen.experts.data[i - 1] < e, op, "home experts must ascend: ", e, " comes after ",
                      chosen.experts.data[i - 1]);
    }
    bool const subsets = chosen.offsets.size > 0;
    if (subsets) {  // read below without further checks: every index must hold
      detail::require(chosen.offsets.size == n + 1, op, "home subsets have ", chosen.offsets.size, " offsets for ", n, " experts");
      detail::require(chosen.offsets.data[0] == 0 && chosen.offsets.data[n] == chosen.ranks.size, op,
                      "home subsets' offsets run from ", chosen.offsets.data[0], " to ", chosen.offsets.data[n], ", not from 0 to ",
                      chosen.ranks.size, " (the subset ranks)");
      for (std::int64_t i = 0; i < n; ++i) {
        std::int32_t const e = chosen.experts.data[i];
        detail::require(chosen.offsets.data[i] <= chosen.offsets.data[i + 1], op, "home subset offsets of expert ", e, " decrease");
        for (std::int32_t k = chosen.offsets.data[i]; k < chosen.offsets.data[i + 1]; ++k) {
          std::int32_t const r = chosen.ranks.data[k];
          detail::require(r >= 0 && r < ranks_ && r != e / local_experts_ && (k == chosen.offsets.data[i] || chosen.ranks.data[k - 1] < r), op,
                          "home subset of expert ", e, " names rank ", r, ": subsets hold ranks of the group, ascending, never the owner ",
                          e / local_experts_);
        }
      }
    }
    std::int32_t const me = groups_->world().rank();
    // Rank s computes its own rows of home expert i: its owner, and every rank or the subset's.
    auto const is_home = [&](std::int64_t i, std::int32_t s) {
      if (!subsets || s == chosen.experts.data[i] / local_experts_) return true;
      for (std::int32_t k = chosen.offsets.data[i]; k < chosen.offsets.data[i + 1]; ++k)
        if (chosen.ranks.data[k] == s) return true;
      return false;
    };
    for (std::int64_t i = 0; i < n; ++i)
      if (is_home(i, me)) home_.push_back(chosen.experts.data[i]);
    home_offsets_.assign(home_.size() + 1, 0);
    for (std::size_t i = 0; i < home_.size(); ++i) home_offsets_[i + 1] = home_offsets_[i] + rows_from(me, home_[i]);
    report_.home_rows = home_offsets_.back();
    if (n == 0) return;
    if (!home_.empty()) relabel_home_last();
    for (std::int32_t s = 0; s < ranks_; ++s)
      for (std::int64_t i = 0; i < n; ++i)
        if (is_home(i, s)) counts_[static_cast<std::size_t>(s) * num_experts_ + chosen.experts.data[i]] = 0;
    derive_local_counts();
  }

  //! The chooser of a `route` without home experts.
  //! Records the access width the row kernels will use on the caller's rows at `p` (the library's
  //! own buffers are 256-byte aligned), for `dispatch_report::row_access_bytes`.
  template <class T>
  void note_row_access(std::int64_t hidden, void const* p) {
    report_.row_access_bytes = std::min(report_.row_access_bytes, detail::row_access_bytes<T>(hidden, {p}));
  }

  struct no_home_experts {
    std::vector<std::int32_t> operator()(std::vector<std::int64_t> const&) const { return {}; }
  };

  void begin_route() {
    report_ = {};
    combined_ = false;
    home_.clear();
    routed_ = false;
  }

  //! The host tables, at their largest: counts by rank and expert, home experts, and one message per
  //! peer (a small step's exchange lists fewer).
  void reserve_tables() {
    auto const R = static_cast<std::size_t>(ranks_), E = static_cast<std::size_t>(num_experts_),
               L = static_cast<std::size_t>(local_experts_);
    counts_.reserve(R * E);
    gathered_.reserve(R * max_row_words());
    row_staging_.reserve(max_row_words());
    (void)status_words();
    chunk_counts_.reserve(R * L);
    receive_chunks_.reserve(R * L);
    local_offsets_.reserve(L + 1);
    rank_major_offsets_.reserve(R * L + 1);
    allowance_.reserve(R);
    for (std::vector<std::int32_t>* v : {&home_, &chosen_, &label_, &eager_home_.experts}) v->reserve(E);
    eager_home_.offsets.reserve(E + 1);
    eager_home_.ranks.reserve(E * R);
    chunk_tables_.reserve(be_, ranks_, local_experts_);
    home_offsets_.reserve(E + 1);
    exchange_scratch_.sends.reserve(R);
    exchange_scratch_.recvs.reserve(R);
  }

  //! True when the capacity policy pads every expert's block to C rows.
  [[nodiscard]] bool capacity_pads() const {
    if constexpr (detail::is_dropless_v<Capacity> || detail::is_receiver_budget_v<Capacity>) return false;
    else return capacity_.pad_to_capacity;
  }

  //! `reserve`'s plans: what `route` builds for `largest` (capacity C, `received` rows arriving), and
  //! the relabeling of home experts, once, so that their arrays and scratch have the largest size.
  void reserve_plans(routing_view const& largest, std::int64_t capacity, std::int64_t received, std::int64_t row_bytes) {
    std::int64_t const slots = largest.num_tokens * largest.top_k;
    build_permute_plan(be_, largest, num_experts_, dropless_plan(), scratch_, unchecked_routing);
    if constexpr (!detail::is_dropless_v<Capacity>) {
      array_view<std::int32_t> const kept_idx{grow(be_, kept_idx_, slots).data(), slots};
      if constexpr (detail::is_receiver_budget_v<Capacity>) be_.copy(kept_idx.data, largest.topk_idx, slots);
      else (void)drop_to_capacity(be_, dropless_plan_, capacity, kept_idx, scratch_, capacity_.rule, 0);
      routing_view kept = largest;
      kept.topk_idx = kept_idx.data;
      build_kept_permute_plan(be_, dropless_plan_, kept, plan_, scratch_, unchecked_routing, capacity_pads() ? capacity : 0);
    }
    grow(be_, relabeled_idx_, slots);
    grow(be_, home_label_, num_experts_);
    label_.resize(static_cast<std::size_t>(num_experts_));
    for (std::int32_t e = 0; e < num_experts_; ++e) label_[static_cast<std::size_t>(e)] = e;
    relabel_permute_plan(be_, plan_, plan_.routing(), array_view<std::int32_t const>(label_), scratch_);
    if constexpr (deduplicated) dedup_.reserve(be_, largest, num_experts_, *groups_, received, row_bytes, scratch_);
  }

  //! Where `route` puts the routing's dropless plan: the step's plan itself when nothing is dropped.
  permute_plan<Backend>& dropless_plan() {
    if constexpr (detail::is_dropless_v<Capacity>) return plan_;
    else return dropless_plan_;
  }

  //! The capacity policy on the dropless plan, the count exchange and the home experts; `deferred`:
  //! the dropless plan is from `enqueue_permute_plan`, completed by the first all-gather.
  template <class ChooseHome>
  void finish_route(ChooseHome&& choose_home, bool deferred) {
    bool const pending = apply_capacity(deferred);
    routing_view const kept = plan_.routing();  // before keep_home relabels it
    // Without home experts the deduplicated rows' counts ride on the count exchange; with them they
    // depend on the choice, made from the counts, and take an all-gather of their own.
    constexpr bool counts_ride_along = deduplicated && std::is_same_v<std::decay_t<ChooseHome>, no_home_experts>;
    if constexpr (counts_ride_along) dedup_.enqueue_source(be_, kept, num_experts_, *groups_, scratch_);
    exchange_counts(plan_, counts_ride_along, pending, pending && detail::is_dropless_v<Capacity>);
    if constexpr (detail::is_dropless_v<Capacity> || detail::is_receiver_budget_v<Capacity>) {
      report_.kept_slots = plan_.num_rows();
      report_.dropped_slots = dropless_plan().num_rows() - report_.kept_slots;
    }
    decltype(auto) chosen = choose_home(counts_);
    if constexpr (std::is_same_v<std::decay_t<decltype(chosen)>, home_subsets>) {
      keep_home(chosen);
      eager_home_.keep(chosen);
    } else {  // on every rank, in any order
      chosen_.assign(chosen.begin(), chosen.end());  // capacity kept between steps
      std::sort(chosen_.begin(), chosen_.end());
      keep_home(home_subsets{array_view<std::int32_t const>(chosen_), {}, {}});
      eager_home_.keep(home_subsets{array_view<std::int32_t const>(chosen_), {}, {}});
    }
    if constexpr (deduplicated) {
      if constexpr (!counts_ride_along) {
        dedup_.build_source(be_, kept, home_, num_experts_, *groups_, scratch_);
        dedup_.gather_counts(be_, *groups_);
      }
      receive_chunks_.resize(chunk_counts_.size());  // [L][R]: the receive map's ids are l * R + s
      for (std::int32_t s = 0; s < ranks_; ++s)
        for (std::int32_t l = 0; l < local_experts_; ++l)
          receive_chunks_[static_cast<std::size_t>(l) * ranks_ + s] = chunk_counts_[static_cast<std::size_t>(s) * local_experts_ + l];
      // The receive map takes its sizes from these counts: its rows are received_rows() by construction.
      dedup_.build_receive(be_, *groups_, plan_.padded_capacity(), algorithm_, report_.slot_metadata, exchange_scratch_, scratch_,
                           receive_chunks_.data());
    }
    routed_ = true;
  }

  //! Throws `capture_blocker`'s reason, naming `op`, unless it is empty.
  void refuse_capture_unless_capturable(char const* op) const {
    std::string const why = capture_blocker();
    if (!why.empty())
      detail::fail(status::invalid_usage, "dispatcher::", op, " was called while the back-end's stream captures a CUDA graph, but "
                   "this step is not capturable: ", why);
  }

  //! `route` while the back-end's stream captures a CUDA graph (a padded capacity policy; checked by
  //! the caller): no host wait, no read of device memory. The capacity and drop_random's first token
  //! are those the ranks agreed on in the eager route before the capture (of the same shape); every
  //! expert's block is C rows, so every count is C and none is exchanged. The value scan's verdict
  //! stays on the device (`check_captured_routing`); an id out of range is masked meanwhile. The home
  //! experts are the eager route's (FasterMoE's shadowing without a change of its choice).
  void route_captured(routing_view const& routing) {
    char const* op = "dispatcher::route";
    if constexpr (!detail::is_dropless_v<Capacity> && !detail::is_receiver_budget_v<Capacity>) {
      if (agreed_.tokens < 0)
        detail::fail(status::invalid_usage, op, "a captured route replays the capacity agreed in an eager route of the same shape, "
                     "and there was none: run one eager step first on every rank (as CUDA graphs are captured after a warm-up step)");
      detail::require(routing.num_tokens == agreed_.tokens && routing.top_k == agreed_.top_k, op, "argument 'routing' has ",
                      routing.num_tokens, " tokens x top_k ", routing.top_k, "; the eager route before the capture had ", agreed_.tokens,
                      " x ", agreed_.top_k, ", whose capacity a captured step replays: capture after an eager step of the same shape");
      detail::enqueue_permute_plan(be_, routing, num_experts_, dropless_plan_, scratch_, checks_, status_words());
      std::int64_t const slots = routing.num_tokens * routing.top_k;
      array_view<std::int32_t> const kept_idx{grow(be_, kept_idx_, slots).data(), slots};
      detail::enqueue_drop_to_capacity(be_, dropless_plan_, agreed_.capacity, kept_idx, scratch_, capacity_.rule, agreed_.first_token);
      routing_view kept = routing;
      kept.topk_idx = kept_idx.data;
      detail::enqueue_kept_permute_plan(be_, dropless_plan_, kept, plan_, scratch_, agreed_.capacity);
      counts_.assign(static_cast<std::size_t>(ranks_) * num_experts_, agreed_.capacity);
      derive_local_counts();
      keep_home(home_subsets{array_view<std::int32_t const>(eager_home_.experts), array_view<std::int32_t const>(eager_home_.offsets),
                             array_view<std::int32_t const>(eager_home_.ranks)});
      report_.capacity = agreed_.capacity;
      report_.kept_slots = report_.dropped_slots = -1;  // on the device only
      routed_ = true;
    }
  }

  //! The algorithm's name, with its inner algorithm's for `dedup_per_rank<Inner>` and its pieces for
  //! `dedup_per_node` (ranks must agree on both).
  [[nodiscard]] std::string algorithm_label() const {
    if constexpr (std::is_same_v<Algorithm, dedup_per_node>) return detail::concat(Algorithm::name, "{pieces = ", algorithm_.pieces, "}");
    else if constexpr (detail::is_dedup_v<Algorithm>) return detail::concat(Algorithm::name, "<", decltype(Algorithm::inner)::name, ">");
    else return Algorithm::name;
  }
  //! The widest row `gather_row` gathers: a head, E counts, R dedup counts, `dedup_per_node`'s
  //! piece counts, top_k and the two status words.
  [[nodiscard]] std::size_t max_row_words() const {
    std::size_t pieces = 0;
    if constexpr (std::is_same_v<Algorithm, dedup_per_node>) pieces = static_cast<std::size_t>(dedup_.piece_words(ranks_));
    return max_head_words + static_cast<std::size_t>(num_experts_) + static_cast<std::size_t>(ranks_) + pieces + 3;
  }

  //! With a deduplicated exchange, every rank routes with the same top_k: a receiver reads each
  //! source's slot lists with its own. `gathered` holds every rank's top_k every `width` words from
  //! word `at`; every rank judges them alike.
  void check_same_top_k(std::int64_t const* gathered, std::int64_t width, std::int64_t at) const {
    for (std::int32_t s = 1; s < ranks_; ++s)
      if (gathered[s * width + at] != gathered[at])
        detail::fail(status::invalid_usage, "dispatcher::route", "rank 0 routes with routing.top_k = ", gathered[at], ", but rank ", s,
                     " with routing.top_k = ", gathered[s * width + at], ": the deduplicated exchange (", algorithm_label(),
                     ") needs the same top_k on every rank (each token's slot list has top_k entries); flat, hierarchical_2d "
                     "and pairwise accept a top_k per rank");
  }

  //! `plan_` from the dropless plan: the kept slots' plan, derived without a second sort. Returns
  //! whether `plan_`'s host side waits for the count exchange (`gather_row`'s `complete`): the
  //! dropless plan itself when `deferred`, an unpadded kept plan always.
  bool apply_capacity(bool deferred) {
    if constexpr (detail::is_dropless_v<Capacity>) {
      return deferred;
    } else if constexpr (detail::is_receiver_budget_v<Capacity>) {
      detail::require(capacity_.rows_per_rank >= 0, "dispatcher::route", "receiver_budget.rows_per_rank = ",
                      capacity_.rows_per_rank, " is negative");
      routing_view const& routing = dropless_plan_.routing();
      exchange_counts(dropless_plan_, false, deferred, deferred);  // the dropless counts of every rank
      receiver_prefix_allowance();
      std::int64_t* const allowed = scratch_.template get<std::int64_t>(be_, ranks_);
      be_.copy(allowed, allowance_.data(), ranks_);
      std::int64_t const slots = routing.num_tokens * routing.top_k;
      std::int32_t* const kept_idx = grow(be_, kept_idx_, slots).data();
      be_.for_each_index(slots, detail::keep_receiver_prefix{routing.topk_idx, dropless_plan_.row_of(),
                                                             dropless_plan_.expert_offsets(), allowed, local_experts_, kept_idx});
      routing_view kept = routing;
      kept.topk_idx = kept_idx;
      detail::enqueue_kept_permute_plan(be_, dropless_plan_, kept, plan_, scratch_, 0);  // a masking by construction
      report_.capacity = capacity_.rows_per_rank;
      return true;
    } else {
      char const* op = "dispatcher::route";
      validate_capacity_policy(capacity_, op);
      routing_view const& routing = dropless_plan_.routing();
      // One all-gather: the capacity agreement, the tokens before this rank (drop_random's counter),
      // and the dropless plan's counts and value scan.
      std::int64_t head[max_head_words];
      detail::write_capacity_fields(capacity_, expert_capacity(routing.num_tokens, routing.top_k, num_experts_, capacity_.factor,
                                                               capacity_.min_capacity), head);
      head[detail::capacity_fields] = routing.num_tokens;
      std::int64_t const width = gather_row({head, max_head_words}, dropless_plan_, false, deferred, deferred);
      std::int64_t const c = detail::agreed_capacity(gathered_.data(), width, ranks_, op);
      std::int64_t first_token = 0;  // the tokens of the ranks before this one
      if constexpr (std::is_same_v<decltype(capacity_.rule), drop_random>)
        for (std::int32_t s = 0; s < groups_->world().rank(); ++s)
          first_token += gathered_[static_cast<std::size_t>(s * width + detail::capacity_fields)];
      report_.capacity = c;
      agreed_ = {routing.num_tokens, routing.top_k, c, first_token};
      std::int64_t const slots = routing.num_tokens * routing.top_k;
      array_view<std::int32_t> const kept_idx{grow(be_, kept_idx_, slots).data(), slots};
      detail::enqueue_drop_to_capacity(be_, dropless_plan_, c, kept_idx, scratch_, capacity_.rule, first_token);
      routing_view kept = routing;
      kept.topk_idx = kept_idx.data;
      detail::enqueue_kept_permute_plan(be_, dropless_plan_, kept, plan_, scratch_, capacity_.pad_to_capacity ? c : 0);
      // Every rule keeps the first C of each expert's slots (by its order): min(n_e, C) of them.
      std::int32_t const* const offsets = dropless_plan_.host_expert_offsets().data;
      for (std::int32_t e = 0; e < num_experts_; ++e) report_.kept_slots += std::min<std::int64_t>(offsets[e + 1] - offsets[e], c);
      report_.dropped_slots = dropless_plan_.num_rows() - report_.kept_slots;
      return plan_.padded_capacity() == 0;  // padded to C > 0, the plan is whole already
    }
  }

  //! This rank's plan with its home experts' rows moved after the others (their rows skip the exchange).
  void relabel_home_last() {
    label_.resize(static_cast<std::size_t>(num_experts_));  // capacity kept between steps
    std::int32_t next = 0;
    for (std::int32_t pass = 0; pass < 2; ++pass)  // others first, then home experts, each ascending
      for (std::int32_t e = 0; e < num_experts_; ++e)
        if (std::binary_search(home_.begin(), home_.end(), e) == (pass == 1)) label_[static_cast<std::size_t>(e)] = next++;
    routing_view relabeled = plan_.routing();
    std::int64_t const slots = relabeled.num_tokens * relabeled.top_k;
    bool const captured = detail::capturing(be_);
    std::int32_t* const device_label = grow(be_, home_label_, num_experts_).data();
    // A captured route keeps the eager route's home experts, whose labels are on the device already.
    if (!captured) be_.copy(device_label, label_.data(), num_experts_);
    std::int32_t* const relabeled_idx = grow(be_, relabeled_idx_, slots).data();
    be_.for_each_index(slots, detail::relabel_experts{relabeled.topk_idx, device_label, num_experts_, relabeled_idx});
    relabeled.topk_idx = relabeled_idx;
    // Either moves blocks (no second sort); a captured plan is padded and moves them on the device alone.
    if (captured) detail::relabel_padded_plan(be_, plan_, relabeled, device_label, scratch_);
    else relabel_permute_plan(be_, plan_, relabeled, array_view<std::int32_t const>(label_), scratch_);
  }

  //! `slot`, grown to hold `rows` rows of T: the dispatcher's row buffers are kept between steps.
  template <class T>
  bytes_t& rows_buffer(bytes_t& slot, std::int64_t rows, std::int64_t hidden) const {
    return grow(be_, slot, rows * hidden * static_cast<std::int64_t>(sizeof(T)));
  }

  //! Rows of T over a byte buffer (its memory comes from the allocator, aligned for any T).
  template <class T>
  static matrix_view<T> as_rows(bytes_t& b, std::int64_t rows, std::int64_t hidden) {
    return {reinterpret_cast<T*>(b.data()), rows, hidden};
  }

  template <class T>
  matrix_view<T const> returned_view(std::int64_t hidden) const {
    return {reinterpret_cast<T const*>(returned_.data()), source_plan().num_rows(), hidden};
  }

  //! The plan of this rank's own rows: the routing's (one row per kept slot), or with dedup the
  //! source plan (one row per token and destination rank, then the home rows).
  [[nodiscard]] permute_plan<Backend> const& source_plan() const {
    if constexpr (deduplicated) return dedup_.source();
    else return plan_;
  }

  //! Receiver budget: `allowance_[d]`, the rows this rank may send each rank d, after the ranks before it took theirs.
  void receiver_prefix_allowance() {
    std::int32_t const me = groups_->world().rank();
    allowance_.resize(static_cast<std::size_t>(ranks_));  // capacity kept between steps
    for (std::int32_t d = 0; d < ranks_; ++d) {
      std::int64_t before = 0, mine = 0;
      for (std::int32_t l = 0; l < local_experts_; ++l) {
        for (std::int32_t s = 0; s < me; ++s) before += rows_from(s, d * local_experts_ + l);
        mine += rows_from(me, d * local_experts_ + l);
      }
      std::int64_t const left = capacity_.rows_per_rank - before;
      allowance_[static_cast<std::size_t>(d)] = left < 0 ? 0 : (left < mine ? left : mine);
    }
  }

  //! One all-gather of a row per rank, packed on the device (`detail::pack_count_row`): `head` (host
  //! values), `plan`'s E counts, with `with_dedup_counts` the deduplicated exchange's counts, and the
  //! verdict words; `gathered_` holds `[R][width]`, the width is returned. With `complete`, `plan`'s
  //! host side (from `enqueue_permute_plan` or `enqueue_kept_permute_plan`) is completed from this
  //! rank's counts; with `verdict`, its value scan rides along, and every rank learns whether any
  //! routing was bad, so that all raise (the bad rank its own error, the others `aborted` naming it)
  //! and none waits for rows that will never come.
  std::int64_t gather_row(array_view<std::int64_t const> head, permute_plan<Backend>& plan, bool with_dedup_counts, bool complete,
                          bool verdict) {
    detail::require(complete || plan.host_expert_offsets().size == num_experts_ + 1, "dispatcher::route", "the plan holds ",
                    plan.host_expert_offsets().size, " host offsets for ", num_experts_, " experts (was it built?)");
    routing_view const& routing = plan.routing();
    std::int64_t* const scan = status_words();  // what the plan's value scan left
    std::int32_t const* piece_rows = nullptr;
    std::int64_t piece_words = 0;
    if constexpr (std::is_same_v<Algorithm, dedup_per_node>)
      if (with_dedup_counts) piece_rows = dedup_.piece_rows(), piece_words = dedup_.piece_words(ranks_);
    std::int64_t* const row = scan + 2;
    detail::pack_count_row const pack{plan.expert_offsets(), num_experts_, with_dedup_counts ? dedup_.source_offsets() : nullptr,
                                      piece_rows, piece_words, with_dedup_counts ? ranks_ : 0, deduplicated ? routing.top_k : -1,
                                      verdict ? scan : nullptr, routing.num_tokens * routing.top_k, row + head.size};
    std::int64_t const width = head.size + pack.words();
    if (head.size > 0) be_.copy(row, head.data, head.size);  // from pageable memory: read when the copy is enqueued
    be_.for_each_index(pack.words(), pack);
    row_staging_.resize(static_cast<std::size_t>(width));
    gathered_.assign(static_cast<std::size_t>(ranks_ * width), 0);
    allgather_to_host(groups_->world(), be_, row, gathered_.data(), width * static_cast<std::int64_t>(sizeof(std::int64_t)),
                      row_staging_.data());
    std::int64_t const* const my_row = gathered_.data() + groups_->world().rank() * width;
    if (complete) detail::complete_permute_plan(be_, plan, my_row + head.size, my_row[width - 2], my_row[width - 1]);
    for (std::int32_t s = 0; s < ranks_; ++s)
      if (std::int64_t const bad = gathered_[static_cast<std::size_t>(s * width + width - 2)]; bad >= 0)
        detail::fail(status::aborted, "dispatcher::route", "rank ", s, "'s routing is invalid at slot ", bad,
                     " of its topk_idx (flattened); that rank's error names the token, the slot and the value. No rows were exchanged");
    return width;
  }

  //! Every rank learns the rows every rank sends every expert in `plan` (one all-gather of E counts),
  //! and with `with_dedup_counts` the rows of the deduplicated exchange it sends each rank (R more):
  //! `gather_row` without a head. The count exchange: the receive sizes of every exchange.
  void exchange_counts(permute_plan<Backend>& plan, bool with_dedup_counts, bool complete, bool verdict) {
    std::int64_t const width = gather_row({}, plan, with_dedup_counts, complete, verdict);
    if constexpr (deduplicated) check_same_top_k(gathered_.data(), width, width - 3);
    counts_.resize(static_cast<std::size_t>(ranks_) * num_experts_);
    for (std::int32_t s = 0; s < ranks_; ++s)
      std::copy_n(gathered_.begin() + s * width, num_experts_, counts_.begin() + static_cast<std::ptrdiff_t>(s) * num_experts_);
    if (with_dedup_counts) dedup_.take_counts(be_, gathered_.data() + num_experts_, width, *groups_);
    derive_local_counts();
  }

  //! This rank's receive counts and expert offsets, from `counts_`.
  void derive_local_counts() {
    std::int32_t const me = groups_->world().rank();
    chunk_counts_.assign(static_cast<std::size_t>(ranks_) * local_experts_, 0);
    local_offsets_.assign(static_cast<std::size_t>(local_experts_) + 1, 0);
    for (std::int32_t s = 0; s < ranks_; ++s)
      for (std::int32_t l = 0; l < local_experts_; ++l) {
        std::int64_t const n = rows_from(s, me * local_experts_ + l);
        detail::require(n <= std::numeric_limits<std::int32_t>::max(), "dispatcher::route", "rank ", s, " sends ", n,
                        " rows to expert ", me * local_experts_ + l, ", beyond int32 row ids");
        chunk_counts_[static_cast<std::size_t>(s) * local_experts_ + l] = static_cast<std::int32_t>(n);
        local_offsets_[static_cast<std::size_t>(l) + 1] += n;
      }
    for (std::int32_t l = 0; l < local_experts_; ++l)
      local_offsets_[static_cast<std::size_t>(l) + 1] += local_offsets_[static_cast<std::size_t>(l)];
    rank_major_offsets_.assign(chunk_counts_.size() + 1, 0);
    for (std::size_t i = 0; i < chunk_counts_.size(); ++i) rank_major_offsets_[i + 1] = rank_major_offsets_[i] + chunk_counts_[i];
    report_.received_rows = local_offsets_.back();
  }

  [[nodiscard]] array_view<std::int32_t const> chunk_counts() const {
    return {chunk_counts_.data(), static_cast<std::int64_t>(chunk_counts_.size())};
  }

  //! Bytes rank s sends rank d, for rows of `row_bytes`, in `m` (its memory kept between steps).
  byte_matrix& row_matrix(std::int64_t row_bytes, byte_matrix& m) const {
    m.assign_zeros(ranks_);
    for (std::int32_t s = 0; s < ranks_; ++s)
      for (std::int32_t e = 0; e < num_experts_; ++e) m.add(s, e / local_experts_, rows_from(s, e) * row_bytes);
    return m;
  }

  //! Permuted rows at this rank -> expert-major rows at the experts' ranks.
  template <class T>
  void exchange_forward(char const* permuted, matrix_view<T> expert_rows, char const* op) {
    detail::check_rows(expert_rows, received_rows(), op, "expert_rows", "dispatcher.received_rows()");
    std::int64_t const row_bytes = expert_rows.row_bytes();
    bytes_t& arrived = rows_buffer<T>(arrived_, received_rows(), expert_rows.hidden);
    byte_matrix const& m = row_matrix(row_bytes, forward_matrix_);
    alltoallv(be_, *groups_, m, array_view<char const>{permuted, m.send_total(groups_->world().rank())},
              array_view<char>{arrived.data(), arrived.size()}, report_.exchange, exchange_scratch_, algorithm_);
    sort_chunks(be_, matrix_view<T const>(as_rows<T>(arrived, received_rows(), expert_rows.hidden)), chunk_counts(), ranks_,
                local_experts_, expert_rows, chunk_tables_, scratch_, chunk_order::rank_major_to_expert_major);
  }

  //! Expert-major rows at the experts' ranks -> permuted rows back at their source rank, in `back`.
  template <class T>
  bytes_t& exchange_back(matrix_view<std::add_const_t<T>> expert_rows, bytes_t& back, char const* op) {
    detail::check_rows(expert_rows, received_rows(), op, "expert_rows", "dispatcher.received_rows()");
    std::int64_t const hidden = expert_rows.hidden;
    bytes_t& rank_major = rows_buffer<T>(rank_major_, received_rows(), hidden);
    sort_chunks(be_, matrix_view<T const>{expert_rows.data, received_rows(), hidden}, chunk_counts(), ranks_,
                local_experts_, as_rows<T>(rank_major, received_rows(), hidden), chunk_tables_, scratch_,
                chunk_order::expert_major_to_rank_major);
    rows_buffer<T>(back, plan_.num_rows(), hidden);
    back_matrix_.assign_transposed(row_matrix(hidden * static_cast<std::int64_t>(sizeof(T)), forward_matrix_));
    alltoallv(be_, *groups_, back_matrix_, array_view<char const>{rank_major.data(), rank_major.size()},
              array_view<char>{back.data(), back.size()}, report_.exchange, exchange_scratch_, algorithm_);
    return back;
  }

  // ---- dedup_per_rank (semantics §10a): one row per (token, destination rank) on the wire
  //! This rank's source rows (`sent`, in source-plan order) -> the rows it receives, by source rank.
  template <class T>
  matrix_view<T const> dedup_arrivals(char const* sent, std::int64_t hidden) {
    std::int64_t const rows = dedup_.received_rows();
    bytes_t& arrived = rows_buffer<T>(arrived_, rows, hidden);
    dedup_.template forward_rows<T>(be_, *groups_, algorithm_, sent, arrived.data(), hidden, report_.exchange, exchange_scratch_);
    return as_rows<T>(arrived, rows, hidden);
  }

  //! The experts' rows -> each received row's sum over its local slots (`Sum`: weighted or not, in
  //! slot order) -> back at the source, in `back` (source-plan order; the home rows are the caller's).
  template <class Sum, class T>
  bytes_t& dedup_exchange_back(matrix_view<std::add_const_t<T>> expert_rows, bytes_t& back, char const* op, char const* name) {
    detail::check_rows(expert_rows, received_rows(), op, name, "dispatcher.received_rows()");
    std::int64_t const hidden = expert_rows.hidden, rows = dedup_.received_rows();
    bytes_t& sums = rows_buffer<T>(rank_major_, rows, hidden);
    unpermute<Sum>(be_, dedup_.receive(), expert_rows, as_rows<T>(sums, rows, hidden));
    rows_buffer<T>(back, source_plan().num_rows(), hidden);
    dedup_.template return_rows<T>(be_, *groups_, algorithm_, sums.data(), back.data(), hidden, report_.exchange, exchange_scratch_);
    return back;
  }

  //! The combine's backward past the source: each token's gradient row once per destination, spread
  //! there over its local slots (weighted), and the receivers' dots returned for the weight
  //! gradient. The dots travel whenever the combine was weighted and ran, so every rank takes part
  //! whether or not it wants `d_weights` (whose home slots `combine_gradient_rows` already holds).
  template <class Weighting, class T>
  void dedup_combine_backward(char const* d_rows, matrix_view<T> d_expert_rows, optional_output<array_view<float>> d_weights) {
    char const* op = "combine_backward";
    detail::check_rows(d_expert_rows, received_rows(), op, "d_expert_rows", "dispatcher.received_rows()");
    std::int64_t const hidden = d_expert_rows.hidden;
    matrix_view<T const> const arrived = dedup_arrivals<T>(d_rows, hidden);
    permute_plan<Backend> const& receive = dedup_.receive();
    if constexpr (detail::is_weighted<Weighting>()) {
      if (combined_) {
        matrix_view<T const> const y{static_cast<T const*>(combined_rows_), received_rows(), hidden};
        std::int64_t const slots = receive.routing().num_tokens * receive.routing().top_k;
        unpermute_backward(be_, receive, arrived, y, d_expert_rows, array_view<float>{dedup_.receiver_weight_grads(be_), slots});
        float* const wanted = d_weights.wanted() ? d_weights.view().data : nullptr;
        [[maybe_unused]] auto const control = detail::payload_scope(be_, detail::payload_kind::control);  // K floats a row, whatever H
        dedup_.return_weight_grads(be_, *groups_, algorithm_, report_.slot_metadata, exchange_scratch_, wanted,
                                   array_view<float>{wanted, wanted != nullptr ? d_weights.view().size : 0});
        return;
      }
    }
    unpermute_backward<Weighting>(be_, receive, arrived, d_expert_rows);
  }

  Backend be_;
  exchange_groups<Comm>* groups_;
  Capacity capacity_;
  Algorithm algorithm_;
  routing_checks checks_;
  std::int32_t num_experts_, ranks_, local_experts_ = 1;
  typename Backend::template buffer_type<std::int32_t> kept_idx_;       //!< the kept routing's ids
  typename Backend::template buffer_type<std::int32_t> relabeled_idx_;  //!< home experts sorted last
  typename Backend::template buffer_type<std::int32_t> home_label_;     //!< [E] their relabeling, on the device
  workspace<Backend> scratch_;  //!< the steps' small tables (scores, labels), kept between steps
  chunk_tables<Backend> chunk_tables_;  //!< the exchange's chunk tables of the last counts (`sort_chunks`)
  alltoall_workspace<Backend> exchange_scratch_;  //!< the all-to-alls' staging and message lists
  std::vector<std::int32_t> label_;  //!< keep_home's relabeling, kept between steps
  std::unique_ptr<lane_t<Backend>> lane_;  //!< the smart schedule's compute lane, made once
  byte_matrix forward_matrix_, back_matrix_;       //!< the step's byte matrices, memory kept between steps
  permute_plan<Backend> plan_;           //!< this step's plan, rebuilt in place each step
  permute_plan<Backend> dropless_plan_;  //!< the capacity policies' plan before dropping
  std::vector<std::int64_t> allowance_;  //!< receiver budget: rows this rank may send each rank
  bool routed_ = false;                  //!< `route` succeeded: plan_ is this step's
  std::vector<std::int64_t> counts_;        //!< [R][E] rows each rank sends each expert
  std::vector<std::int64_t> row_staging_;   //!< the count row read back, for a communicator that gathers host memory
  std::vector<std::int64_t> gathered_;      //!< [R][width] the all-gather of every rank's count row
  //! [2 status words of a deferred plan][the count row]: device memory, sized once (`status_words`)
  typename Backend::template buffer_type<std::int64_t> count_row_;
  std::vector<std::int32_t> chunk_counts_;  //!< [R][L] rows each rank sends each of my experts
  std::vector<std::int64_t> receive_chunks_;  //!< dedup: chunk_counts_ as [L][R], the receive map's sizes
  std::vector<std::int64_t> local_offsets_;
  std::vector<std::int64_t> rank_major_offsets_;  //!< [R * L + 1] prefix of chunk_counts_
  std::vector<std::int32_t> home_;           //!< this rank's home experts, ascending
  std::vector<std::int32_t> chosen_;         //!< a chooser's vector, sorted
  //! The last eager route's choice of home experts (every rank's), which a captured route keeps.
  struct kept_home_choice {
    std::vector<std::int32_t> experts, offsets, ranks;
    void keep(home_subsets const& chosen) {
      experts.assign(chosen.experts.data, chosen.experts.data + chosen.experts.size);
      offsets.assign(chosen.offsets.data, chosen.offsets.data + chosen.offsets.size);
      ranks.assign(chosen.ranks.data, chosen.ranks.data + chosen.ranks.size);
    }
  } eager_home_;
  std::vector<std::int64_t> home_offsets_;   //!< [home_.size() + 1] rows of each home expert
  // Row buffers kept between steps (they only grow): this rank's permuted rows (then their
  // gradient), arrivals and rank-major staging of the exchanges, the combine's returned rows (kept
  // for combine_backward's weight gradient), and the returned gradient rows.
  bytes_t sent_, arrived_, rank_major_, returned_, d_back_;
  void const* combined_rows_ = nullptr;  //!< dedup: the combine's `expert_rows`, for the weight gradient's dots
  //! dedup: this routing's source and receive plans (per node: through the relays)
  std::conditional_t<std::is_same_v<Algorithm, dedup_per_node>, dedup_node_plan<Backend>, dedup_plan<Backend>> dedup_;
  bool combined_ = false;  //!< returned_ holds this routing's combine
  //! The last eager capacity route's shape and agreement, which a captured route replays.
  struct agreement {
    std::int64_t tokens = -1;  //!< -1: no eager capacity route yet
    std::int32_t top_k = 0;
    std::int64_t capacity = 0, first_token = 0;
  } agreed_;
  dispatch_report report_;
};

MOECOMM_NAMESPACE_END
