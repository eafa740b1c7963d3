// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `cluster_spec`: what a simulated GPU cluster is made of (devices, links, how many), in SI units.
//!
//! It is the input of the platform generator (`simulation/platform.hpp`) and what a `.platform`
//! file describes (`simulation/platform_file.hpp`). The figures are the hardware's, not fitted
//! ones: the simulator's network model (CM02, docs/simulation.md) prices a message from them alone.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <moecomm/config.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/error.hpp>
#include <string>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

namespace detail {
//! The fraction of the peak FLOP rate a GEMM of `rows` rows reaches: `efficiency` from `ridge_rows`
//! rows on, and in proportion to its rows below (the roofline: it reads its weights whatever its rows).
[[nodiscard]] inline double roofline_efficiency(double efficiency, double ridge_rows, double rows) {
  return efficiency * std::min(1.0, std::max(rows, 1.0) / ridge_rows);
}
}  // namespace detail

//! One link, per direction: a message of `b` bytes alone on it takes `latency_seconds + b / bytes_per_second`.
struct link_spec {
  double bytes_per_second = 0;  //!< bandwidth of one direction, B/s
  double latency_seconds = 0;   //!< one-way latency, s

  friend bool operator==(link_spec const& a, link_spec const& b) {
    return a.bytes_per_second == b.bytes_per_second && a.latency_seconds == b.latency_seconds;
  }
  friend bool operator!=(link_spec const& a, link_spec const& b) { return !(a == b); }
};

//! A cluster of identical GPU nodes, grouped in one or more data centres ("domains").
//!
//! What a GPU's traffic crosses (docs/simulation.md draws it):
//! - to a GPU of its node: its own `intra_node` port out, the peer's port in (an NVLink port to the
//!   node's switch; on PCIe-only servers the `pcie` link itself, `intra_node_over_pcie`);
//! - to another node: its `pcie` link to the node's NIC, the node's NICs (`nics_per_node` x `nic`,
//!   one aggregate link per direction), the domain's `fabric`, then the peer node's NICs and the
//!   peer's `pcie` link;
//! - to another domain: as to another node, but from the fabric through both domains' `inter_domain`
//!   uplinks.
struct cluster_spec {
  std::string name;    //!< short identifier, e.g. "fastermoe-v100-ib"
  std::string source;  //!< where the figures come from (paper, section, vendor sheet); free text, one line

  std::int32_t domains = 1;           //!< data centres joined by a WAN (1 = one machine room)
  std::int32_t nodes_per_domain = 0;  //!< nodes (servers) in each domain
  std::int32_t gpus_per_node = 0;     //!< GPUs in each node
  std::int32_t nics_per_node = 1;     //!< NICs in each node; they act as one link of `nics_per_node` x `nic`

  double gpu_flops = 0;              //!< FLOP/s of one GPU at the precision the workload computes in
  double hbm_bytes_per_second = 0;   //!< device memory bandwidth, B/s (a copy on the GPU moves at half of it)
  double kernel_launch_seconds = 0;  //!< fixed cost of launching one kernel, s

  // How the device computes and shares itself (docs/simulation.md, "The device"):
  double gemm_efficiency = 1;          //!< fraction of `gpu_flops` a large GEMM reaches (cuBLAS's, from public figures)
  double gemm_ridge_rows = 1;          //!< rows of a GEMM from which it is compute-bound; below, its rate falls in
                                       //!< proportion to its rows (the roofline: the weights are read whatever the rows)
  double comm_sm_share = 0;            //!< fraction of the FLOP rate a communication kernel takes while it runs (its SMs)
  double collective_overhead_seconds = 0;  //!< fixed cost of one collective: its launch and the peers' handshake, s
  bool device_contention = true;       //!< concurrent memory kernels share HBM and communication takes its SMs;
                                       //!< false: each memory kernel runs as if alone, communication takes no SMs

  link_spec intra_node;               //!< GPU <-> GPU inside a node: one GPU's port, per direction
  bool intra_node_over_pcie = false;  //!< GPU-to-GPU traffic shares the `pcie` link (then `intra_node == pcie`)
  link_spec pcie;                     //!< GPU <-> NIC path of one GPU, per direction
  link_spec nic;                      //!< one NIC, per direction (papers' "100 Gb/s InfiniBand" is 12.5e9 B/s)
  link_spec fabric;                   //!< a domain's backbone, shared by all its inter-node traffic;
                                      //!< `bytes_per_second == 0`: non-blocking (a flow is limited only by NICs)
  link_spec inter_domain;             //!< each domain's uplink to the WAN, per direction; used when `domains > 1`

  //! FLOP/s of a large GEMM: `gpu_flops x gemm_efficiency` (what planners price compute at).
  [[nodiscard]] double gemm_flops() const { return gpu_flops * gemm_efficiency; }

  //! Seconds of `flops` in GEMMs of `rows` rows (default: large ones), on the roofline the simulated
  //! device charges (`detail::roofline_efficiency`).
  [[nodiscard]] double gemm_seconds(double flops, double rows = std::numeric_limits<double>::infinity()) const {
    return flops / (gpu_flops * detail::roofline_efficiency(gemm_efficiency, gemm_ridge_rows, rows));
  }

  //! The most GPUs a cluster may have: SimGrid builds 4096 in about a second, and more in a time
  //! that grows faster than their number (2^16 take minutes; 2^20 nodes never finished), and the
  //! advisers price `[R][R]` matrices of the ranks. `validate` refuses a larger cluster.
  static constexpr std::int32_t max_gpus = 4096;

  //! Every GPU of the cluster: domains x nodes per domain x GPUs per node.
  [[nodiscard]] std::int32_t num_gpus() const {
    return detail::checked_int32(
        detail::checked_mul(
            detail::checked_mul(domains, nodes_per_domain, "cluster_spec", "domains * nodes_per_domain"), gpus_per_node,
            "cluster_spec", "domains * nodes_per_domain * gpus_per_node"),
        "cluster_spec", "num_gpus()", "GPUs are numbered with int32 ranks");
  }

  //! Checks every field: counts >= 1, at most `max_gpus` GPUs, rates > 0, latencies >= 0, all finite; the fabric may be 0
  //! (non-blocking); `inter_domain` must be a real link when `domains > 1`; `intra_node == pcie` when
  //! `intra_node_over_pcie`; `name` and `source` non-empty single lines without `#` (so that
  //! `to_platform_text` can write them).
  //! @throws error (invalid_argument) naming the field and its value.
  void validate() const;

  friend bool operator==(cluster_spec const& a, cluster_spec const& b) {
    return a.name == b.name && a.source == b.source && a.domains == b.domains &&
           a.nodes_per_domain == b.nodes_per_domain && a.gpus_per_node == b.gpus_per_node &&
           a.nics_per_node == b.nics_per_node && a.gpu_flops == b.gpu_flops &&
           a.hbm_bytes_per_second == b.hbm_bytes_per_second && a.kernel_launch_seconds == b.kernel_launch_seconds &&
           a.gemm_efficiency == b.gemm_efficiency && a.gemm_ridge_rows == b.gemm_ridge_rows &&
           a.comm_sm_share == b.comm_sm_share && a.collective_overhead_seconds == b.collective_overhead_seconds &&
           a.device_contention == b.device_contention &&
           a.intra_node == b.intra_node && a.intra_node_over_pcie == b.intra_node_over_pcie && a.pcie == b.pcie &&
           a.nic == b.nic && a.fabric == b.fabric && a.inter_domain == b.inter_domain;
  }
  friend bool operator!=(cluster_spec const& a, cluster_spec const& b) { return !(a == b); }
};

namespace detail {

//! A number of `cluster_spec` and its key in the text form. The key carries the unit papers use
//! (`nic_Gbps`, `kernel_launch_us`); `si = value * multiply / divide`, with one of the two equal to 1
//! so that the conversion rounds once (and `1e-6` is never used: it has no exact double).
struct spec_number {
  char const* field;  //!< e.g. "nic.bytes_per_second"
  char const* key;    //!< e.g. "nic_Gbps"
  double multiply;    //!< SI per unit, when >= 1
  double divide;      //!< units per SI, when >= 1
  bool may_be_zero;   //!< a rate of 0 means something (the non-blocking fabric) or a latency
  bool fraction;      //!< at most 1 (a share of the device)
  double& (*at)(cluster_spec&);
};

//! The numbers, in the order the text form writes them.
inline constexpr spec_number spec_numbers[] = {
    {"gpu_flops", "gpu_tflops", 1e12, 1, false, false, [](cluster_spec& s) -> double& { return s.gpu_flops; }},
    {"hbm_bytes_per_second", "hbm_GBps", 1e9, 1, false, false,
     [](cluster_spec& s) -> double& { return s.hbm_bytes_per_second; }},
    {"kernel_launch_seconds", "kernel_launch_us", 1, 1e6, true, false,
     [](cluster_spec& s) -> double& { return s.kernel_launch_seconds; }},
    {"gemm_efficiency", "gemm_efficiency", 1, 1, false, true,
     [](cluster_spec& s) -> double& { return s.gemm_efficiency; }},
    {"gemm_ridge_rows", "gemm_ridge_rows", 1, 1, false, false,
     [](cluster_spec& s) -> double& { return s.gemm_ridge_rows; }},
    {"comm_sm_share", "comm_sm_share", 1, 1, true, true, [](cluster_spec& s) -> double& { return s.comm_sm_share; }},
    {"collective_overhead_seconds", "collective_overhead_us", 1, 1e6, true, false,
     [](cluster_spec& s) -> double& { return s.collective_overhead_seconds; }},
    {"intra_node.bytes_per_second", "intra_node_GBps", 1e9, 1, false, false,
     [](cluster_spec& s) -> double& { return s.intra_node.bytes_per_second; }},
    {"intra_node.latency_seconds", "intra_node_us", 1, 1e6, true, false,
     [](cluster_spec& s) -> double& { return s.intra_node.latency_seconds; }},
    {"pcie.bytes_per_second", "pcie_GBps", 1e9, 1, false, false,
     [](cluster_spec& s) -> double& { return s.pcie.bytes_per_second; }},
    {"pcie.latency_seconds", "pcie_us", 1, 1e6, true, false,
     [](cluster_spec& s) -> double& { return s.pcie.latency_seconds; }},
    {"nic.bytes_per_second", "nic_Gbps", 1.25e8, 1, false, false,
     [](cluster_spec& s) -> double& { return s.nic.bytes_per_second; }},
    {"nic.latency_seconds", "nic_us", 1, 1e6, true, false, [](cluster_spec& s) -> double& { return s.nic.latency_seconds; }},
    {"fabric.bytes_per_second", "fabric_GBps", 1e9, 1, true, false,
     [](cluster_spec& s) -> double& { return s.fabric.bytes_per_second; }},
    {"fabric.latency_seconds", "fabric_us", 1, 1e6, true, false,
     [](cluster_spec& s) -> double& { return s.fabric.latency_seconds; }},
    {"inter_domain.bytes_per_second", "inter_domain_Gbps", 1.25e8, 1, true, false,
     [](cluster_spec& s) -> double& { return s.inter_domain.bytes_per_second; }},
    {"inter_domain.latency_seconds", "inter_domain_us", 1, 1e6, true, false,
     [](cluster_spec& s) -> double& { return s.inter_domain.latency_seconds; }},
};

//! A count of `cluster_spec` (>= 1), its key in the text form, and whether the text may leave it out.
struct spec_count {
  char const* field;  //!< the member's name, which is also its key
  bool optional;      //!< `domains` defaults to 1
  std::int32_t& (*at)(cluster_spec&);
};

inline constexpr spec_count spec_counts[] = {
    {"domains", true, [](cluster_spec& s) -> std::int32_t& { return s.domains; }},
    {"nodes_per_domain", false, [](cluster_spec& s) -> std::int32_t& { return s.nodes_per_domain; }},
    {"gpus_per_node", false, [](cluster_spec& s) -> std::int32_t& { return s.gpus_per_node; }},
    {"nics_per_node", false, [](cluster_spec& s) -> std::int32_t& { return s.nics_per_node; }},
};

//! The checks of `cluster_spec::validate`. `subject(field, key, value)` names what failed: the
//! field and its SI value for `validate`, the file, line, key and text for the parser.
template <class Subject>
void check_cluster_spec(cluster_spec const& spec, char const* op, Subject&& subject) {
  cluster_spec s = spec;  // the accessors hand out references to a non-const spec
  for (auto const& line : {std::pair<char const*, std::string const*>{"name", &s.name}, {"source", &s.source}}) {
    std::string const& text = *line.second;
    bool const one_line = text.find_first_of("#\n\r") == std::string::npos;
    bool const trimmed =
        !text.empty() && text.front() != ' ' && text.front() != '\t' && text.back() != ' ' && text.back() != '\t';
    require(one_line && trimmed, op, subject(line.first, line.first, "'" + text + "'"),
            " must be non-empty, on one line, without '#' and without blanks at either end");
  }
  for (auto const& c : spec_counts) {
    std::int32_t const v = c.at(s);
    require(v >= 1, op, subject(c.field, c.field, std::to_string(v)), " must be >= 1");
  }
  std::int64_t const nodes = std::int64_t{s.domains} * s.nodes_per_domain;
  std::int64_t const most = cluster_spec::max_gpus;  // also keeps the product within int32's range
  if (nodes > most || nodes * s.gpus_per_node > most) {
    char const* const field = nodes > most ? (s.domains > most ? "domains" : "nodes_per_domain") : "gpus_per_node";
    std::int32_t const value = nodes > most ? (s.domains > most ? s.domains : s.nodes_per_domain) : s.gpus_per_node;
    fail(status::invalid_argument, op, subject(field, field, std::to_string(value)), " makes ", s.domains, " domains x ",
         s.nodes_per_domain, " nodes x ", s.gpus_per_node, " GPUs = ",
         nodes <= most ? std::to_string(nodes * s.gpus_per_node) : concat(static_cast<double>(nodes) * s.gpus_per_node),
         " GPUs, more than the limit of cluster_spec::max_gpus = ", most);
  }
  for (auto const& n : spec_numbers) {
    double const v = n.at(s);
    bool const ok = std::isfinite(v) && (n.may_be_zero ? v >= 0 : v > 0) && (!n.fraction || v <= 1);
    require(ok, op, subject(n.field, n.key, concat(v)), n.may_be_zero ? " must be finite and >= 0" : " must be finite and > 0",
            n.fraction ? " and <= 1 (a share of the device)" : "");
  }
  require(s.domains == 1 || s.inter_domain.bytes_per_second > 0, op,
          subject("inter_domain.bytes_per_second", "inter_domain_Gbps", concat(s.inter_domain.bytes_per_second)),
          " must be > 0 when domains = ", s.domains, " (the domains talk through it)");
  require(!s.intra_node_over_pcie || s.intra_node == s.pcie, op,
          subject("intra_node", "intra_node",
                  concat(s.intra_node.bytes_per_second, " B/s, ", s.intra_node.latency_seconds, " s")),
          " must equal pcie (", s.pcie.bytes_per_second, " B/s, ", s.pcie.latency_seconds,
          " s) when intra_node_over_pcie: one link carries both");
}

}  // namespace detail

inline void cluster_spec::validate() const {
  detail::check_cluster_spec(
      *this, "cluster_spec::validate",
      [](char const* field, char const*, std::string const& value) { return detail::concat(field, " = ", value); });
}

MOECOMM_NAMESPACE_END
