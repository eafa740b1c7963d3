// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `hybridep_layer`: HybridEP (arXiv 2510.19470 §IV-A; reference/systems.md §5), expert
//! parallelism for GPUs in several data centres (domains, `topology`) joined by slow links: move
//! experts inside a domain, tokens only between same-offset ranks.
//!
//! The ranks are cut into expert domains of `S` ranks (`hybridep::expert_domain`), laid out by
//! `hybridep::spread`:
//! - `across_data_centres` (the paper's aim, and the default): ranks are taken local index first,
//!   data centre second (position `l · D + d` for local rank `l` of data centre `d` of `D`), so an
//!   expert domain holds the same local rank of `S` data centres (or, for `S > D`, `S / D` local
//!   ranks of every one): the experts cross the slow links, and the same-offset all-to-all stays
//!   inside a data centre when `S` is a multiple of `D`;
//! - `within_data_centres`: `S` consecutive ranks of one data centre (`S` divides its ranks): the
//!   gather stays on the fast links, and cross-domain tokens still cross the slow ones.
//! Rank `r` at offset `o` of expert domain `j`:
//! - all-gathers, inside its expert domain, the parameters of the `S · L` experts its members own
//!   (`L = E / R` per rank), so it can compute any of them;
//! - sends each slot whose expert belongs to expert domain `j'` to the rank at offset `o` of `j'`,
//!   which holds that expert after the gather; slots for its own expert domain stay here.
//!
//! That is plain expert parallelism over the same-offset group (one rank per expert domain, `S · L`
//! experts each, the expert domain's experts by member, then local index), so the layer is the
//! library's `dispatcher` over that group, on expert ids relabeled to that order: combine order, capacity and the backward are the dispatcher's,
//! and outputs and input gradients equal plain EP's bit for bit (an expert's row does not depend
//! on the rank computing it). Per rank: `R/S − 1` all-to-all peers and `S − 1` all-gather peers,
//! i.e. the paper's pair counts `G·(G/S − 1)` and `G·(S − 1)` for `G = R` ranks. `S = 1` is plain EP;
//! `S = R` gathers every expert everywhere and moves no token.
//!
//! Overlap (§III): `begin_expert_gather(experts)` starts the all-gather on the back-end's lane
//! (core/lane.hpp) and returns; the caller runs its pre-expert compute (attention, dense FFN) and
//! then `forward`, which routes and dispatches while the gather finishes and waits for it only
//! before the experts compute. `forward` without `begin_expert_gather` gathers first.
//!
//! Parameter-efficient migration (§IV-B; collectives/expert_codec.hpp), with `hybridep::compression` > 1:
//! the expert domain's shared expert (the mean of its experts, `refresh_shared_expert`, computed on
//! first use and whenever the caller asks, e.g. after an optimizer step) is on every member; each
//! rank sends, per expert, only the `ceil(P / compression)` parameters farthest from it (values and
//! indices), and the others decode `shared` with those values scattered over it. A rank computes
//! its own experts with their exact parameters; the gradients of the decoded ones still return to
//! the owners. With `compression = 1` the gathered parameters are exact.
//!
//! Backward: the dispatcher's mirror exchanges; each rank computes the gradients of the `S · L`
//! experts on its rows, and an ordered reduce-scatter inside the expert domain sums them, in
//! ascending offset, into the owners' (`ordered_reduce_scatter`). The owners' gradients equal plain
//! EP's where the sums are exact; otherwise they differ by the reassociation of one sum over `S`
//! shares.

#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/expert_domains.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
#include <moecomm/collectives/expert_codec.hpp>
#include <moecomm/collectives/row_collectives.hpp>
#include <moecomm/patterns/experts.hpp>
#include <moecomm/patterns/layer_arguments.hpp>
#include <moecomm/patterns/layer_steps.hpp>
#include <moecomm/planners/hybridep_planner.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! HybridEP's layout: `expert_domain` = S, the ranks that gather each other's experts.
struct hybridep {
  std::int32_t expert_domain = 1;  //!< S: divides the ranks (`within_data_centres`: a data centre's); 1 is plain EP
  expert_domain_spread spread = expert_domain_spread::across_data_centres;
  //! Parameters per gathered expert over those sent (finite, >= 1): 1 sends them all, exactly; 50 is
  //! the paper's setting. Above 1 the experts' parameters must be float.
  double compression = 1;
};

//! What one step of a `hybridep_layer` did on this rank.
struct hybridep_report {
  std::int32_t expert_domain = 1;  //!< S
  std::int64_t gathered_experts = 0;  //!< experts this rank computes: S · L
  alltoall_stats exchange;           //!< the token all-to-alls (the dispatcher's), forward and backward
  alltoall_stats expert_gather;      //!< the parameter all-gather and the gradients' reduce-scatter
};

namespace detail {

//! `out[e]` = expert e's id in the order of positions: owner position · L + local index.
inline void expert_labels_by_position(expert_domain_layout const& layout, std::int32_t local_experts, std::vector<std::int32_t>& out) {
  out.resize(static_cast<std::size_t>(layout.ranks) * static_cast<std::size_t>(local_experts));
  for (std::int32_t r = 0; r < layout.ranks; ++r)
    for (std::int32_t l = 0; l < local_experts; ++l)
      out[static_cast<std::size_t>(r * local_experts + l)] = layout.position_of(r) * local_experts + l;
}

}  // namespace detail

//! One MoE layer under HybridEP (see the file comment).
//! @tparam Capacity `dropless` or `capacity<rule>`; @tparam Weighting `weighted` or `unweighted`.
//! @tparam Algorithm the token exchange over each offset's ranks: `flat` (the default),
//!         `hierarchical_2d`, `pairwise`, `dedup_per_rank<...>` or `dedup_per_node` (one row per token and destination
//!         rank); not the smart schedule, which pipelines experts the layer runs once.
//! The experts must be parametric (patterns/experts.hpp): the layer moves their parameters. Local
//! expert `l` of rank `r` is global expert `r · E / R + l`, as in plain expert parallelism.
template <class T, class Backend, class Comm, class Capacity = dropless, class Weighting = weighted, class Algorithm = flat>
class hybridep_layer : public detail::layer_mode {
  static_assert(!std::is_same_v<Algorithm, smart_schedule>,
                "moecomm::hybridep_layer: the smart schedule pipelines the experts per source rank; HybridEP runs them once "
                "over the gathered experts: use flat, hierarchical_2d, pairwise, dedup_per_rank or dedup_per_node");

 public:
  //! Collective over the world of `groups`, whose topology names the domains.
  //! @throws error (invalid_argument) naming `policy.expert_domain` when it does not divide the ranks
  //!         of a domain, or `num_experts` unless it is a positive multiple of the ranks.
  hybridep_layer(Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, std::int64_t hidden,
                 hybridep policy = {}, Capacity capacity = {}, routing_checks checks = {}, Algorithm algorithm = {})
      : detail::layer_mode(groups.world(), "hybridep_layer"),
        be_(be),
        world_(&agreed(groups.world(), policy, num_experts, hidden)),
        layout_(detail::expert_domain_layout::of(groups.topo(), policy.expert_domain, policy.spread, "hybridep_layer",
                                                 "policy.expert_domain")),
        position_(layout_.position_of(groups.world().rank())),
        same_offset_(groups.world().split(position_ % layout_.size, position_ / layout_.size)),
        expert_domain_(groups.world().split(position_ / layout_.size, position_ % layout_.size)),
        same_offset_groups_(same_offset_, groups.topo().of_members(layout_.same_offset(position_ % layout_.size))),
        dispatcher_(be, same_offset_groups_, num_experts, capacity, algorithm, checks),
        topo_(groups.topo()),
        hidden_(hidden),
        compression_(policy.compression),
        local_experts_(num_experts / groups.world().size()) {
    detail::require(hidden > 0, "hybridep_layer", "hidden = ", hidden, " must be positive");
    detail::require(std::isfinite(policy.compression) && policy.compression >= 1, "hybridep_layer", "policy.compression = ",
                    policy.compression, " must be finite and >= 1 (1: the experts' exact parameters)");
    detail::require(num_experts % groups.world().size() == 0, "hybridep_layer", "num_experts = ", num_experts,
                    " must be a positive multiple of the ", groups.world().size(), " ranks");
    detail::expert_labels_by_position(layout_, local_experts_, labels_);
    for (std::size_t e = 0; e < labels_.size(); ++e) relabel_ = relabel_ || labels_[e] != static_cast<std::int32_t>(e);
    if (relabel_) be_.copy(grow(be_, device_labels_, num_experts).data(), labels_.data(), num_experts);
    be_.synchronize();
    for (std::int32_t r : layout_.members(position_ / layout_.size)) expert_domain_members_.push_back(r);
  }

  //! Its groups and lane point into it: it stays where it was made.
  hybridep_layer(hybridep_layer const&) = delete;
  hybridep_layer& operator=(hybridep_layer const&) = delete;
  ~hybridep_layer() {
    try {
      finish_gather();  // a gather begun and never waited for: let the lane go first
    } catch (...) {
    }
  }

  //! Sizes every buffer whose size depends on the batch for steps within `bounds` (as
  //! `expert_parallel_layer::reserve`: the dispatcher's plans, exchange and rows over the same-offset
  //! group, the experts' rows, the relabeled routing), so that such steps allocate nothing. The
  //! gathered parameters and gradients depend on the experts, not the batch: the first step sizes
  //! them. Local: no traffic; call it on every rank before the first step.
  //! @throws error (invalid_argument) naming the field of `bounds` that is out of range; (invalid_usage)
  //!         between a forward and its backward (training mode), whose routing it would drop.
  void reserve(step_bounds const& bounds) {
    steps_.check_reserve("hybridep_layer::reserve");
    std::int64_t const received = dispatcher_.template reserve<T>(bounds, hidden_);
    for (rows_t* b : {&expert_in_, &expert_out_, &d_expert_out_, &d_expert_in_}) grow_rows(*b, received);
    if (relabel_) grow(be_, relabeled_idx_, bounds.max_tokens * bounds.top_k);
    routed_ = false;  // the dispatcher's plans held the largest routing: a backward needs a new forward
  }

  //! Starts the all-gather of the expert domain's parameters in the background and returns: run
  //! the pre-expert compute, then `forward`. Collective over the expert domain. `experts`'
  //! parameters must not change until `forward` returns.
  template <class Experts>
  void begin_expert_gather(Experts& experts) {
    if constexpr (detail::check_experts<T, Backend, Experts, true, false>()) {
      auto const call = scope(*world_, detail::layer_call::hybridep_begin_expert_gather, steps_.step() + 1);
      start_gather(experts);
    }
  }

  //! With compression: recomputes the shared expert, the mean of the expert domain's experts in a
  //! fixed order, from their current parameters. Collective over the expert domain; call it after
  //! the optimizer has moved the experts far enough (it runs once by itself, on first use).
  template <class Experts>
  void refresh_shared_expert(Experts& experts) {
    if constexpr (detail::check_experts<T, Backend, Experts, true, false>()) {
      auto const call = scope(*world_, detail::layer_call::hybridep_refresh_shared_expert, steps_.step());
      compute_shared_expert(experts);
    }
  }

  //! `out[t]` = the combine of t's kept slots' expert outputs (plain expert parallelism's). Collective
  //! over the world. `routing` and `x` must stay alive and unchanged until `backward` is done.
  //! @param x `[>= T][hidden]`; @param out `[>= T][hidden]`.
  //! @throws error (invalid_argument) naming the argument, before any communication.
  template <class Experts>
  void forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts&& experts) {
    if constexpr (detail::check_experts<T, Backend, Experts, true, false>()) {
      char const* op = "hybridep_layer::forward";
      auto const call = scope(*world_, detail::layer_call::hybridep_forward, steps_.begin_forward(op));
      checked_forward(routing, x, out, experts);
      steps_.forward_done();
    }
  }

  //! The gradients of `x`, of the routing weights (weighted) and, summed into their owners', of the
  //! experts' parameters, for the last forward. Collective over the world.
  //! @param d_x `[>= T][hidden]` or `not_needed`; @param d_weights `[>= T * K]` or `not_needed`.
  template <class ExpertsBackward>
  void backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                optional_output<array_view<float>> d_weights, ExpertsBackward&& experts) {
    if constexpr (detail::check_experts<T, Backend, ExpertsBackward, true, true>()) {
      char const* op = "hybridep_layer::backward";
      auto const call = scope(*world_, detail::layer_call::hybridep_backward, steps_.begin_backward(op));
      checked_backward(d_out, d_x, d_weights, experts);
    }
  }


  [[nodiscard]] hybridep_report const& report() const { return report_; }
  //! The dispatcher over the same-offset group (its report: capacity, drops, rows).
  [[nodiscard]] dispatcher<Backend, Comm, Capacity, Algorithm> const& dispatch_state() const { return dispatcher_; }
  //! The ranks of this rank's expert domain, and of its same-offset group.
  [[nodiscard]] Comm& expert_domain() { return expert_domain_; }
  [[nodiscard]] Comm& same_offset() { return same_offset_; }

 private:
  //! `world`, once every rank has passed the same policy, experts and hidden size (before anything
  //! is derived from them: ranks that disagree on `expert_domain` would otherwise split into groups
  //! that do not match and be told about a topology).
  static Comm& agreed(Comm& world, hybridep const& policy, std::int32_t num_experts, std::int64_t hidden) {
    std::int64_t compression_bits = 0;
    static_assert(sizeof(compression_bits) == sizeof(policy.compression));
    std::memcpy(&compression_bits, &policy.compression, sizeof(compression_bits));
    static constexpr char const* names[] = {"policy.expert_domain", "policy.spread", "policy.compression (bits)", "num_experts",
                                            "hidden"};
    std::int64_t const mine[] = {policy.expert_domain, static_cast<std::int64_t>(policy.spread), compression_bits, num_experts,
                                 hidden};
    std::vector<std::int64_t> all;
    detail::agree_on(world, "hybridep_layer", "on the layer's configuration", names, mine, all);
    return world;
  }

  template <class Experts>
  void start_gather(Experts& experts) {
    // A gather begun and never waited for (its step's forward was refused) finishes first, or
    // reports its failure: the lane runs one job at a time, and this one rewrites its buffers.
    finish_gather();
    using P = detail::parameter_t<Experts>;
    std::int64_t const count = experts.parameter_count(), mine = local_experts_ * count;
    P* const staged = reinterpret_cast<P*>(grow(be_, staged_params_, mine * std::int64_t(sizeof(P))).data());
    grow(be_, gathered_params_, layout_.size * mine * std::int64_t(sizeof(P)));
    for (std::int32_t l = 0; l < local_experts_; ++l) be_.copy(staged + l * count, experts.parameters(l), count);
    be_.synchronize();
    std::int64_t sent = mine * std::int64_t(sizeof(P));
    if (compressed()) {
      if constexpr (std::is_same_v<P, float>) {
        if (!shared_ready_) compute_shared_expert(experts);
        std::int64_t const k = top_k_for_ratio(count, compression_);
        encode_own_experts(count, k);
        gather_ = {this, &hybridep_layer::gather_compressed, k};
        sent = local_experts_ * k * std::int64_t(sizeof(float) + sizeof(std::int32_t));
      } else {
        detail::fail(status::invalid_argument, "hybridep_layer", "policy.compression = ", compression_,
                     " needs float expert parameters (the codec's)");
      }
    } else {
      gather_ = {this, &hybridep_layer::template gather_parameters<P>, count};
    }
    if (!lane_) {  // once: the lane and its own copy of the expert domain (collective), kept only together
      auto lane = std::make_unique<lane_t<Backend>>(be_);
      lane_expert_domain_.emplace(split_for(expert_domain_, lane_backend(*lane, be_)));
      lane_ = std::move(lane);
    }
    lane_->start(gather_, 1);
    gathering_ = true;
    lane_->release(0);
    report_.expert_gather = {};  // this step's: the gather, then the backward's reduce-scatter
    record_gather(sent);
  }

  [[nodiscard]] bool compressed() const { return compression_ > 1; }

  template <class Experts>
  void compute_shared_expert(Experts& experts) {
    using P = detail::parameter_t<Experts>;
    detail::require(std::is_same_v<P, float>, "hybridep_layer::refresh_shared_expert", "the experts' parameters must be float (the codec's)");
    if (gathering_)
      detail::fail(status::invalid_usage, "hybridep_layer::refresh_shared_expert", "called between begin_expert_gather and forward");
    if constexpr (std::is_same_v<P, float>) {
      std::int64_t const count = experts.parameter_count();
      float* const own = reinterpret_cast<float*>(grow(be_, shared_inputs_, local_experts_ * count * std::int64_t(sizeof(float))).data());
      for (std::int32_t l = 0; l < local_experts_; ++l) be_.copy(own + l * count, experts.parameters(l), count);
      be_.synchronize();
      float* const shared = reinterpret_cast<float*>(grow(be_, shared_, count * std::int64_t(sizeof(float))).data());
      [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::parameters);
      shared_expert_mean(be_, expert_domain_, matrix_view<float const>{own, local_experts_, count}, array_view<float>{shared, count},
                         codec_scratch_);
      shared_ready_ = true;
      shared_count_ = count;
    }
  }

  //! This rank's experts (staged) as `k` values and indices each, into its rows of the gathered codes.
  void encode_own_experts(std::int64_t count, std::int64_t k) {
    detail::require(shared_count_ == count, "hybridep_layer", "the experts have ", count,
                    " parameters, the shared expert ", shared_count_, ": call refresh_shared_expert after changing them");
    std::int64_t const rows = std::int64_t{layout_.size} * local_experts_;
    std::int32_t* const idx = reinterpret_cast<std::int32_t*>(grow(be_, code_indices_, (rows + local_experts_) * k * 4).data());
    float* const val = reinterpret_cast<float*>(grow(be_, code_values_, (rows + local_experts_) * k * 4).data());
    float const* const staged = reinterpret_cast<float const*>(staged_params_.data());
    float const* const shared = reinterpret_cast<float const*>(shared_.data());
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::parameters);
    for (std::int32_t l = 0; l < local_experts_; ++l)  // the own codes after the gathered ones: [rows][k], then [L][k]
      encode_expert(be_, array_view<float const>{staged + l * count, count}, array_view<float const>{shared, count}, k,
                    array_view<std::int32_t>{idx + (rows + l) * k, k}, array_view<float>{val + (rows + l) * k, k}, codec_scratch_);
    be_.synchronize();
  }

  //! The lane's job with compression: the codes' all-gather (`k` per expert).
  static void gather_compressed(hybridep_layer& self, std::int64_t k) {
    std::int64_t const rows = std::int64_t{self.layout_.size} * self.local_experts_, L = self.local_experts_;
    auto* const idx = reinterpret_cast<std::int32_t*>(self.code_indices_.data());
    auto* const val = reinterpret_cast<float*>(self.code_values_.data());
    Backend const& be = lane_backend(*self.lane_, self.be_);
    row_allgather(be, *self.lane_expert_domain_, matrix_view<std::int32_t const>{idx + rows * k, L, k},
                  matrix_view<std::int32_t>{idx, rows, k}, self.gather_scratch_, detail::payload_kind::parameters);
    row_allgather(be, *self.lane_expert_domain_, matrix_view<float const>{val + rows * k, L, k}, matrix_view<float>{val, rows, k},
                  self.gather_scratch_, detail::payload_kind::parameters);
  }

  //! With compression, after the gather: the other members' experts decoded, this rank's exact.
  void decode_gathered(std::int64_t count) {
    std::int64_t const k = top_k_for_ratio(count, compression_);
    float* const gathered = reinterpret_cast<float*>(gathered_params_.data());
    auto const* const idx = reinterpret_cast<std::int32_t const*>(code_indices_.data());
    auto const* const val = reinterpret_cast<float const*>(code_values_.data());
    float const* const shared = reinterpret_cast<float const*>(shared_.data());
    std::int32_t const me = position_ % layout_.size;
    [[maybe_unused]] auto const payload = detail::payload_scope(be_, detail::payload_kind::parameters);
    for (std::int32_t m = 0; m < layout_.size; ++m)
      for (std::int32_t l = 0; l < local_experts_; ++l) {
        std::int64_t const row = std::int64_t{m} * local_experts_ + l;
        if (m == me)
          be_.copy(gathered + row * count, reinterpret_cast<float const*>(staged_params_.data()) + l * count, count);
        else
          decode_expert(be_, array_view<float const>{shared, count}, array_view<std::int32_t const>{idx + row * k, k},
                        array_view<float const>{val + row * k, k}, array_view<float>{gathered + row * count, count});
      }
    be_.synchronize();
  }

  //! The lane's job: the all-gather of the staged parameters (`count` of type P per expert).
  template <class P>
  static void gather_parameters(hybridep_layer& self, std::int64_t count) {
    row_allgather(lane_backend(*self.lane_, self.be_), *self.lane_expert_domain_,
                  matrix_view<P const>{reinterpret_cast<P const*>(self.staged_params_.data()), self.local_experts_, count},
                  matrix_view<P>{reinterpret_cast<P*>(self.gathered_params_.data()), std::int64_t{self.layout_.size} * self.local_experts_, count},
                  self.gather_scratch_, detail::payload_kind::parameters);
  }
  //! The job the lane runs (a plain struct: starting it allocates nothing).
  struct gather_job {
    hybridep_layer* layer = nullptr;
    void (*gather)(hybridep_layer&, std::int64_t) = nullptr;
    std::int64_t count = 0;
    void operator()(std::int32_t) const { gather(*layer, count); }
  };

  //! Waits for the gather started by `begin_expert_gather`, rethrowing its failure.
  void finish_gather() {
    if (!gathering_) return;
    gathering_ = false;
    wait_and_finish(*lane_, 0);
  }

  //! The all-gather's (or the reduce-scatter's) messages: one to each other member of the expert domain.
  void record_gather(std::int64_t bytes) {
    for (std::int32_t peer : expert_domain_members_) report_.expert_gather.record(topo_, world_->rank(), peer, bytes);
  }

  template <class Experts>
  void checked_forward(routing_view const& routing, matrix_view<T const> x, matrix_view<T> out, Experts& experts) {
    char const* op = "hybridep_layer::forward";
    detail::check_layer_forward_arguments(op, routing, x, out, hidden_);
    routed_ = false;
    if (!gathering_) start_gather(experts);  // not begun: gather now
    struct wait_on_exit {  // a failed dispatch still lets the lane go before the job's state dies
      hybridep_layer& layer;
      ~wait_on_exit() {
        try { layer.finish_gather(); } catch (...) {}
      }
    } const waiter{*this};
    dispatcher_.route(by_position(routing));
    std::int64_t const rows = dispatcher_.received_rows();
    dispatcher_.template dispatch<T>(x, view(grow_rows(expert_in_, rows), rows));
    finish_gather();
    using P = detail::parameter_t<Experts>;
    if constexpr (std::is_same_v<P, float>)
      if (compressed()) decode_gathered(experts.parameter_count());
    P const* const gathered = reinterpret_cast<P const*>(gathered_params_.data());
    matrix_view<T> const expert_out = view(grow_rows(expert_out_, rows), rows);
    for_each_expert([&](std::int32_t l, std::int64_t b, std::int64_t n) {
      detail::expert_forward<T>(experts, gathered + l * experts.parameter_count(), rows_at(expert_in_, b, n),
                                rows_at(expert_out_, b, n), be_);
      detail::charge_expert_flops(be_, experts, n, 1);
    });
    dispatcher_.template combine<Weighting, T>(matrix_view<T const>(expert_out), out);
    report_.expert_domain = layout_.size;
    report_.gathered_experts = std::int64_t{layout_.size} * local_experts_;
    report_.exchange = dispatcher_.report().exchange;
    routed_ = true;
  }

  template <class Experts>
  void checked_backward(matrix_view<T const> d_out, optional_output<matrix_view<T>> d_x,
                        optional_output<array_view<float>> d_weights, Experts& experts) {
    char const* op = "hybridep_layer::backward";
    if (!routed_) detail::fail(status::invalid_usage, op, "called without a successful forward before it");
    routing_view const& routing = dispatcher_.plan().routing();
    detail::check_layer_backward_arguments(op, routing.num_tokens, routing.top_k, detail::is_weighted<Weighting>(), d_out,
                                           d_x, d_weights, hidden_);
    using P = detail::parameter_t<Experts>;
    std::int64_t const rows = dispatcher_.received_rows(), count = experts.parameter_count();
    std::int64_t const gathered_count = std::int64_t{layout_.size} * local_experts_ * count;
    matrix_view<T> const d_expert_out = view(grow_rows(d_expert_out_, rows), rows);
    matrix_view<T> const d_expert_in = view(grow_rows(d_expert_in_, rows), rows);
    dispatcher_.template combine_backward<Weighting, T>(d_out, d_expert_out, d_weights);
    P const* const gathered = reinterpret_cast<P const*>(gathered_params_.data());
    P* const shares = reinterpret_cast<P*>(grow(be_, gradient_shares_, gathered_count * std::int64_t(sizeof(P))).data());
    be_.for_each_index(gathered_count, detail::fill_value<P>{shares, P(0)});
    for_each_expert([&](std::int32_t l, std::int64_t b, std::int64_t n) {
      detail::expert_backward<T>(experts, gathered + l * count, rows_at(expert_in_, b, n), rows_at(d_expert_out_, b, n),
                                 rows_at(d_expert_in_, b, n), shares + l * count, be_);
      detail::charge_expert_flops(be_, experts, n, 2);
    });
    // The members' shares of this rank's experts, summed in ascending offset, then into the owner's.
    P* const summed = reinterpret_cast<P*>(grow(be_, summed_gradients_, local_experts_ * count * std::int64_t(sizeof(P))).data());
    ordered_reduce_scatter(be_, expert_domain_, matrix_view<P const>{shares, std::int64_t{layout_.size} * local_experts_, count},
                           matrix_view<P>{summed, local_experts_, count}, gather_scratch_, detail::payload_kind::parameters);
    record_gather(local_experts_ * count * std::int64_t(sizeof(P)));
    for (std::int32_t l = 0; l < local_experts_; ++l)
      be_.for_each_index(count, detail::add_into<P>{summed + l * count, experts.gradients(l)});
    dispatcher_.template dispatch_backward<T>(matrix_view<T const>(d_expert_in), d_x);
    report_.exchange = dispatcher_.report().exchange;
  }

  using rows_t = typename Backend::template buffer_type<T>;
  using bytes_t = typename Backend::template buffer_type<char>;
  rows_t& grow_rows(rows_t& b, std::int64_t rows) const { return grow(be_, b, rows * hidden_); }
  matrix_view<T> view(rows_t& b, std::int64_t rows) const { return {b.data(), rows, hidden_}; }
  matrix_view<T> rows_at(rows_t& b, std::int64_t begin, std::int64_t n) const { return {b.data() + begin * hidden_, n, hidden_}; }

  //! `f(l, first row, rows)` for each of the `S · L` experts this rank computes.
  template <class F>
  void for_each_expert(F&& f) const {
    auto const& offsets = dispatcher_.local_expert_offsets();
    for (std::int32_t l = 0; l < dispatcher_.num_local_experts(); ++l)
      f(l, offsets[static_cast<std::size_t>(l)], offsets[static_cast<std::size_t>(l) + 1] - offsets[static_cast<std::size_t>(l)]);
  }

  //! `routing` with its experts relabeled to the order of positions (the same view when it is already).
  routing_view by_position(routing_view const& routing) {
    if (!relabel_) return routing;
    std::int64_t const slots = detail::checked_mul(routing.num_tokens, std::int64_t{routing.top_k}, "hybridep_layer::forward",
                                                   "routing.num_tokens x routing.top_k");
    std::int32_t* const idx = grow(be_, relabeled_idx_, slots).data();
    if (slots > 0)
      be_.for_each_index(slots, detail::relabel_experts{routing.topk_idx, device_labels_.data(),
                                                        static_cast<std::int32_t>(labels_.size()), idx});
    routing_view relabeled = routing;
    relabeled.topk_idx = idx;
    return relabeled;
  }

  Backend be_;
  Comm* world_;
  detail::expert_domain_layout layout_;
  std::int32_t position_;
  Comm same_offset_, expert_domain_;
  exchange_groups<Comm> same_offset_groups_;
  dispatcher<Backend, Comm, Capacity, Algorithm> dispatcher_;
  topology topo_;
  std::int64_t hidden_;
  double compression_;
  std::int32_t local_experts_;
  hybridep_report report_;
  std::vector<std::int32_t> labels_, expert_domain_members_;  //!< host: experts by position; this rank's expert domain
  bool relabel_ = false;  //!< positions differ from ranks: routing is relabeled each step
  typename Backend::template buffer_type<std::int32_t> device_labels_, relabeled_idx_;
  rows_t expert_in_, expert_out_, d_expert_out_, d_expert_in_;  //!< kept from step to step
  bytes_t staged_params_, gathered_params_, gradient_shares_, summed_gradients_;
  bytes_t shared_, shared_inputs_, code_indices_, code_values_;  //!< compression: the shared expert, the codes
  bool shared_ready_ = false;
  std::int64_t shared_count_ = 0;
  workspace<Backend> codec_scratch_;
  workspace<Backend> gather_scratch_;  //!< the lane's (and the backward's) collectives
  std::unique_ptr<lane_t<Backend>> lane_;
  std::optional<Comm> lane_expert_domain_;  //!< the lane's copy of expert_domain_, on its stream
  gather_job gather_;
  bool gathering_ = false;
  bool routed_ = false;
};

MOECOMM_NAMESPACE_END
