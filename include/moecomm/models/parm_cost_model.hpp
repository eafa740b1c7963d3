// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Parm's performance model (Pan et al., "Parm", INFOCOM'24) of one MoE layer under model (MP),
//! expert (EP) and expert-slicing (ESP) parallelism, for three schedules: DeepSpeed-MoE's (the
//! baseline), S1 and S2 (PauseMP with separate or with unified collectives); and Parm's selection
//! rule, the schedule of the smaller predicted step. The paper's formulas are not public: this is
//! the reconstruction of reference/systems.md §6 [I]. Times are in seconds. Like
//! `planners/fastermoe_cost_model.hpp`, it predicts and never measures.
//!
//! Every collective costs `t = α + max(n_intra·m·β_intra, n_inter·m·β_inter, (n_intra + n_inter)·m
//! / B_port)` (FSMoE ASPLOS'25 §6.2: one α-β pair per collective and link class), a rank sending `m`
//! bytes to each of its `n_intra` peers in its node and `n_inter` peers in other nodes at once: the
//! two link classes run side by side unless both cross one shared port (`B_port`,
//! `shared_port_bytes_per_second`); α is the slower class's. A group of one rank, or one with nothing
//! to move, costs nothing. Groups are those of `comm/parallel_groups.hpp` (world rank `(dp·P + ep)·M
//! + mp`): an MP group is `M` consecutive ranks, an ESP group `G` consecutive ranks of one, an EP
//! group `P` ranks `M` apart, the ranks of an MP group holding the same slice `M/G` ranks `G` apart.
//! A group of `n` ranks `d` apart lies in one node when `ranks_per_node % (n·d) == 0`, covers whole
//! nodes with `ranks_per_node / d` of its ranks in each when `(n·d) % ranks_per_node == 0` and
//! `ranks_per_node % d == 0`, and otherwise is priced as if every peer were in another node.
//!
//! Device copies are priced as the simulated back-end charges them: `launch + bytes /
//! copy_bytes_per_second` each (`kernel_launch_seconds`), one per block and piece of the pipelined
//! collectives (collectives/pipelined_collectives.hpp), so S2 pays W times S1's launches.
//!
//! Symbols: `b = hidden · element_bytes` (bytes of a row), `T = tokens`, `S = T · top_k ·
//! kept_fraction` (slot rows of an MP group), `M`, `P`, `G` the MP, EP and ESP sizes, `W = pieces`,
//! `L = num_experts / P` (experts per rank, a `1/G` slice of each). The experts receive balanced
//! load: every rank gets the average.
//!
//! S2's concurrent stages contend where they share a GPU's port, as one collective's link classes
//! do: on nodes whose GPUs talk over PCIe (`cluster_spec::intra_node_over_pcie`) every transfer of
//! a GPU, to a peer in its node or to the NIC, crosses its one PCIe link.
//!
//! Not modelled: the gate, the permutations and the data-parallel gradient all-reduce (outside the
//! schedules); any other contention (the NIC's share is in `inter`).

#include <moecomm/comm/parallel_groups.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/cluster_spec.hpp>
#include <moecomm/planners/detail/workload_scales.hpp>

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
  //! direction; α = the collective's overhead (the file's `collective_overhead_us`, 12 µs) and the
  //! sender's and the receiver's port latencies, 1 µs each (the file's `pcie_us`).
  parm_link intra{14e-6, 1 / 15.75e9};
  //! Groups across nodes. The node's one 100 Gb/s NIC (12.5 GB/s) shared by its 4 GPUs, which all
  //! send at once in every schedule: 3.125 GB/s per rank; α = the overhead and the PCIe, NIC, fabric,
  //! NIC, PCIe latencies (12 + 1 + 1 + 0.5 + 1 + 1 µs).
  parm_link inter{16.5e-6, 1 / 3.125e9};
  //! RTX 2080 Ti, FP16 tensor cores with FP32 accumulate (mixed precision): 53.8 TFLOP/s (Turing
  //! whitepaper, Appendix A), of which large cuBLAS GEMMs reach about 70 % (the file's `gemm_efficiency`).
  double gemm_flops = 0.7 * 53.8e12;
  //! A device copy reads and writes: half of the RTX 2080 Ti's 616 GB/s GDDR6.
  double copy_bytes_per_second = 616e9 / 2;
  //! The fixed cost of one kernel (a copy, a sum): the platform file's `kernel_launch_us`.
  double kernel_launch_seconds = 4e-6;
  //! One GPU's port that all its transfers cross, inside its node and out of it, per direction:
  //! its PCIe 3.0 x16 link (15.75 GB/s) when GPUs talk over PCIe; 0 when the two link classes
  //! have ports of their own (e.g. NVLink inside a node, PCIe to the NIC). S2's overlapped stages
  //! share it.
  double shared_port_bytes_per_second = 15.75e9;

  //! The constants a simulated `spec` prices (the routes of `simulation/platform.hpp`):
  //! - `intra`: α = `collective_overhead_seconds` + 2 x `intra_node.latency_seconds` (out of one
  //!   port, into another), β = 1 /
  //!   `intra_node.bytes_per_second` (each GPU has its own port);
  //! - `inter`: α = `collective_overhead_seconds` + the latencies of PCIe, NIC, fabric, NIC, PCIe; β = 1 / the bandwidth one GPU gets
  //!   when every GPU sends at once, as every rank does in all three schedules (and as
  //!   `measure_links` measures): its `pcie` link, its share `nics_per_node x nic / gpus_per_node`
  //!   of the node's NICs, and, for a blocking fabric, its share of `fabric` over the domain's GPUs,
  //!   whichever is smallest;
  //! - `gemm_flops` = `gpu_flops x gemm_efficiency` (large GEMMs); `copy_bytes_per_second` = `hbm_bytes_per_second / 2`;
  //!   `kernel_launch_seconds` = `kernel_launch_seconds`;
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
    detail::require(std::isfinite(params.kernel_launch_seconds) && params.kernel_launch_seconds >= 0, "parm_cost_model",
                    "kernel_launch_seconds = ", params.kernel_launch_seconds, " must be finite and >= 0");
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
    parm_cost_model m = *this;
    m.scales_ = scales_.times("parm_cost_model", token_bytes, parameter_bytes, flops);
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
  //! A group of ranks as the file comment prices it: its size and where its peers are.
  struct group {
    std::int32_t ranks = 1;
    double intra_peers = 0, inter_peers = 0;  //!< of each rank: in its node, in other nodes
  };

  //! The symbols of the file comment for one checked shape, and each group.
  struct symbols {
    double b, T, S, M, G, P, W, L, slice_bytes;
    double flops_per_row;  //!< forward FLOPs of one row on 1/G of an expert
    group mp, ep, esp, same_slice;
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

  //! A group of `ranks` ranks `stride` apart on nodes of `per_node` consecutive ranks (file comment).
  static group group_of(std::int64_t ranks, std::int64_t stride, std::int64_t per_node) {
    std::int64_t in_node = 1;  // the ranks of the group in one node
    if (per_node % (ranks * stride) == 0) in_node = ranks;
    else if ((ranks * stride) % per_node == 0 && per_node % stride == 0) in_node = per_node / stride;
    return {static_cast<std::int32_t>(ranks), static_cast<double>(in_node - 1), static_cast<double>(ranks - in_node)};
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
    symbols l;
    l.b = static_cast<double>(s.hidden) * s.element_bytes * scales_.token_bytes;
    l.T = static_cast<double>(s.tokens);
    l.S = l.T * s.top_k * s.kept_fraction;
    l.M = M;
    l.G = G;
    l.P = P;
    l.W = s.pieces;
    l.L = static_cast<double>(s.num_experts / P);
    l.slice_bytes = static_cast<double>(s.parameter_bytes_per_expert) * scales_.parameter_bytes / G;
    // Two GEMMs, H x F/G and F/G x H, 2 FLOPs per multiply-add.
    l.flops_per_row = 2.0 * 2.0 * static_cast<double>(s.hidden) * static_cast<double>(s.ffn) * scales_.flops / G;
    l.mp = group_of(M, 1, s.ranks_per_node);
    l.ep = group_of(P, M, s.ranks_per_node);
    l.esp = group_of(G, 1, s.ranks_per_node);
    l.same_slice = group_of(M / G, G, s.ranks_per_node);
    return l;
  }

  //! One collective, or one piece of one: its time, its α, the bytes its rank puts on the wire, and
  //! the device copies that belong to it (included in `seconds`).
  struct stage {
    double seconds = 0, alpha = 0, bytes = 0, copies = 0;
  };

  //! A rank of `g` sending `bytes_per_peer` to each of its peers (file comment); nothing over a group
  //! of one or with nothing to move.
  stage collective(group const& g, double bytes_per_peer) const {
    if (g.ranks == 1 || bytes_per_peer == 0) return {};
    double const alpha = g.inter_peers > 0 ? params_.inter.alpha_seconds : params_.intra.alpha_seconds;
    double const intra = g.intra_peers * bytes_per_peer, inter = g.inter_peers * bytes_per_peer;
    double wire = std::max(intra * params_.intra.beta_seconds_per_byte, inter * params_.inter.beta_seconds_per_byte);
    if (params_.shared_port_bytes_per_second > 0) wire = std::max(wire, (intra + inter) / params_.shared_port_bytes_per_second);
    return {alpha + wire, alpha, intra + inter, 0};
  }

  //! `s` followed by `launches` device kernels moving `bytes` through a copy in all.
  stage with_copies(stage s, double launches, double bytes) const {
    double const t = launches * params_.kernel_launch_seconds + bytes / params_.copy_bytes_per_second;
    s.seconds += t;
    s.copies += t;
    return s;
  }

  //! Two stages over W pieces, stage 2 of piece i beside stage 1 of piece i+1 (systems.md §6
  //! reconstruction item 2 [I]): the first piece's stage 1, W − 1 steps of both, the last piece's
  //! stage 2. A step of both takes the slower stage, or, through a shared port, at least the
  //! larger α plus both pieces' bytes at the port's bandwidth plus the copies of the stages that
  //! move bytes there (a stage's copies wait for its own transfer; a stage without one, e.g. the
  //! ESP stage with ESP 1, copies beside the other stage's transfer).
  double pipeline(stage const& first, stage const& second, double pieces) const {
    double both = std::max(first.seconds, second.seconds);
    if (params_.shared_port_bytes_per_second > 0) {
      double const copies = (first.bytes > 0 ? first.copies : 0) + (second.bytes > 0 ? second.copies : 0);
      both = std::max(both, std::max(first.alpha, second.alpha) +
                                (first.bytes + second.bytes) / params_.shared_port_bytes_per_second + copies);
    }
    return first.seconds + (pieces - 1) * both + second.seconds;
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
    // Every MP rank sends all S rows over EP, S/P to each peer (systems.md §6, baseline item 2 [C]).
    double const a2a = collective(l.ep, l.S * l.b / l.P).seconds;
    p.dispatch = a2a;
    p.expert = expert_seconds(l, l.S);  // all S rows on 1/G of each expert, on every MP rank
    // The ESP all-reduce of the outputs of the R = S rows received (systems.md §6, baseline item 3
    // [C]): an ordered reduce-scatter (its own slice copied, then G slices summed), then an all-gather
    // (its own slice copied), each sending S/G rows to each peer.
    double const slice = l.S / l.G * l.b;
    stage const esp = collective(l.esp, slice);
    double const reduce = l.G == 1 ? 0 : with_copies(esp, 2, slice + (l.G + 1) / 2 * slice).seconds;
    double const gather = l.G == 1 ? 0 : with_copies(esp, 1, slice).seconds;
    p.combine = reduce + gather + a2a;
    // No MP gather and nothing backward-only: every MP rank holds the whole output and gradients.
    return finished(p);
  }

  //! S1's and S2's terms: S2 is the pipeline of W pieces, S1 the same in one piece (systems.md §6
  //! reconstruction items 1-3 [I]).
  parm_prediction pause_mp(symbols const& l) const {
    parm_prediction p;
    double const W = l.W, own = l.S / l.M * l.b;  // the bytes of this rank's rows after the MP split
    // One piece of the A2A: a 1/P share of this rank's rows to each peer.
    stage const a2a = collective(l.ep, own / l.P / W);
    // One piece of the ESP all-gather, unpacked block by block (G·P copies of G·own/W bytes in all);
    // of the reduce-scatter: packed likewise, this rank's own piece copied, the G pieces summed.
    stage const esp = collective(l.esp, own / W);
    stage const gather = with_copies(esp, l.G * l.P, l.G * own / W);
    stage const reduce = with_copies(esp, l.G * l.P + 2, (l.G + 1 + (l.G + 1) / 2) * own / W);
    p.dispatch = pipeline(a2a, gather, W);  // the all-gather of piece i−1 beside the A2A of piece i
    p.expert = expert_seconds(l, l.G * l.S / l.M);  // the G peers' rows on 1/G of each expert
    p.combine = pipeline(reduce, a2a, W);  // the reduce-scatter of piece i beside the A2A of piece i−1
    // MP all-gather of the T/M combined token rows each rank holds, its own copied first (item 1).
    double const mine = l.T / l.M * l.b;
    p.mp_gather = l.M == 1 ? 0 : with_copies(collective(l.mp, mine), 1, mine).seconds;
    // The M/G ranks of an MP group holding the same slice saw different tokens: an ordered
    // all-reduce (all-gather, then a sum) of their L slices' gradients (item 3).
    p.backward_extra = collective(l.same_slice, l.L * l.slice_bytes).seconds;
    return finished(p);
  }

  parm_prediction s1(symbols l) const {
    l.W = 1;
    return pause_mp(l);
  }

  parm_prediction s2(symbols const& l) const { return pause_mp(l); }

  parm_cost_params params_;
  detail::workload_scales scales_;  //!< see `scaled`
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
  double const overhead = spec.collective_overhead_seconds;
  p.intra = {overhead + 2 * spec.intra_node.latency_seconds, 1 / spec.intra_node.bytes_per_second};
  p.inter = {overhead + 2 * spec.pcie.latency_seconds + 2 * spec.nic.latency_seconds + spec.fabric.latency_seconds,
             1 / per_gpu};
  p.gemm_flops = spec.gemm_flops();
  p.copy_bytes_per_second = spec.hbm_bytes_per_second / 2;
  p.kernel_launch_seconds = spec.kernel_launch_seconds;
  p.shared_port_bytes_per_second = spec.intra_node_over_pcie ? spec.pcie.bytes_per_second : 0;
  return p;
}

MOECOMM_NAMESPACE_END
