// SPDX-License-Identifier: Apache-2.0
// simgrid_communicator: every collective moves the right bytes for odd group sizes (self-identifying
// payloads, poisoned receive buffers), sub-groups work, bad calls throw on every rank as
// in-process, and the simulated time of an all-to-all is the alpha-beta figure of the platform.

#include "../comm/pipelined_collectives_cases.hpp"
#include "../comm/row_collectives_cases.hpp"
#include "../support/test_support.hpp"
#include "sim_support.hpp"

#include <cstdint>
#include <numeric>
#include <vector>

namespace test {

// A byte that names (sender, receiver, index).
inline char tag(int from, int to, std::int64_t i) { return static_cast<char>(from * 31 + to * 7 + i * 13 + 1); }

TEST_CASE("simulated comm: every collective moves the right bytes, for 1, 3 and 8 ranks") {
  for (int n : {1, 3, 8}) {
    CAPTURE(n);
    moecomm::simgrid_world world = sim_world(n, n == 3 ? 3 : 4);
    world.run([&](moecomm::simgrid_communicator comm) {
      int const me = comm.rank();
      std::int64_t const bytes = 1000 + me * 0;  // the same size on every rank
      // allgather
      std::vector<char> mine(static_cast<std::size_t>(bytes)), all(static_cast<std::size_t>(bytes * n), '\x7f');
      for (std::int64_t i = 0; i < bytes; ++i) mine[static_cast<std::size_t>(i)] = tag(me, 0, i);
      comm.allgather(mine.data(), all.data(), bytes);
      for (int r = 0; r < n; ++r)
        for (std::int64_t i = 0; i < bytes; ++i) REQUIRE(all[static_cast<std::size_t>(r * bytes + i)] == tag(r, 0, i));
      // exchange: rank i sends (i + j) * 3 bytes to j
      std::vector<std::vector<char>> out(static_cast<std::size_t>(n)), in(static_cast<std::size_t>(n));
      std::vector<moecomm::send_block> sends;
      std::vector<moecomm::recv_block> recvs;
      for (int p = 0; p < n; ++p) {
        out[static_cast<std::size_t>(p)].resize(static_cast<std::size_t>((me + p) * 3));
        for (std::size_t i = 0; i < out[static_cast<std::size_t>(p)].size(); ++i) out[static_cast<std::size_t>(p)][i] = tag(me, p, static_cast<std::int64_t>(i));
        in[static_cast<std::size_t>(p)].assign(static_cast<std::size_t>((me + p) * 3), '\x7f');
        sends.push_back({p, out[static_cast<std::size_t>(p)].data(), (me + p) * 3});
        recvs.push_back({p, in[static_cast<std::size_t>(p)].data(), (me + p) * 3});
      }
      comm.exchange(sends, recvs);
      for (int p = 0; p < n; ++p)
        for (std::size_t i = 0; i < in[static_cast<std::size_t>(p)].size(); ++i)
          REQUIRE(in[static_cast<std::size_t>(p)][i] == tag(p, me, static_cast<std::int64_t>(i)));
      // broadcast from the last rank, 3 MiB (several chunks)
      std::vector<char> data(3 << 20, '\x7f');
      if (me == n - 1)
        for (std::size_t i = 0; i < data.size(); ++i) data[i] = tag(n - 1, 0, static_cast<std::int64_t>(i));
      comm.broadcast(data.data(), static_cast<std::int64_t>(data.size()), n - 1);
      for (std::size_t i = 0; i < data.size(); i += 4099) REQUIRE(data[i] == tag(n - 1, 0, static_cast<std::int64_t>(i)));
      // allreduce and reduce: sums in ascending rank order, exactly
      std::vector<double> values(37), sums(37, std::nan(""));
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = me * 100.0 + static_cast<double>(i);
      comm.allreduce(values.data(), sums.data(), 37, moecomm::reduce_op::sum);
      for (std::size_t i = 0; i < values.size(); ++i) REQUIRE(sums[i] == 100.0 * n * (n - 1) / 2 + n * static_cast<double>(i));
      std::int64_t most = me, at_root = -1;
      comm.reduce(&most, me == 0 ? &at_root : nullptr, 1, moecomm::reduce_op::max, 0);
      if (me == 0) CHECK(at_root == n - 1);
      comm.barrier();
      // split into odd and even ranks, reversed by key
      moecomm::simgrid_communicator half = comm.split(me % 2, -me);
      CHECK(half.size() == (n + 1 - me % 2) / 2);
      int const sub = half.rank();
      std::vector<int> ranks(static_cast<std::size_t>(half.size()));
      half.allgather(&me, ranks.data(), sizeof(int));
      CHECK(ranks[static_cast<std::size_t>(sub)] == me);
      CHECK(std::is_sorted(ranks.rbegin(), ranks.rend()));
    });
  }
}

TEST_CASE("simulated comm: bad calls throw on every simulated rank, naming the operation and the ranks") {
  moecomm::simgrid_world mismatched = sim_world(4, 4);
  CHECK_THROWS_WITH_AS(mismatched.run([&](moecomm::simgrid_communicator comm) {
    int x = 0;
    if (comm.rank() == 2) comm.barrier(); else comm.broadcast(&x, 4, 0);
  }), doctest::Contains("ranks disagree: world rank 0 called broadcast(size 4, 0), but world rank 2 called barrier"),
  moecomm::error);
  moecomm::simgrid_world early = sim_world(4, 4);
  CHECK_THROWS_WITH_AS(early.run([&](moecomm::simgrid_communicator comm) {
    if (comm.rank() != 3) comm.barrier();
  }), doctest::Contains("for world rank 3, which has returned from run"), moecomm::error);
  moecomm::simgrid_world null_buffer = sim_world(2, 2);
  CHECK_THROWS_WITH_AS(null_buffer.run([&](moecomm::simgrid_communicator comm) {
    std::vector<char> recv(8);
    comm.allgather(comm.rank() == 1 ? nullptr : recv.data(), recv.data(), 4);
  }), doctest::Contains("send"), moecomm::error);
  moecomm::simgrid_world odd_throw = sim_world(2, 2);
  CHECK_THROWS_WITH_AS(odd_throw.run([&](moecomm::simgrid_communicator comm) {
    if (comm.rank() == 0) throw 42;
    comm.barrier();
  }), doctest::Contains("world rank 0 threw an exception not derived from std::exception"), moecomm::error);
}

TEST_CASE("simulated comm: ranks that wait in different groups, or outside any collective, end with errors") {
  // Different sub-groups: each waits for a rank that waits elsewhere; the simulated timeout (10 s of
  // simulated time, no wall time) ends them, naming the ranks.
  std::vector<simgrid::s4u::Host*> hosts;
  moecomm::simgrid_world probe = sim_world(4, 4);
  for (int r = 0; r < 4; ++r) hosts.push_back(probe.host(r));
  moecomm::simgrid_world crossed(hosts, 10.0);
  CHECK_THROWS_WITH_AS(crossed.run([&](moecomm::simgrid_communicator comm) {
    moecomm::simgrid_communicator half = comm.split(comm.rank() % 2, comm.rank());
    if (comm.rank() < 2) half.barrier(); else comm.barrier();
  }), doctest::Contains("timed out after 10 simulated seconds"), moecomm::error);
  // Blocked outside the library (a receive nobody sends): SimGrid finds the deadlock and run says where.
  moecomm::simgrid_world stuck = sim_world(2, 2);
  CHECK_THROWS_WITH_AS(stuck.run([&](moecomm::simgrid_communicator comm) {
    if (comm.rank() == 0) (void)simgrid::s4u::Mailbox::by_name("nobody sends here")->get<int>();
  }), doctest::Contains("the simulation deadlocked (no rank could go on): world rank 0 waits in something outside a collective"),
  moecomm::error);
}

// A collective's second wait must not end on an abort: S4U hands a receiver the sender's pointer and
// the receiver copies after the transfer, so a sender that left on another group's abort would
// free (here: poison) a buffer its peer still reads. Rank 2, outside the pair, fails while the
// pair's 16 MiB all-gather is in flight; each rank's buffers are poisoned when its body unwinds.
TEST_CASE("simulated comm: a failure outside a group mid-transfer leaves its ranks' received bytes intact") {
  std::int64_t const bytes = std::int64_t{16} << 20;
  std::vector<std::vector<char>> sent(2, std::vector<char>(static_cast<std::size_t>(bytes))),
      got(2, std::vector<char>(static_cast<std::size_t>(2 * bytes), 0));
  std::int64_t wrong = -1;  // actors are cooperative: no data race
  moecomm::simgrid_world world = sim_world(3, 4);
  CHECK_THROWS_WITH_AS(world.run([&](moecomm::simgrid_communicator comm) {
    moecomm::simgrid_communicator pair = comm.split(comm.rank() < 2 ? 0 : 1, comm.rank());
    if (comm.rank() == 2) {
      simgrid::s4u::this_actor::sleep_for(1e-5);  // the transfer takes ~170 us
      throw std::runtime_error("rank 2 fails mid-transfer");
    }
    std::size_t const me = static_cast<std::size_t>(comm.rank());
    std::fill(sent[me].begin(), sent[me].end(), static_cast<char>('A' + me));
    struct poison_on_exit {  // the ring forwards from the receive buffer: both are the rank's
      std::vector<char>& sent;
      std::vector<char>& got;
      ~poison_on_exit() {
        std::fill(sent.begin(), sent.end(), '#');
        std::fill(got.begin(), got.end(), '#');
      }
    } const guard{sent[me], got[me]};
    auto count_wrong = [&] {
      if (wrong < 0) wrong = 0;
      for (std::int64_t i = 0; i < 2 * bytes; ++i) wrong += got[me][static_cast<std::size_t>(i)] != static_cast<char>('A' + i / bytes);
    };
    try {
      pair.allgather(sent[me].data(), got[me].data(), bytes);
    } catch (moecomm::error const&) {
      count_wrong();
      throw;
    }
    count_wrong();
  }), doctest::Contains("rank 2 fails mid-transfer"), std::runtime_error);
  CHECK(wrong == 0);
}

TEST_CASE("simulated comm: a flat all-to-all takes the alpha-beta time of the platform's links, within 5 %") {
  // 8 ranks, 2 nodes x 4; each rank sends b bytes to every other rank at once. The bottleneck is
  // each node's NIC: 4 ranks x 4 remote peers x b bytes leave a node through one 12.5 GB/s link;
  // every NVLink port carries 3 b (100 GB/s) and every PCIe link 4 b (25 GB/s) meanwhile.
  moecomm::cluster_spec const s = two_nodes_of_four();
  std::int64_t const b = 4 << 20;
  double const nic_seconds = 16.0 * static_cast<double>(b) / s.nic.bytes_per_second;
  double const latency = s.pcie.latency_seconds + s.nic.latency_seconds + s.fabric.latency_seconds +
                         s.nic.latency_seconds + s.pcie.latency_seconds;
  double const alpha_beta = latency + nic_seconds;
  double seconds = 0;
  moecomm::simgrid_world world = sim_world(8, 4);
  world.run([&](moecomm::simgrid_communicator comm) {
    std::vector<char> out(static_cast<std::size_t>(8 * b)), in(static_cast<std::size_t>(8 * b));
    std::vector<moecomm::send_block> sends;
    std::vector<moecomm::recv_block> recvs;
    for (int p = 0; p < 8; ++p)
      if (p != comm.rank()) {
        sends.push_back({p, out.data() + p * b, b});
        recvs.push_back({p, in.data() + p * b, b});
      }
    comm.barrier();
    double const start = moecomm::simulated_seconds{}();
    comm.exchange(sends, recvs);
    if (comm.rank() == 0) seconds = moecomm::simulated_seconds{}() - start;
  });
  CAPTURE(alpha_beta);
  CHECK(seconds == relatively(alpha_beta, 0.05));
}

TEST_CASE("simulated comm: row collectives and parallel groups behave as in-process") {
  moecomm::simgrid_world rows = sim_world(3, 3);
  rows.run([&](moecomm::simgrid_communicator comm) {
    check_row_collectives_on_rank<float>(moecomm::simulated_backend<>{}, comm);
    check_row_collectives_on_rank<__nv_bfloat16>(moecomm::simulated_backend<>{}, comm);
  });
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{2, 2, 2}}) {
    moecomm::simgrid_world groups = sim_world(8, 4);
    groups.run([&](moecomm::simgrid_communicator comm) { check_parallel_groups_on_rank(comm, sizes); });
  }
}

TEST_CASE("simulated comm: the pipelined collectives equal the two collectives in turn, on simulated ranks") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 2}}) {
    moecomm::simgrid_world world = sim_world(8, 4);
    world.run([&](moecomm::simgrid_communicator comm) {
      check_pipelined_collectives_on_rank<float>(moecomm::simulated_backend<>{}, comm, sizes);
    });
  }
}

// Simulated seconds of one alltoall_allgather of `rows` rows per block, MP 4 x EP 2 with ESP 4 on
// 2 nodes of 4: the all-to-all crosses the NIC, the gather stays on NVLink. Each real row stands
// for `payload_scale` rows.
inline double pipelined_seconds(std::int32_t pieces, std::int64_t rows, double payload_scale = 1) {
  moecomm::simgrid_world world = sim_world(8, 4);
  double seconds = 0;
  world.run([&](moecomm::simgrid_communicator comm) {
    moecomm::parallel_groups<moecomm::simgrid_communicator> groups(comm, {4, 2, 4});
    std::int64_t const h = 1024;
    std::vector<std::int64_t> const send(2, rows), recv(8, rows);
    std::vector<float> in(static_cast<std::size_t>(2 * rows * h), 1.0f), out(static_cast<std::size_t>(8 * rows * h));
    moecomm::pipeline_workspace<moecomm::simulated_backend<>> scratch;
    moecomm::simulated_backend<> const be(moecomm::host_backend{}, {payload_scale, 1, 1});
    double const start = moecomm::simulated_seconds{}();
    moecomm::alltoall_allgather(be, groups.ep(), groups.esp(),
                                moecomm::matrix_view<float const>{in.data(), 2 * rows, h},
                                moecomm::array_view<std::int64_t const>(send), moecomm::array_view<std::int64_t const>(recv),
                                moecomm::matrix_view<float>{out.data(), 8 * rows, h}, scratch, pieces);
    comm.barrier();
    if (comm.rank() == 0) seconds = moecomm::simulated_seconds{}() - start;
  });
  return seconds;
}

TEST_CASE("simulated comm: pipelining the all-to-all with the all-gather overlaps them in simulated time") {
  // The all-to-all puts 4 MiB through each node's 12.5 GB/s NIC (~0.34 ms); the gather 6 MiB per
  // rank through NVLink ports of 100 GB/s (~0.06 ms) plus the packing copies: overlap can hide at
  // most the gather, ~15 % of the separate time. Measured: 0.461 ms separate, 0.422 ms in 4 pieces.
  double const separate = pipelined_seconds(1, 256), pipelined = pipelined_seconds(4, 256);
  CAPTURE(separate);
  CAPTURE(pipelined);
  CHECK(pipelined > 0);
  CHECK(pipelined < 0.95 * separate);
}

TEST_CASE("simulated comm: both stages of a pipeline move the rows the real ones stand for") {
  // The second stage runs on the rank's lane, a second actor: it must price its messages at the
  // rank's payload scale, as the first stage does. 64 rows standing for 256 take as long as 256.
  for (std::int32_t pieces : {1, 4}) {
    CAPTURE(pieces);
    double const scaled = pipelined_seconds(pieces, 64, 4), real = pipelined_seconds(pieces, 256);
    CAPTURE(scaled);
    CAPTURE(real);
    CHECK(scaled == relatively(real, 0.02));
  }
}

}  // namespace test
