// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `expert_parallel_layer`: expert parallelism (DeepSpeed-MoE / Megatron-LM style): dispatch ->
//! the user's experts -> combine, and the backward, over any back-end, communicator, capacity
//! policy and all-to-all algorithm; with `fastermoe_shadowing` (patterns/fastermoe.hpp) as the
//! shadowing policy it becomes FasterMoE's layer.

#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/step_bounds.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/rows/unpermute.hpp>
#include <moecomm/patterns/experts.hpp>
#include <moecomm/patterns/layer_arguments.hpp>
#include <moecomm/patterns/layer_steps.hpp>
#include <moecomm/patterns/policy_kinds.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
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
//! `hierarchical_2d`, `pairwise` or `smart_schedule` (pairwise, with the experts' work overlapping
//! the exchanges, on a worker thread), or `dedup_per_rank<flat | hierarchical_2d | pairwise>` (each
//! token sent once per destination rank, semantics §10a) or `dedup_per_node` (once per destination
//! node); @tparam Weighting `weighted` (weights applied at combine) or
//! `unweighted`; @tparam Shadowing `no_shadowing` or `fastermoe_shadowing<Path>`, which needs
//! parametric experts.
//!
//! Experts see `matrix_view`s of their rows in the back-end's memory. Local expert `l` of rank `r`
//! is global expert `r * E / R + l`.
template <class T, class Backend, class Comm, class Capacity = dropless, class Algorithm = flat,
          class Weighting = weighted, class Shadowing = no_shadowing>
class expert_parallel_layer : public detail::layer_mode {
  // The positional form checks each policy's kind (patterns/policy_kinds.hpp); the first one out of
  // place is the one error (the layer builds with the defaults there, so nothing else fails).
  static_assert(detail::is_kind<is_capacity_policy, Capacity>,
                "moecomm::expert_parallel_layer<T, Backend, Comm, Capacity, Algorithm, Weighting, Shadowing>: the 4th "
                "argument must be a capacity policy (dropless, capacity<Rule>, receiver_budget). For policies in any "
                "order, use make_expert_parallel_layer");
  static_assert(!detail::is_kind<is_capacity_policy, Capacity> || detail::is_kind<is_alltoall_algorithm, Algorithm>,
                "moecomm::expert_parallel_layer<T, Backend, Comm, Capacity, Algorithm, Weighting, Shadowing>: the 5th "
                "argument must be an all-to-all algorithm (flat, hierarchical_2d, pairwise, smart_schedule, dedup_per_rank<...>, dedup_per_node). For "
                "policies in any order, use make_expert_parallel_layer");
  static_assert(!detail::is_kind<is_capacity_policy, Capacity> || !detail::is_kind<is_alltoall_algorithm, Algorithm> ||
                    detail::is_kind<is_weighting_policy, Weighting>,
                "moecomm::expert_parallel_layer<T, Backend, Comm, Capacity, Algorithm, Weighting, Shadowing>: the 6th "
                "argument must be a weighting policy (weighted, unweighted). For policies in any order, use "
                "make_expert_parallel_layer");
  static_assert(!detail::is_kind<is_capacity_policy, Capacity> || !detail::is_kind<is_alltoall_algorithm, Algorithm> ||
                    !detail::is_kind<is_weighting_policy, Weighting> || detail::is_kind<is_shadowing_policy, Shadowing>,
                "moecomm::expert_parallel_layer<T, Backend, Comm, Capacity, Algorithm, Weighting, Shadowing>: the 7th "
                "argument must be a shadowing policy (no_shadowing, fastermoe_shadowing<...>). For policies in any "
                "order, use make_expert_parallel_layer");
  using capacity_t = detail::policy_or_default_t<is_capacity_policy, Capacity, dropless>;
  using algorithm_t = detail::policy_or_default_t<is_alltoall_algorithm, Algorithm, flat>;
  using weighting_t = detail::policy_or_default_t<is_weighting_policy, Weighting, weighted>;
  using shadowing_t = detail::policy_or_default_t<is_shadowing_policy, Shadowing, no_shadowing>;
 public:
  expert_parallel_layer(Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, std::int64_t hidden,
                        Capacity capacity = {}, Algorithm algorithm = {}, routing_checks checks = {},
                        Shadowing shadowing = {})
      : detail::layer_mode(groups.world(), "expert_parallel_layer"),
        dispatcher_(be, agreed(groups, num_experts, hidden), num_experts, detail::policy_or_default<capacity_t>(capacity),
                    detail::policy_or_default<algorithm_t>(algorithm), checks),
        shadow_(detail::policy_or_default<shadowing_t>(shadowing), be, groups, num_experts, hidden),
        hidden_(hidden) {}

  //! `out[t] = combine over t's kept slots of expert(e)(x[t])`. Collective. `routing` and `x` must
  //! stay alive and unchanged until `backward` is done.
  //! @param x `[>= T][hidden]` this rank's token rows (T = `routing.num_tokens`).
  //! @param out `[>= T][hidden]`; written only once every exchange has succeeded.
  //! @throws error (invalid_argument) naming the argument, before any communication.
  template <class Experts>
  void forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts&& experts) {
    // The interface is checked member by member; only the first mistake is reported.
    if constexpr (detail::check_experts<T, Backend, Experts, shadowing_t::shadows, false>()) {
      char const* op = "expert_parallel_layer::forward";
      auto const call = scope(dispatcher_.groups().world(), detail::layer_call::expert_parallel_forward, steps_.begin_forward(op));
      checked_forward(routing, x, out, experts);
      steps_.forward_done();
    }
  }

  //! The gradient of `x` and, with `weighted`, of the routing weights, from that of `out`, for the
  //! last `forward`; parametric experts also get their parameter gradients (the replicas' summed
  //! into the owner's, when shadowed). Collective: every rank calls it, also one that needs no
  //! gradient. `d_x` and `d_weights` are written together at the end, when nothing can fail any
  //! more: after an error neither holds a partial result (parameter gradients may). No host wait:
  //! on a device they are written in the back-end's stream order, for the caller's next work there.
  //! @param d_out `[>= T][hidden]` the gradient of the forward's `out`.
  //! @param d_x `[>= T][hidden]`, or `not_needed`.
  //! @param d_weights `[>= T * K]` (weighted layers only), or `not_needed`.
  //! @throws error (invalid_argument) naming the argument, before any communication; (invalid_usage)
  //!         before a forward.
  template <class ExpertsBackward>
  void backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                optional_output<array_view<float>> d_weights, ExpertsBackward&& experts) {
    if constexpr (detail::check_experts<T, Backend, ExpertsBackward, shadowing_t::shadows, true>()) {
      char const* op = "expert_parallel_layer::backward";
      auto const call = scope(dispatcher_.groups().world(), detail::layer_call::expert_parallel_backward, steps_.begin_backward(op));
      checked_backward(d_out, d_x, d_weights, experts);
    }
  }

  //! Sizes every buffer whose size depends on the batch for steps within `bounds` (the dispatcher's
  //! plans, exchanges and rows, and the experts' rows), so that such steps allocate nothing, as
  //! DeepEP's `Buffer` is sized once. Local: no traffic; call it on every rank, before the first
  //! step (a larger step still runs and grows what it needs). Not sized here: what the first call of
  //! anything sets up whatever the batch (the communicator's bookkeeping, the smart schedule's lane),
  //! and a shadowing policy's replica buffers, which depend on the experts: `reserve(bounds, experts)`.
  //! @throws error (invalid_argument) naming the field of `bounds` that is out of range; (invalid_usage)
  //!         between a forward and its backward (training mode), whose routing it would drop.
  void reserve(step_bounds const& bounds) {
    steps_.check_reserve("expert_parallel_layer::reserve");
    std::int64_t const received = dispatcher_.template reserve<T>(bounds, hidden_);
    std::int64_t const slots = bounds.max_tokens * bounds.top_k;
    for (rows_t* b : {&expert_in_, &expert_out_, &d_expert_out_, &d_expert_in_}) grow_rows(*b, received);
    if constexpr (shadowing_t::shadows)
      for (rows_t* b : {&home_in_, &home_out_, &d_home_out_, &d_home_in_}) grow_rows(*b, slots);
    if constexpr (pipelined && shadowing_t::shadows) grow_rows(d_x_, bounds.max_tokens);
    grow(dispatcher_.backend(), d_weights_, slots);
    routed_ = false;  // the dispatcher's plans held the largest routing: a backward needs a new forward
  }

  //! `reserve(bounds)`, and, with a shadowing policy, its replica buffers for
  //! `bounds.max_shadowed_experts` of `experts` (their parameter count and type size them).
  template <class Experts>
  void reserve(step_bounds const& bounds, Experts& experts) {
    reserve(bounds);
    if constexpr (shadowing_t::shadows) {
      detail::require(bounds.max_shadowed_experts >= 0, "expert_parallel_layer::reserve", "step_bounds.max_shadowed_experts = ",
                      bounds.max_shadowed_experts, " is negative");
      shadow_.reserve(bounds.max_shadowed_experts, experts);
    }
  }

  //! Begins a scheduled step (Pro-Prophet's scheduler; patterns/fastermoe.hpp): plans it from the
  //! last step's counts and starts the replicas' parameter transfers in the background, to overlap
  //! the caller's compute before `forward`; that step's backward leaves the gradients' aggregation
  //! in the background until `finish_replica_gradients`. Collective. `experts` must stay alive, and
  //! their parameters unchanged, until then. Returns false on the first step (nothing to predict
  //! from: the step runs unscheduled).
  template <class Experts>
  bool begin_replica_transfer(Experts& experts) {
    static_assert(shadowing_t::shadows, "moecomm::expert_parallel_layer::begin_replica_transfer: needs a shadowing policy");
    auto const call = scope(dispatcher_.groups().world(), detail::layer_call::expert_parallel_begin_replica_transfer, steps_.step() + 1);
    return shadow_.begin_transfer(experts);
  }

  //! Waits for a scheduled step's gradient aggregation, rethrowing its failure: the owners'
  //! gradients are whole after it. Call it before the optimizer reads them.
  void finish_replica_gradients() {
    static_assert(shadowing_t::shadows, "moecomm::expert_parallel_layer::finish_replica_gradients: needs a shadowing policy");
    shadow_.finish_lane();
  }


  //! Why this layer's step cannot be captured into a CUDA graph, or "" when it can: a padded capacity
  //! policy over flat, hierarchical_2d or pairwise (`dispatcher::capture_blocker`), and with
  //! FasterMoE's shadowing its point-to-point path in a step that is not scheduled. Then a `forward`
  //! and `backward` called while the back-end's stream captures, after `reserve` and one eager step
  //! of the same shape (whose capacity, and shadowed experts, the graph keeps), enqueue their work and
  //! wait for nothing: the owners' parameters still go to the replicas and the gradients come back
  //! in every replay. After a replay, `dispatch_state().check_captured_routing()` raises a bad
  //! routing. A step that is not capturable is refused at capture with this reason.
  [[nodiscard]] std::string capture_blocker() const {
    std::string const why = dispatcher_.capture_blocker();
    if constexpr (shadowing_t::shadows)
      if (why.empty()) return shadow_.capture_blocker();
    return why;
  }

  //! The layer's shadowing policy (`no_shadowing` or `fastermoe_shadowing<...>`).
  using shadowing_policy = shadowing_t;

  //! The dispatcher: the step's report (capacity, drops, received and home rows, messages), counts, plan.
  [[nodiscard]] dispatcher<Backend, Comm, capacity_t, algorithm_t> const& dispatch_state() const { return dispatcher_; }
  //! The shadowing policy's state of the last step (for `fastermoe_shadowing`: the decision and the counts).
  [[nodiscard]] auto const& shadow_state() const { return shadow_; }

 private:
  using rows_t = typename Backend::template buffer_type<T>;

  //! The groups, once every rank has passed the same experts and hidden size (ranks that disagree
  //! would size and route their rows differently). One all-gather, at construction only.
  static exchange_groups<Comm>& agreed(exchange_groups<Comm>& groups, std::int32_t num_experts, std::int64_t hidden) {
    static constexpr char const* names[] = {"num_experts", "hidden"};
    std::int64_t const mine[] = {num_experts, hidden};
    std::vector<std::int64_t> all;
    detail::agree_on(groups.world(), "expert_parallel_layer", "on the layer's configuration", names, mine, all);
    return groups;
  }

  template <class Experts>
  void checked_forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts&& experts) {
    check_forward_arguments(routing, x, out);
    if constexpr (shadowing_t::shadows) {
      if (detail::capturing(dispatcher_.backend()))  // the dispatcher refuses for its own reasons
        if (std::string const why = shadow_.capture_blocker(); !why.empty())
          detail::fail(status::invalid_usage, "expert_parallel_layer::forward was called while the back-end's stream captures a CUDA "
                       "graph, but this step is not capturable: ", why);
      if (!shadow_.planned_ahead()) shadow_.finish_lane();  // a previous step's aggregation: its buffers are reused
      dispatcher_.route(routing, [&](std::vector<std::int64_t> const& counts) {
        return shadow_.choose(counts);  // views of the state's vectors: nothing is copied
      });
      shadow_.broadcast(experts);
    } else {
      dispatcher_.route(routing);
    }
    routed_ = false;
    std::int64_t const rows = dispatcher_.received_rows(), home = dispatcher_.home_rows();
    grow_rows(expert_in_, rows);
    grow_rows(home_in_, home);
    rows_t& expert_out = grow_rows(expert_out_, rows);
    rows_t& home_out = grow_rows(home_out_, home);
    auto run_home = [&](Backend const& on) {
      if constexpr (shadowing_t::shadows)
        for_each_home_expert([&](std::int32_t e, std::int64_t begin, std::int64_t n) {
          detail::expert_forward<T>(experts, shadow_.parameters(experts, e), input_rows(home_in_, begin, n),
                                    rows_at(home_out, begin, n), on);
          detail::charge_expert_flops(on, experts, n, 1);
        });
    };
    auto run_local = [&](array_view<std::int64_t const> offsets, Backend const& on) {
      detail::run_local_experts<T>(experts, offsets, input_rows(expert_in_, 0, rows), view(expert_out, rows), on, group_offsets_);
    };
    if constexpr (pipelined) {
      dispatcher_.template forward_pipelined<weighting_t, T>(
          x, view(expert_in_, rows), view(expert_out, rows), view(home_in_, home), view(home_out, home), out, run_home,
          [&](std::int32_t first, std::int32_t sources, Backend const& on) { for_each_source(first, sources, run_local, on); });
    } else {
      Backend const& be = dispatcher_.backend();
      dispatcher_.template dispatch<T>(x, view(expert_in_, rows), view(home_in_, home));
      run_local(dispatcher_.local_expert_offsets(), be);
      run_home(be);
      dispatcher_.template combine<weighting_t, T>(view(expert_out, rows), view(home_out, home), out);
    }
    routed_ = true;
  }

  template <class ExpertsBackward>
  void checked_backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                optional_output<array_view<float>> d_weights, ExpertsBackward&& experts) {
    check_backward_arguments(d_out, d_x, d_weights);
    if constexpr (shadowing_t::shadows) shadow_.begin_gradients(experts);
    std::int64_t const slots = dispatcher_.plan().routing().num_tokens * dispatcher_.plan().routing().top_k;
    std::int64_t const tokens = dispatcher_.plan().routing().num_tokens;
    optional_output<array_view<float>> const d_weights_staged =
        d_weights.wanted() ? optional_output<array_view<float>>(array_view<float>{grow(dispatcher_.backend(), d_weights_, slots).data(), slots})
                           : optional_output<array_view<float>>(not_needed);
    // The smart schedule writes d_x before the shadowed gradients are reduced, which may fail: stage it.
    constexpr bool stage_d_x = pipelined && shadowing_t::shadows;
    optional_output<matrix_view<T>> const d_x_staged =
        stage_d_x && d_x.wanted() ? optional_output<matrix_view<T>>(view(grow_rows(d_x_, tokens), tokens)) : d_x;
    std::int64_t const rows = dispatcher_.received_rows(), home = dispatcher_.home_rows();
    rows_t& d_expert_out = grow_rows(d_expert_out_, rows);
    rows_t& d_expert_in = grow_rows(d_expert_in_, rows);
    rows_t& d_home_out = grow_rows(d_home_out_, home);
    rows_t& d_home_in = grow_rows(d_home_in_, home);
    auto run_home = [&](Backend const& on) {
      if constexpr (shadowing_t::shadows)
        for_each_home_expert([&](std::int32_t e, std::int64_t begin, std::int64_t n) {
          detail::expert_backward<T>(experts, shadow_.parameters(experts, e), input_rows(home_in_, begin, n),
                                     input_rows(d_home_out, begin, n), rows_at(d_home_in, begin, n),
                                     shadow_.gradients(experts, e), on);
          detail::charge_expert_flops(on, experts, n, 2);
        });
    };
    auto run_local = [&](array_view<std::int64_t const> offsets, Backend const& on) {
      detail::run_local_experts_backward<T>(experts, offsets, input_rows(expert_in_, 0, rows), input_rows(d_expert_out, 0, rows),
                                            view(d_expert_in, rows), on, group_offsets_);
    };
    if constexpr (pipelined) {
      dispatcher_.template backward_pipelined<weighting_t, T>(
          d_out, view(d_expert_out, rows), view(d_expert_in, rows), view(d_home_out, home), view(d_home_in, home),
          d_x_staged, d_weights_staged, run_home,
          [&](std::int32_t first, std::int32_t sources, Backend const& on) { for_each_source(first, sources, run_local, on); });
    } else {
      Backend const& be = dispatcher_.backend();
      dispatcher_.template combine_backward<weighting_t, T>(d_out, view(d_expert_out, rows), view(d_home_out, home),
                                                          d_weights_staged);
      run_local(dispatcher_.local_expert_offsets(), be);
      run_home(be);
      if constexpr (shadowing_t::shadows) shadow_.reduce(experts);
      dispatcher_.template dispatch_backward<T>(view(d_expert_in, rows), view(d_home_in, home), d_x_staged);
    }
    if constexpr (pipelined && shadowing_t::shadows) shadow_.reduce(experts);
    // Nothing can fail from here on (dispatch_backward's last step writes d_x after its exchange).
    Backend const& be = dispatcher_.backend();
    if constexpr (stage_d_x)
      if (d_x.wanted()) be.copy(d_x.view().data, d_x_staged.view().data, tokens * hidden_);
    if (d_weights.wanted()) be.copy(d_weights.view().data, d_weights_staged.view().data, slots);
  }


  void check_forward_arguments(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out) const {
    detail::check_layer_forward_arguments("expert_parallel_layer::forward", routing, x, out, hidden_);
  }

  void check_backward_arguments(matrix_view<T const> d_out, optional_output<matrix_view<T>> const& d_x,
                                optional_output<array_view<float>> const& d_weights) const {
    char const* op = "expert_parallel_layer::backward";
    if (!routed_) detail::fail(status::invalid_usage, op, "called without a successful forward before it");
    routing_view const& routing = dispatcher_.plan().routing();
    detail::check_layer_backward_arguments(op, routing.num_tokens, routing.top_k, detail::is_weighted<weighting_t>(), d_out, d_x,
                                           d_weights, hidden_);
  }
  //! The smart schedule runs dispatch, experts and combine as one pipelined call.
  static constexpr bool pipelined = std::is_same_v<algorithm_t, smart_schedule>;

  //! `b`, grown to `rows` rows: the layer's row buffers are kept from step to step.
  rows_t& grow_rows(rows_t& b, std::int64_t rows) const { return grow(dispatcher_.backend(), b, rows * hidden_); }
  matrix_view<T> view(rows_t& b, std::int64_t rows) const { return {b.data(), rows, hidden_}; }
  matrix_view<T> rows_at(rows_t& b, std::int64_t begin, std::int64_t n) const { return {b.data() + begin * hidden_, n, hidden_}; }
  matrix_view<T const> input_rows(rows_t& b, std::int64_t begin, std::int64_t n) const { return rows_at(b, begin, n); }

  //! `f(offsets, on)` for each source rank in `[first, first + sources)`, with the L + 1 rank-major
  //! offsets of its rows cut among the local experts.
  template <class F>
  void for_each_source(std::int32_t first, std::int32_t sources, F&& f, Backend const& on) const {
    auto const& offsets = dispatcher_.rank_major_offsets();
    std::int64_t const experts = dispatcher_.num_local_experts();
    for (std::int32_t s = first; s < first + sources; ++s) f(array_view<std::int64_t const>{offsets.data() + s * experts, experts + 1}, on);
  }

  //! `f(expert, first row, rows)` for each of this rank's home experts.
  template <class F>
  void for_each_home_expert(F&& f) const {
    auto const& offsets = dispatcher_.home_expert_offsets();
    auto const& home = dispatcher_.home_experts();
    for (std::size_t i = 0; i < home.size(); ++i) f(home[i], offsets[i], offsets[i + 1] - offsets[i]);
  }

  dispatcher<Backend, Comm, capacity_t, algorithm_t> dispatcher_;
  typename shadowing_t::template state<Backend, Comm> shadow_;
  std::int64_t hidden_;
  std::vector<std::int64_t> group_offsets_;  //!< grouped experts' offsets, relative to their block
  rows_t expert_in_;  //!< the experts' input rows, kept for their backward
  rows_t home_in_;    //!< the home (shadowed) experts' input rows, likewise
  rows_t expert_out_, home_out_, d_expert_out_, d_expert_in_, d_home_out_, d_home_in_;  //!< reused each step
  rows_t d_x_;  //!< `d_x` staged until the backward can no longer fail (smart schedule with shadowing)
  typename Backend::template buffer_type<float> d_weights_;  //!< `d_weights`, likewise
  bool routed_ = false;  //!< a forward completed: backward has its routing
};

MOECOMM_NAMESPACE_END
