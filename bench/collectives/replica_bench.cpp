// SPDX-License-Identifier: Apache-2.0
//! @file
//! `replica_broadcast`, `gradient_reduce` and `replica_allreduce` over in-process ranks
//! (`inproc_world`: one thread per rank), on both paths (`collective_path`, `point_to_point_path`),
//! reported as nccl-tests reports broadcast, reduce and all-reduce:
//!
//!   algbw = S / t                 S = the buffer's bytes (one expert's parameters or gradients)
//!   busbw = algbw                 replica_broadcast (nccl-tests' broadcast) and gradient_reduce
//!                                 (nccl-tests' reduce)
//!   busbw = algbw * 2(n-1)/n      replica_allreduce (nccl-tests' all-reduce); n = members of the
//!                                 replica set (owner + replicas), not the ranks of the world
//!
//! and as a ratio to this machine's memcpy, measured in the same process before any benchmark
//! (bench/support/memcpy_reference.hpp):
//!
//!   bus_of_memcpy = busbw / copy_bytes_per_s()
//!
//! where copy_bytes_per_s() = memcpy_GBps / 2: memcpy_GBps (the context line) counts read + write,
//! 2 x size bytes per copy, while busbw counts each byte delivered once, so the denominator is the
//! bytes one memcpy thread *delivers* per second. bus_of_memcpy = 1 means the operation moved its
//! bus bytes as fast as one thread's memcpy copies them.
//!
//! In-process every "link" is the same memory system, so the bytes all members move together are
//! reported as well (as bench_alltoall's all_ranks_of_memcpy):
//!
//!   moved_of_memcpy = M / t / copy_bytes_per_s()
//!   M = (n-1) S for the broadcast and the reduce, 2(n-1) S for the all-reduce (= n busbw t)
//!
//! i.e. how many single-thread memcpys' worth of bytes land in other members' buffers. With the
//! ranks' threads on 2 cores its ceiling is about 2 (less if 2 copying cores share DRAM bandwidth).
//!
//! Cases: R = 2 (1 node), 4 (2x2), 8 (2x4) ranks (the layout only names the case: in-process
//! ranks share one memory, and these operations take no topology); buffers of 64 KiB, 1 MiB and
//! 16 MiB of float; the replica set "everyone" (owner 0, every other rank a replica: FasterMoE's
//! shadowed expert) on both paths, and for point_to_point also "half" (the even ranks, owner R/2,
//! so the owner sits in the middle of the summation order; the odd ranks pass a null buffer and
//! post nothing); the default 16 MiB chunk everywhere, plus 1 MiB chunks on the 16 MiB buffer.
//!
//! Timing (manual time, `UseManualTime`): as bench_alltoall (bench/support/harness.hpp's
//! `timed_loop`). The ranks' threads are started once per benchmark run; rank 0's thread runs
//! Google Benchmark's loop; each iteration is
//!
//!   barrier; start = steady_clock::now() on rank 0; operation on every rank; barrier; t = now() - start
//!
//! so `t` runs from "all ranks ready" to "all ranks done" and includes both barriers;
//! `barrier/R:n` measures an iteration without the operation, i.e. that floor.
//!
//! Correctness: each rank's value at element i is a small integer (-8..7) from a hash of (rank, i),
//! so every sum of at most 8 of them is exact in float whatever the order. Before the timed loop
//! every member's buffer is initialised (for the broadcast: the owner's values, the replicas'
//! poisoned), one untimed call runs, and every member checks every element: the owner's values on
//! every replica (broadcast), the sum of the members' values on the owner and the replicas' own
//! values untouched (reduce), the sum on every member (all-reduce). After the timed loop the same
//! initialisation, call and check run once more, so a call that only goes wrong when repeated is
//! caught too. A mismatch (or an exception on any rank) fails the benchmark, and main() returns
//! non-zero. In the timed loop the reductions keep accumulating (the owner's or every member's
//! values grow, up to +-inf for the all-reduce); that changes no memory traffic, and integer-valued
//! floats never become subnormal.

#include <moecomm/moecomm.hpp>
#include <moecomm/collectives/gradient_reduce.hpp>
#include <moecomm/collectives/replica_broadcast.hpp>

#include "../support/inproc_ranks.hpp"

#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace moecomm_bench;

// ---- cases -----------------------------------------------------------------------------------

enum class op_kind { broadcast, reduce, allreduce };

char const* op_name(op_kind op) {
  return op == op_kind::broadcast ? "replica_broadcast" : op == op_kind::reduce ? "gradient_reduce" : "replica_allreduce";
}

enum class set_kind { everyone, half };

char const* set_name(set_kind s) { return s == set_kind::everyone ? "everyone" : "half"; }

//! everyone: owner 0, all other ranks replicas. half: the even ranks, owner R/2 (an even rank for
//! R = 4 and 8): last of the members {0, 2} for R = 4, third of {0, 2, 4, 6} for R = 8.
moecomm::replica_set make_set(set_kind s, std::int32_t ranks) {
  if (s == set_kind::everyone) return moecomm::replica_set::everyone(0, ranks);
  moecomm::replica_set set{ranks / 2, {}};
  for (std::int32_t r = 0; r < ranks; r += 2)
    if (r != set.owner) set.replicas.push_back(r);
  return set;
}

std::string bytes_name(std::int64_t bytes) {
  return bytes >= (std::int64_t{1} << 20) ? std::to_string(bytes >> 20) + "MiB" : std::to_string(bytes >> 10) + "KiB";
}

// ---- integer-valued floats ---------------------------------------------------------------------

//! Rank r's value at element i: an integer in [-8, 7] from a multiplicative hash of (r, i).
float value_of(std::int32_t rank, std::int64_t i) {
  std::uint32_t const h = (static_cast<std::uint32_t>(i) + 0x9e37u * static_cast<std::uint32_t>(rank + 1)) * 0x9e3779b1u;
  return static_cast<float>(static_cast<std::int32_t>(h >> 28) - 8);
}

constexpr float kPoison = 1.0e6f;  //!< no value_of and no sum of at most 8 of them

// ---- benchmark ---------------------------------------------------------------------------------

template <class Path>
void bm_replica(benchmark::State& state, op_kind op, Path path, layout lay, set_kind which, std::int64_t bytes) {
  std::int32_t const ranks = lay.ranks();
  moecomm::replica_set const set = make_set(which, ranks);
  std::vector<std::int32_t> const members = set.members();
  std::int64_t const count = bytes / static_cast<std::int64_t>(sizeof(float));
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<double> seconds;
  std::atomic<bool> stop{false};

  bool const ran = run_ranks<world_t>(state, ranks, std::chrono::seconds(120), errors, [&](comm_t comm) {
    std::int32_t const me = comm.rank();
    bool const member = set.holds(me);
    auto buf = be.allocate<float>(member ? count : 0);
    float* const data = member ? buf.data() : nullptr;  // outside the set: empty, as documented
    moecomm::array_view<float> const view{data, member ? count : 0};
    moecomm::workspace<moecomm::host_backend> workspace;  // reused across calls, as a layer does

    auto const initialise = [&] {
      if (!member) return;
      bool const poison = op == op_kind::broadcast && me != set.owner;
      for (std::int64_t i = 0; i < count; ++i) data[i] = poison ? kPoison : value_of(me, i);
    };
    auto const call = [&] {
      if (op == op_kind::broadcast)
        moecomm::replica_broadcast(comm, set, count, view, path);
      else if (op == op_kind::reduce)
        moecomm::gradient_reduce(be, comm, set, count, view, workspace, path);
      else
        moecomm::replica_allreduce(be, comm, set, count, view, workspace, path);
    };
    //! The expected value of element i on this rank after one call on initialised buffers.
    auto const expected = [&](std::int64_t i) {
      if (op == op_kind::broadcast) return value_of(set.owner, i);
      if (op == op_kind::reduce && me != set.owner) return value_of(me, i);
      float sum = 0.0f;
      for (std::int32_t m : members) sum += value_of(m, i);
      return sum;
    };
    auto const check = [&](char const* when) {
      std::string& error = errors[static_cast<std::size_t>(me)];
      if (!member || !error.empty()) return;
      for (std::int64_t i = 0; i < count; ++i) {
        float const want = expected(i);
        if (data[i] != want) {
          error = std::string(op_name(op)) + "<" + Path::name + "> " + when + ": rank " + std::to_string(me) +
                  " element " + std::to_string(i) + " = " + std::to_string(data[i]) + ", expected " +
                  std::to_string(want);
          return;
        }
      }
    };

    initialise();
    comm.barrier();  // every buffer is initialised before anyone reads a peer's
    call();
    check("first call");

    timed_loop(state, comm, stop, seconds, call);

    initialise();
    comm.barrier();
    call();
    check("call after the timed loop");
  });
  if (!ran) return;

  double const t = mean(seconds);
  double const n = static_cast<double>(members.size());
  double const algbw = t > 0 ? static_cast<double>(bytes) / t : 0.0;
  double const busbw = op == op_kind::allreduce ? algbw * 2.0 * (n - 1.0) / n : algbw;
  // busbw (each byte counted once) over the bytes one memcpy thread delivers per second (half the
  // read + write figure memcpy_GBps); see the file comment.
  double const copy = g_memcpy.copy_bytes_per_s();
  state.counters["S_MiB"] = static_cast<double>(bytes) / (1 << 20);
  state.counters["members"] = n;
  state.counters["chunks"] = static_cast<double>((bytes + path.chunk_bytes - 1) / path.chunk_bytes);
  state.counters["algbw_GBps"] = algbw / 1e9;
  state.counters["busbw_GBps"] = busbw / 1e9;
  state.counters["bus_of_memcpy"] = copy > 0 ? busbw / copy : 0.0;
  double const moved = (op == op_kind::allreduce ? 2.0 : 1.0) * (n - 1.0) * static_cast<double>(bytes);
  state.counters["moved_of_memcpy"] = copy > 0 && t > 0 ? moved / t / copy : 0.0;
}

// ---- registration ------------------------------------------------------------------------------

template <class Path>
void register_case(op_kind op, Path path, layout lay, set_kind which, std::int64_t bytes) {
  std::string const name = std::string(op_name(op)) + "<" + Path::name + ">/" + lay.name() + "/" + set_name(which) +
                           "/" + bytes_name(bytes) + "/chunk:" + bytes_name(path.chunk_bytes);
  benchmark::RegisterBenchmark(name.c_str(), bm_replica<Path>, op, path, lay, which, bytes)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

void register_all() {
  constexpr std::int64_t kSizes[] = {std::int64_t{64} << 10, std::int64_t{1} << 20, std::int64_t{16} << 20};
  constexpr std::int64_t kSmallChunk = std::int64_t{1} << 20;
  register_barriers<world_t>(kCollectiveLayouts);  // the floor: an iteration without the operation
  for (op_kind op : {op_kind::broadcast, op_kind::reduce, op_kind::allreduce})
    for (layout const& lay : kCollectiveLayouts) {
      for (std::int64_t bytes : kSizes) {
        register_case(op, moecomm::collective_path{}, lay, set_kind::everyone, bytes);
        register_case(op, moecomm::point_to_point_path{}, lay, set_kind::everyone, bytes);
        if (lay.ranks() >= 4) register_case(op, moecomm::point_to_point_path{}, lay, set_kind::half, bytes);
      }
      register_case(op, moecomm::collective_path{kSmallChunk}, lay, set_kind::everyone, kSizes[2]);
      register_case(op, moecomm::point_to_point_path{kSmallChunk}, lay, set_kind::everyone, kSizes[2]);
    }
}

}  // namespace

int main(int argc, char** argv) {
  if (!moecomm_bench::start(argc, argv,
                            {moecomm_bench::in_process_ranks,
                             {"bus_of_memcpy", "busbw / (memcpy_GBps / 2): bytes delivered, each counted once"}}))
    return 1;
  g_memcpy = moecomm_bench::use_memcpy_reference();

  register_all();
  return moecomm_bench::finish(argv[0]);
}
