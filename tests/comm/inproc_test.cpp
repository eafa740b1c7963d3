// SPDX-License-Identifier: Apache-2.0
// The in-process communicator: every collective's result, sub-groups, and the failure contract
// (mismatched collectives and sizes name the ranks on every rank; a failing or absent rank turns
// into an error on every other rank within the timeout, never a hang).

#include "communicator_checks.hpp"
#include "inproc_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/collectives/alltoall/stats.hpp>
#include <moecomm/core/topology.hpp>

#include <atomic>
#include <chrono>
#include <numeric>

namespace test {

using moecomm::inproc_communicator;
using moecomm::inproc_world;
using std::chrono::milliseconds;

TEST_CASE("inproc collectives compute what they promise for 1, 2, 4 and 8 ranks") {
  for (int ranks : {1, 2, 4, 8}) {
    CAPTURE(ranks);
    inproc_world const world(ranks);
    world.run([&](inproc_communicator comm) {
      int const me = comm.rank();
      // allgather
      std::int64_t const mine[2] = {me, 100 + me};
      std::vector<std::int64_t> all(2 * static_cast<std::size_t>(ranks));
      comm.allgather(mine, all.data(), sizeof(mine));
      for (int r = 0; r < ranks; ++r) REQUIRE((all[2 * r] == r && all[2 * r + 1] == 100 + r));
      // allreduce, in place, sum and max
      check_allreduce_in_place(comm);
      std::int64_t const total = std::int64_t{ranks} * (ranks - 1) / 2;
      // reduce to the last rank, in place there; the others' recv stays untouched (or null)
      std::vector<std::int64_t> r{me, 1};
      comm.reduce(r.data(), me == ranks - 1 ? r.data() : nullptr, 2, moecomm::reduce_op::sum, ranks - 1);
      REQUIRE(r == (me == ranks - 1 ? std::vector<std::int64_t>{total, ranks} : std::vector<std::int64_t>{me, 1}));
      // broadcast from the last rank
      std::int32_t word = me == ranks - 1 ? 4242 : -1;
      comm.broadcast(&word, sizeof(word), ranks - 1);
      REQUIRE(word == 4242);
      check_exchange_between_every_pair(comm);
      comm.barrier();
    });
  }
}

TEST_CASE("inproc split makes intra-node and inter-node groups of a 2 x 4 world") {
  inproc_world const world(8);
  moecomm::topology const topo(8, 4);
  world.run([&](inproc_communicator comm) {
    int const me = comm.rank();
    auto intra = comm.split(topo.node_of(me), me);
    auto inter = comm.split(topo.local_of(me), me);
    REQUIRE(intra.size() == 4);
    REQUIRE(intra.rank() == topo.local_of(me));
    REQUIRE(inter.size() == 2);
    REQUIRE(inter.rank() == topo.node_of(me));
    std::int64_t sum = me;
    intra.allreduce(&sum, &sum, 1, moecomm::reduce_op::sum);
    REQUIRE(sum == (topo.node_of(me) == 0 ? 0 + 1 + 2 + 3 : 4 + 5 + 6 + 7));
    std::int64_t across = me;
    inter.allreduce(&across, &across, 1, moecomm::reduce_op::sum);
    REQUIRE(across == 2 * topo.local_of(me) + 4);
    // A second split of the same communicator makes fresh groups: keys reverse the order.
    auto reversed = comm.split(0, -me);
    REQUIRE(reversed.rank() == 7 - me);
    REQUIRE(reversed.world_rank() == me);
  });
}

TEST_CASE("topology maps ranks to nodes, contiguously or as given") {
  moecomm::topology const contiguous(8, 4);
  CHECK(contiguous.num_nodes() == 2);
  CHECK(contiguous.node_of(5) == 1);
  CHECK(contiguous.local_of(5) == 1);
  CHECK(contiguous.rank_at(1, 3) == 7);
  moecomm::topology const interleaved(std::vector<std::int32_t>{0, 1, 0, 1});
  CHECK(interleaved.ranks_per_node() == 2);
  CHECK(interleaved.local_of(2) == 1);
  CHECK(interleaved.rank_at(1, 1) == 3);
  check_error([] { moecomm::topology(8, 3); }, moecomm::status::invalid_argument, {"ranks_per_node = 3"});
  check_error([] { moecomm::topology(std::vector<std::int32_t>{0, 0, 1}); }, moecomm::status::invalid_argument,
              {"node 1 has 1 ranks but node 0 has 2"});
}

TEST_CASE("topology puts nodes in domains, induces a group's topology, and alltoall_stats counts three link classes") {
  moecomm::topology const one(8, 2);  // default: one domain
  CHECK(one.num_domains() == 1);
  CHECK(one.same_domain(0, 7));
  moecomm::topology const three_level(12, 2, /*nodes_per_domain=*/3);  // 2 domains of 3 nodes of 2 ranks
  CHECK(three_level.num_domains() == 2);
  CHECK(three_level.ranks_per_domain() == 6);
  CHECK(three_level.domain_of(5) == 0);
  CHECK(three_level.domain_of(6) == 1);
  CHECK(!three_level.same_domain(5, 6));
  // Ranks 1, 3, 6, 8 as a group: nodes 0, 1, 3, 4 (renumbered 0..3), domains 0, 0, 1, 1.
  moecomm::topology const members = three_level.of_members({1, 3, 6, 8});
  CHECK(members.num_ranks() == 4);
  CHECK(members.ranks_per_node() == 1);
  CHECK(members.num_domains() == 2);
  CHECK(members.same_domain(0, 1));
  CHECK(!members.same_domain(1, 2));
  moecomm::alltoall_stats stats;
  stats.record(three_level, 0, 1, 10);   // same node
  stats.record(three_level, 0, 2, 20);   // same domain, other node
  stats.record(three_level, 0, 11, 40);  // other domain
  stats.record(three_level, 0, 0, 80);   // itself: not a message
  CHECK(stats.intra_messages == 1);
  CHECK(stats.inter_messages == 1);
  CHECK(stats.inter_domain_messages == 1);
  CHECK(stats.inter_domain_bytes == 40);
  CHECK(stats.bytes() == 70);
  check_error([] { moecomm::topology(8, 2, 3); }, moecomm::status::invalid_argument, {"nodes_per_domain = 3"});
  check_error([] { moecomm::topology({0, 0, 1, 1, 2, 2}, {0, 0, 1}); }, moecomm::status::invalid_argument,
              {"domain 1 has 1 nodes but domain 0 has 2"});
  check_error([] { moecomm::topology({0, 1}, {0}); }, moecomm::status::invalid_argument, {"domain_of_node has 1 entries, the nodes 2"});
  check_error([] { (void)moecomm::topology(4, 2).of_members({0, 4}); }, moecomm::status::invalid_argument,
              {"topology::of_members: member 4 is not a rank of 4"});
}

TEST_CASE("ranks calling different collectives all get an error naming the operation and the ranks") {
  std::vector<moecomm::status> codes;
  auto const messages = errors_on_every_rank(4, milliseconds(5000), [](inproc_communicator comm) {
    std::int64_t v = 1;
    if (comm.rank() == 2) comm.broadcast(&v, sizeof(v), 0);
    else comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  }, &codes);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(codes[r] == moecomm::status::invalid_usage);
    CHECK(messages[r].find("ranks disagree: world rank 0 called allreduce") != std::string::npos);
    CHECK(messages[r].find("world rank 2 called broadcast") != std::string::npos);
  }
}

TEST_CASE("ranks that name different roots for a reduce all get an error") {
  std::vector<moecomm::status> codes;
  auto const messages = errors_on_every_rank(3, milliseconds(5000), [](inproc_communicator comm) {
    float v = 1.0f;
    comm.reduce(&v, &v, 1, moecomm::reduce_op::sum, comm.rank() == 2 ? 1 : 0);
  }, &codes);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(codes[r] == moecomm::status::invalid_usage);
    CHECK(messages[r].find("called reduce") != std::string::npos);
  }
}

TEST_CASE("inconsistent sizes across ranks are an error on every rank") {
  auto const messages = errors_on_every_rank(3, milliseconds(5000), [](inproc_communicator comm) {
    std::vector<char> send(comm.rank() == 1 ? 16 : 8), recv(3 * 16);
    comm.allgather(send.data(), recv.data(), static_cast<std::int64_t>(send.size()));
  });
  for (auto const& m : messages) CHECK(m.find("world rank 0 called allgather(size 8, 0), but world rank 1 called allgather(size 16, 0)") != std::string::npos);
}

TEST_CASE("an exchange whose sizes disagree names the pair on every rank") {
  auto const messages = errors_on_every_rank(4, milliseconds(5000), [](inproc_communicator comm) {
    std::vector<char> buf(64);
    std::vector<moecomm::send_block> sends;
    std::vector<moecomm::recv_block> recvs;
    int const me = comm.rank();
    for (int peer = 0; peer < 4; ++peer) {
      sends.push_back({peer, buf.data(), me == 1 && peer == 3 ? 12 : 8});
      recvs.push_back({peer, buf.data() + 32, 8});
    }
    comm.exchange(sends, recvs);
  });
  for (auto const& m : messages)
    CHECK_MESSAGE(m.find("pair (1, 3): rank 1 sends 12 bytes to rank 3, but rank 3 expects 8 bytes from rank 1") != std::string::npos, m);
}

TEST_CASE("a rank that throws mid-run aborts the world: every other rank errors, nothing hangs") {
  inproc_world const world(4, milliseconds(20000));
  std::atomic<int> aborted{0};
  auto const start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(
    world.run([&](inproc_communicator comm) {
      std::int64_t v = comm.rank();
      comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
      if (comm.rank() == 3) throw std::runtime_error("expert 5 failed on rank 3");
      try {
        comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);  // rank 3 never arrives
      } catch (moecomm::error const& e) {
        if (e.code() == moecomm::status::aborted && std::string(e.what()).find("world rank 3 failed: expert 5 failed") != std::string::npos) ++aborted;
        throw;
      }
    }),
    "expert 5 failed on rank 3", std::runtime_error);  // run rethrows the first failure
  CHECK(aborted == 3);
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(10000));  // long before the timeout
}

TEST_CASE("a rank that never arrives makes the others time out, naming it") {
  std::vector<moecomm::status> codes;
  auto const start = std::chrono::steady_clock::now();
  auto const messages = errors_on_every_rank(3, milliseconds(200), [](inproc_communicator comm) {
    if (comm.rank() == 1) return;  // skips the collective
    comm.barrier();
  }, &codes);
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(5000));
  CHECK(messages[1].empty());
  for (int r : {0, 2}) {
    CAPTURE(r);
    // The first rank to time out reports it; the other is woken by the abort.
    bool const timed_out = codes[r] == moecomm::status::timeout;
    CHECK((timed_out || codes[r] == moecomm::status::aborted));
    CHECK(messages[r].find("timed out after 200 ms in barrier waiting for world rank(s) 1") != std::string::npos);
  }
}

}  // namespace test
