// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! HybridEP's stream model and planner (Yang et al., "HybridEP", arXiv 2510.19470; reference/
//! systems.md §5): how many ranks of a data centre should all-gather each other's experts, so that
//! the tokens for those experts are computed where they are and no longer travel. The paper's code
//! is not public; the formulas below are its §III stream model and §III-E decision rule as
//! systems.md records them, extended to two link classes and to layers over several data centres.
//! Times are in seconds. Like `models/parm_cost_model.hpp`, it predicts and never measures.
//!
//! Symbols: `G` ranks per data centre ("domain"), `K` data centres in the layer's EP group, `N = K·G`
//! ranks, `n` experts per rank, `P_E` bytes of one expert, `D` token bytes a rank sends per all-to-all
//! (its whole dispatch buffer, its own share included: tokens x row bytes x top_k), `Lat_PE` the
//! pre-expert compute (attention and dense FFN, given by the caller), `S = S_ED` ranks per expert
//! domain, a divisor of `N` (of `G` within data centres). Routing is uniform: a rank sends `D/N` to each rank's experts, so every
//! rank predicts the same time and the system's time (the maximum over ranks) is any rank's.
//!
//! Domain partition (§IV-A): the expert domains are runs of `S` positions of the layout
//! `expert_domain_spread` names (across data centres, the default; or within them); a rank's offset
//! is its place in its expert domain. Every rank all-gathers its expert domain's experts, computes
//! its own tokens for them, and sends the tokens for other expert domains' experts to the rank of
//! the same offset there, which now holds them. Each peer's bytes go over `intra` or `inter` as the
//! peer is in the rank's data centre or not; the two classes run side by side (the maximum), and the
//! slowest offset is the layer's. The bullets below give the sums for `within_data_centres`.
//! - All-gather: `|G_AG| = S`, `V_AG = n·P_E·(S − 1)` (§III writes `P_E·(|G_AG| − 1)` for one expert
//!   per GPU; a peer brings its `n`), `Lat_AG = α_intra + V_AG / B_intra`, 0 when `S = 1`.
//! - All-to-all: `|G_A2A| = N/S` same-offset ranks; a rank keeps `S/N` of `D` and sends `V_A2A =
//!   D·(|G_A2A| − 1)/|G_A2A| = D·(N − S)/N` (§III): `D·(G − S)/N` to `G/S − 1` peers in its data centre
//!   over `intra`, `D·(K − 1)/K` to `(K − 1)·G/S` peers in the others over `inter`. Tokens for other
//!   data centres always travel, whatever `S`: the model is the paper's per data centre plus this
//!   cross-domain all-to-all between same-offset ranks. The two link classes run side by side:
//!   `Lat_A2A = max(α_intra + in-DC bytes / B_intra, α_inter + cross-DC bytes / B_inter)`, a class
//!   without bytes costing 0.
//! - `p = (N − S)/(N − 1)`: the share of plain EP's outgoing bytes that still go as tokens (1: plain
//!   EP, `S = 1`; 0: all experts gathered, `S = N`). It is the `p` of §III-E's case formulas, whose
//!   volumes are `V_A2A = p·D·(G − 1)/G` and `V_AG = (1 − p)·(G − 1)·P_E`: both give it for `K = 1`
//!   (`N = G`). It is not the share of pairs `(G/S − 1)/(G − 1)`:
//!   the A2A pairs `G·(G/S − 1)` and the AG pairs `G·(S − 1)` of a data centre sum to `G·(G − 1)` only
//!   for `S = 1` or `S = G`, and an A2A peer receives `S` ranks' share of tokens.
//! - Pairs over the layer (systems.md §5 [I from Table VII]): A2A `N·(N/S − 1)`, AG `N·(S − 1)`.
//! - Streams (§III): `n·Lat_Ep = expert_flops / gemm_flops` (the expert GEMMs a rank runs: every rank
//!   computes `D` bytes of tokens whatever `S`), `Lat_comp = Lat_PE + n·Lat_Ep`, `Lat_comm = Lat_AG +
//!   2·Lat_A2A`, `Lat_ovlp = min(Lat_PE, Lat_AG) + min(n·Lat_Ep, 2·Lat_A2A)`, `total = Lat_comp +
//!   Lat_comm − Lat_ovlp = max(Lat_PE, Lat_AG) + max(n·Lat_Ep, 2·Lat_A2A)`. The paper's overlap adds
//!   `n·Lat_Ep` whole (the GEMMs hide under the all-to-alls); bounding it by `2·Lat_A2A` keeps the
//!   GEMMs in a layer with little or nothing to send (`S = G` on one data centre), and is the paper's
//!   term whenever the GEMMs are the shorter stream, its regime.
//!
//! Decision rule (§III-E), in the paper's setting: one data centre (`K = 1`), one bandwidth `B =
//! B_intra`, no α, the GEMMs hidden. `p* = 1 − B·Lat_PE / (n·P_E·(G − 1))` is the `p` at which
//! `Lat_AG = (1 − p)·(G − 1)·n·P_E / B` equals `Lat_PE`. Case 1, `p ≥ p*` (the all-gather hides under
//! `Lat_PE`): `Lat = Lat_PE + 2D·(G − 1)·p / (G·B)`, increasing in `p`. Case 2, `p < p*`: `Lat =
//! p·(G − 1)·(2D − G·n·P_E) / (B·G) + (G − 1)·n·P_E / B`; if `2D − G·n·P_E < 0` it decreases up to
//! `p*`, so `p = max(p*, 0)` (mixed); if `2D − G·n·P_E ≥ 0`, `p = 0` (all experts gathered). `choose`
//! reports `p*` and this `p` beside its own choice, which prices every divisor `S` with the whole
//! model above (α, two link classes, `K` data centres, the GEMMs) and is the one to follow.
//!
//! Not modelled: the backward pass (the paper's stream model is the forward's), parameter-efficient
//! migration (§IV-B: pass the compressed residual's bytes as `parameter_bytes_per_expert`), the
//! cross-DC traffic's share of a GPU's PCIe link when GPUs talk over PCIe, and skewed routing.

#include <moecomm/config.hpp>
#include <moecomm/core/expert_domains.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/cluster_spec.hpp>
#include <moecomm/planners/detail/workload_scales.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! One link class as a rank sees it: `bytes` to its peers over it take `alpha_seconds + bytes /
//! bytes_per_second`.
struct hybridep_link {
  double alpha_seconds = 0;     //!< α: the fixed cost of one collective, s
  double bytes_per_second = 0;  //!< the bandwidth one rank gets when every rank sends at once, B/s
};

//! The model's constants. The defaults are `from_cluster` of `platforms/hybridep-a800-8.platform`
//! (and of its 16- and 32-GPU siblings, which differ only in the number of data centres): HybridEP's
//! testbed, §V, one 4-A800 node per data centre.
struct hybridep_params {
  //! Inside a data centre (the expert all-gather, the all-to-all between its expert domains): PCIe
  //! 3.0, §V's "128 Gbps" read as 128 Gb/s = 16 GB/s, the platform file's reading; α = the
  //! collective's overhead (8 µs, the file's `collective_overhead_us`) and two PCIe ports of 1 µs. systems.md §5 [I]: Table IV's chosen p (0.75, 0.5) follows only if "128 Gbps" is
  //! 128 GB/s; set `bytes_per_second = 128e9` to model that reading.
  hybridep_link intra{10e-6, 16e9};
  //! Between data centres: §V's 10 Gb/s Ethernet (1.25 GB/s) per data centre, shared by its 4 GPUs
  //! when all send at once: 312.5 MB/s per rank; α = the overhead and the route's PCIe, NIC and
  //! inter-DC latencies twice each (8 + 2 x (1 + 5 + 25) µs, the platform file's, not the paper's).
  hybridep_link inter{70e-6, 312.5e6};
  //! A800 (as A100) BF16 dense tensor throughput, 312 TFLOP/s (product brief; not in the paper), of
  //! which large cuBLAS GEMMs reach about 80 % (the file's `gemm_efficiency`).
  double gemm_flops = 0.8 * 312e12;

  //! The constants a simulated `spec` prices (the routes of `simulation/platform.hpp`):
  //! - `intra`: α = `collective_overhead_seconds` + 2 x `intra_node.latency_seconds`, bandwidth `intra_node.bytes_per_second` (each
  //!   GPU has its own port);
  //! - `inter`: α = `collective_overhead_seconds` + 2 x (`pcie` + `nic` + `fabric` + `inter_domain`
  //!   latencies), bandwidth = the
  //!   smallest of a GPU's `pcie` link and its shares, when all of a data centre's GPUs send at once,
  //!   of its node's NICs (`nics_per_node x nic / gpus_per_node`), of a blocking `fabric` and of the
  //!   data centre's uplink (`inter_domain / gpus_per_node`); with one data centre nothing crosses
  //!   and `inter = intra`;
  //! - `gemm_flops` = `gpu_flops x gemm_efficiency`: large GEMMs (the model does not lower the rate of
  //!   small ones, as the simulated device does below `gemm_ridge_rows`).
  //! @throws error (invalid_argument) from `spec.validate()`, or naming `spec.nodes_per_domain` when
  //!         it is not 1 (the model has one link class inside a data centre: one node, as in §V).
  [[nodiscard]] static hybridep_params from_cluster(cluster_spec const& spec);
};

//! One MoE layer over `domains` data centres of `ranks_per_domain` ranks: what the model needs.
struct hybridep_layer_shape {
  std::int32_t ranks_per_domain = 0;            //!< G: ranks of one data centre
  std::int32_t domains = 1;                     //!< K: data centres in the layer's EP group
  std::int32_t experts_per_rank = 1;            //!< n
  std::int64_t parameter_bytes_per_expert = 0;  //!< P_E: bytes an all-gather moves per expert
  std::int64_t token_bytes = 0;                 //!< D: a rank's dispatch buffer, its own share included
  double pre_expert_seconds = 0;                //!< Lat_PE: attention and dense FFN before the MoE block
  double expert_flops = 0;                      //!< FLOPs of the expert GEMMs one rank runs in the layer
  expert_domain_spread spread = expert_domain_spread::across_data_centres;  //!< where expert domains lie
};

//! The model's terms for one expert-domain size (seconds, bytes per rank).
struct hybridep_prediction {
  std::int32_t expert_domain_ranks = 1;  //!< S = S_ED
  double p = 1;                          //!< (N − S)/(N − 1): plain EP's outgoing bytes still sent as tokens; 1 when N = 1
  std::int64_t a2a_pairs = 0;            //!< N·(N/S − 1): ordered pairs of ranks exchanging tokens
  std::int64_t ag_pairs = 0;             //!< N·(S − 1): ordered pairs of ranks exchanging experts
  double allgather_bytes = 0;            //!< V_AG = n·P_E·(S − 1)
  double a2a_bytes_intra = 0;            //!< to same-offset peers in the rank's data centre (within: D·(G − S)/N)
  double a2a_bytes_inter = 0;            //!< to same-offset peers in other data centres (within: D·(K − 1)/K)
  double allgather = 0;                  //!< Lat_AG
  double a2a = 0;                        //!< Lat_A2A, one all-to-all (dispatch or combine)
  double compute = 0;                    //!< Lat_comp = Lat_PE + n·Lat_Ep
  double communication = 0;              //!< Lat_comm = Lat_AG + 2·Lat_A2A
  double overlap = 0;                    //!< Lat_ovlp = min(Lat_PE, Lat_AG) + min(n·Lat_Ep, 2·Lat_A2A)
  double total = 0;                      //!< Lat_comp + Lat_comm − Lat_ovlp
  double allgather_bytes_inter = 0;      //!< the part of V_AG from peers in other data centres
  //! The backward (not in the paper's model, which is the forward's): the two all-to-alls again, the
  //! gathered experts' gradients reduce-scattered to their owners (the gather's volume, after the
  //! experts' backward: nothing left to hide it), and the GEMMs twice: `2·Lat_A2A + Lat_AG + 2·n·Lat_Ep`.
  double backward = 0;
  double step_total = 0;  //!< total + backward: a training step of the layer after its pre-expert compute
};

//! What `hybridep_planner::choose` decided, and why.
struct hybridep_choice {
  std::int32_t expert_domain_ranks = 1;  //!< the S of the smallest total; the smaller S on a tie
  double p = 1;                          //!< that S's p
  double p_star = 1;                     //!< §III-E's closed form (may be negative; 1 when G = 1)
  double p_rule = 1;                     //!< §III-E's case analysis: max(p*, 0), or 0 when 2D ≥ G·n·P_E
  std::vector<hybridep_prediction> candidates;  //!< every divisor S of G, ascending

  //! The prediction of the chosen S. Precondition: `*this` came from `choose` (it lists every S).
  [[nodiscard]] hybridep_prediction const& chosen() const {
    return *std::find_if(candidates.begin(), candidates.end(),
                         [this](hybridep_prediction const& c) { return c.expert_domain_ranks == expert_domain_ranks; });
  }
};

//! The formulas of the file comment over validated `hybridep_params`. The same arguments always give
//! the same bits.
class hybridep_planner {
 public:
  //! @throws error (invalid_argument) naming the first parameter that is not finite, or not positive
  //!         (an α may be 0).
  explicit hybridep_planner(hybridep_params const& params = {}) : params_(params) {
    require_link("intra", params.intra);
    require_link("inter", params.inter);
    require_positive("gemm_flops", params.gemm_flops);
  }

  [[nodiscard]] hybridep_params const& params() const { return params_; }

  //! This planner for a layer whose token bytes, parameter bytes and FLOPs are `token_bytes`,
  //! `parameter_bytes` and `flops` times those its shape gives (a simulated back-end's
  //! `simulation_scale`). `pre_expert_seconds` is a time and is not scaled. Scales multiply.
  //! @throws error (invalid_argument) naming the first scale that is not finite and positive.
  [[nodiscard]] hybridep_planner scaled(double token_bytes, double parameter_bytes, double flops) const {
    hybridep_planner m = *this;
    m.scales_ = scales_.times("hybridep_planner", token_bytes, parameter_bytes, flops);
    return m;
  }

  //! The model for expert domains of `expert_domain_ranks` ranks.
  //! @throws error (invalid_argument) naming the first field of `shape` out of range, or
  //!         `expert_domain_ranks` when it does not divide `shape.ranks_per_domain`.
  [[nodiscard]] hybridep_prediction predict(hybridep_layer_shape const& shape, std::int32_t expert_domain_ranks) const {
    char const* const op = "hybridep_planner::predict";
    symbols const l = symbols_of(op, shape);
    if (l.within)
      detail::require(expert_domain_ranks >= 1 && shape.ranks_per_domain % expert_domain_ranks == 0, op,
                      "expert_domain_ranks = ", expert_domain_ranks, " does not divide shape.ranks_per_domain = ",
                      shape.ranks_per_domain, " (within_data_centres: an expert domain lies inside a data centre)");
    else
      detail::require(expert_domain_ranks >= 1 && l.ranks % expert_domain_ranks == 0, op, "expert_domain_ranks = ",
                      expert_domain_ranks, " does not divide the ", l.ranks, " ranks");
    return predicted(l, expert_domain_ranks);
  }

  //! HybridEP's choice: every divisor S of `shape.ranks_per_domain` priced, the smallest total kept
  //! (the smaller S on a tie: fewer parameter bytes), with §III-E's p* and rule beside it.
  //! @throws error (invalid_argument) naming the first field of `shape` out of range.
  [[nodiscard]] hybridep_choice choose(hybridep_layer_shape const& shape) const {
    symbols const l = symbols_of("hybridep_planner::choose", shape);
    hybridep_choice c;
    std::size_t best = 0;
    std::int64_t const limit = l.within ? shape.ranks_per_domain : l.ranks;
    for (std::int32_t s = 1; s <= limit; ++s) {
      if (limit % s != 0) continue;
      c.candidates.push_back(predicted(l, s));
      if (c.candidates.back().total < c.candidates[best].total) best = c.candidates.size() - 1;  // strict: ties keep the smaller S
    }
    c.expert_domain_ranks = c.candidates[best].expert_domain_ranks;
    c.p = c.candidates[best].p;
    if (l.G > 1) {
      double const expert_bytes = l.n * l.P_E;  // a peer's n experts
      // §III-E: p* = 1 − B·Lat_PE / (P_E·(G − 1)), B the one bandwidth of the paper's model.
      c.p_star = 1 - params_.intra.bytes_per_second * l.Lat_PE / (expert_bytes * (l.G - 1));
      // §III-E, case 2's slope sign 2D − G·P_E: negative -> mixed at p*, else p = 0.
      c.p_rule = 2 * l.D - l.G * expert_bytes < 0 ? std::max(c.p_star, 0.0) : 0.0;
    }
    return c;
  }

 private:
  //! The file comment's symbols for one checked shape, scaled.
  struct symbols {
    double G, K, N, n, P_E, D, Lat_PE, expert_seconds;
    std::int64_t ranks;  //!< N, for the pair counts
    bool within;         //!< `expert_domain_spread::within_data_centres`
    //! The data centre of the rank at `position` of the expert-domain layout.
    [[nodiscard]] std::int64_t data_centre(std::int64_t position) const {
      return within ? position / static_cast<std::int64_t>(G) : position % static_cast<std::int64_t>(K);
    }
  };

  static void require_positive(char const* name, double value) {
    detail::require(std::isfinite(value) && value > 0, "hybridep_planner", name, " = ", value,
                    " must be finite and positive");
  }

  static void require_link(char const* name, hybridep_link const& link) {
    detail::require(std::isfinite(link.alpha_seconds) && link.alpha_seconds >= 0, "hybridep_planner", name,
                    ".alpha_seconds = ", link.alpha_seconds, " must be finite and >= 0");
    detail::require(std::isfinite(link.bytes_per_second) && link.bytes_per_second > 0, "hybridep_planner", name,
                    ".bytes_per_second = ", link.bytes_per_second, " must be finite and positive");
  }

  //! Checks every field of `shape` (errors name it as `shape.<field>`) and derives the symbols.
  symbols symbols_of(char const* op, hybridep_layer_shape const& s) const {
    auto const at_least_one = [op](char const* name, std::int64_t value) {
      detail::require(value >= 1, op, "shape.", name, " = ", value, " must be at least 1");
    };
    at_least_one("ranks_per_domain", s.ranks_per_domain);
    at_least_one("domains", s.domains);
    at_least_one("experts_per_rank", s.experts_per_rank);
    at_least_one("parameter_bytes_per_expert", s.parameter_bytes_per_expert);
    at_least_one("token_bytes", s.token_bytes);
    auto const finite_non_negative = [op](char const* name, double value) {
      detail::require(std::isfinite(value) && value >= 0, op, "shape.", name, " = ", value,
                      " must be finite and >= 0");
    };
    finite_non_negative("pre_expert_seconds", s.pre_expert_seconds);
    finite_non_negative("expert_flops", s.expert_flops);
    std::int64_t const ranks = std::int64_t{s.domains} * s.ranks_per_domain;
    detail::require(ranks <= std::numeric_limits<std::int32_t>::max(), op, "shape.domains = ", s.domains,
                    " x shape.ranks_per_domain = ", s.ranks_per_domain, " is more ranks than int32 can number");
    symbols l;
    l.G = s.ranks_per_domain;
    l.K = s.domains;
    l.N = static_cast<double>(ranks);
    l.n = s.experts_per_rank;
    l.P_E = static_cast<double>(s.parameter_bytes_per_expert) * scales_.parameter_bytes;
    l.D = static_cast<double>(s.token_bytes) * scales_.token_bytes;
    l.Lat_PE = s.pre_expert_seconds;
    l.expert_seconds = s.expert_flops * scales_.flops / params_.gemm_flops;
    l.ranks = ranks;
    l.within = s.spread == expert_domain_spread::within_data_centres;
    return l;
  }

  //! `bytes` over `link`, nothing when there are none.
  static double over(hybridep_link const& link, double bytes) {
    return bytes > 0 ? link.alpha_seconds + bytes / link.bytes_per_second : 0.0;
  }

  //! Seconds of `intra` bytes and `inter` bytes sent at once over the two link classes.
  double side_by_side(double intra, double inter) const {
    return std::max(over(params_.intra, intra), over(params_.inter, inter));
  }

  hybridep_prediction predicted(symbols const& l, std::int32_t expert_domain_ranks) const {
    std::int64_t const s = expert_domain_ranks, groups = l.ranks / s;
    double const S = static_cast<double>(s);
    hybridep_prediction r;
    r.expert_domain_ranks = expert_domain_ranks;
    r.p = l.N > 1 ? (l.N - S) / (l.N - 1) : 1.0;
    r.a2a_pairs = l.ranks * (groups - 1);
    r.ag_pairs = l.ranks * (s - 1);
    // Each offset o of expert domain 0 (positions [0, S)) stands for its rank; every expert domain
    // is laid out alike. Peers in o's data centre, in its expert domain and in its same-offset group
    // (positions j·S + o); the slowest offset is the layer's.
    double const expert_bytes = l.n * l.P_E, to_each_group = l.D * S / l.N;  // §III: V_AG per peer; D/N per expert domain's rank
    for (std::int64_t o = 0; o < s; ++o) {
      std::int64_t const dc = l.data_centre(o);
      double gather_near = -1, a2a_near = -1;  // peers in o's data centre, o itself excluded below
      for (std::int64_t q = 0; q < s; ++q) gather_near += l.data_centre(q) == dc;
      for (std::int64_t j = 0; j < groups; ++j) a2a_near += l.data_centre(j * s + o) == dc;
      double const gather_far = S - 1 - gather_near, a2a_far = static_cast<double>(groups) - 1 - a2a_near;
      // §III: Lat_AG over V_AG = n·P_E·(|G_AG| − 1), |G_AG| = S; Lat_A2A over V_A2A = D·(|G_A2A| − 1)/|G_A2A|,
      // |G_A2A| = N/S; each split by where the peers are.
      double const allgather = side_by_side(gather_near * expert_bytes, gather_far * expert_bytes);
      double const a2a = side_by_side(a2a_near * to_each_group, a2a_far * to_each_group);
      if (o > 0 && allgather + 2 * a2a <= r.allgather + 2 * r.a2a) continue;
      r.allgather = allgather;
      r.a2a = a2a;
      r.allgather_bytes = (S - 1) * expert_bytes;
      r.allgather_bytes_inter = gather_far * expert_bytes;
      r.a2a_bytes_intra = a2a_near * to_each_group;
      r.a2a_bytes_inter = a2a_far * to_each_group;
    }
    // §III: Lat_comp, Lat_comm = Lat_AG + 2·Lat_A2A, Lat_ovlp (GEMM overlap bounded, file comment).
    r.compute = l.Lat_PE + l.expert_seconds;
    r.communication = r.allgather + 2 * r.a2a;
    r.overlap = std::min(l.Lat_PE, r.allgather) + std::min(l.expert_seconds, 2 * r.a2a);
    // Lat_comp + Lat_comm − Lat_ovlp, in the form that rounds once per stream.
    r.total = std::max(l.Lat_PE, r.allgather) + std::max(l.expert_seconds, 2 * r.a2a);
    r.backward = 2 * r.a2a + r.allgather + 2 * l.expert_seconds;
    r.step_total = r.total + r.backward;
    return r;
  }

  hybridep_params params_;
  detail::workload_scales scales_;  //!< see `scaled`
};

inline hybridep_params hybridep_params::from_cluster(cluster_spec const& spec) {
  spec.validate();
  detail::require(spec.nodes_per_domain == 1, "hybridep_params::from_cluster", "spec.nodes_per_domain = ",
                  spec.nodes_per_domain,
                  " must be 1: the model has one link class inside a data centre (one node per data centre, as in "
                  "HybridEP sec. V)");
  hybridep_params p;
  double const overhead = spec.collective_overhead_seconds;
  p.intra = {overhead + 2 * spec.intra_node.latency_seconds, spec.intra_node.bytes_per_second};
  p.gemm_flops = spec.gemm_flops();
  if (spec.domains == 1) {
    p.inter = p.intra;  // never used: nothing leaves the one data centre
    return p;
  }
  double per_gpu = std::min({spec.pcie.bytes_per_second, spec.nics_per_node * spec.nic.bytes_per_second / spec.gpus_per_node,
                             spec.inter_domain.bytes_per_second / spec.gpus_per_node});
  if (spec.fabric.bytes_per_second > 0)  // 0: non-blocking
    per_gpu = std::min(per_gpu, spec.fabric.bytes_per_second / spec.gpus_per_node);
  p.inter = {overhead + 2 * (spec.pcie.latency_seconds + spec.nic.latency_seconds + spec.fabric.latency_seconds +
                             spec.inter_domain.latency_seconds),
             per_gpu};
  return p;
}

MOECOMM_NAMESPACE_END
