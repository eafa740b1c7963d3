// SPDX-License-Identifier: Apache-2.0
// All-to-all algorithms over in-process ranks: flat == hierarchical_2d == pairwise, bit for bit,
// with self-identifying bytes, random (and zero) block sizes and several node layouts; and the
// exact message counts of each algorithm (semantics §11's table).

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/collectives/alltoall.hpp>

namespace test {

// Byte `i` of the block that rank s sends rank d.
inline char block_byte(std::int32_t s, std::int32_t d, std::int64_t i) {
  return static_cast<char>((s * 131 + d * 31 + i * 7 + (i >> 8)) & 0xFF);
}

inline moecomm::byte_matrix random_matrix(std::int32_t ranks, std::uint32_t seed, std::int64_t max_bytes, bool zeros) {
  std::mt19937 rng(seed);
  std::vector<std::int64_t> cells(static_cast<std::size_t>(ranks * ranks));
  for (auto& c : cells) c = (zeros && rng() % 4 == 0) ? 0 : 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(max_bytes));
  return {ranks, cells};
}

// Runs `algorithm` on every rank and checks every received block byte by byte. Returns each rank's stats.
template <class Algorithm>
std::vector<moecomm::alltoall_stats> run_alltoall(Algorithm const& algorithm, moecomm::topology const& topo,
                                                  moecomm::byte_matrix const& m) {
  std::int32_t const ranks = topo.num_ranks();
  std::vector<moecomm::alltoall_stats> stats(static_cast<std::size_t>(ranks));
  moecomm::inproc_world const world(ranks, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, topo);
    std::int32_t const me = comm.rank();
    std::vector<char> send(static_cast<std::size_t>(m.send_total(me)));
    for (std::int32_t d = 0; d < ranks; ++d)
      for (std::int64_t i = 0; i < m.bytes(me, d); ++i) send[static_cast<std::size_t>(m.send_offset(me, d) + i)] = block_byte(me, d, i);
    std::vector<char> recv(static_cast<std::size_t>(m.recv_total(me) + 5), '\x5A');  // poisoned, with a tail
    moecomm::alltoallv(be, groups, m, moecomm::array_view<char const>(send), moecomm::array_view<char>(recv), stats[static_cast<std::size_t>(me)], algorithm);
    for (std::int32_t s = 0; s < ranks; ++s)
      for (std::int64_t i = 0; i < m.bytes(s, me); ++i)
        if (recv[static_cast<std::size_t>(m.recv_offset(s, me) + i)] != block_byte(s, me, i))
          FAIL(Algorithm::name, ": rank ", me, " got a wrong byte ", i, " of the block from rank ", s);
    for (std::size_t i = static_cast<std::size_t>(m.recv_total(me)); i < recv.size(); ++i)
      if (recv[i] != '\x5A') FAIL(Algorithm::name, ": rank ", me, " wrote past its receive buffer");
  });
  return stats;
}

TEST_CASE("flat, hierarchical_2d and pairwise deliver identical buffers") {
  struct layout { std::int32_t ranks, per_node; };
  std::uint32_t seed = 1;
  for (layout const l : {layout{1, 1}, layout{2, 1}, layout{2, 2}, layout{4, 2}, layout{8, 4}, layout{8, 2}, layout{8, 1}})
    for (bool zeros : {false, true}) {
      CAPTURE(l.ranks);
      CAPTURE(l.per_node);
      CAPTURE(zeros);
      moecomm::topology const topo(l.ranks, l.per_node);
      auto const m = random_matrix(l.ranks, seed++, 300, zeros);
      run_alltoall(moecomm::flat{}, topo, m);
      run_alltoall(moecomm::hierarchical_2d{}, topo, m);
      run_alltoall(moecomm::pairwise{1}, topo, m);
      if (l.ranks % 2 == 0) run_alltoall(moecomm::pairwise{2}, topo, m);
    }
  // Nodes that are not contiguous blocks of ranks: rank r on node r % 2.
  moecomm::topology const interleaved(std::vector<std::int32_t>{0, 1, 0, 1, 0, 1, 0, 1});
  auto const m = random_matrix(8, 99, 200, true);
  run_alltoall(moecomm::hierarchical_2d{}, interleaved, m);
}

TEST_CASE("message counts: flat sends R - 1, hierarchical_2d (G - 1) + (N - 1)") {
  std::int32_t const nodes = 2, per_node = 4, ranks = nodes * per_node;
  std::int64_t const block = 64;  // uniform traffic: every block non-empty
  moecomm::topology const topo(ranks, per_node);
  moecomm::byte_matrix const m(ranks, std::vector<std::int64_t>(ranks * ranks, block));
  std::int64_t const sent = block * ranks;  // S, bytes a rank sends, self block included
  for (auto const& s : run_alltoall(moecomm::flat{}, topo, m)) {
    CHECK(s.messages() == ranks - 1);
    CHECK(s.inter_messages == (nodes - 1) * per_node);
    CHECK(s.inter_bytes == sent * (nodes - 1) / nodes);
    CHECK(s.intra_bytes == sent * (per_node - 1) / ranks);
    CHECK(s.rounds == 1);
  }
  for (auto const& s : run_alltoall(moecomm::hierarchical_2d{}, topo, m)) {
    CHECK(s.intra_messages == per_node - 1);
    CHECK(s.inter_messages == nodes - 1);
    CHECK(s.inter_bytes == sent * (nodes - 1) / nodes);    // the same cross-node bytes ...
    CHECK(s.intra_bytes == sent * (per_node - 1) / per_node);  // ... but more intra-node bytes
    CHECK(s.rounds == 2);
  }
  for (auto const& s : run_alltoall(moecomm::pairwise{1}, topo, m)) {
    CHECK(s.messages() == ranks - 1);
    CHECK(s.rounds == ranks);
  }
}

TEST_CASE("the count exchange gives every rank the same matrix") {
  moecomm::inproc_world const world(4);
  world.run([&](moecomm::inproc_communicator comm) {
    std::vector<std::int64_t> row(4);
    for (int d = 0; d < 4; ++d) row[static_cast<std::size_t>(d)] = 10 * comm.rank() + d;
    auto const m = moecomm::exchange_byte_counts(comm, row);
    for (int s = 0; s < 4; ++s)
      for (int d = 0; d < 4; ++d) REQUIRE(m.bytes(s, d) == 10 * s + d);
    REQUIRE(m.transposed().bytes(1, 3) == 31);
  });
}

}  // namespace test
