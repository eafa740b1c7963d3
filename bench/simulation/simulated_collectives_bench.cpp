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
//! - `deepep_dispatch/EP:<n>`: the dispatcher's `route` + `dispatch` (dropless, flat) of 4096
//!   tokens per rank, H = 7168 bf16, top-8 of 256 experts routed uniformly; GBps = bytes a rank
//!   receives (its own rows included, as DeepEP's tests count `num_recv_tokens`) / time.
//! Real blocks are small; the payload scale makes each message its simulated size. Time = simulated
//! span over all ranks (earliest start to latest end of the operation), one iteration (deterministic).
//! Check: every rank receives exactly the bytes its peers sent it.

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
        benchmark::RegisterBenchmark(name.c_str(), [&platform, op, n, mib](benchmark::State& state) {
          double seconds = 0;
          bool correct = true;
          for (auto _ : state) {
            seconds = run_collective(platform, op, n, mib * MiB, correct);
            state.SetIterationTime(seconds);
          }
          if (!correct) return moecomm_bench::fail(state, "a rank received bytes its peer did not send it");
          report_bandwidth(state, double(mib * MiB), n, seconds);
        })
            ->UseManualTime()
            ->Iterations(1)
            ->Unit(benchmark::kMicrosecond);
      }
}

// DeepEP's normal-kernel benchmark configuration (its README / tests).
constexpr std::int64_t deepep_tokens = 4096, deepep_hidden = 7168, real_hidden = 4;
constexpr std::int32_t deepep_top_k = 8, deepep_experts = 256;
constexpr double bf16 = 2.0;

void register_deepep_dispatch(moecomm::simulated_platform const& platform) {
  for (std::int32_t n : rank_counts) {
    std::string const name = "deepep_dispatch/EP:" + std::to_string(n);
    benchmark::RegisterBenchmark(name.c_str(), [&platform, n](benchmark::State& state) {
      auto const routing = moecomm_bench::skewed_routing(n, deepep_tokens, deepep_top_k, deepep_experts, 0.0, 7);
      backend const be(moecomm::host_backend{}, moecomm_bench::model_scale(deepep_hidden, 1, bf16, real_hidden, 1, sizeof(float)));
      double seconds = 0, received_rows = 0;
      std::int64_t sent_rows = 0, arrived_rows = 0;
      for (auto _ : state) {
        moecomm_bench::step_span span(n);
        moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, n);
        received_rows = 0;
        sent_rows = arrived_rows = 0;
        world.run([&](comm_t comm) {
          auto const me = static_cast<std::size_t>(comm.rank());
          moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(n, platform.gpus_per_node()));
          moecomm::dispatcher<backend, comm_t> d(be, groups, deepep_experts);
          std::vector<float> const x = moecomm_bench::random_rows(deepep_tokens * real_hidden, 400 + me);
          comm.barrier();
          span.start[me] = moecomm::simulated_seconds{}();
          d.route(routing[me].view());
          std::vector<float> rows(static_cast<std::size_t>(d.received_rows() * real_hidden));
          d.template dispatch<float>({x.data(), deepep_tokens, real_hidden}, {rows.data(), d.received_rows(), real_hidden});
          span.end[me] = moecomm::simulated_seconds{}();
          received_rows += double(d.received_rows()) / n;  // mean over ranks; actors run one at a time
          sent_rows += d.report().kept_slots;
          arrived_rows += d.received_rows();
        });
        seconds = span.seconds();
        state.SetIterationTime(seconds);
      }
      if (sent_rows != arrived_rows || sent_rows != n * deepep_tokens * deepep_top_k)
        return moecomm_bench::fail(state, "rows sent and received differ from T * K per rank");
      double const bytes = received_rows * deepep_hidden * bf16;
      state.counters["recv_MB_per_rank"] = bytes / 1e6;
      state.counters["GBps"] = bytes / seconds / 1e9;
    })
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "deepep-h800");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name);
  register_collectives(platform);
  register_deepep_dispatch(platform);
  return moecomm_bench::finish("bench_simulated_collectives");
}
