// SPDX-License-Identifier: Apache-2.0
//! Example 02: one MoE layer, expert parallel, over in-process ranks.
//!
//! R ranks run as R threads of this process (`inproc_world`), arranged as N nodes of G ranks
//! (`topology`); each rank holds E / R experts. Read `run_layer` for one layer step on one rank:
//! 1. route: its own tokens, from a skewed top-K gate (Zipf-distributed expert popularity);
//! 2. forward: capacity -> dispatch all-to-all -> its experts (global expert e multiplies its rows
//!    by e + 1) -> combine all-to-all; 3. backward: the same, in reverse;
//! 4. the step's 4 all-to-alls again, alone, timed for the cost model.
//! `run` does that once for every (all-to-all algorithm, capacity policy) asked for, and reports
//! what moved where: the load per rank, the drops per policy, the messages and bytes per link class
//! (intra- / inter-node), the time of a step beside an alpha-beta model, and every rank's output and
//! gradients checked against a single-process oracle (examples/common/expert_parallel_oracle.hpp).
//!
//! Run with --help for the flags.

#include "../common/caching_allocator.hpp"
#include "../common/exit_code.hpp"
#include "../common/expert_parallel_options.hpp"
#include "../common/expert_parallel_oracle.hpp"
#include "../common/expert_parallel_tables.hpp"
#include "../common/format.hpp"
#include "../common/inproc_cost_probes.hpp"
#include "../common/timing.hpp"

#include <moecomm/moecomm.hpp>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace example_support;  // options, the oracle, the tables, formatting, timing (examples/common/)

using moecomm::inproc_communicator;
using std::int32_t;
using std::int64_t;

// ---- one configuration: R ranks run the layer ---------------------------------------------------

//! With `warmup`: one step, unchecked and untimed (it only makes the heap as large as the runs need).
template <class T, class Capacity, class Algorithm>
run_result run_layer(problem<T> const& p, Capacity capacity, Algorithm algorithm, algo_id a, policy_id policy,
                     bool warmup) {
  using layer_type = moecomm::expert_parallel_layer<T, moecomm::host_backend, inproc_communicator, Capacity, Algorithm>;
  options const& o = p.o;
  int32_t const R = o.ranks, E = o.experts, K = o.topk;
  int64_t const H = o.hidden;
  run_result res{a, policy, std::vector<rank_result>(static_cast<std::size_t>(R)), {}, {}};
  moecomm::inproc_world const world(R, std::chrono::seconds(o.timeout));
  moecomm::topology const topo(R, p.per_node);
  world.run([&](inproc_communicator comm) {
    int32_t const me = comm.rank();
    auto const mine = static_cast<std::size_t>(me);
    moecomm::host_backend const be;  // one thread per rank: the ranks are the parallelism
    moecomm::exchange_groups<inproc_communicator> groups(comm, topo);
    layer_type layer(be, groups, E, H, capacity, algorithm);
    scale_experts<T> const experts{me * p.local_experts};
    int64_t const tokens = p.tokens[mine];
    routing_data const& g = p.gate[mine];
    moecomm::routing_view const routing{g.idx.data(), g.weights.data(), tokens, K};
    moecomm::matrix_view<T const> const x{p.x[mine].data(), tokens, H}, d_out{p.d_out[mine].data(), tokens, H};
    auto out = be.allocate<T>(tokens * H);
    auto d_x = be.allocate<T>(tokens * H);
    std::vector<float> d_w(static_cast<std::size_t>(tokens * K));

    for (int it = 0; it < (warmup ? 1 : o.iters); ++it) {
      if (it == 0) {  // poison what the layer must write: NaN never equals the oracle's finite values
        T const nan = from32<T>(std::numeric_limits<float>::quiet_NaN());
        std::fill(out.data(), out.data() + tokens * H, nan);
        std::fill(d_x.data(), d_x.data() + tokens * H, nan);
        std::fill(d_w.begin(), d_w.end(), std::numeric_limits<float>::quiet_NaN());
      }
      comm.barrier();
      auto const start = clock_type::now();
      layer.forward(routing, x, {out.data(), tokens, H}, experts);
      layer.backward(d_out, moecomm::matrix_view<T>{d_x.data(), tokens, H}, d_w, experts);
      comm.barrier();
      double const seconds = seconds_since(start);
      if (me == 0) res.step_s.push_back(seconds);
      if (warmup) return;
      if (it == 0)
        res.ranks[mine] = check_rank(p, me, policy, layer.dispatch_state(), out.data(), d_x.data(), d_w.data());
    }

    // The step's 4 all-to-alls alone (dispatch, combine, combine_backward, dispatch_backward: the
    // byte matrix M, then its transpose, twice), with the byte matrix the dispatcher used.
    auto const& ds = layer.dispatch_state();
    int64_t const row_bytes = H * static_cast<int64_t>(sizeof(T));
    std::vector<int64_t> cells(static_cast<std::size_t>(R) * R, 0);
    for (int32_t s = 0; s < R; ++s)
      for (int32_t e = 0; e < E; ++e)
        cells[static_cast<std::size_t>(s) * R + e / p.local_experts] += ds.rows_from(s, e) * row_bytes;
    moecomm::byte_matrix const m(R, std::move(cells));
    moecomm::byte_matrix const mt = m.transposed();
    auto sent = be.allocate<char>(std::max<int64_t>(1, m.send_total(me)));
    auto arrived = be.allocate<char>(std::max<int64_t>(1, m.recv_total(me)));
    std::memset(sent.data(), 0, static_cast<std::size_t>(sent.size()));  // no page faults in the timed loop
    std::memset(arrived.data(), 0, static_cast<std::size_t>(arrived.size()));
    moecomm::alltoall_workspace<moecomm::host_backend> scratch;  // kept across calls, as the dispatcher keeps it
    for (int it = 0; it < o.iters; ++it) {
      moecomm::alltoall_stats stats;
      comm.barrier();
      auto const start = clock_type::now();
      for (int pass = 0; pass < 2; ++pass) {
        moecomm::alltoallv(be, groups, m, moecomm::array_view<char const>{sent.data(), sent.size()},
                           moecomm::array_view<char>{arrived.data(), arrived.size()}, stats, scratch, algorithm);
        moecomm::alltoallv(be, groups, mt, moecomm::array_view<char const>{arrived.data(), arrived.size()},
                           moecomm::array_view<char>{sent.data(), sent.size()}, stats, scratch, algorithm);
      }
      comm.barrier();
      double const seconds = seconds_since(start);
      if (me == 0) res.exchange_s.push_back(seconds);
      moecomm::alltoall_stats const& step = res.ranks[mine].report.exchange;
      res.ranks[mine].replay_same_stats = res.ranks[mine].replay_same_stats && stats.intra_bytes == step.intra_bytes &&
                                          stats.inter_bytes == step.inter_bytes &&
                                          stats.messages() == step.messages() && stats.rounds == step.rounds;
    }
  });
  return res;
}

// ---- runtime choices -> compile-time instantiations (once, here) ----------------------------------
// 3 algorithms x 4 capacity policies = 12 instantiations of the layer per element type.

template <class T, class Algorithm>
run_result run_policy(problem<T> const& p, Algorithm algorithm, algo_id a, policy_id policy, bool warmup) {
  double const f = p.o.capacity_factor;
  switch (policy) {
    case policy_id::dropless:
      return run_layer<T>(p, moecomm::dropless{}, algorithm, a, policy, warmup);
    case policy_id::position:
      return run_layer<T>(p, moecomm::capacity<moecomm::drop_by_position>{f, 0, false, {}}, algorithm, a, policy,
                          warmup);
    case policy_id::probability:
      return run_layer<T>(p, moecomm::capacity<moecomm::drop_by_probability>{f, 0, false, {}}, algorithm, a, policy,
                          warmup);
    case policy_id::random:
      return run_layer<T>(p, moecomm::capacity<moecomm::drop_random>{f, 0, false, {p.o.seed, 0}}, algorithm, a, policy,
                          warmup);
  }
  return {};
}

template <class T>
run_result run_config(problem<T> const& p, algo_id a, policy_id policy, bool warmup = false) {
  switch (a) {
    case algo_id::flat:
      return run_policy<T>(p, moecomm::flat{}, a, policy, warmup);
    case algo_id::hierarchical_2d:
      return run_policy<T>(p, moecomm::hierarchical_2d{}, a, policy, warmup);
    case algo_id::pairwise:
      return run_policy<T>(p, moecomm::pairwise{1}, a, policy, warmup);
  }
  return {};
}

// ---- the report ---------------------------------------------------------------------------------

template <class T>
int run(options const& o) {
  problem<T> const p = make_problem<T>(o);
  int32_t const R = o.ranks, N = o.nodes, G = p.per_node, L = p.local_experts, E = o.experts, K = o.topk;
  int64_t const H = o.hidden;
  unsigned const cpus = std::max(1u, std::thread::hardware_concurrency());

  std::printf("moecomm %d.%d.%d - example 02: an expert-parallel MoE layer over in-process ranks\n",
              MOECOMM_VERSION_MAJOR, MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH);
  std::printf("==============================================================================\n");
  std::printf("1. Setup\n");
  std::printf("   ranks R = %d as %d node%s x %d local rank%s; one thread per rank (inproc_world), %u CPU%s here\n", R,
              N, N == 1 ? "" : "s", G, G == 1 ? "" : "s", cpus, cpus == 1 ? "" : "s");
  std::printf("   experts E = %d, %d per rank (rank r holds experts %d*r..%d*r+%d), top-K = %d, gate Zipf(s = %.2f)",
              E, L, L, L, L - 1, K, o.zipf);
  std::printf(", seed %" PRIu64 "\n", o.seed);
  if (p.tokens.back() == p.tokens.front())
    std::printf("   tokens: %" PRId64 " per rank, %" PRId64 " in all\n", o.tokens, p.total_tokens);
  else
    std::printf("   tokens: %" PRId64 " per rank; rank r holds T - floor(r*T/(16*R)) (%" PRId64 "..%" PRId64
                ", %" PRId64 " in all)\n",
                o.tokens, p.tokens.back(), p.tokens.front(), p.total_tokens);
  std::printf("   hidden H = %" PRId64 ", dtype %s (a row is %s), host back-end, collective timeout %d s\n", H,
              moecomm::dtype_traits<T>::name, format_bytes(static_cast<double>(H * sizeof(T))).c_str(), o.timeout);
  std::printf("   memory: %s\n", allocator_note);
  std::printf(
      "   experts: global expert e multiplies its rows by (e + 1); its backward does the same to the gradient\n");
  std::printf("   capacity factor %.2f%s; algorithms:", o.capacity_factor, o.capacity_factor == 0 ? " (dropless)" : "");
  for (algo_id a : o.algorithms) std::printf(" %s%s", name_of(a), a == algo_id::pairwise ? "{group_size 1}" : "");
  std::printf("; policies:");
  for (policy_id pol : o.policies) std::printf(" %s", name_of(pol));
  std::printf("\n\n");

  // The cost model's two machine constants, measured before the runs.
  double const beta = memcpy_bandwidth();
  double const alpha = barrier_latency(R, std::chrono::seconds(o.timeout));

  // One untimed step of the configuration that needs the most memory (no capacity; hierarchical_2d
  // stages every block), so that no timed step pays for first touching the heap.
  bool const has_h2d = std::count(o.algorithms.begin(), o.algorithms.end(), algo_id::hierarchical_2d) > 0;
  algo_id const warm_algo = has_h2d ? algo_id::hierarchical_2d : o.algorithms.front();
  policy_id const warm_policy = o.policies.front();  // dropless when it runs
  std::vector<run_result> results;
  auto const wall = clock_type::now();
  run_config(p, warm_algo, warm_policy, true);
  for (algo_id a : o.algorithms)
    for (policy_id pol : o.policies) results.push_back(run_config(p, a, pol));
  double const wall_s = seconds_since(wall);

  print_load_per_rank(p, results);                          // 2. where the slots went
  bool const capacity_ok = print_drops(p, results);         // 3. what each capacity policy dropped
  print_messages(p, results);                               // 4. what moved where, per link class

  // -- 5. time per step beside the model ----------------------------------------------------------
  double const f = static_cast<double>(R) / std::min<double>(R, cpus);
  std::printf(
      "5. Time per layer step (forward + backward), median (min-max) of %d, wall clock on rank 0 between barriers\n",
      o.iters);
  std::printf("   model of the step's 4 all-to-alls:  t = rounds * alpha + f * B / beta\n");
  std::printf("     alpha = %s  latency of one %d-rank in-process barrier, measured here (a round is one rendezvous)\n",
              format_time(alpha).c_str(), R);
  std::printf(
      "     beta  = %.2f GB/s  bytes one thread copies per second with memcpy, measured here (64 MiB); the\n"
      "             bandwidth of intra- and inter-node links alike: in-process, a message is a memcpy by its "
      "receiver\n",
      beta / 1e9);
  std::printf(
      "     B     = the busiest rank's message bytes in the step (intra + inter, section 4); over the 4\n"
      "             all-to-alls a rank receives about what it sends (exactly, for flat and pairwise)\n");
  if (static_cast<unsigned>(R) > cpus)
    std::printf(
        "     f     = R / min(R, CPUs) = %.2f: %d rank threads share %u CPU%s, so while all of them copy, each\n"
        "             gets 1/f of a CPU\n",
        f, R, cpus, cpus == 1 ? "" : "s");
  else
    std::printf("     f     = R / min(R, CPUs) = 1: each of the %d rank thread%s can have a CPU of its own (%u here)\n",
                R, R == 1 ? "" : "s", cpus);
  std::printf(
      "   'all-to-alls alone' replays the step's 4 all-to-alls (the dispatcher's byte matrices, rank 0's clock):\n"
      "   what the model predicts, plus local copies it leaves out: each rank's block to itself and, for\n"
      "   hierarchical_2d, 3 reorderings of all its blocks per all-to-all. The step adds the layer's local\n"
      "   work: permute, experts, sort_chunks, combine, and their backward.\n");
  std::printf("   %-16s %-12s %6s %10s %10s %32s %26s\n", "algorithm", "policy", "rounds", "B", "model",
              "all-to-alls alone", "step");
  for (algo_id a : o.algorithms)
    for (policy_id pol : o.policies) {
      auto const& res = result_of(results, a, pol);
      int64_t const most = busiest_bytes(res);
      int64_t const rounds = res.ranks[0].report.exchange.rounds;
      double const model = static_cast<double>(rounds) * alpha + f * static_cast<double>(most) / beta;
      spread const alone = spread_of(res.exchange_s);
      std::string const ratio =
          most > 0 ? format("(%4.1fx)", alone.median / model) : "(   - )";  // no messages: local copies only
      std::printf("   %-16s %-12s %6" PRId64 " %10s %10s %24s %s %26s\n", name_of(a), name_of(pol), rounds,
                  format_bytes(static_cast<double>(most)).c_str(), format_time(model).c_str(),
                  format_spread(alone).c_str(), ratio.c_str(), format_spread(spread_of(res.step_s)).c_str());
    }
  std::printf("   (%zu configurations ran in %.2f s, checks and a first untimed step of %s / %s included)\n\n",
              results.size(), wall_s, name_of(warm_algo), name_of(warm_policy));

  bool const all_ok = print_oracle_checks(p, results, capacity_ok);  // 6. the oracle
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  use_caching_allocator();
  return exit_code_of(program, "fewer --tokens or --ranks, or a smaller --hidden", [&] {
#if MOECOMM_HAS_CUDA_FP16()
    if (o.dtype == "bf16") return run<__nv_bfloat16>(o);
#endif
    return run<float>(o);
  });
}
