// SPDX-License-Identifier: Apache-2.0
//! @file
//! How far the simulated `deepep-h800` cluster is from the hardware: collective bandwidths reported
//! as nccl-tests reports them, and DeepEP's normal-kernel dispatch figure, to set beside the
//! published numbers (docs/performance.md, "Simulated clusters").
//!
//! `bench_simulated_collectives [--platform=deepep-h800]`:
//! - `alltoall/n:<n>/MiB:<S>`: `simgrid_communicator::exchange` with n equal blocks of S / n bytes
//!   per rank (nccl-tests' alltoall "size" S = what one rank sends, its own block included);
//! - `allgather/n:<n>/MiB:<S>`: `allgather` of S / n bytes per rank (nccl-tests' "size" S = the
//!   gathered buffer);
//!   both with algbw = S / time and busbw = algbw · (n − 1) / n (nccl-tests' factor for both), for
//!   n = 8 (one node, NVLink) and 16, 32, 64 (2, 4, 8 nodes), S = 1 MiB … 256 MiB;
//! - `deepep/EP:<n>/routing:<uniform|node_limited>/exchange:<slots|dedup|dedup_node|dedup_node_sf>`: the dispatcher's
//!   `route` + `dispatch` (the time; `route_us` its route), then `combine` (`combine_us`), dropless, of 4096 tokens per
//!   rank, H = 7168 bf16, top-8 of 256 experts routed uniformly or on at most 4 nodes per token
//!   (DeepSeek-V3; only where there are more than 4 nodes), with one row per slot (`flat`), per
//!   (token, rank) (`dedup_per_rank<flat>`) or per (token, node) between nodes and (token, rank)
//!   inside (`dedup_per_node`: its hops overlapped in `--pieces=P` pieces, default 4; `_sf`
//!   store-and-forward, one piece). Counters, means per rank: `nvlink_MB` / `rdma_MB`, the dispatch's
//!   row bytes that leave the rank over each link class (the relay's forwarding included);
//!   `rdma_GBps` = `rdma_MB` / time; `recv_MB`, rows the experts' ranks receive (own included);
//!   `tokens_GBps` = distinct (token, rank) rows received × 7168 × 2 / time, DeepEP's count
//!   (`num_recv_tokens`); `wire_GBps` = rows actually received (slots or tokens) / time.
//! Real blocks are small; the payload scale makes each message its simulated size. Time = simulated
//! span over all ranks (earliest start to latest end of the operation), one iteration (deterministic).
//! Check (collectives): every rank receives exactly the bytes its peers sent it.

#include <moecomm/moecomm.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using backend = moecomm::simulated_backend<>;
using comm_t = moecomm::simgrid_communicator;
constexpr std::int64_t MiB = std::int64_t{1} << 20;
constexpr std::int64_t real_block = 64;  // real bytes per block; sizes are powers of two, so scales are exact
constexpr std::int32_t rank_counts[] = {8, 16, 32, 64};

//! algbw and busbw as nccl-tests computes them (GB = 1e9 B).
void report_bandwidth(benchmark::State& state, double bytes, std::int32_t ranks, double seconds) {
  double const algbw = bytes / seconds / 1e9;
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * (ranks - 1) / ranks;
}

enum class collective { alltoall, allgather };

//! One collective of `size` simulated bytes (nccl-tests' size) on ranks 0..n-1; returns its span.
double run_collective(moecomm::simulated_platform const& platform, collective op, std::int32_t n, std::int64_t size,
                      bool& correct) {
  std::int64_t const block = size / n;
  backend const be(moecomm::host_backend{}, {double(block) / double(real_block), 1, 1});
  moecomm_bench::step_span span(n);
  moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, n);
  world.run([&](comm_t comm) {
    auto const me = static_cast<std::size_t>(comm.rank());
    std::vector<char> send(static_cast<std::size_t>(n * real_block)), recv(send.size());
    for (std::int32_t p = 0; p < n; ++p)  // block p of rank r holds byte r ^ p, so a receiver can check its sources
      std::fill_n(send.begin() + p * real_block, real_block, static_cast<char>(comm.rank() ^ p));
    std::vector<moecomm::send_block> sends;
    std::vector<moecomm::recv_block> recvs;
    for (std::int32_t p = 0; p < n; ++p) {
      sends.push_back({p, send.data() + p * real_block, real_block});
      recvs.push_back({p, recv.data() + p * real_block, real_block});
    }
    auto const scope = be.payload_scope(moecomm::detail::payload_kind::rows);
    comm.barrier();
    span.start[me] = moecomm::simulated_seconds{}();
    if (op == collective::alltoall) comm.exchange(sends, recvs);
    else comm.allgather(send.data() + comm.rank() * real_block, recv.data(), real_block);
    span.end[me] = moecomm::simulated_seconds{}();
    for (std::int32_t p = 0; p < n; ++p) {  // all-to-all: p ^ me from p; all-gather: p's own block, p ^ p
      char const want = static_cast<char>(op == collective::alltoall ? p ^ comm.rank() : 0);
      for (std::int64_t i = 0; i < real_block; ++i) correct = correct && recv[static_cast<std::size_t>(p * real_block + i)] == want;
    }
  });
  return span.seconds();
}

void register_collectives(moecomm::simulated_platform const& platform) {
  for (collective op : {collective::alltoall, collective::allgather})
    for (std::int32_t n : rank_counts)
      for (std::int64_t mib = 1; mib <= 256; mib *= 4) {
        std::string const name = std::string(op == collective::alltoall ? "alltoall" : "allgather") + "/n:" +
                                 std::to_string(n) + "/MiB:" + std::to_string(mib);
        moecomm_bench::register_simulated(name, benchmark::kMicrosecond, [&platform, op, n, mib](benchmark::State& state) {
          double seconds = 0;
          bool correct = true;
          for (auto _ : state) {
            seconds = run_collective(platform, op, n, mib * MiB, correct);
            state.SetIterationTime(seconds);
          }
          if (!correct) return moecomm_bench::fail(state, "a rank received bytes its peer did not send it");
          report_bandwidth(state, double(mib * MiB), n, seconds);
        });
      }
}

// DeepEP's normal-kernel benchmark configuration (its README / tests).
constexpr std::int64_t deepep_tokens = 4096, deepep_hidden = 7168, real_hidden = 4;
constexpr std::int32_t deepep_top_k = 8, deepep_experts = 256;
constexpr double bf16 = 2.0;

//! Rows each rank receives, mean over ranks: one per (token, destination rank) with a slot there,
//! its own included (DeepEP's `num_recv_tokens`), or one per slot.
double mean_received_rows(std::vector<moecomm_bench::rank_routing> const& routing, std::int32_t ranks, bool per_rank) {
  std::int32_t const local = deepep_experts / ranks;
  double rows = 0;
  for (auto const& r : routing)
    for (std::int64_t t = 0; t < r.tokens; ++t)
      for (std::int32_t k = 0; k < r.top_k; ++k) {
        std::int32_t const d = r.idx[static_cast<std::size_t>(t * r.top_k + k)] / local;
        bool first = true;
        for (std::int32_t j = 0; j < k && per_rank; ++j) first = first && r.idx[static_cast<std::size_t>(t * r.top_k + j)] / local != d;
        rows += first ? 1 : 0;
      }
  return rows / ranks;
}

//! DeepEP's normal-kernel test on the simulated cluster: dispatch, then combine, of 4096 tokens per
//! rank (H 7168 bf16, top-8 of 256), with one row per slot (`flat`) or per (token, rank) (`dedup`).
template <class Algorithm>
void register_deepep(moecomm::simulated_platform const& platform, char const* exchange, bool node_limited, Algorithm algorithm = {}) {
  for (std::int32_t n : rank_counts) {
    std::int32_t const nodes = n / platform.gpus_per_node();
    if (node_limited && nodes <= 4) continue;  // at most 4 nodes per token limits nothing
    std::string const name = std::string("deepep/EP:") + std::to_string(n) + "/routing:" + (node_limited ? "node_limited" : "uniform") +
                             "/exchange:" + exchange;
    moecomm_bench::register_simulated(name, benchmark::kMicrosecond, [&platform, n, nodes, node_limited, algorithm](benchmark::State& state) {
      auto const routing = node_limited ? moecomm_bench::node_limited_routing(n, deepep_tokens, deepep_top_k, deepep_experts, nodes, 4, 7)
                                        : moecomm_bench::skewed_routing(n, deepep_tokens, deepep_top_k, deepep_experts, 0.0, 7);
      backend const be(moecomm::host_backend{}, moecomm_bench::model_scale(deepep_hidden, 1, bf16, real_hidden, 1, sizeof(float)));
      double const model_row = deepep_hidden * bf16, real_row = real_hidden * sizeof(float);
      moecomm_bench::exchange_times times;
      for (auto _ : state) {
        times = moecomm_bench::simulate_exchange<Algorithm>(platform, n, routing, deepep_experts, be, real_hidden, algorithm);
        state.SetIterationTime(times.dispatch);
      }
      double const slot_rows = times.received_rows, dispatch_s = times.dispatch;
      // The dispatch's row bytes at the model's size (the slot lists, 64 bytes a row, apart).
      double const intra = times.intra_bytes / real_row * model_row, inter = times.inter_bytes / real_row * model_row;
      if (slot_rows != mean_received_rows(routing, n, false))
        return moecomm_bench::fail(state, "the experts received other rows than the routing's slots");
      double const tokens = mean_received_rows(routing, n, true) * model_row;
      double const wire = mean_received_rows(routing, n, moecomm::detail::is_dedup_v<Algorithm>) * model_row;
      state.counters["route_us"] = times.route * 1e6;
      state.counters["combine_us"] = times.combine * 1e6;
      state.counters["nvlink_MB"] = intra / 1e6;
      state.counters["rdma_MB"] = inter / 1e6;
      state.counters["rdma_GBps"] = inter / dispatch_s / 1e9;
      state.counters["recv_MB"] = wire / 1e6;
      state.counters["tokens_GBps"] = tokens / dispatch_s / 1e9;
      state.counters["wire_GBps"] = wire / dispatch_s / 1e9;
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "deepep-h800");
  moecomm_bench::take_contention_flag(argc, argv);
  auto const pieces = static_cast<std::int32_t>(moecomm_bench::take_int_flag(argc, argv, "--pieces", 4, 1, 4096));
  if (!moecomm_bench::start(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name);
  register_collectives(platform);
  for (bool node_limited : {false, true}) {
    register_deepep<moecomm::flat>(platform, "slots", node_limited);
    register_deepep<moecomm::dedup_per_rank<moecomm::flat>>(platform, "dedup", node_limited);
    register_deepep(platform, "dedup_node", node_limited, moecomm::dedup_per_node{pieces});
    register_deepep(platform, "dedup_node_sf", node_limited, moecomm::dedup_per_node{1});
  }
  return moecomm_bench::finish("bench_simulated_collectives");
}
