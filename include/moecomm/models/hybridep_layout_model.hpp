// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `hybridep_layout_model`: one routing step of an MoE layer under HybridEP's expert domains
//! (`hybridep_layer`, patterns/hybridep.hpp), priced on `link_model` from the step's exact rows, for
//! the pattern adviser. `hybridep_planner` is HybridEP's own stream model (uniform routing, two
//! link classes, the forward only); this one sees the routing, every link a message crosses, and
//! the backward.
//!
//! The layout (core/expert_domains.hpp): R ranks, L = E / R experts each (expert e on rank e / L),
//! expert domains of S ranks; a rank computes the rows its same-offset peers send it for the S·L
//! experts of its expert domain. A step (forward and backward) is priced as the layer runs it:
//! - the gather: each rank stages its L experts (a copy each), then its lane copies its own into the
//!   gathered matrix and sends them to every other member of its expert domain (one round, every
//!   expert domain side by side). The lane runs beside the caller's pre-expert compute
//!   (`pre_expert_seconds`), the route and the dispatch, and the experts wait for both: for the
//!   later of the dispatch alone, the gather alone, and the gather's and the dispatch's messages
//!   as one round (they share the links they both cross: the WAN uplinks, across data centres);
//! - the exchange: the dispatcher over each same-offset group, the groups side by side: the counts
//!   all-gathered over each group, the plan's launches and the routing's relabeling, then `flat`'s
//!   permute, round and chunk sort each way (`exchange_adviser::flat`), forward and backward;
//! - the experts: one GEMM per gathered expert over the rows it received, on the busiest rank; the
//!   backward's twice the forward's FLOPs;
//! - the reduce-scatter of the gradients: the shares zeroed, this rank's own slice copied, one round
//!   of the other members' slices, the S slices summed, the sum added to each owned expert's gradient.
//! What it leaves out: that the dispatch's messages start after the route, while the gather's are
//! already moving (the joint round starts them together); the codec (`hybridep::compression`); the
//! exchanges other than `flat`; and what `link_model` leaves out.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/expert_domains.hpp>
#include <moecomm/error.hpp>
#include <moecomm/models/exchange_adviser.hpp>
#include <moecomm/models/link_model.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! HybridEP's setting: `expert_domain` = S ranks that gather each other's experts, and where they lie.
struct hybridep_layout {
  std::int32_t expert_domain = 1;
  expert_domain_spread spread = expert_domain_spread::across_data_centres;
};

//! One layout's predicted step (seconds).
struct hybridep_layout_prediction {
  double exchange_seconds = 0;        //!< route, dispatch and combine, forward and backward, with their memory passes
  double compute_seconds = 0;         //!< the busiest rank's GEMMs over its gathered experts, forward and backward
  double exposed_gather_seconds = 0;  //!< the gather's part not hidden under the pre-expert compute, the route and the dispatch
  double reduce_scatter_seconds = 0;  //!< the gradients summed into their owners'
  double layer_seconds = 0;           //!< exchange, compute, the exposed gather and the reduce-scatter
};

class hybridep_layout_model {
 public:
  //! @param links the ranks, their domains the data centres; @param num_experts E, a multiple of the
  //! ranks; @param hidden, @param ffn an expert's H -> F -> H (no biases); @param element_bytes a row's
  //! and a parameter's element.
  //! @throws error (invalid_argument) naming the argument out of range.
  hybridep_layout_model(link_model links, std::int32_t num_experts, std::int64_t hidden, std::int64_t ffn, double element_bytes)
      : links_(std::move(links)), exchanges_(links_.spec(), links_.topo()), E_(num_experts), H_(hidden), F_(ffn),
        element_bytes_(element_bytes) {
    std::int32_t const R = links_.ranks();
    detail::require(E_ > 0 && E_ % R == 0, op, "num_experts = ", E_, " must be a positive multiple of the ", R, " ranks");
    detail::require(H_ > 0 && F_ > 0 && element_bytes_ > 0, op, "hidden = ", H_, ", ffn = ", F_, " and element_bytes = ",
                    element_bytes_, " must be positive");
  }

  //! `layout`'s step for `counts` (`[R][E]`: the slots rank r routes to expert e) and `tokens`
  //! (`[R]`), the experts waiting at least `pre_expert_seconds` (the compute before the layer,
  //! under which the gather runs).
  //! @throws error (invalid_argument) naming `counts` or `tokens` when not of the ranks' shape (or a
  //!   count negative), a negative or non-finite `pre_expert_seconds`, or `layout.expert_domain` unless it divides the
  //!   ranks (`within_data_centres`: a domain's).
  [[nodiscard]] hybridep_layout_prediction predict(array_view<std::int64_t const> counts, std::vector<double> const& tokens,
                                                   hybridep_layout const& layout, double pre_expert_seconds) const {
    std::int32_t const R = links_.ranks(), L = E_ / R, S = layout.expert_domain;
    detail::require(counts.size == std::int64_t{R} * E_ && counts.data != nullptr, op, "argument 'counts' has ", counts.size,
                    " entries", counts.data == nullptr ? " at null" : "", "; ", R, " ranks and ", E_, " experts need ", std::int64_t{R} * E_);
    detail::require(tokens.size() == static_cast<std::size_t>(R), op, "argument 'tokens' has ", tokens.size(), " entries; the topology has ",
                    R, " ranks");
    detail::require(std::isfinite(pre_expert_seconds) && pre_expert_seconds >= 0, op, "pre_expert_seconds = ", pre_expert_seconds,
                    " must be finite and >= 0");
    auto const domains = detail::expert_domain_layout::of(links_.topo(), S, layout.spread, op, "layout.expert_domain");
    // The rows each rank sends each, and what each computes per expert.
    link_model::matrix slots = links_.zeros();
    std::vector<double> received(static_cast<std::size_t>(R) * E_, 0.0);
    bool relabel = false;
    for (std::int32_t r = 0; r < R; ++r) {
      relabel = relabel || domains.position_of(r) != r;
      for (std::int32_t e = 0; e < E_; ++e) {
        std::int64_t const c = counts.data[static_cast<std::int64_t>(r) * E_ + e];
        detail::require(c >= 0, op, "argument 'counts' holds ", c, " slots of rank ", r, " to expert ", e, "; counts are >= 0");
        auto const n = static_cast<double>(c);
        std::int32_t const d = domains.computing_rank(r, e / L);
        slots[links_.cell(r, d)] += n;
        received[static_cast<std::size_t>(d) * E_ + e] += n;
      }
    }
    std::vector<std::vector<std::int32_t>> same_offset;
    for (std::int32_t o = 0; o < S; ++o) same_offset.push_back(domains.same_offset(o));
    double const route = links_.allgather_seconds(same_offset, 8.0 * E_) + links_.launches(exchange_adviser::plan_kernels + (relabel ? 1 : 0));
    exchange_prediction const x = exchanges_.flat(slots, tokens, row_bytes(), route);
    // The gather's (and the reduce-scatter's) messages: L experts to every other member.
    double const expert_bytes = 2.0 * static_cast<double>(H_) * static_cast<double>(F_) * element_bytes_, own = L * expert_bytes;
    link_model::matrix members = links_.zeros();
    for (std::int32_t j = 0; j < R / S; ++j)
      for (std::int32_t a : domains.members(j))
        for (std::int32_t b : domains.members(j))
          if (a != b) members[links_.cell(a, b)] = own;
    double const round = S > 1 ? links_.round_seconds(members) : 0.0;
    double const staging = L * links_.memory_seconds(2 * expert_bytes), lane = links_.memory_seconds(2 * own) + round;
    // The gather and the dispatch side by side: the experts start when the later of the two is in,
    // and no earlier than both sets of messages take as one round (the dispatch's memory passes added).
    link_model::matrix tokens_out = slots;
    for (double& b : tokens_out) b *= row_bytes();
    link_model::matrix both = members;
    for (std::size_t i = 0; i < both.size(); ++i) both[i] += tokens_out[i];
    double const passes = x.dispatch_seconds - links_.round_seconds(tokens_out);
    double const joint = links_.memory_seconds(2 * own) + links_.round_seconds(both) + passes;
    double const dispatched = pre_expert_seconds + x.route_seconds + x.dispatch_seconds;
    double busiest = 0;
    for (std::int32_t d = 0; d < R; ++d) {
      double t = 0;
      for (std::int32_t e = 0; e < E_; ++e) {
        double const n = received[static_cast<std::size_t>(d) * E_ + e];
        if (n > 0) t += links_.gemm_seconds(4 * n * static_cast<double>(H_) * static_cast<double>(F_), n);
      }
      busiest = std::max(busiest, t);
    }
    hybridep_layout_prediction p;
    p.exchange_seconds = x.route_seconds + 2 * (x.dispatch_seconds + x.combine_seconds);
    p.compute_seconds = 3 * busiest;
    p.exposed_gather_seconds = staging + std::max({dispatched, lane, joint}) - dispatched;
    p.reduce_scatter_seconds = links_.memory_seconds(S * own) + links_.memory_seconds(2 * own) + round +
                               links_.memory_seconds((S + 1) * own) + L * links_.memory_seconds(3 * expert_bytes);
    p.layer_seconds = p.exchange_seconds + p.compute_seconds + p.exposed_gather_seconds + p.reduce_scatter_seconds;
    return p;
  }

 private:
  static constexpr char const* op = "hybridep_layout_model";

  [[nodiscard]] double row_bytes() const { return static_cast<double>(H_) * element_bytes_; }

  link_model links_;
  exchange_adviser exchanges_;
  std::int32_t E_;
  std::int64_t H_, F_;
  double element_bytes_;
};

MOECOMM_NAMESPACE_END
