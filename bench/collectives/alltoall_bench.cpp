// SPDX-License-Identifier: Apache-2.0
//! @file
//! `alltoallv` over in-process ranks (`inproc_world`: one thread per rank), for each algorithm
//! (`flat`, `hierarchical_2d`, `pairwise{1}`), reported as nccl-tests reports its all-to-all:
//!
//!   algbw = S / t            S = bytes one rank sends, its own block included (nccl-tests' "size")
//!   busbw = algbw * (R-1)/R  the bytes that actually leave the rank
//!
//! and as a ratio to this machine's memcpy, measured in the same process before any benchmark
//! (bench/support/memcpy_reference.hpp). busbw counts each byte once, so it is compared with the
//! bytes one memcpy thread *delivers* per second (half the read + write figure `memcpy_GBps`).
//!
//! Timing (manual time, `UseManualTime`): the ranks' threads are started once per benchmark run
//! (one `inproc_world::run`), and rank 0's thread runs Google Benchmark's loop. Each iteration is
//!
//!   barrier; start = steady_clock::now() on rank 0; alltoallv; barrier; t = now() - start
//!
//! and `t` goes to `state.SetIterationTime`. The closing barrier returns on rank 0 only once every
//! rank has finished its `alltoallv`, so `t` runs from "all ranks ready" to "all ranks done". The
//! other ranks learn that the loop is over from a shared flag that rank 0 sets before one last
//! barrier (the barrier's lock orders the write before their read). Both barriers are inside `t`;
//! `barrier/R:n` measures an iteration without the `alltoallv`, i.e. that floor.
//!
//! Correctness: every byte of every block identifies (source, destination, offset). One untimed
//! call runs first (it also gives the message counts); then each rank poisons its receive buffer,
//! the timed loop runs, and every rank checks every received byte and the untouched tail. A
//! mismatch (or an exception on any rank) fails the benchmark, and main() returns non-zero.

#include <moecomm/moecomm.hpp>

#include "../support/inproc_ranks.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace moecomm_bench;

// ---- cases -----------------------------------------------------------------------------------

enum class traffic { uniform_64k, uniform_1m, skewed };

char const* traffic_name(traffic t) {
  return t == traffic::uniform_64k ? "64KiB" : t == traffic::uniform_1m ? "1MiB" : "skewed";
}

//! Uniform: every (s, d) block, self included, has the same size. Skewed: destination d gets
//! blocks proportional to 1 / (d + 1) (Zipf 1 over ranks; rank 0 is the hot rank, as with a hot
//! expert), with a mean of about 256 KiB per block, plus 17·s bytes so that no two sources agree
//! and blocks are not multiples of 8.
moecomm::byte_matrix make_matrix(traffic t, std::int32_t ranks) {
  std::vector<std::int64_t> cells(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks));
  double harmonic = 0.0;
  for (std::int32_t d = 0; d < ranks; ++d) harmonic += 1.0 / (d + 1);
  for (std::int32_t s = 0; s < ranks; ++s)
    for (std::int32_t d = 0; d < ranks; ++d) {
      std::int64_t b = 0;
      if (t == traffic::uniform_64k) b = std::int64_t{64} << 10;
      if (t == traffic::uniform_1m) b = std::int64_t{1} << 20;
      if (t == traffic::skewed) b = static_cast<std::int64_t>(262144.0 * ranks / ((d + 1) * harmonic)) + 17 * s;
      cells[static_cast<std::size_t>(s) * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(d)] = b;
    }
  return {ranks, std::move(cells)};
}

// ---- self-identifying bytes ------------------------------------------------------------------

//! Word j of the block that rank s sends rank d; byte i of the block is byte i % 8 (little end
//! first) of word i / 8.
std::uint64_t block_word(std::int32_t s, std::int32_t d, std::int64_t j) {
  std::uint64_t z = (static_cast<std::uint64_t>(s) << 40) ^ (static_cast<std::uint64_t>(d) << 20) ^ 0x5eed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) + static_cast<std::uint64_t>(j) * 0x9e3779b97f4a7c15ULL;
}

void fill_block(unsigned char* p, std::int32_t s, std::int32_t d, std::int64_t bytes) {
  std::int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t const w = block_word(s, d, i / 8);
    for (int b = 0; b < 8; ++b) p[i + b] = static_cast<unsigned char>(w >> (8 * b));
  }
  std::uint64_t const w = block_word(s, d, i / 8);
  for (int b = 0; i < bytes; ++i, ++b) p[i] = static_cast<unsigned char>(w >> (8 * b));
}

//! Index of the first wrong byte of the block (s -> d) at `p`, or -1.
std::int64_t first_wrong_byte(unsigned char const* p, std::int32_t s, std::int32_t d, std::int64_t bytes) {
  for (std::int64_t j = 0; j * 8 < bytes; ++j) {
    std::uint64_t const w = block_word(s, d, j);
    for (std::int64_t i = j * 8; i < std::min(bytes, j * 8 + 8); ++i)
      if (p[i] != static_cast<unsigned char>(w >> (8 * (i - j * 8)))) return i;
  }
  return -1;
}

constexpr unsigned char kPoison = 0xA5;
constexpr std::int64_t kTail = 64;  //!< bytes past the receive total that must stay poisoned

// ---- benchmarks --------------------------------------------------------------------------------

template <class Algorithm>
void bm_alltoall(benchmark::State& state, Algorithm algorithm, layout lay, traffic kind) {
  std::int32_t const ranks = lay.ranks();
  moecomm::topology const topo(ranks, lay.per_node);
  moecomm::byte_matrix const m = make_matrix(kind, ranks);
  std::vector<moecomm::alltoall_stats> stats(static_cast<std::size_t>(ranks));  // of the untimed call
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<double> seconds;
  std::atomic<bool> stop{false};

  bool const ran = run_ranks<world_t>(state, ranks, std::chrono::seconds(120), errors, [&](comm_t comm) {
    std::int32_t const me = comm.rank();
    moecomm::exchange_groups<comm_t> groups(comm, topo);
    auto send = be.allocate<unsigned char>(std::max<std::int64_t>(m.send_total(me), 1));
    auto recv = be.allocate<unsigned char>(m.recv_total(me) + kTail);
    for (std::int32_t d = 0; d < ranks; ++d) fill_block(send.data() + m.send_offset(me, d), me, d, m.bytes(me, d));
    std::memset(recv.data(), 0, static_cast<std::size_t>(recv.size()));
    moecomm::array_view<char const> const send_view{reinterpret_cast<char const*>(send.data()), m.send_total(me)};
    moecomm::array_view<char> const recv_view{reinterpret_cast<char*>(recv.data()), recv.size()};
    moecomm::alltoall_workspace<moecomm::host_backend> scratch;  // kept across calls, as the dispatcher keeps it

    moecomm::alltoallv(be, groups, m, send_view, recv_view, stats[static_cast<std::size_t>(me)], scratch, algorithm);
    std::memset(recv.data(), kPoison, static_cast<std::size_t>(recv.size()));

    moecomm::alltoall_stats timed;  // accumulates over the timed calls; not reported
    timed_loop(state, comm, stop, seconds,
               [&] { moecomm::alltoallv(be, groups, m, send_view, recv_view, timed, scratch, algorithm); });

    std::string& error = errors[static_cast<std::size_t>(me)];
    for (std::int32_t s = 0; s < ranks && error.empty(); ++s) {
      std::int64_t const bad = first_wrong_byte(recv.data() + m.recv_offset(s, me), s, me, m.bytes(s, me));
      if (bad >= 0)
        error = std::string(Algorithm::name) + ": rank " + std::to_string(me) + " got a wrong byte " +
                std::to_string(bad) + " in the block from rank " + std::to_string(s);
    }
    for (std::int64_t i = m.recv_total(me); i < recv.size() && error.empty(); ++i)
      if (recv.data()[i] != kPoison)
        error = std::string(Algorithm::name) + ": rank " + std::to_string(me) + " wrote past its receive buffer";
  });
  if (!ran) return;

  double const t = mean(seconds);
  double total = 0.0, messages = 0.0, inter_messages = 0.0, link_bytes = 0.0, rounds = 0.0;
  for (std::int32_t r = 0; r < ranks; ++r) {
    auto const& s = stats[static_cast<std::size_t>(r)];
    total += static_cast<double>(m.send_total(r));
    messages += static_cast<double>(s.messages());
    inter_messages += static_cast<double>(s.inter_messages);
    link_bytes += static_cast<double>(s.bytes());
    rounds += static_cast<double>(s.rounds);
  }
  double const per_rank = total / ranks;  // S; for the skewed matrix the mean over ranks
  double const algbw = t > 0 ? per_rank / t : 0.0;
  double const busbw = algbw * (ranks - 1) / ranks;
  double const copy = g_memcpy.copy_bytes_per_s();
  state.counters["S_MiB"] = per_rank / (1 << 20);
  state.counters["algbw_GBps"] = algbw / 1e9;
  state.counters["busbw_GBps"] = busbw / 1e9;
  state.counters["bus_of_memcpy"] = copy > 0 ? busbw / copy : 0.0;
  state.counters["all_ranks_of_memcpy"] = copy > 0 ? ranks * busbw / copy : 0.0;
  state.counters["msgs"] = messages / ranks;
  state.counters["inter_msgs"] = inter_messages / ranks;
  state.counters["rounds"] = rounds / ranks;
  // Bytes a rank puts on links per byte it must deliver elsewhere: 1 for flat and pairwise, more
  // for hierarchical_2d (blocks travel an intra-node hop and then an inter-node hop).
  double const needed = total - [&] {
    double self = 0.0;
    for (std::int32_t r = 0; r < ranks; ++r) self += static_cast<double>(m.bytes(r, r));
    return self;
  }();
  state.counters["link_bytes_x"] = needed > 0 ? link_bytes / needed : 0.0;
}

// ---- registration ------------------------------------------------------------------------------

template <class Algorithm>
void register_algorithm(Algorithm const& algorithm, std::string const& name) {
  for (layout const& lay : kCollectiveLayouts)
    for (traffic kind : {traffic::uniform_64k, traffic::uniform_1m, traffic::skewed})
      benchmark::RegisterBenchmark(("alltoall<" + name + ">/" + lay.name() + "/" + traffic_name(kind)).c_str(),
                                   bm_alltoall<Algorithm>, algorithm, lay, kind)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
}

void register_all() {
  register_barriers<world_t>(kCollectiveLayouts);  // the floor: an iteration without the all-to-all
  register_algorithm(moecomm::flat{}, "flat");
  register_algorithm(moecomm::hierarchical_2d{}, "hierarchical_2d");
  register_algorithm(moecomm::pairwise{1}, "pairwise1");
}

}  // namespace

int main(int argc, char** argv) {
  if (!moecomm_bench::start(argc, argv,
                            {moecomm_bench::in_process_ranks, {"pairwise1", "moecomm::pairwise{1} (groups of one rank)"}}))
    return 1;
  g_memcpy = moecomm_bench::use_memcpy_reference();

  register_all();
  return moecomm_bench::finish("bench_alltoall");
}
