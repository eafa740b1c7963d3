// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `link_model`: what the planners price a cluster's traffic and kernels with, from its
//! `cluster_spec` alone (no simulation): a round of messages over the links they cross, the ring
//! all-gather, the pipelined chain of a broadcast or reduce, a memory kernel, a GEMM on the roofline
//! of its rows. `exchange_adviser` (one routing step's exchanges) and `pattern_adviser` (whole layer
//! steps of every pattern) are built on it, so both price a message alike.
//!
//! The model (docs/performance.md, "The exchange adviser", validates it against the simulation):
//! - a round of messages (one grouped exchange) takes the time its messages take as fluid flows
//!   sharing each link max-min fairly (at least the largest load of any link over its bandwidth),
//!   plus the latency of the longest route it uses, plus the collective's
//!   `collective_overhead_seconds`. The links are a GPU's intra-node port (out and in), its PCIe link
//!   to the NIC, its node's NICs (one aggregate link), the domain's fabric and the domain's WAN
//!   uplink, as `cluster_spec` describes them;
//! - a ring all-gather is n - 1 dependent steps of one block to the next rank, paying the overhead
//!   once; a broadcast or reduce is a chain through the ranks in order, pipelined in chunks of at
//!   most 1 MiB (at most 64), as `simgrid_communicator` runs them: the first chunk crosses each hop
//!   in turn, the others follow at the slowest hop's pace; ring all-reduces over disjoint groups
//!   (expert data parallelism, replica groups) run side by side, each ring edge one fluid flow of
//!   its whole traffic, plus its 2(n - 1) hop latencies;
//! - a memory kernel moves its bytes at HBM bandwidth after its launch; a GEMM runs at
//!   `cluster_spec::gemm_seconds`.
//! What it leaves out: the SMs communication takes from concurrent compute (`comm_sm_share`), and
//! messages that start at different times within a round.

#include <moecomm/config.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/core/cluster_spec.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

namespace detail {

//! Flows of bytes over links of given capacities, sharing each link max-min fairly; `makespan`
//! runs them to the end. The flows that would finish within `batch` of the elapsed time after the
//! next one are run together to the last of their finishes before the rates are recomputed: a few
//! hundred times, not once per flow. The capacity they free is given back late, never early, so the
//! makespan is never below the exact fluid one, nor the busiest link's load over its bandwidth.
class fluid_flows {
 public:
  static constexpr double batch = 0.02;

  //! A flow of `bytes` over the `n` links of `path` (links of capacity 0 are left out: they limit nothing).
  void add(double bytes, std::int32_t const* path, int n, std::vector<double> const& capacity) {
    remaining_.push_back(bytes);
    first_.push_back(static_cast<std::int32_t>(links_.size()));
    for (int i = 0; i < n; ++i)
      if (capacity[static_cast<std::size_t>(path[i])] > 0) links_.push_back(path[i]);
    end_.push_back(static_cast<std::int32_t>(links_.size()));
  }

  //! The time until every flow has finished.
  [[nodiscard]] double makespan(std::vector<double> const& capacity) {
    std::size_t const F = remaining_.size(), L = capacity.size();
    std::vector<std::vector<std::int32_t>> on(L);  // the active flows on each link
    std::vector<char> active(F, 1);
    std::size_t left = F;
    for (std::size_t f = 0; f < F; ++f) {
      if (first_[f] == end_[f]) {  // limited by nothing: instantaneous
        active[f] = 0;
        --left;
        continue;
      }
      for (std::int32_t i = first_[f]; i < end_[f]; ++i) on[static_cast<std::size_t>(links_[static_cast<std::size_t>(i)])].push_back(static_cast<std::int32_t>(f));
    }
    std::vector<double> rate(F, 0.0), spare(L), finish(F);
    std::vector<std::int32_t> unfixed(L);
    std::vector<std::size_t> busy;  // links with flows whose rate is not fixed yet
    std::vector<char> fixed(F);
    double now = 0;
    while (left > 0) {
      // Max-min rates: the link with the smallest fair share fixes its flows' rate, repeatedly.
      busy.clear();
      for (std::size_t l = 0; l < L; ++l) {
        auto& flows = on[l];
        flows.erase(std::remove_if(flows.begin(), flows.end(), [&](std::int32_t f) { return !active[static_cast<std::size_t>(f)]; }), flows.end());
        spare[l] = capacity[l];
        unfixed[l] = static_cast<std::int32_t>(flows.size());
        if (unfixed[l] > 0) busy.push_back(l);
      }
      std::fill(fixed.begin(), fixed.end(), 0);
      while (!busy.empty()) {
        std::size_t bottleneck = 0;
        double share = std::numeric_limits<double>::infinity();
        std::size_t kept = 0;
        for (std::size_t l : busy) {
          if (unfixed[l] == 0) continue;
          busy[kept++] = l;
          if (spare[l] / unfixed[l] < share) {
            bottleneck = l;
            share = spare[l] / unfixed[l];
          }
        }
        busy.resize(kept);
        if (kept == 0) break;
        for (std::int32_t f : on[bottleneck]) {
          auto const uf = static_cast<std::size_t>(f);
          if (fixed[uf]) continue;
          fixed[uf] = 1;
          rate[uf] = share;
          for (std::int32_t i = first_[uf]; i < end_[uf]; ++i) {
            auto const l = static_cast<std::size_t>(links_[static_cast<std::size_t>(i)]);
            spare[l] = std::max(0.0, spare[l] - share);
            --unfixed[l];
          }
        }
      }
      // Run the flows finishing within `batch` of the elapsed time after the next finish to the
      // last of their finishes.
      double next = std::numeric_limits<double>::infinity();
      for (std::size_t f = 0; f < F; ++f)
        if (active[f]) next = std::min(next, finish[f] = remaining_[f] / rate[f]);
      double const horizon = next + batch * (now + next);
      double step = next;
      for (std::size_t f = 0; f < F; ++f)
        if (active[f] && finish[f] <= horizon) step = std::max(step, finish[f]);
      for (std::size_t f = 0; f < F; ++f) {
        if (!active[f]) continue;
        if (finish[f] <= horizon) {
          active[f] = 0;
          --left;
        } else {
          remaining_[f] -= rate[f] * step;
        }
      }
      now += step;
    }
    return now;
  }

 private:
  std::vector<double> remaining_;
  std::vector<std::int32_t> first_, end_, links_;  //!< flow f crosses links_[first_[f] .. end_[f])
};

}  // namespace detail

class link_model {
 public:
  using matrix = std::vector<double>;  //!< [R][R]: what rank s sends rank d, at `cell(s, d)`

  //! @param spec the cluster (validated); @param topo the ranks' nodes and domains.
  //! @throws error (invalid_argument) naming the field of `spec` that is invalid.
  link_model(cluster_spec spec, topology topo) : spec_(std::move(spec)), topo_(std::move(topo)) { spec_.validate(); }

  [[nodiscard]] cluster_spec const& spec() const noexcept { return spec_; }
  [[nodiscard]] topology const& topo() const noexcept { return topo_; }
  [[nodiscard]] std::int32_t ranks() const noexcept { return topo_.num_ranks(); }

  [[nodiscard]] std::size_t cell(std::int32_t s, std::int32_t d) const {
    return static_cast<std::size_t>(s) * static_cast<std::size_t>(topo_.num_ranks()) + static_cast<std::size_t>(d);
  }
  //! An all-zero `[R][R]` matrix.
  [[nodiscard]] matrix zeros() const { return matrix(cell(ranks(), 0), 0.0); }
  //! `m` with senders and receivers swapped: the messages of the way back.
  [[nodiscard]] matrix transposed(matrix const& m) const {
    matrix t = zeros();
    for (std::int32_t s = 0; s < ranks(); ++s)
      for (std::int32_t d = 0; d < ranks(); ++d) t[cell(d, s)] = m[cell(s, d)];
    return t;
  }

  //! One round of messages, one collective: its overhead and its links' time.
  [[nodiscard]] double round_seconds(matrix const& bytes) const { return spec_.collective_overhead_seconds + links_seconds(bytes); }

  //! The links' time of `bytes[s][d]` from s to d at once (the diagonal is a local copy, not a
  //! message): the longest route's latency, plus the time the messages take as fluid flows that
  //! share each link max-min fairly (what SimGrid's `fairbottleneck` solver computes), their rates
  //! recomputed whenever some finish. Never below the busiest link's load over its bandwidth; above
  //! it when a link's flows are held back elsewhere (a hot rank's PCIe link, say, while its node's
  //! NICs are shared with every other flow into the node).
  [[nodiscard]] double links_seconds(matrix const& bytes) const {
    double latency = 0;
    for (std::int32_t s = 0; s < ranks(); ++s)
      for (std::int32_t d = 0; d < ranks(); ++d)
        if (s != d && bytes[cell(s, d)] > 0) latency = std::max(latency, route_latency(s, d));
    return latency + makespan(bytes);
  }

  //! The ring all-gather of `bytes` per rank over every rank: n - 1 dependent steps of one block to
  //! the next rank.
  [[nodiscard]] double allgather_seconds(double bytes) const {
    std::int32_t const n = topo_.num_ranks();
    if (n == 1) return 0;
    return spec_.collective_overhead_seconds + (n - 1) * links_seconds(ring(bytes));
  }

  //! Ring all-gathers of `bytes` per rank, one over each of `groups` (disjoint, each in its ring's
  //! order), side by side: n - 1 dependent steps (n the largest group's size), in each every rank
  //! sends one block to its next. Groups of one rank cost nothing.
  [[nodiscard]] double allgather_seconds(std::vector<std::vector<std::int32_t>> const& groups, double bytes) const {
    matrix step = zeros();
    std::size_t n = 1;
    for (auto const& g : groups) {
      if (g.size() < 2) continue;
      n = std::max(n, g.size());
      for (std::size_t i = 0; i < g.size(); ++i) step[cell(g[i], g[(i + 1) % g.size()])] = bytes;
    }
    if (n == 1) return 0;
    return spec_.collective_overhead_seconds + static_cast<double>(n - 1) * links_seconds(step);
  }

  //! A broadcast (or reduce) of `bytes` over every rank: a chain through the ranks in order (from
  //! rank 0), in chunks of at most 1 MiB (at most 64) that follow each other down it. The first
  //! chunk crosses every hop in turn; the others follow at the pace of the slowest hop.
  [[nodiscard]] double chain_seconds(double bytes) const {
    std::int32_t const n = topo_.num_ranks();
    if (n == 1) return 0;
    double const chunks = std::clamp(std::ceil(bytes / double(1 << 20)), 1.0, 64.0);
    double first = 0, slowest = 0;
    matrix hop = zeros();
    for (std::int32_t r = 0; r + 1 < n; ++r) {
      hop[cell(r, r + 1)] = bytes / chunks;
      double const t = links_seconds(hop);
      hop[cell(r, r + 1)] = 0;
      first += t;
      slowest = std::max(slowest, t);
    }
    return spec_.collective_overhead_seconds + first + (chunks - 1) * slowest;
  }

  //! Ring all-reduces of `bytes` each, one over each of `groups` (disjoint sets of ranks, each in
  //! its ring's order), all at once, as NCCL runs one per group: a reduce-scatter then an
  //! all-gather, 2(n - 1) steps in which every rank of a group of n sends `bytes / n` to the next.
  //! The groups run independently: each ring edge is one fluid flow of its 2(n - 1) · bytes / n,
  //! the flows of every group sharing the links max-min fairly, plus the longest group's 2(n - 1)
  //! hop latencies; the overhead once. Groups of one rank cost nothing.
  [[nodiscard]] double allreduce_seconds(std::vector<std::vector<std::int32_t>> const& groups, double bytes) const {
    matrix edges = zeros();
    double latency = 0;
    bool any = false;
    for (auto const& g : groups) {
      if (g.size() < 2) continue;
      any = true;
      double const n = static_cast<double>(g.size()), steps = 2 * (n - 1);
      double hop = 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        std::int32_t const next = g[(i + 1) % g.size()];
        edges[cell(g[i], next)] = steps * bytes / n;
        hop = std::max(hop, route_latency(g[i], next));
      }
      latency = std::max(latency, steps * hop);
    }
    return any ? spec_.collective_overhead_seconds + latency + makespan(edges) : 0.0;
  }

  //! `kernels` launches.
  [[nodiscard]] double launches(int kernels) const { return kernels * spec_.kernel_launch_seconds; }

  //! A kernel that reads and writes `bytes` in all, at HBM bandwidth (a copy's bytes count twice).
  [[nodiscard]] double memory_seconds(double bytes) const {
    return spec_.kernel_launch_seconds + bytes / spec_.hbm_bytes_per_second;
  }

  //! `flops` in GEMMs of `rows` rows (`cluster_spec::gemm_seconds`).
  [[nodiscard]] double gemm_seconds(double flops, double rows) const { return spec_.gemm_seconds(flops, rows); }

 private:
  //! The latency of the route from s to d: two ports inside a node; PCIe, NIC, the fabric, NIC and
  //! PCIe between nodes, and the WAN uplinks and a second fabric between domains.
  [[nodiscard]] double route_latency(std::int32_t s, std::int32_t d) const {
    if (topo_.same_node(s, d)) return 2 * (spec_.intra_node_over_pcie ? spec_.pcie : spec_.intra_node).latency_seconds;
    double route = 2 * (spec_.pcie.latency_seconds + spec_.nic.latency_seconds) + spec_.fabric.latency_seconds;
    if (!topo_.same_domain(s, d)) route += spec_.fabric.latency_seconds + 2 * spec_.inter_domain.latency_seconds;
    return route;
  }

  //! The time `bytes[s][d]` take as fluid flows over the links they cross, sharing each link
  //! max-min fairly (the diagonal is a local copy, not a message). The links: a GPU's port out and
  //! in, its PCIe out and in; a node's NICs out and in; a domain's fabric and WAN uplink out and in.
  //! A bandwidth of 0 (a non-blocking fabric) limits nothing.
  [[nodiscard]] double makespan(matrix const& bytes) const {
    std::int32_t const R = topo_.num_ranks(), N = topo_.num_nodes(), D = topo_.num_domains();
    std::int32_t const port_out = 0, port_in = R, pcie_out = 2 * R, pcie_in = 3 * R, nic_out = 4 * R, nic_in = 4 * R + N,
                       fabric = 4 * R + 2 * N, wan_out = fabric + D, wan_in = fabric + 2 * D, links = fabric + 3 * D;
    std::vector<double> capacity(static_cast<std::size_t>(links), 0.0);
    auto set = [&](std::int32_t first, std::int32_t count, double bandwidth) {
      for (std::int32_t l = first; l < first + count; ++l) capacity[static_cast<std::size_t>(l)] = bandwidth;
    };
    set(port_out, 2 * R, spec_.intra_node.bytes_per_second);
    set(pcie_out, 2 * R, spec_.pcie.bytes_per_second);
    set(nic_out, 2 * N, spec_.nics_per_node * spec_.nic.bytes_per_second);
    set(fabric, D, spec_.fabric.bytes_per_second);
    set(wan_out, 2 * D, spec_.inter_domain.bytes_per_second);
    detail::fluid_flows flows;
    for (std::int32_t s = 0; s < R; ++s)
      for (std::int32_t d = 0; d < R; ++d) {
        double const b = bytes[cell(s, d)];
        if (s == d || b <= 0) continue;
        std::int32_t path[7];
        int n = 0;
        if (topo_.same_node(s, d)) {
          path[n++] = (spec_.intra_node_over_pcie ? pcie_out : port_out) + s;
          path[n++] = (spec_.intra_node_over_pcie ? pcie_in : port_in) + d;
        } else {
          path[n++] = pcie_out + s;
          path[n++] = pcie_in + d;
          path[n++] = nic_out + topo_.node_of(s);
          path[n++] = nic_in + topo_.node_of(d);
          if (topo_.same_domain(s, d)) {
            path[n++] = fabric + topo_.domain_of(s);
          } else {
            path[n++] = wan_out + topo_.domain_of(s);
            path[n++] = wan_in + topo_.domain_of(d);
          }
        }
        flows.add(b, path, n, capacity);
      }
    return flows.makespan(capacity);
  }

  //! Every rank sends `bytes` to the next.
  [[nodiscard]] matrix ring(double bytes) const {
    std::int32_t const R = topo_.num_ranks();
    matrix m = zeros();
    for (std::int32_t s = 0; s < R; ++s) m[cell(s, (s + 1) % R)] = bytes;
    return m;
  }

  cluster_spec spec_;
  topology topo_;
};

MOECOMM_NAMESPACE_END
