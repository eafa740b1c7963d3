// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `parm_layout_model`: one routing step of an MoE layer under MP x EP x ESP (`parm_layer`,
//! patterns/parm.hpp), priced on `link_model` from the step's exact rows, for the pattern adviser.
//! `parm_cost_model` is Parm's own rule (balanced loads, two link classes); this one sees the
//! routing: a hot expert's rank receives and computes more, and each message crosses the links it
//! really crosses.
//!
//! The layout, as `parallel_groups` builds it with DP 1: R ranks, MP groups of M consecutive ranks,
//! which all hold the group's tokens (the same routing); MP group g holds experts [g·L, (g+1)·L),
//! L = E·M / R, each cut into G slices (ESP, G divides M: rank g·M + m holds slice m mod G), so the
//! EP group of rank g·M + m is the ranks q·M + m, and its ESP group the G consecutive ranks around it.
//!
//! A step (forward and backward) is priced as the layer runs it:
//! - `route`: the dispatcher's counts all-gathered over each EP group (rings side by side) and its
//!   plan's launches; under PauseMP also the ESP group's all-gather of the received blocks' counts;
//! - `deepspeed_mp`: every rank dispatches all its group's tokens (permute, one all-to-all round, the
//!   chunk sort); each rank's slices compute every row it received, one GEMM per local expert; with
//!   G > 1 the ESP group all-reduces the partial outputs (a reduce-scatter round and an all-gather
//!   round of 1/G of the rows each, their copies and the sum); the mirror back;
//! - PauseMP (`drop_tokens`: G = 1, whole experts; `parm_s1`; `parm_s2` in W pieces): each rank
//!   dispatches its 1/M of the tokens (`row_slice`); the all-to-all round, then the ESP all-gather
//!   of the received rows (one message per member, the blocks unpacked), the chunks sorted by expert
//!   and back, one GEMM per local expert over the ESP group's rows, the ESP reduce-scatter (the
//!   partial sums packed, sent, summed), the all-to-all back, and the MP all-gather of the combined
//!   rows. S2 pipelines the all-to-all with the all-gather (and the reduce-scatter with the
//!   all-to-all back) in W pieces: the first piece's first collective, W − 1 steps in which piece
//!   i's second runs beside piece i + 1's first (one round of both pieces' messages), the last
//!   piece's second;
//! - the backward repeats every collective and memory pass; its GEMMs cost twice the forward's.
//! The gradient sync (`replica_gradients::left_to_trainer`, once per iteration): under PauseMP the
//! M / G ranks of an MP group holding one slice saw different tokens, and all-reduce each local
//! expert's slice gradient, one local expert after the other, the groups side by side
//! (`link_model::allreduce_seconds`); `deepspeed_mp`'s MP peers computed the same gradients.
//! What it leaves out: the gate, the capacity (dropless), and what `link_model` leaves out.

#include <moecomm/config.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/row_slice.hpp>
#include <moecomm/error.hpp>
#include <moecomm/models/exchange_adviser.hpp>
#include <moecomm/models/link_model.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! A Parm layout's schedule and slicing.
struct parm_layout {
  bool pauses_mp = true;            //!< PauseMP (`drop_tokens`, `parm_s1`, `parm_s2`); false: `deepspeed_mp`
  std::int32_t expert_slicing = 1;  //!< G, dividing M
  std::int32_t pieces = 1;          //!< W: S2's pipeline depth (1: S1, or `deepspeed_mp`)
};

//! One layout's predicted step (seconds).
struct parm_layout_prediction {
  double exchange_seconds = 0;  //!< route, the collectives and their memory passes, forward and backward
  double compute_seconds = 0;   //!< the busiest rank's GEMMs, forward and backward
  double layer_seconds = 0;     //!< their sum: one step
  double gradient_sync_seconds = 0;  //!< the slices' gradients over their MP replicas, once per iteration
};

class parm_layout_model {
 public:
  //! @param links the ranks (R, a multiple of `model_parallel`); @param model_parallel M;
  //! @param num_experts E, with E·M / R local experts a rank; @param hidden, @param ffn an expert's
  //! H -> F -> H; @param element_bytes a row's element; @param gradient_bytes a gradient's element.
  //! @throws error (invalid_argument) naming the argument out of range.
  parm_layout_model(link_model links, std::int32_t model_parallel, std::int32_t num_experts, std::int64_t hidden, std::int64_t ffn,
                    double element_bytes, double gradient_bytes)
      : links_(std::move(links)), M_(model_parallel), E_(num_experts), H_(hidden), F_(ffn), element_bytes_(element_bytes),
        gradient_bytes_(gradient_bytes) {
    std::int32_t const R = links_.ranks();
    detail::require(M_ >= 1 && R % M_ == 0, op, "model_parallel = ", M_, " must divide the ", R, " ranks");
    detail::require(E_ > 0 && E_ % (R / M_) == 0, op, "num_experts = ", E_, " must be a positive multiple of the ", R / M_,
                    " MP groups");
    detail::require(H_ > 0 && F_ > 0 && element_bytes_ > 0 && gradient_bytes_ > 0, op, "hidden = ", H_, ", ffn = ", F_,
                    ", element_bytes = ", element_bytes_, " and gradient_bytes = ", gradient_bytes_, " must be positive");
  }

  //! L: the local experts of a rank (each cut into G slices).
  [[nodiscard]] std::int32_t local_experts() const { return E_ * M_ / links_.ranks(); }

  //! One step's rows: `group[g][e]` the slots of MP group g's tokens routed to expert e, `slice[r][e]`
  //! those of rank r's 1/M of them; the group's and the slice's tokens.
  struct step {
    std::vector<double> group, slice, group_tokens, slice_tokens;
  };

  //! `routing[r]`, rank r's routing (host memory), the same on every rank of an MP group (-1 masked;
  //! ids outside [0, E) count as masked: `pattern_adviser::rank` refuses them first).
  //! @throws error (invalid_argument) naming `routing`: one per rank, ids given for its tokens, the
  //!   same on every rank of an MP group (naming the rank that differs).
  [[nodiscard]] step count(std::vector<routing_view> const& routing) const {
    std::int32_t const R = links_.ranks(), groups = R / M_;
    detail::require(static_cast<std::int32_t>(routing.size()) == R, op, "argument 'routing' has ", routing.size(), " ranks' routings; the topology has ", R);
    step s{std::vector<double>(static_cast<std::size_t>(groups) * E_, 0.0), std::vector<double>(static_cast<std::size_t>(R) * E_, 0.0),
           std::vector<double>(static_cast<std::size_t>(groups), 0.0), std::vector<double>(static_cast<std::size_t>(R), 0.0)};
    for (std::int32_t r = 0; r < R; ++r) {
      routing_view const& v = routing[static_cast<std::size_t>(r)];
      routing_view const& first = routing[static_cast<std::size_t>(r - r % M_)];
      detail::require(v.num_tokens >= 0 && v.top_k > 0 && (v.num_tokens == 0 || v.topk_idx != nullptr), op, "routing[", r, "] has ",
                      v.num_tokens, " tokens, top_k ", v.top_k, " and topk_idx ", v.topk_idx == nullptr ? "null" : "given");
      bool same = v.num_tokens == first.num_tokens && v.top_k == first.top_k;
      for (std::int64_t i = 0; same && i < v.num_tokens * v.top_k; ++i) same = v.topk_idx[i] == first.topk_idx[i];
      detail::require(same, op, "routing[", r, "] differs from routing[", r - r % M_, "]: the ranks of an MP group hold the same tokens");
      row_range const mine = row_slice(v.num_tokens, M_, r % M_);
      s.slice_tokens[static_cast<std::size_t>(r)] = static_cast<double>(mine.count);
      for (std::int64_t t = 0; t < v.num_tokens; ++t)
        for (std::int32_t k = 0; k < v.top_k; ++k) {
          std::int32_t const e = v.topk_idx[t * v.top_k + k];
          if (e < 0 || e >= E_) continue;
          if (r % M_ == 0) s.group[static_cast<std::size_t>(r / M_) * E_ + e] += 1;
          if (t >= mine.begin && t < mine.begin + mine.count) s.slice[static_cast<std::size_t>(r) * E_ + e] += 1;
        }
      if (r % M_ == 0) s.group_tokens[static_cast<std::size_t>(r / M_)] = static_cast<double>(v.num_tokens);
    }
    return s;
  }

  //! `layout`'s step (see the file comment) for `s`, what `count` gave.
  //! @throws error (invalid_argument) naming `s` when it is not `count`'s shape, `layout.expert_slicing`
  //!   unless it divides M, or `layout.pieces` unless it is at least 1 (1 unless PauseMP).
  [[nodiscard]] parm_layout_prediction predict(step const& s, parm_layout const& layout) const {
    std::int32_t const R = links_.ranks(), G = layout.expert_slicing, L = local_experts();
    detail::require(s.slice.size() == static_cast<std::size_t>(R) * E_ && s.group.size() == static_cast<std::size_t>(R / M_) * E_ &&
                        s.slice_tokens.size() == static_cast<std::size_t>(R) && s.group_tokens.size() == static_cast<std::size_t>(R / M_),
                    op, "argument 's' is not a step of ", R, " ranks and ", E_, " experts (count's result)");
    detail::require(G >= 1 && M_ % G == 0, op, "layout.expert_slicing = ", G, " must divide model_parallel = ", M_);
    detail::require(layout.pieces >= 1 && (layout.pauses_mp || layout.pieces == 1), op, "layout.pieces = ", layout.pieces,
                    " must be at least 1 (and 1 for deepspeed_mp)");
    double const b = row_bytes();
    // The rows rank r sends for expert e, and each rank's received rows per local expert.
    auto const sent = [&](std::int32_t r, std::int32_t e) {
      return layout.pauses_mp ? s.slice[static_cast<std::size_t>(r) * E_ + e] : s.group[static_cast<std::size_t>(r / M_) * E_ + e];
    };
    link_model::matrix there = links_.zeros();
    std::vector<double> received(static_cast<std::size_t>(R) * L, 0.0), total(static_cast<std::size_t>(R), 0.0);
    std::vector<double> permuted(static_cast<std::size_t>(R), 0.0);  // tokens read and rows written by the permute
    for (std::int32_t r = 0; r < R; ++r) {
      permuted[static_cast<std::size_t>(r)] = layout.pauses_mp ? s.slice_tokens[static_cast<std::size_t>(r)] : s.group_tokens[static_cast<std::size_t>(r / M_)];
      for (std::int32_t e = 0; e < E_; ++e) {
        std::int32_t const d = (e / L) * M_ + r % M_;  // the EP peer holding e
        double const n = sent(r, e);
        there[links_.cell(r, d)] += n * b;
        received[static_cast<std::size_t>(d) * L + e % L] += n;
        total[static_cast<std::size_t>(d)] += n;
        permuted[static_cast<std::size_t>(r)] += n;
      }
    }
    double const permute = busiest(permuted, b);
    std::vector<std::vector<std::int32_t>> ep_groups;  // ranks M apart
    for (std::int32_t m = 0; m < M_; ++m) {
      ep_groups.emplace_back();
      for (std::int32_t r = m; r < R; r += M_) ep_groups.back().push_back(r);
    }
    double route = links_.allgather_seconds(ep_groups, 8.0 * E_) + links_.launches(exchange_adviser::plan_kernels);
    parm_layout_prediction p;
    double forward_exchange = 0;  // one direction's collectives and passes (the backward's are alike)
    double busiest_gemms = 0;
    if (!layout.pauses_mp) {
      for (std::int32_t d = 0; d < R; ++d) busiest_gemms = std::max(busiest_gemms, gemms(received, d, L, G));
      double const sort = busiest(total, 2 * b);
      double esp = 0;  // the all-reduce of the partial outputs: reduce-scatter, then all-gather, of 1/G each
      if (G > 1) {
        link_model::matrix slices = links_.zeros();
        for (std::int32_t d = 0; d < R; ++d)
          for (std::int32_t j = 0; j < G; ++j)
            if (d - d % G + j != d) slices[links_.cell(d, d - d % G + j)] = total[static_cast<std::size_t>(d)] / G * b;
        double const rows = *std::max_element(total.begin(), total.end()) / G * b;
        esp = 2 * round(slices) + links_.memory_seconds(2 * rows + (G + 1) * rows) + links_.memory_seconds(2 * rows);
      }
      forward_exchange = permute + round(there) + sort + esp + sort + round(links_.transposed(there)) + permute;
    } else {
      std::vector<double> gathered(static_cast<std::size_t>(R) * L, 0.0), gathered_total(static_cast<std::size_t>(R), 0.0);
      link_model::matrix to_members = links_.zeros();  // the ESP all-gather: each member's received rows to the others
      std::vector<std::vector<std::int32_t>> esp_groups;
      for (std::int32_t d = 0; d < R; ++d) {
        if (d % G == 0) esp_groups.emplace_back();
        esp_groups.back().push_back(d);
        for (std::int32_t j = d - d % G; j < d - d % G + G; ++j) {
          for (std::int32_t l = 0; l < L; ++l) gathered[static_cast<std::size_t>(d) * L + l] += received[static_cast<std::size_t>(j) * L + l];
          gathered_total[static_cast<std::size_t>(d)] += total[static_cast<std::size_t>(j)];
          if (j != d) to_members[links_.cell(d, j)] = total[static_cast<std::size_t>(d)] * b;
        }
      }
      for (std::int32_t d = 0; d < R; ++d) busiest_gemms = std::max(busiest_gemms, gemms(gathered, d, L, 1) / G);
      route += links_.allgather_seconds(esp_groups, 8.0 * (R / M_) * L);
      double const most = *std::max_element(gathered_total.begin(), gathered_total.end()) * b;
      double const P = R / M_;
      // The all-gather's blocks unpacked (a launch each), the reduce-scatter's packed, this rank's
      // own piece copied and the G pieces summed; with several local experts the chunks sorted
      // by expert and back (sort_chunks).
      copies const unpack{G * P, 2 * most}, pack{G * P + 2, 2 * most + (G + 1) * most / G};
      double const sort = L > 1 ? 2 * links_.memory_seconds(2 * most) : 0.0;
      double const W = layout.pieces;
      link_model::matrix const back = links_.transposed(there), from_members = links_.transposed(to_members);
      double const a2a = pipelined(there, to_members, unpack, W), returned = pipelined(from_members, back, pack, W, true);
      // The MP all-gather of each rank's combined slice.
      link_model::matrix slices = links_.zeros();
      double own = 0;
      for (std::int32_t r = 0; r < R; ++r) {
        own = std::max(own, s.slice_tokens[static_cast<std::size_t>(r)] * b);
        for (std::int32_t j = r - r % M_; j < r - r % M_ + M_; ++j)
          if (j != r) slices[links_.cell(r, j)] = s.slice_tokens[static_cast<std::size_t>(r)] * b;
      }
      double const mp_gather = M_ > 1 ? round(slices) + links_.memory_seconds(2 * own) : 0.0;
      forward_exchange = permute + a2a + sort + returned + permute + mp_gather;
      // The slices' gradients over their M / G replicas: the ranks of an MP group G apart.
      std::vector<std::vector<std::int32_t>> replicas;
      for (std::int32_t g = 0; g < R / M_; ++g)
        for (std::int32_t j = 0; j < G; ++j) {
          replicas.emplace_back();
          for (std::int32_t m = j; m < M_; m += G) replicas.back().push_back(g * M_ + m);
        }
      p.gradient_sync_seconds = L * links_.allreduce_seconds(replicas, 2.0 * static_cast<double>(H_) * static_cast<double>(F_) / G * gradient_bytes_);
    }
    p.exchange_seconds = route + 2 * forward_exchange;
    p.compute_seconds = 3 * busiest_gemms;
    p.layer_seconds = p.exchange_seconds + p.compute_seconds;
    return p;
  }

 private:
  static constexpr char const* op = "parm_layout_model";

  [[nodiscard]] double row_bytes() const { return static_cast<double>(H_) * element_bytes_; }

  //! The largest `rows[r]` through one memory pass of `bytes_per_row` each.
  [[nodiscard]] double busiest(std::vector<double> const& rows, double bytes_per_row) const {
    return links_.memory_seconds(*std::max_element(rows.begin(), rows.end()) * bytes_per_row);
  }

  //! Rank d's forward GEMMs over `rows[d][l]`, one per local expert, on 1/G of each.
  [[nodiscard]] double gemms(std::vector<double> const& rows, std::int32_t d, std::int32_t L, std::int32_t G) const {
    double t = 0;
    for (std::int32_t l = 0; l < L; ++l) {
      double const n = rows[static_cast<std::size_t>(d) * L + l];
      if (n > 0) t += links_.gemm_seconds(4 * n * static_cast<double>(H_) * static_cast<double>(F_) / G, n);
    }
    return t;
  }

  //! One collective round of `m`: nothing when nothing moves (a group of one).
  [[nodiscard]] double round(link_model::matrix const& m) const {
    return std::any_of(m.begin(), m.end(), [](double v) { return v > 0; }) ? links_.round_seconds(m) : 0.0;
  }

  //! The device copies of an ESP collective: a launch per block of every piece, and the bytes they
  //! read and write in all.
  struct copies {
    double launches_per_piece, bytes;
  };

  //! Two dependent collectives, `first` then `second`, in W pieces: piece i's second beside piece
  //! i + 1's first (one round of both pieces' messages); `work` the second's copies, or with
  //! `work_first` the first's.
  [[nodiscard]] double pipelined(link_model::matrix const& first, link_model::matrix const& second, copies const& work, double W,
                                 bool work_first = false) const {
    link_model::matrix a = first, b = second, both = first;
    for (std::size_t i = 0; i < a.size(); ++i) {
      a[i] /= W;
      b[i] /= W;
      both[i] = a[i] + b[i];
    }
    double const piece = work.launches_per_piece * links_.spec().kernel_launch_seconds + work.bytes / W / links_.spec().hbm_bytes_per_second;
    double const one = round(a) + (work_first ? piece : 0.0), two = round(b) + (work_first ? 0.0 : piece);
    double const overlapped = std::max({one, two, round(both) + piece});
    return one + (W - 1) * overlapped + two;
  }

  link_model links_;
  std::int32_t M_, E_;
  std::int64_t H_, F_;
  double element_bytes_, gradient_bytes_;
};

MOECOMM_NAMESPACE_END
