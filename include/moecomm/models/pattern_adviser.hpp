// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `pattern_adviser`: which expert-parallel pattern, and which setting of it, to train a model with
//! on a cluster, ranked by the predicted iteration time, from the platform's figures and one routing
//! step, without running anything. What none of the peers offers: DeepEP, Tutel and Megatron each
//! run their own exchange; this compares the published patterns on one cost model.
//!
//! @code
//! moecomm::pattern_adviser const adviser(platform.spec(), moecomm::topology(64, 8), gpt, {256, 2048, 2, 8});  // 8 slots a GPU
//! for (auto const& p : adviser.rank(routing_of_every_rank)) std::cout << p.pattern << " " << p.setting << "\n";
//! @endcode
//!
//! The candidates that hold every expert once (E / R per rank, expert e on rank e / (E / R)):
//! - `expert_parallel` with each exchange `exchange_adviser` ranks (`flat`, `hierarchical_2d`,
//!   `dedup_per_rank`, `dedup_per_node`), and with the smart schedule (FasterMoE §4.2,
//!   `smart_schedule{g}`) for each group size g that divides R (powers of two below R);
//! - `fastermoe` shadowing (§4.1, Algorithm 1 with `fastermoe_params()`), with `flat` and with each
//!   smart schedule, its replicas moved on `collective_path`;
//! - `pro_prophet`: Pro-Prophet's planner (replicas on subsets, `proprophet_params()`), `flat`, its
//!   transfers exposed (the planner without the block-wise scheduler).
//! When the ranks span several data centres (the topology's domains), HybridEP's expert domains
//! (patterns/hybridep.hpp, `flat`), each size S > 1 and spread whose S·L gathered experts fit in the
//! slots (L = E / R), priced by `hybridep_layout_model`: the gather under the block's attention
//! (`transformer_shape::attention_forward_flops`), the route and the dispatch, the exchange over the
//! same-offset groups, the gradients reduce-scattered to their owners in the step.
//! When `moe.slots_per_rank` gives a rank room for more than E / R experts, the layouts that hold
//! experts several times, each with every exchange:
//! - `expert_data_parallel`: Megatron-LM's EP x expert-DP, plain EP inside groups of P consecutive
//!   ranks (each its own communicator), every group holding every expert, for each P that fits;
//! - `finemoe`: FineMoE's exact min-max split over its `symmetric` placement (`cyclic`, when R·S / E
//!   divides R) and its `asymmetric` one (`from_loads` on this step's loads, its re-placement's
//!   steady state);
//! - `flexmoe`: FlexMoE's even split over the placement its planner settles on for this step's loads
//!   (`flexmoe_options()`, from `from_loads` on equal loads; the moves themselves are not priced).
//! When the model is tensor-parallel (`transformer_shape::model_parallel` M > 1, MP groups of M
//! consecutive ranks holding the same tokens), Parm's layouts instead (patterns/parm.hpp, DP 1, EP
//! over the R / M MP groups), each slicing G of M whose slices fit in the slots (L / G whole
//! experts a rank, L = E·M / R): `deepspeed_mp` (every MP rank dispatches all the group's tokens),
//! `drop_tokens` (DeepSpeed-MoE's deduplicated dispatch: `parm_s1` on whole experts, G = 1),
//! `parm_s1` and `parm_s2` with 2 and 4 pieces, each priced by `parm_layout_model`.
//! Each is priced as the layer runs it (`expert_parallel_layer`, `replicated_expert_layer`), on
//! `link_model`:
//! - a non-pipelined step is `route`, then dispatch, the experts' forward and combine, then the
//!   backward's dispatch, the experts' backward and combine; the exchanges are `exchange_adviser`'s
//!   (the backward's equal the forward's), the experts the busiest rank's GEMMs, one per expert (per
//!   slot) at its rows' roofline (`cluster_spec::gemm_seconds`), the backward twice the forward's FLOPs;
//! - a shadowed step adds the plan's rebuild, one broadcast (forward) and one reduce (backward) per
//!   replicated expert over every rank (`link_model::chain_seconds`), and drops the replicated
//!   experts' rows from the exchange: each rank that holds a replica computes its own rows of it;
//! - a replicated layout's step is the exchange of its slots (each slot relabeled to the replica its
//!   split gives it, as the layer's runs do), after the layer's all-gather of the real counts and
//!   their plan; each expert's gradient is all-reduced over its replicas once per iteration (the
//!   trainer's expert-DP reduction, `replica_gradients::left_to_trainer`), the replica groups of a
//!   slot row side by side (`link_model::allreduce_seconds`), one row after the other;
//! - the smart schedule's R / g pairwise rounds run one after the other while a lane computes each
//!   round's rows (one GEMM per source rank and expert) as soon as they arrive, then each round's
//!   results return as soon as they are computed; the adviser runs that pipeline per rank.
//! - the iteration is, per MoE layer, a step per micro-batch and one gradient sync, and
//!   `iteration_model`'s rest (the dense compute, the gradients' all-reduce, the optimizer over the
//!   rank's experts or slots): the more micro-batches an iteration accumulates, the less the
//!   replicated layouts' sync weighs.
//! What it leaves out: everything `link_model` leaves out (notably the SMs communication takes from
//! overlapped compute), FasterMoE's and Pro-Prophet's overlap of the replicas' transfers with other
//! blocks, FlexMoE's and FineMoE's replica moves (amortised over their intervals), the memory the
//! replicas' optimizer state takes beyond the slots, HybridEP's codec and its exchanges other than
//! `flat`, and, with tensor parallelism, the single-copy and replicated patterns above (they would
//! run on each MP rank's share of the tokens, as `drop_tokens` does); docs/performance.md, "The
//! pattern adviser", validates the rest against the simulation.

#include <moecomm/config.hpp>
#include <moecomm/core/placement.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>
#include <moecomm/planners/fastermoe_cost_model.hpp>
#include <moecomm/models/exchange_adviser.hpp>
#include <moecomm/planners/flexmoe_planner.hpp>
#include <moecomm/models/hybridep_layout_model.hpp>
#include <moecomm/models/iteration_model.hpp>
#include <moecomm/models/link_model.hpp>
#include <moecomm/models/parm_layout_model.hpp>
#include <moecomm/planners/proprophet_planner.hpp>
#include <moecomm/planners/replica_assignment.hpp>
#include <moecomm/planners/replica_schedule.hpp>
#include <moecomm/planners/shadow_selection.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! The MoE layers' experts: `num_experts` MLPs H -> `expert_ffn` -> H (H the model's `hidden`),
//! without biases, rows and parameters of `element_bytes` each.
struct moe_layer_shape {
  std::int32_t num_experts = 0;
  std::int64_t expert_ffn = 0;
  double element_bytes = 2;
  //! S, the expert slots of memory a rank gives each MoE layer, in [E / R, E]; 0 means E / R (each
  //! expert held once). Above E / R, the layouts that replicate experts become candidates.
  std::int32_t slots_per_rank = 0;
};

//! One candidate's predicted times (seconds).
struct pattern_prediction {
  //! "expert_parallel", "fastermoe", "pro_prophet" (every expert held once, the last two shadowing
  //! some), "hybridep" (expert domains gathering each other's experts for the step),
  //! "expert_data_parallel", "finemoe", "flexmoe" (experts replicated in `slots_per_rank`);
  //! with tensor parallelism (`transformer_shape::model_parallel` > 1) Parm's layouts instead:
  //! "deepspeed_mp", "drop_tokens" (`parm_s1` on whole experts), "parm_s1", "parm_s2"
  std::string pattern;
  //! its exchange: "flat", "hierarchical_2d", "dedup_per_rank", "dedup_per_node", "smart_schedule{4}";
  //! Parm's layouts: the expert slicing and S2's pieces, "ESP 2" or "ESP 2, 4 pieces"; HybridEP's:
  //! the expert domain's size, "S 4"
  std::string setting;
  //! How the replicated layouts hold the experts: "EP 8 x EDP 2" (`expert_data_parallel`),
  //! "symmetric" or "asymmetric" (`finemoe`), "planned" (`flexmoe`); Parm's layouts "MP 4 x EP 4";
  //! HybridEP's "across data centres" or "within data centres"; empty for the others.
  std::string placement;
  //! ranks of an expert-parallel group: R, `expert_data_parallel`'s P, HybridEP's R / S (a same-offset group)
  std::int32_t ep_size = 0;
  //! The replicated layouts' slot table `[rank * S + local]` (`replica_placement::slot_experts`;
  //! the expert in each slot, -1 empty); empty when every expert is held once.
  std::vector<std::int32_t> slot_experts;
  std::int32_t replicated = 0;  //!< experts held more than once (the shadowing patterns': those the planner replicated)
  double exchange_seconds = 0;  //!< route and the row exchanges of forward and backward, with their memory passes
  double compute_seconds = 0;   //!< the experts' forward and backward on the busiest rank
  //! the replicas' parameters out and gradients back (HybridEP: the gather's exposed part and the reduce-scatter)
  double replica_seconds = 0;
  //! One MoE layer step, forward and backward: the parts' sum, or less when the smart schedule
  //! overlaps the exchange with the experts.
  double layer_seconds = 0;
  //! The replicated layouts: each expert's gradient all-reduced over its replicas, once per
  //! iteration and MoE layer (the trainer's expert-data-parallel reduction, outside the layer step).
  double gradient_sync_seconds = 0;
  //! `moe_layers` times (`micro_batches` layer steps and one gradient sync), and the rest of the iteration
  double iteration_seconds = 0;
};

class pattern_adviser {
 public:
  //! @param spec the cluster; @param topo its first ranks (`topology(R, gpus_per_node, nodes_per_domain)`);
  //! @param model the transformer (validated; its `hidden` is the experts' H); @param moe its experts.
  //! @throws error (invalid_argument) naming the field that is invalid: `spec`'s, `model`'s,
  //!   `moe.num_experts` (a positive multiple of the ranks), `moe.expert_ffn`, `moe.element_bytes`
  //!   (positive and finite).
  pattern_adviser(cluster_spec spec, topology topo, transformer_shape model, moe_layer_shape moe)
      : links_(spec, topo), exchanges_(spec, topo), iteration_(spec, topo.num_ranks(), model), moe_(validated(moe, topo.num_ranks())),
        parm_(links_, model.model_parallel, moe.num_experts, model.hidden, moe.expert_ffn, moe.element_bytes, model.gradient_bytes),
        hybridep_(links_, moe.num_experts, model.hidden, moe.expert_ffn, moe.element_bytes) {
    expert_chain_seconds_ = links_.chain_seconds(expert_parameters() * moe.element_bytes);
  }

  //! FasterMoE's model as the adviser plans shadowing with it: the experts' shape, GEMMs at the
  //! platform's large-GEMM rate, a node's NICs between nodes and a GPU's port inside one.
  [[nodiscard]] fastermoe_cost_params fastermoe_params() const {
    cluster_spec const& s = links_.spec();
    fastermoe_cost_params p;
    p.alpha = static_cast<double>(moe_.expert_ffn) / static_cast<double>(hidden());
    p.hidden = hidden();
    p.bytes_per_element = moe_.element_bytes;
    p.gemm_flops = s.gemm_flops();
    p.net_bandwidth = s.nics_per_node * s.nic.bytes_per_second;
    p.local_bandwidth = s.intra_node.bytes_per_second;
    return p;
  }

  //! Pro-Prophet's model as the adviser plans with it: the experts' shape, the platform's GEMM rate
  //! (no FLOP factor), a GPU's share of its node's NICs for the all-to-all and the transfers, the
  //! model's sequences for FNEC.
  [[nodiscard]] proprophet_cost_params proprophet_params() const {
    cluster_spec const& s = links_.spec();
    transformer_shape const& m = iteration_.shape();
    proprophet_cost_params p;
    p.hidden = hidden();
    p.bytes_per_element = moe_.element_bytes;
    p.mlp_ratio = static_cast<double>(moe_.expert_ffn) / static_cast<double>(hidden());
    p.compute_flops = s.gemm_flops();
    p.flop_scale = 1;
    double const share = links_.topo().num_nodes() > 1 ? s.nics_per_node * s.nic.bytes_per_second / s.gpus_per_node
                                                       : s.intra_node.bytes_per_second;
    p.a2a_bandwidths = {share, share, share, share};
    p.trans_bandwidth = p.agg_bandwidth = share;
    p.sequences_per_device = m.tokens_per_rank / m.sequence;
    p.seq_length = m.sequence;
    return p;
  }

  //! Pro-Prophet's planner options as the adviser runs it: its transfers exposed.
  [[nodiscard]] static proprophet_planner_options proprophet_options() {
    proprophet_planner_options o;
    o.schedule = proprophet_schedule::planner_only;
    return o;
  }

  //! The smart schedule's group sizes the adviser tries: the powers of two below R that divide it.
  [[nodiscard]] std::vector<std::int32_t> group_sizes() const {
    std::vector<std::int32_t> g;
    for (std::int32_t s = 1; s < links_.ranks(); s *= 2)
      if (links_.ranks() % s == 0) g.push_back(s);
    return g;
  }

  //! Every candidate for one routing step, fastest iteration first. `routing[r]` is rank r's
  //! routing (host memory; -1 masked).
  //! @throws error (invalid_argument) naming the argument: one routing per rank, each of the same
  //!   top_k in [1, E] with its ids given, ids in [-1, E).
  [[nodiscard]] std::vector<pattern_prediction> rank(std::vector<routing_view> const& routing) const {
    std::int32_t const R = links_.ranks(), E = moe_.num_experts;
    detail::require(static_cast<std::int32_t>(routing.size()) == R, op, "argument 'routing' has ", routing.size(),
                    " ranks' routings; the topology has ", R);
    step const s = count(routing);
    std::vector<pattern_prediction> out;
    if (iteration_.shape().model_parallel > 1) {
      add_parm(out, routing);
      std::stable_sort(out.begin(), out.end(), [](auto const& a, auto const& b) { return a.iteration_seconds < b.iteration_seconds; });
      return out;
    }
    std::vector<std::uint8_t> const none(static_cast<std::size_t>(R) * static_cast<std::size_t>(E), 0);
    for (exchange_prediction const& x : exchanges_.rank(routing, E, row_bytes()))
      out.push_back(shadowed("expert_parallel", x.algorithm, x, s, none, 0));
    for (std::int32_t g : group_sizes()) out.push_back(pipelined("expert_parallel", g, s, none, 0));

    std::vector<std::int32_t> owner(static_cast<std::size_t>(E));
    for (std::int32_t e = 0; e < E; ++e) owner[static_cast<std::size_t>(e)] = e / (E / R);

    shadow_decision const faster = select_shadowed_experts(fastermoe_cost_model(fastermoe_params()), links_.topo(), owner, s.counts_view());
    std::vector<std::uint8_t> const faster_home = holders(faster);
    auto const n_faster = static_cast<std::int32_t>(faster.shadowed.size());
    out.push_back(shadowed("fastermoe", "flat", exchange_without(routing, faster_home), s, faster_home, n_faster));
    for (std::int32_t g : group_sizes()) out.push_back(pipelined("fastermoe", g, s, faster_home, n_faster));

    shadow_decision const prophet = select_proprophet_replicas(proprophet_cost_model(proprophet_params()), links_.topo(), owner,
                                                               s.counts_view(), proprophet_options());
    std::vector<std::uint8_t> const prophet_home = holders(prophet);
    out.push_back(shadowed("pro_prophet", "flat", exchange_without(routing, prophet_home), s, prophet_home,
                           static_cast<std::int32_t>(prophet.shadowed.size())));
    if (links_.topo().num_domains() > 1) add_hybridep(out, s);

    std::int32_t const S = slots();
    if (S > local_experts()) {
      for (std::int32_t P : ep_group_sizes())
        add_replicated(out, routing, s, "expert_data_parallel", "EP " + std::to_string(P) + " x EDP " + std::to_string(R / P),
                       replica_placement::per_domain(R, E / P, P), split::in_group, P);
      if ((R * S) % E == 0 && R % (R * S / E) == 0)
        add_replicated(out, routing, s, "finemoe", "symmetric", replica_placement::cyclic(R, S, R * S / E), split::min_max, R);
      std::vector<double> const loads(s.loads.begin(), s.loads.end());
      add_replicated(out, routing, s, "finemoe", "asymmetric", replica_placement::from_loads(R, S, loads, placement_seed), split::min_max, R);
      add_replicated(out, routing, s, "flexmoe", "planned", flexmoe_placement(s.loads), split::even, R);
    }

    std::stable_sort(out.begin(), out.end(), [](auto const& a, auto const& b) { return a.iteration_seconds < b.iteration_seconds; });
    return out;
  }

  //! FlexMoE's planner options as the adviser plans with them: a token row's GEMMs (forward and
  //! backward, at the large-GEMM rate) and its four crossings at a GPU's share of the links (as
  //! `proprophet_params`), an expert's parameters and Adam's 12 bytes of state each moved at that
  //! share, FlexMoE's interval of 50 steps.
  [[nodiscard]] flexmoe_planner_options flexmoe_options() const {
    proprophet_cost_params const shares = proprophet_params();
    flexmoe_planner_options o;
    double const row_flops = 4.0 * static_cast<double>(hidden()) * static_cast<double>(moe_.expert_ffn);
    o.seconds_per_row = 3 * row_flops / links_.spec().gemm_flops() + 4 * row_bytes() / shares.trans_bandwidth;
    o.bytes_per_replica = expert_parameters() * (moe_.element_bytes + 12);
    o.move_bytes_per_second = shares.trans_bandwidth;
    return o;
  }

  //! FlexMoE's placement once its planner has settled on `loads` (`[E]`, each expert's slots in
  //! a step): from every expert replicated alike (`from_loads` on equal loads), each interval's
  //! moves applied, until an interval plans none (at most `flexmoe_intervals`).
  //! @throws error (invalid_argument) naming `loads` when it has not one entry per expert (a negative
  //!   one: `plan_replica_moves`' error).
  [[nodiscard]] replica_placement flexmoe_placement(std::vector<std::int64_t> const& loads) const {
    std::int32_t const E = moe_.num_experts;
    detail::require(loads.size() == static_cast<std::size_t>(E), "pattern_adviser::flexmoe_placement", "argument 'loads' has ",
                    loads.size(), " entries; the layer has ", E, " experts");
    replica_placement p = replica_placement::from_loads(links_.ranks(), slots(), std::vector<double>(static_cast<std::size_t>(E), 1.0), placement_seed);
    flexmoe_planner_options const options = flexmoe_options();
    for (int i = 0; i < flexmoe_intervals; ++i) {
      placement_decision const d = plan_replica_moves(p, {loads.data(), E}, options);
      if (d.moves.empty()) break;
      p = apply_replica_moves(p, {d.moves.data(), static_cast<std::int64_t>(d.moves.size())});
    }
    return p;
  }

  //! `expert_data_parallel`'s EP group sizes: the divisors P < R of R that divide E with E / P
  //! experts fitting in `slots_per_rank`.
  [[nodiscard]] std::vector<std::int32_t> ep_group_sizes() const {
    std::vector<std::int32_t> sizes;
    for (std::int32_t P = 1; P < links_.ranks(); ++P)
      if (links_.ranks() % P == 0 && moe_.num_experts % P == 0 && moe_.num_experts / P <= slots()) sizes.push_back(P);
    return sizes;
  }

  //! S: `moe.slots_per_rank`, or E / R when it is 0.
  [[nodiscard]] std::int32_t slots() const { return moe_.slots_per_rank > 0 ? moe_.slots_per_rank : local_experts(); }

  [[nodiscard]] iteration_model const& iteration() const noexcept { return iteration_; }

  static constexpr std::uint64_t placement_seed = 1;  //!< `from_loads`' draw, for FineMoE's asymmetric and FlexMoE's first placements
  static constexpr int flexmoe_intervals = 16;
  static constexpr std::int32_t parm_pieces[] = {2, 4};  //!< S2's pipeline depths the adviser tries

 private:
  static constexpr char const* op = "pattern_adviser";

  //! `moe`, checked against the R ranks before any member uses it (see the constructor).
  static moe_layer_shape validated(moe_layer_shape const& moe, std::int32_t R) {
    detail::require(moe.num_experts > 0 && moe.num_experts % R == 0, op, "moe.num_experts = ", moe.num_experts,
                    " must be a positive multiple of the ", R, " ranks");
    detail::require(moe.expert_ffn > 0, op, "moe.expert_ffn = ", moe.expert_ffn, " must be positive");
    detail::require(moe.element_bytes > 0 && std::isfinite(moe.element_bytes), op, "moe.element_bytes = ", moe.element_bytes,
                    " must be positive and finite");
    detail::require(moe.slots_per_rank == 0 || (moe.slots_per_rank >= moe.num_experts / R && moe.slots_per_rank <= moe.num_experts), op,
                    "moe.slots_per_rank = ", moe.slots_per_rank, " must be 0 or in [num_experts / ranks = ", moe.num_experts / R,
                    ", num_experts = ", moe.num_experts, "]");
    return moe;
  }

  //! One routing step: `counts[s][e]`, the slots rank s routes to expert e; `loads[e]`, every
  //! rank's slots of expert e; each rank's tokens.
  struct step {
    std::vector<std::int64_t> counts, loads;
    std::vector<double> tokens;
    [[nodiscard]] array_view<std::int64_t const> counts_view() const { return {counts.data(), static_cast<std::int64_t>(counts.size())}; }
  };

  //! `s.counts[r][e]` as rows to price.
  [[nodiscard]] double rows(step const& s, std::int32_t r, std::int32_t e) const { return static_cast<double>(s.counts[at(r, e)]); }

  [[nodiscard]] std::int64_t hidden() const { return iteration_.shape().hidden; }
  [[nodiscard]] double row_bytes() const { return static_cast<double>(hidden()) * moe_.element_bytes; }
  [[nodiscard]] std::int32_t local_experts() const { return moe_.num_experts / links_.ranks(); }
  [[nodiscard]] std::size_t at(std::int32_t s, std::int32_t e) const {
    return static_cast<std::size_t>(s) * static_cast<std::size_t>(moe_.num_experts) + static_cast<std::size_t>(e);
  }

  [[nodiscard]] step count(std::vector<routing_view> const& routing) const {
    std::int32_t const R = links_.ranks(), E = moe_.num_experts;
    std::size_t const cells = static_cast<std::size_t>(R) * static_cast<std::size_t>(E);
    step s{std::vector<std::int64_t>(cells, 0), std::vector<std::int64_t>(static_cast<std::size_t>(E), 0),
           std::vector<double>(static_cast<std::size_t>(R), 0.0)};
    detail::require(routing[0].top_k >= 1 && routing[0].top_k <= E, op, "top_k = ", routing[0].top_k, " must be in [1, num_experts = ", E,
                    "]: a token's slots name distinct experts");
    for (std::int32_t r = 0; r < R; ++r) {
      routing_view const& v = routing[static_cast<std::size_t>(r)];
      detail::require(v.top_k > 0 && v.top_k == routing[0].top_k, op, "routing[", r, "].top_k = ", v.top_k,
                      "; routing[0].top_k = ", routing[0].top_k, " (every rank's, positive)");
      detail::require(v.num_tokens >= 0 && (v.num_tokens == 0 || v.topk_idx != nullptr), op, "routing[", r, "] has ",
                      v.num_tokens, " tokens and topk_idx ", v.topk_idx == nullptr ? "null" : "given");
      s.tokens[static_cast<std::size_t>(r)] = static_cast<double>(v.num_tokens);
      for (std::int64_t i = 0; i < v.num_tokens * v.top_k; ++i) {
        std::int32_t const e = v.topk_idx[i];
        detail::require(e >= -1 && e < E, op, "routing[", r, "] token ", i / v.top_k, " slot ", i % v.top_k, " names expert ",
                        e, ", not one of the ", E, " (or -1)");
        if (e >= 0) ++s.counts[at(r, e)], ++s.loads[static_cast<std::size_t>(e)];
      }
    }
    return s;
  }

  //! `[R][E]`: 1 where rank s computes its own rows of expert e (it holds a replica).
  [[nodiscard]] std::vector<std::uint8_t> holders(shadow_decision const& d) const {
    std::int32_t const R = links_.ranks();
    std::vector<std::uint8_t> h(static_cast<std::size_t>(R) * static_cast<std::size_t>(moe_.num_experts), 0);
    for (std::size_t i = 0; i < d.shadowed.size(); ++i) {
      std::int32_t const e = d.shadowed[i];
      if (d.subset_offsets.empty()) {
        for (std::int32_t s = 0; s < R; ++s) h[at(s, e)] = 1;
        continue;
      }
      for (std::int32_t k = d.subset_offsets[i]; k < d.subset_offsets[i + 1]; ++k) h[at(d.subset_ranks[static_cast<std::size_t>(k)], e)] = 1;
    }
    return h;
  }

  //! `flat`'s exchange of `routing` with the slots a rank computes itself (`home`) taken out.
  [[nodiscard]] exchange_prediction exchange_without(std::vector<routing_view> const& routing, std::vector<std::uint8_t> const& home) const {
    std::vector<std::vector<std::int32_t>> ids(routing.size());
    std::vector<routing_view> kept(routing);
    for (std::size_t r = 0; r < routing.size(); ++r) {
      routing_view const& v = routing[r];
      ids[r].assign(v.topk_idx, v.topk_idx + v.num_tokens * v.top_k);
      for (std::int32_t& e : ids[r])
        if (e >= 0 && home[at(static_cast<std::int32_t>(r), e)]) e = -1;
      kept[r].topk_idx = ids[r].data();
    }
    for (exchange_prediction const& x : exchanges_.rank(kept, moe_.num_experts, row_bytes()))
      if (x.algorithm == "flat") return x;
    return {};  // unreachable: flat is always a candidate
  }

  //! The forward of `rows` rows through one expert: two GEMMs of 2·rows·H·F FLOPs.
  [[nodiscard]] double expert_forward(double rows) const {
    if (rows <= 0) return 0;
    return links_.gemm_seconds(4 * rows * static_cast<double>(hidden()) * static_cast<double>(moe_.expert_ffn), rows);
  }

  //! Rank d's forward of its own experts, one GEMM per expert over the rows the ranks without a
  //! replica send it, and of the replicas it holds, one GEMM each over its own rows.
  [[nodiscard]] double rank_forward(step const& s, std::vector<std::uint8_t> const& home, std::int32_t d) const {
    std::int32_t const L = local_experts(), R = links_.ranks();
    double t = home_forward(s, home, d);
    for (std::int32_t e = d * L; e < (d + 1) * L; ++e) {
      double sum = 0;
      for (std::int32_t r = 0; r < R; ++r)
        if (!home[at(r, e)]) sum += rows(s, r, e);
      t += expert_forward(sum);
    }
    return t;
  }

  //! Rank d's forward of the replicas it holds (the smart schedule's first unit).
  [[nodiscard]] double home_forward(step const& s, std::vector<std::uint8_t> const& home, std::int32_t d) const {
    double t = 0;
    for (std::int32_t e = 0; e < moe_.num_experts; ++e)
      if (home[at(d, e)]) t += expert_forward(rows(s, d, e));
    return t;
  }

  //! Rank d's forward of the rows sources [first, first + sources) send it: one GEMM per source and
  //! expert (the smart schedule's unit of a round).
  [[nodiscard]] double unit_forward(step const& s, std::vector<std::uint8_t> const& home, std::int32_t d, std::int32_t first,
                                    std::int32_t sources) const {
    std::int32_t const L = local_experts();
    double t = 0;
    for (std::int32_t r = first; r < first + sources; ++r)
      for (std::int32_t e = d * L; e < (d + 1) * L; ++e)
        if (!home[at(r, e)]) t += expert_forward(rows(s, r, e));
    return t;
  }

  //! Broadcasts out and reduces back of `n` replicated experts' parameters, one chain each over
  //! every rank (`collective_path`, whatever the subsets).
  [[nodiscard]] double replica_seconds(std::int32_t n) const { return 2.0 * n * expert_chain_seconds_; }

  //! One expert's parameters: two H x F matrices.
  [[nodiscard]] double expert_parameters() const { return 2.0 * static_cast<double>(hidden()) * static_cast<double>(moe_.expert_ffn); }

  //! The iteration around `p.layer_seconds` and `p.gradient_sync_seconds`, a rank holding `slots` experts.
  void finish(pattern_prediction& p, std::int32_t slots) const {
    p.iteration_seconds = iteration_.iteration_seconds(p.layer_seconds, slots * expert_parameters(), p.gradient_sync_seconds);
  }

  //! The busiest rank's forward when the ranks marked in `home` compute their own rows of an expert.
  [[nodiscard]] double busiest_forward(step const& s, std::vector<std::uint8_t> const& home) const {
    double busiest = 0;
    for (std::int32_t d = 0; d < links_.ranks(); ++d) busiest = std::max(busiest, rank_forward(s, home, d));
    return busiest;
  }

  //! A step whose exchanges are `x` (forward and, alike, backward) and whose experts wait for them:
  //! `busiest` the busiest rank's forward, `plans` the route's launches beyond the exchange's, `replicas`
  //! the replicas' broadcasts and reduces.
  [[nodiscard]] pattern_prediction layered(char const* pattern, std::string setting, exchange_prediction const& x, double busiest,
                                           double plans, double replicas) const {
    pattern_prediction p;
    p.pattern = pattern;
    p.setting = std::move(setting);
    p.ep_size = links_.ranks();
    p.exchange_seconds = x.route_seconds + 2 * (x.dispatch_seconds + x.combine_seconds) + plans;
    p.compute_seconds = 3 * busiest;
    p.replica_seconds = replicas;
    p.layer_seconds = p.exchange_seconds + p.compute_seconds + p.replica_seconds;
    return p;
  }

  //! A shadowing pattern's (or plain EP's, `replicated` = 0) layered step: the plan rebuilt when
  //! experts are replicated, their chains out and back.
  [[nodiscard]] pattern_prediction shadowed(char const* pattern, std::string setting, exchange_prediction const& x, step const& s,
                                            std::vector<std::uint8_t> const& home, std::int32_t replicated) const {
    pattern_prediction p = layered(pattern, std::move(setting), x, busiest_forward(s, home),
                                   replicated > 0 ? links_.launches(exchange_adviser::plan_kernels) : 0.0, replica_seconds(replicated));
    p.replicated = replicated;
    finish(p, local_experts());
    return p;
  }

  //! How a replicated layout splits each expert's tokens over its replicas.
  enum class split {
    min_max,  //!< FineMoE's exact min-max schedule and Algorithm 1
    even,     //!< FlexMoE's: each rank's tokens shared evenly
    in_group  //!< Megatron's expert data parallelism: each rank's tokens to its own EP group's replica
  };

  //! The candidates of a layout that holds experts in `placement`'s slots, one per exchange, each
  //! priced as `replicated_expert_layer` runs it (the real counts' all-gather and plan, the split,
  //! the slots' exchange, one GEMM per slot), or, `in_group`, as plain EP on each group's own
  //! communicator, the groups side by side. The replicas' gradients are summed once per iteration.
  void add_replicated(std::vector<pattern_prediction>& out, std::vector<routing_view> const& routing, step const& s, char const* pattern,
                      std::string const& name, replica_placement const& placement, split how, std::int32_t ep_size) const {
    std::int32_t const R = links_.ranks(), E = moe_.num_experts, S = placement.slots_per_rank();
    replica_sets const sets = replica_sets_of(placement);
    array_view<std::int64_t const> const counts_view = s.counts_view();
    replica_assignment a;
    if (how == split::min_max) assign_tokens_finemoe(sets, counts_view, schedule_replicas(sets, s.loads).split, a);
    if (how == split::even) assign_tokens_evenly(sets, counts_view, a);
    if (how == split::in_group) assign_tokens_in_domain(sets, counts_view, [ep_size](std::int32_t r) { return r / ep_size; }, a);
    // Each slot relabeled to its replica's slot id (the layer's runs: a rank's rows of an expert
    // in (token, slot) order, its own replica's first).
    std::vector<std::vector<std::int32_t>> ids(routing.size());
    std::vector<routing_view> by_slot(routing);
    std::vector<std::int64_t> position(static_cast<std::size_t>(E));
    for (std::int32_t r = 0; r < R; ++r) {
      routing_view const& v = routing[static_cast<std::size_t>(r)];
      std::vector<std::int32_t>& id = ids[static_cast<std::size_t>(r)];
      id.assign(v.topk_idx, v.topk_idx + v.num_tokens * v.top_k);
      std::fill(position.begin(), position.end(), 0);
      for (std::int32_t& e : id) {
        if (e < 0) continue;
        std::int32_t const j = a.replica_of(sets, r, e, position[static_cast<std::size_t>(e)]++);
        e = sets.ranks[static_cast<std::size_t>(sets.offsets[static_cast<std::size_t>(e)] + j)] * S + placement.local_index_of(e);
      }
      by_slot[static_cast<std::size_t>(r)].topk_idx = id.data();
    }
    // The rows each slot computes; the busiest rank's forward, one GEMM per slot.
    std::vector<double> slot_rows(static_cast<std::size_t>(R) * static_cast<std::size_t>(S), 0.0);
    std::size_t const K = sets.ranks.size();
    for (std::int32_t e = 0; e < E; ++e)
      for (std::int32_t k = sets.offsets[static_cast<std::size_t>(e)]; k < sets.offsets[static_cast<std::size_t>(e) + 1]; ++k)
        for (std::int32_t r = 0; r < R; ++r)
          slot_rows[static_cast<std::size_t>(sets.ranks[static_cast<std::size_t>(k)] * S + placement.local_index_of(e))] +=
              static_cast<double>(a.take[static_cast<std::size_t>(r) * K + static_cast<std::size_t>(k)]);
    double busiest = 0;
    for (std::int32_t d = 0; d < R; ++d) {
      double t = 0;
      for (std::int32_t l = 0; l < S; ++l) t += expert_forward(slot_rows[static_cast<std::size_t>(d * S + l)]);
      busiest = std::max(busiest, t);
    }
    // The gradients' sync: per slot row, the replica groups of its experts side by side.
    double sync = 0;
    std::int32_t replicated = 0;
    double const gradient_bytes = expert_parameters() * iteration_.shape().gradient_bytes;
    for (std::int32_t l = 0; l < S; ++l) {
      std::vector<std::vector<std::int32_t>> groups;
      for (std::int32_t e = 0; e < E; ++e)
        if (placement.local_index_of(e) == l && placement.replica_count(e) > 1)
          groups.emplace_back(sets.ranks.begin() + sets.offsets[static_cast<std::size_t>(e)],
                              sets.ranks.begin() + sets.offsets[static_cast<std::size_t>(e) + 1]);
      replicated += static_cast<std::int32_t>(groups.size());
      sync += links_.allreduce_seconds(groups, gradient_bytes);
    }
    // In groups, each group's plain EP routes its own counts; replicated, the layer first
    // all-gathers the real counts and builds their plan.
    double const plans = how == split::in_group ? 0.0 : links_.allgather_seconds(8.0 * E) + links_.launches(exchange_adviser::plan_kernels);
    bool const group_in_node = ep_size <= links_.topo().ranks_per_node();
    std::vector<std::vector<std::int32_t>> groups;  // in groups: each group's exchange on its own communicator
    for (std::int32_t r = 0; how == split::in_group && r < R; ++r) {
      if (r % ep_size == 0) groups.emplace_back();
      groups.back().push_back(r);
    }
    for (exchange_prediction const& x : exchanges_.rank(by_slot, R * S, row_bytes(), groups)) {
      if (how == split::in_group && group_in_node && (x.algorithm == "hierarchical_2d" || x.algorithm == "dedup_per_node")) continue;
      pattern_prediction p = layered(pattern, x.algorithm, x, busiest, plans, 0.0);
      p.placement = name;
      p.ep_size = ep_size;
      p.slot_experts = placement.slot_experts();
      p.replicated = replicated;
      p.gradient_sync_seconds = sync;
      finish(p, S);
      out.push_back(std::move(p));
    }
  }

  //! The smart schedule with groups of `g` (see the file comment), `home` computed first on the lane.
  [[nodiscard]] pattern_prediction pipelined(char const* pattern, std::int32_t g, step const& s, std::vector<std::uint8_t> const& home,
                                             std::int32_t replicated) const {
    std::int32_t const R = links_.ranks(), G = R / g, L = local_experts();
    pattern_prediction p;
    p.pattern = pattern;
    p.setting = "smart_schedule{" + std::to_string(g) + "}";
    p.ep_size = R;
    p.replicated = replicated;
    // The slot rows each rank sends each other (its own included), the replicas' taken out.
    link_model::matrix moved = links_.zeros();
    for (std::int32_t r = 0; r < R; ++r)
      for (std::int32_t e = 0; e < moe_.num_experts; ++e)
        if (!home[at(r, e)]) moved[links_.cell(r, e / L)] += rows(s, r, e);
    // Round j: group q sends group q + j; its rows return in round (G - j) mod G.
    std::vector<double> there(static_cast<std::size_t>(G)), back(static_cast<std::size_t>(G));
    for (std::int32_t j = 0; j < G; ++j) {
      link_model::matrix out = links_.zeros(), in = links_.zeros();
      for (std::int32_t r = 0; r < R; ++r)
        for (std::int32_t i = 0; i < g; ++i) {
          std::int32_t const d = ((r / g + j) % G) * g + i;
          out[links_.cell(r, d)] = moved[links_.cell(r, d)] * row_bytes();
          in[links_.cell(d, r)] = out[links_.cell(r, d)];
        }
      there[static_cast<std::size_t>(j)] = links_.round_seconds(out);
      back[static_cast<std::size_t>((G - j) % G)] = links_.round_seconds(in);
    }
    // Per direction (forward, backward): the rounds go out one after the other, after the self
    // block's copy; each rank's lane computes its replicas, then each round's rows once they are
    // in; round j's results return once every rank has computed them and round j - 1's are back.
    double span[2] = {0, 0};
    for (int backward = 0; backward < 2; ++backward) {
      double const factor = backward ? 2.0 : 1.0;  // the backward's FLOPs
      std::vector<double> computed(static_cast<std::size_t>(G), 0.0);  // round j's rows computed on every rank
      double dispatched = 0;
      for (std::int32_t d = 0; d < R; ++d) {
        double arrived = links_.memory_seconds(2 * moved[links_.cell(d, d)] * row_bytes());
        double lane = factor * home_forward(s, home, d);
        for (std::int32_t j = 0; j < G; ++j) {
          arrived += there[static_cast<std::size_t>(j)];
          lane = std::max(lane, arrived) + factor * unit_forward(s, home, d, ((d / g - j + G) % G) * g, g);
          computed[static_cast<std::size_t>(j)] = std::max(computed[static_cast<std::size_t>(j)], lane);
        }
        dispatched = std::max(dispatched, arrived);
      }
      double returned = dispatched;
      for (std::int32_t j = 0; j < G; ++j)
        returned = std::max(returned, computed[static_cast<std::size_t>(j)]) + back[static_cast<std::size_t>(j)];
      span[backward] = returned;
    }
    double passes = 0;  // permute or unpermute (or their gradients) on the busiest rank
    for (std::int32_t d = 0; d < R; ++d) {
      double sent = 0;
      for (std::int32_t r = 0; r < R; ++r) sent += moved[links_.cell(d, r)];
      passes = std::max(passes, links_.memory_seconds((s.tokens[static_cast<std::size_t>(d)] + sent) * row_bytes()));
      p.compute_seconds = std::max(p.compute_seconds, 3 * rank_forward(s, home, d));
    }
    double const route = links_.allgather_seconds(8.0 * moe_.num_experts) +
                         links_.launches(exchange_adviser::plan_kernels * (replicated > 0 ? 2 : 1));
    double rounds = 0;
    for (std::int32_t j = 0; j < G; ++j) rounds += there[static_cast<std::size_t>(j)] + back[static_cast<std::size_t>(j)];
    p.exchange_seconds = route + 4 * passes + 2 * rounds;
    p.replica_seconds = replica_seconds(replicated);
    p.layer_seconds = route + 4 * passes + span[0] + span[1] + p.replica_seconds;
    finish(p, L);
    return p;
  }

  //! Parm's layouts on the MP groups of `transformer_shape::model_parallel` (see the file comment):
  //! each `deepspeed_mp` and PauseMP slicing (and S2's pieces) whose slices fit in the slots.
  void add_parm(std::vector<pattern_prediction>& out, std::vector<routing_view> const& routing) const {
    std::int32_t const M = iteration_.shape().model_parallel, P = links_.ranks() / M, L = parm_.local_experts();
    parm_layout_model::step const s = parm_.count(routing);
    auto const add = [&](char const* pattern, parm_layout const& layout) {
      std::int32_t const G = layout.expert_slicing;
      if (L > slots() * G) return;  // a rank holds L / G whole experts' parameters
      parm_layout_prediction const x = parm_.predict(s, layout);
      pattern_prediction p;
      p.pattern = pattern;
      p.setting = "ESP " + std::to_string(G) + (layout.pieces > 1 ? ", " + std::to_string(layout.pieces) + " pieces" : "");
      p.placement = "MP " + std::to_string(M) + " x EP " + std::to_string(P);
      p.ep_size = P;
      p.exchange_seconds = x.exchange_seconds;
      p.compute_seconds = x.compute_seconds;
      p.layer_seconds = x.layer_seconds;
      p.gradient_sync_seconds = x.gradient_sync_seconds;
      p.iteration_seconds = iteration_.iteration_seconds(p.layer_seconds, static_cast<double>(L) / G * expert_parameters(), p.gradient_sync_seconds);
      out.push_back(std::move(p));
    };
    for (std::int32_t G = 1; G <= M; ++G)
      if (M % G == 0) add("deepspeed_mp", {false, G, 1});
    add("drop_tokens", {true, 1, 1});
    for (std::int32_t G = 2; G <= M; ++G) {
      if (M % G != 0) continue;
      add("parm_s1", {true, G, 1});
      for (std::int32_t W : parm_pieces) add("parm_s2", {true, G, W});
    }
  }

  //! HybridEP's expert domains (see the file comment): each spread and size S > 1 whose S·L
  //! gathered experts fit in the slots.
  void add_hybridep(std::vector<pattern_prediction>& out, step const& s) const {
    std::int32_t const R = links_.ranks(), L = local_experts();
    double const pre_expert = iteration_.shape().attention_forward_flops() / links_.spec().gemm_flops();
    for (expert_domain_spread spread : {expert_domain_spread::across_data_centres, expert_domain_spread::within_data_centres}) {
      bool const across = spread == expert_domain_spread::across_data_centres;
      std::int32_t const limit = across ? R : links_.topo().ranks_per_domain();
      for (std::int32_t S = 2; S <= limit && S * L <= slots(); ++S) {
        if (limit % S != 0) continue;
        hybridep_layout_prediction const x = hybridep_.predict(s.counts_view(), s.tokens, {S, spread}, pre_expert);
        pattern_prediction p;
        p.pattern = "hybridep";
        p.setting = "S " + std::to_string(S);
        p.placement = across ? "across data centres" : "within data centres";
        p.ep_size = R / S;
        p.exchange_seconds = x.exchange_seconds;
        p.compute_seconds = x.compute_seconds;
        p.replica_seconds = x.exposed_gather_seconds + x.reduce_scatter_seconds;
        p.layer_seconds = x.layer_seconds;
        finish(p, L);
        out.push_back(std::move(p));
      }
    }
  }

  link_model links_;
  exchange_adviser exchanges_;
  iteration_model iteration_;
  moe_layer_shape moe_;
  parm_layout_model parm_;
  hybridep_layout_model hybridep_;
  double expert_chain_seconds_ = 0;  //!< one expert's parameters broadcast (or its gradients reduced) over every rank
};

MOECOMM_NAMESPACE_END
