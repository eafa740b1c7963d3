// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Parm's performance model (Pan et al., "Parm", INFOCOM'24) of one MoE layer under model (MP),
//! expert (EP) and expert-slicing (ESP) parallelism, for three schedules: DeepSpeed-MoE's (the
//! baseline), S1 and S2 (PauseMP with separate or with unified collectives); and Parm's selection
//! rule, the schedule of the smaller predicted step. The paper's formulas are not public: this is
//! the reconstruction of reference/systems.md §6 [I]. Times are in seconds. Like
//! `plan/cost_model.hpp`, it predicts and never measures.
//!
//! Every collective costs `t(m) = α_c + β_c·m` (FSMoE ASPLOS'25 §6.2: one α-β pair per collective
//! and link class), `m` being the bytes one rank puts on the wire in it and `c` the link class of
//! its group. A group of one rank, or one with nothing to move, costs nothing. Groups are those of `comm/parallel_groups.hpp`
//! (world rank `(dp·P + ep)·M + mp`): an MP group is `M` consecutive ranks, an ESP group `G`
//! consecutive ranks of one, an EP group `P` ranks `M` apart. A group kind is priced `intra` when
//! every group of that kind lies inside one node whatever the world size (MP: `ranks_per_node % M
//! == 0`; ESP: `% G == 0`; EP: `% (P·M) == 0`), else `inter`: a group that spans nodes waits for its
//! slowest link. The sum of parameter gradients runs over ranks of an MP group and is priced as MP.
//!
//! Symbols: `b = hidden · element_bytes` (bytes of a row), `T = tokens`, `S = T · top_k ·
//! kept_fraction` (slot rows of an MP group), `M`, `P`, `G` the MP, EP and ESP sizes, `W = pieces`,
//! `L = num_experts / P` (experts per rank, a `1/G` slice of each). The experts receive balanced
//! load: every rank gets the average.
//!
//! S2's concurrent stages contend where they share a GPU's port: on nodes whose GPUs talk over
//! PCIe (`cluster_spec::intra_node_over_pcie`) every transfer of a GPU, to a peer in its node or
//! to the NIC, crosses its one PCIe link (`shared_port_bytes_per_second`).
//!
//! Not modelled: the gate, the permutations and the data-parallel gradient all-reduce (outside the
//! schedules); any other contention (the NIC's share is in `inter`).

#include <moecomm/comm/parallel_groups.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/simulation/cluster_spec.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! One link class: a collective whose rank puts `m` bytes on the wire takes `alpha + beta · m`.
struct parm_link {
  double alpha_seconds = 0;          //!< α: the fixed cost of one collective, s
  double beta_seconds_per_byte = 0;  //!< β: 1 / the bandwidth one rank gets, s/B
};

//! The model's constants. The defaults are `from_cluster` of `platforms/parm-2080ti.platform`:
//! Parm's 32-GPU cluster as inferred in reference/systems.md §6 item 4 [I] (FSMoE's Testbed-B:
//! 8 nodes x 4 RTX 2080 Ti, PCIe 3.0, 100 Gb/s InfiniBand), with that file's figures.
struct parm_cost_params {
  //! MP and ESP groups inside a node. GPU-to-GPU traffic crosses PCIe 3.0 x16, 15.75 GB/s per
  //! direction; α = the sender's and the receiver's port latencies, 1 µs each (the file's `pcie_us`).
  parm_link intra{2e-6, 1 / 15.75e9};
  //! Groups across nodes. The node's one 100 Gb/s NIC (12.5 GB/s) shared by its 4 GPUs, which all
  //! send at once in every schedule: 3.125 GB/s per rank; α = PCIe, NIC, fabric, NIC, PCIe latencies
  //! (1 + 1 + 0.5 + 1 + 1 µs).
  parm_link inter{4.5e-6, 1 / 3.125e9};
  //! RTX 2080 Ti, FP16 tensor cores with FP32 accumulate (mixed precision): 53.8 TFLOP/s (Turing
  //! whitepaper, Appendix A).
  double gemm_flops = 53.8e12;
  //! A device copy reads and writes: half of the RTX 2080 Ti's 616 GB/s GDDR6.
  double copy_bytes_per_second = 616e9 / 2;
  //! One GPU's port that all its transfers cross, inside its node and out of it, per direction:
  //! its PCIe 3.0 x16 link (15.75 GB/s) when GPUs talk over PCIe; 0 when the two link classes
  //! have ports of their own (e.g. NVLink inside a node, PCIe to the NIC). S2's overlapped stages
  //! share it.
  double shared_port_bytes_per_second = 15.75e9;

  //! The constants a simulated `spec` prices (the routes of `simulation/platform.hpp`):
  //! - `intra`: α = 2 x `intra_node.latency_seconds` (out of one port, into another), β = 1 /
  //!   `intra_node.bytes_per_second` (each GPU has its own port);
  //! - `inter`: α = the latencies of PCIe, NIC, fabric, NIC, PCIe; β = 1 / the bandwidth one GPU gets
  //!   when every GPU sends at once, as every rank does in all three schedules (and as
  //!   `measure_links` measures): its `pcie` link, its share `nics_per_node x nic / gpus_per_node`
  //!   of the node's NICs, and, for a blocking fabric, its share of `fabric` over the domain's GPUs,
  //!   whichever is smallest;
  //! - `gemm_flops` = `gpu_flops`; `copy_bytes_per_second` = `hbm_bytes_per_second / 2`;
  //! - `shared_port_bytes_per_second` = `pcie.bytes_per_second` when `intra_node_over_pcie`, else 0.
  //! @throws error (invalid_argument) from `spec.validate()`, or naming `spec.domains` when it is
  //!         not 1 (the model has two link classes; a link between domains would be a third).
  [[nodiscard]] static parm_cost_params from_cluster(cluster_spec const& spec);
};

//! One MoE layer and how it is spread over the ranks: what the model needs to know.
struct parm_layer_shape {
  std::int64_t tokens = 0;                      //!< T: tokens of one MP group (each of its ranks holds all T)
  std::int32_t top_k = 1;                       //!< K: slots per token, at most `num_experts`
  std::int64_t hidden = 0;                      //!< H: elements of a row
  std::int64_t ffn = 0;                         //!< F: an expert's inner width (H -> F -> H, two GEMMs)
  std::int32_t element_bytes = 2;               //!< bytes of one element (2: fp16/bf16 rows)
  double kept_fraction = 1;                     //!< share of the T·K slots the capacity keeps, in (0, 1]; 1: dropless
  std::int32_t num_experts = 0;                 //!< E, a multiple of `sizes.expert`
  std::int64_t parameter_bytes_per_expert = 0;  //!< bytes of one whole expert's parameters (a rank holds 1/G); 0: none
  parallel_sizes sizes;                         //!< M = `model`, P = `expert`, G = `expert_slicing` (divides M)
  std::int32_t ranks_per_node = 0;              //!< consecutive world ranks per node
  std::int32_t pieces = 1;                      //!< W: pieces of S2's pipelines
};

//! One schedule's predicted times, term by term (seconds).
struct parm_prediction {
  double dispatch = 0;        //!< forward: slot rows from the gate to the experts' input
  double expert = 0;          //!< forward: the expert GEMMs
  double combine = 0;         //!< forward: expert outputs back to this rank's token rows
  double mp_gather = 0;       //!< forward: the MP all-gather of the combined token rows
  double backward_extra = 0;  //!< backward only: the expert gradients summed over MP ranks with the same slice
  double forward_total = 0;   //!< dispatch + expert + combine + mp_gather
  //! A training step of the layer: 2·(dispatch + combine + mp_gather) + 3·expert + backward_extra.
  //! The backward repeats every collective with the forward's volume (all-to-all for all-to-all,
  //! all-gather for reduce-scatter; the MP all-gather of `d_x`, the mirror of the free MP split,
  //! stands for `mp_gather`, whose own mirror is a slice of the replicated `d_out`), and its GEMMs
  //! cost twice the forward's.
  double step_total = 0;
};

//! Parm's two schedules.
enum class parm_schedule {
  s1,  //!< PauseMP with separate collectives
  s2,  //!< PauseMP with unified collectives: pipelined all-to-alls overlapping the ESP collectives
};

//! What `parm_cost_model::choose` decided, and why.
struct parm_choice {
  parm_schedule schedule = parm_schedule::s1;  //!< the smaller `step_total`; S1 on a tie (fewer messages)
  parm_prediction s1;
  parm_prediction s2;
};

//! The formulas of the file comment over validated `parm_cost_params`. The same arguments always
//! give the same bits.
class parm_cost_model {
 public:
  //! @throws error (invalid_argument) naming the first parameter that is not finite, or not
  //!         positive (an α may be 0).
  explicit parm_cost_model(parm_cost_params const& params = {}) : params_(params) {
    require_link("intra", params.intra);
    require_link("inter", params.inter);
    require_positive("gemm_flops", params.gemm_flops);
    require_positive("copy_bytes_per_second", params.copy_bytes_per_second);
    detail::require(std::isfinite(params.shared_port_bytes_per_second) && params.shared_port_bytes_per_second >= 0,
                    "parm_cost_model", "shared_port_bytes_per_second = ", params.shared_port_bytes_per_second,
                    " must be finite and >= 0 (0: no shared port)");
  }

  [[nodiscard]] parm_cost_params const& params() const { return params_; }

  //! This model for a layer whose row bytes, parameter bytes and FLOPs are `token_bytes`,
  //! `parameter_bytes` and `flops` times those its shape gives (a simulated back-end's
  //! `simulation_scale`: the layer hands the model its real rows, the simulation prices the
  //! model-sized ones). Scales multiply.
  //! @throws error (invalid_argument) naming the first scale that is not finite and positive.
  [[nodiscard]] parm_cost_model scaled(double token_bytes, double parameter_bytes, double flops) const {
    require_positive("token_bytes scale", token_bytes);
    require_positive("parameter_bytes scale", parameter_bytes);
    require_positive("flops scale", flops);
    parm_cost_model m = *this;
    m.token_bytes_scale_ *= token_bytes;
    m.parameter_bytes_scale_ *= parameter_bytes;
    m.flops_scale_ *= flops;
    return m;
  }

  //! DeepSpeed-MoE with MP: every MP rank dispatches all S slot rows and runs its 1/G expert slices
  //! on them; with G > 1 the ESP group all-reduces the partial outputs.
  //! @throws error (invalid_argument) naming the first field of `shape` that is out of range.
  [[nodiscard]] parm_prediction predict_deepspeed_mp(parm_layer_shape const& shape) const {
    return deepspeed_mp(symbols_of("parm_cost_model::predict_deepspeed_mp", shape));
  }

  //! S1: each MP rank dispatches S/M slot rows; A2A, ESP all-gather, expert slices, ESP
  //! reduce-scatter, A2A and the MP all-gather, one after the other; the gathered rows are
  //! unpacked, and packed and summed on the way back (device copies).
  //! @throws error (invalid_argument) naming the first field of `shape` that is out of range.
  [[nodiscard]] parm_prediction predict_s1(parm_layer_shape const& shape) const {
    return s1(symbols_of("parm_cost_model::predict_s1", shape));
  }

  //! S2: S1's volumes and copies, with the A2A and the ESP all-gather and its copies (then the ESP
  //! reduce-scatter and its copies, and the A2A) pipelined over W pieces. With W = 1 it is S1.
  //! @throws error (invalid_argument) naming the first field of `shape` that is out of range.
  [[nodiscard]] parm_prediction predict_s2(parm_layer_shape const& shape) const {
    return s2(symbols_of("parm_cost_model::predict_s2", shape));
  }

  //! Parm's rule: the schedule of the smaller predicted step, with both predictions.
  //! @throws error (invalid_argument) naming the first field of `shape` that is out of range.
  [[nodiscard]] parm_choice choose(parm_layer_shape const& shape) const {
    symbols const l = symbols_of("parm_cost_model::choose", shape);
    parm_choice c;
    c.s1 = s1(l);
    c.s2 = s2(l);
    c.schedule = c.s2.step_total < c.s1.step_total ? parm_schedule::s2 : parm_schedule::s1;
    return c;
  }

 private:
  //! The symbols of the file comment for one checked shape, each group's size and link.
  struct symbols {
    double b, T, S, M, G, P, W, L, slice_bytes;
    double flops_per_row;  //!< forward FLOPs of one row on 1/G of an expert
    std::int32_t mp_size, ep_size, esp_size;
    parm_link mp, ep, esp;
  };

  static void require_positive(char const* name, double value) {
    detail::require(std::isfinite(value) && value > 0, "parm_cost_model", name, " = ", value,
                    " must be finite and positive");
  }

  static void require_link(char const* name, parm_link const& link) {
    detail::require(std::isfinite(link.alpha_seconds) && link.alpha_seconds >= 0, "parm_cost_model", name,
                    ".alpha_seconds = ", link.alpha_seconds, " must be finite and >= 0");
    detail::require(std::isfinite(link.beta_seconds_per_byte) && link.beta_seconds_per_byte > 0, "parm_cost_model",
                    name, ".beta_seconds_per_byte = ", link.beta_seconds_per_byte, " must be finite and positive");
  }

  //! Checks every field of `shape` (errors name it as `shape.<field>`) and derives the symbols.
  symbols symbols_of(char const* op, parm_layer_shape const& s) const {
    auto const at_least_one = [op](char const* name, std::int64_t value) {
      detail::require(value >= 1, op, "shape.", name, " = ", value, " must be at least 1");
    };
    at_least_one("tokens", s.tokens);
    at_least_one("hidden", s.hidden);
    at_least_one("ffn", s.ffn);
    at_least_one("element_bytes", s.element_bytes);
    at_least_one("num_experts", s.num_experts);
    detail::require(s.parameter_bytes_per_expert >= 0, op, "shape.parameter_bytes_per_expert = ",
                    s.parameter_bytes_per_expert, " must be at least 0");
    at_least_one("sizes.model", s.sizes.model);
    at_least_one("sizes.expert", s.sizes.expert);
    at_least_one("sizes.expert_slicing", s.sizes.expert_slicing);
    at_least_one("ranks_per_node", s.ranks_per_node);
    at_least_one("pieces", s.pieces);
    detail::require(s.top_k >= 1 && s.top_k <= s.num_experts, op, "shape.top_k = ", s.top_k,
                    " must be in [1, shape.num_experts = ", s.num_experts, "]");
    // `!(x <= 1)` is true for NaN too, so NaN is refused.
    detail::require(s.kept_fraction > 0 && s.kept_fraction <= 1, op, "shape.kept_fraction = ", s.kept_fraction,
                    " must be in (0, 1]");
    detail::require(s.num_experts % s.sizes.expert == 0, op, "shape.num_experts = ", s.num_experts,
                    " is not a multiple of shape.sizes.expert = ", s.sizes.expert,
                    " (every rank of an EP group holds as many experts)");
    detail::require(s.sizes.model % s.sizes.expert_slicing == 0, op, "shape.sizes.expert_slicing = ",
                    s.sizes.expert_slicing, " does not divide shape.sizes.model = ", s.sizes.model,
                    " (an ESP group lies inside an MP group)");
    std::int32_t const M = s.sizes.model, P = s.sizes.expert, G = s.sizes.expert_slicing;
    auto const link = [&](std::int64_t aligned_block) {
      return s.ranks_per_node % aligned_block == 0 ? params_.intra : params_.inter;
    };
    symbols l;
    l.b = static_cast<double>(s.hidden) * s.element_bytes * token_bytes_scale_;
    l.T = static_cast<double>(s.tokens);
    l.S = l.T * s.top_k * s.kept_fraction;
    l.M = M;
    l.G = G;
    l.P = P;
    l.W = s.pieces;
    l.L = static_cast<double>(s.num_experts / P);
    l.slice_bytes = static_cast<double>(s.parameter_bytes_per_expert) * parameter_bytes_scale_ / G;
    // Two GEMMs, H x F/G and F/G x H, 2 FLOPs per multiply-add.
    l.flops_per_row = 2.0 * 2.0 * static_cast<double>(s.hidden) * static_cast<double>(s.ffn) * flops_scale_ / G;
    l.mp_size = M;
    l.ep_size = P;
    l.esp_size = G;
    l.mp = link(M);
    l.ep = link(std::int64_t{P} * M);  // an EP group lies in the block of P·M ranks of its dp index
    l.esp = link(G);
    return l;
  }

  //! α + β·m over a group of `ranks` (FSMoE §6.2); nothing over a group of one or with nothing to move.
  static double collective(parm_link const& link, std::int32_t ranks, double bytes) {
    return ranks == 1 || bytes == 0 ? 0.0 : link.alpha_seconds + link.beta_seconds_per_byte * bytes;
  }

  //! One piece of one collective: its time, its α and the bytes its rank sends.
  struct stage {
    double seconds = 0, alpha = 0, bytes = 0;
  };
  static stage piece(parm_link const& link, std::int32_t ranks, double bytes) {
    double const t = collective(link, ranks, bytes);
    return t == 0 ? stage{} : stage{t, link.alpha_seconds, bytes};
  }

  //! Two stages over W pieces, stage 2 of piece i beside stage 1 of piece i+1 (systems.md §6
  //! reconstruction item 2 [I]): the first piece's stage 1, W − 1 steps of both, the last piece's
  //! stage 2. A step of both takes the slower stage, or, through a shared port, at least the
  //! larger α plus both pieces' bytes at the port's bandwidth.
  double pipeline(stage const& first, stage const& second, double pieces) const {
    double both = std::max(first.seconds, second.seconds);
    if (params_.shared_port_bytes_per_second > 0)
      both = std::max(both, std::max(first.alpha, second.alpha) + (first.bytes + second.bytes) / params_.shared_port_bytes_per_second);
    return first.seconds + (pieces - 1) * both + second.seconds;
  }

  //! `copies` device copies of the G·S/M gathered rows: 1 in the dispatch (unpacking the gathered
  //! pieces), 2 in the combine (packing them, then summing the members' shares).
  double copy_seconds(symbols const& l, double copies) const {
    return copies * l.G * l.S / l.M * l.b / params_.copy_bytes_per_second;
  }

  //! Seconds of the expert GEMMs on `rows` rows (FLOPs / `gemm_flops`).
  double expert_seconds(symbols const& l, double rows) const { return rows * l.flops_per_row / params_.gemm_flops; }

  //! The totals of a prediction whose terms are set.
  static parm_prediction finished(parm_prediction p) {
    p.forward_total = p.dispatch + p.expert + p.combine + p.mp_gather;
    // The backward repeats every collective's volume and computes 2x the forward (see `step_total`).
    p.step_total = 2 * (p.dispatch + p.combine + p.mp_gather) + 3 * p.expert + p.backward_extra;
    return p;
  }

  parm_prediction deepspeed_mp(symbols const& l) const {
    parm_prediction p;
    // Every MP rank sends all S rows over EP but its own 1/P (systems.md §6, baseline item 2 [C]).
    double const a2a = collective(l.ep, l.ep_size, l.S * l.b * (l.P - 1) / l.P);
    // The ESP all-reduce of the outputs of the R = S rows received: an ordered reduce-scatter, then
    // an all-gather, each moving (G − 1)/G of them (systems.md §6, baseline item 3 [C]).
    double const esp_slice = collective(l.esp, l.esp_size, l.S * l.b * (l.G - 1) / l.G);
    p.dispatch = a2a;
    p.expert = expert_seconds(l, l.S);  // all S rows on 1/G of each expert, on every MP rank
    p.combine = 2 * esp_slice + a2a;
    // No MP gather and nothing backward-only: every MP rank holds the whole output and gradients.
    return finished(p);
  }

  //! S1's terms; S2 replaces its dispatch and combine.
  parm_prediction s1(symbols const& l) const {
    parm_prediction p;
    // After the MP split each MP rank sends its S/M rows over EP but its own 1/P (systems.md §6
    // reconstruction item 1 [I]; the other S1 and S2 formulas cite the same section).
    double const a2a = collective(l.ep, l.ep_size, l.S / l.M * l.b * (l.P - 1) / l.P);
    // ESP all-gather (then reduce-scatter) of S/M rows from (to) each of G − 1 peers (item 1).
    double const esp = collective(l.esp, l.esp_size, l.S / l.M * l.b * (l.G - 1));
    p.dispatch = a2a + esp + copy_seconds(l, 1);
    p.expert = expert_seconds(l, l.G * l.S / l.M);  // the G peers' rows on 1/G of each expert
    p.combine = esp + a2a + copy_seconds(l, 2);
    // MP all-gather of the T/M combined token rows each rank holds (item 1).
    p.mp_gather = collective(l.mp, l.mp_size, l.T / l.M * l.b * (l.M - 1));
    // The M/G ranks of an MP group holding the same slice saw different tokens: an ordered
    // all-reduce (all-gather, then a sum) of their L slices' gradients (item 3).
    p.backward_extra = collective(l.mp, l.mp_size / l.esp_size, l.L * l.slice_bytes * (l.M / l.G - 1));
    return finished(p);
  }

  parm_prediction s2(symbols const& l) const {
    parm_prediction p = s1(l);
    // One piece of the A2A and of the ESP collective: α + β·m/W each (item 2).
    stage const a2a = piece(l.ep, l.ep_size, l.S / l.M * l.b * (l.P - 1) / l.P / l.W);
    stage const esp = piece(l.esp, l.esp_size, l.S / l.M * l.b * (l.G - 1) / l.W);
    // The copies belong to the ESP stage of each piece: the gather unpacks what it received, the
    // reduce-scatter packs and sums before it sends.
    stage gather = esp, reduce = esp;
    gather.seconds += copy_seconds(l, 1) / l.W;
    reduce.seconds += copy_seconds(l, 2) / l.W;
    p.dispatch = pipeline(a2a, gather, l.W);  // the all-gather of piece i−1 beside the A2A of piece i
    p.combine = pipeline(reduce, a2a, l.W);   // the reduce-scatter of piece i beside the A2A of piece i−1
    return finished(p);
  }

  parm_cost_params params_;
  double token_bytes_scale_ = 1, parameter_bytes_scale_ = 1, flops_scale_ = 1;  //!< see `scaled`
};

inline parm_cost_params parm_cost_params::from_cluster(cluster_spec const& spec) {
  spec.validate();
  detail::require(spec.domains == 1, "parm_cost_params::from_cluster", "spec.domains = ", spec.domains,
                  " must be 1: the model has two link classes, inside a node and between the nodes of a domain");
  double per_gpu =
      std::min(spec.pcie.bytes_per_second, spec.nics_per_node * spec.nic.bytes_per_second / spec.gpus_per_node);
  if (spec.fabric.bytes_per_second > 0)  // 0: non-blocking
    per_gpu = std::min(per_gpu, spec.fabric.bytes_per_second / spec.num_gpus());
  parm_cost_params p;
  p.intra = {2 * spec.intra_node.latency_seconds, 1 / spec.intra_node.bytes_per_second};
  p.inter = {2 * spec.pcie.latency_seconds + 2 * spec.nic.latency_seconds + spec.fabric.latency_seconds, 1 / per_gpu};
  p.gemm_flops = spec.gpu_flops;
  p.copy_bytes_per_second = spec.hbm_bytes_per_second / 2;
  p.shared_port_bytes_per_second = spec.intra_node_over_pcie ? spec.pcie.bytes_per_second : 0;
  return p;
}

MOECOMM_NAMESPACE_END
