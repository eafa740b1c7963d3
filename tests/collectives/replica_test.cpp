// SPDX-License-Identifier: Apache-2.0
// replica_broadcast, gradient_reduce and replica_allreduce over in-process ranks: exact bytes on
// exactly the set's ranks (subsets that change every iteration, empty sets, buffers of several
// chunks with an odd tail), sums bit for bit in ascending rank order, collective == point to
// point, and errors that name the argument.

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/collectives/gradient_reduce.hpp>
#include <moecomm/collectives/replica_broadcast.hpp>

#include <random>

namespace test {

// A random set of a group of `ranks`: random owner, each other rank a replica with probability p.
inline moecomm::replica_set random_set(std::mt19937& rng, std::int32_t ranks, double p) {
  std::bernoulli_distribution pick(p);
  moecomm::replica_set set{static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(ranks)), {}};
  for (std::int32_t r = 0; r < ranks; ++r)
    if (r != set.owner && pick(rng)) set.replicas.push_back(r);
  return set;
}

// Rank r's gradient values: full-mantissa floats, so the order of summation shows in the bits.
template <class T>
std::vector<T> gradient_of(std::int32_t rank, std::int64_t count, std::uint32_t seed) {
  auto const f = finite_rows<float>(count, 1, seed * 131 + static_cast<std::uint32_t>(rank));
  return std::vector<T>(f.begin(), f.end());
}

// The owner's expected result: members in ascending rank, summed left to right.
template <class T>
std::vector<T> ordered_sum(moecomm::replica_set const& set, std::int64_t count, std::uint32_t seed) {
  std::vector<T> sum;
  for (std::int32_t m : set.members()) {
    auto const g = gradient_of<T>(m, count, seed);
    if (sum.empty()) sum = g;
    else
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i] + g[i];
  }
  return sum;
}

template <class Path>
void check_broadcasts(Path const& path, std::int32_t ranks, double p, std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (std::int64_t bytes : {std::int64_t{0}, std::int64_t{1}, std::int64_t{1000}, std::int64_t{4099}}) {
    for (int iteration = 0; iteration < 4; ++iteration) {  // a new set every iteration
      moecomm::replica_set const set =
          std::is_same_v<Path, moecomm::collective_path> ? moecomm::replica_set::everyone(rng() % ranks, ranks)
                                                         : random_set(rng, ranks, p);
      CAPTURE(bytes);
      CAPTURE(set.owner);
      moecomm::inproc_world const world(ranks, std::chrono::seconds(30));
      world.run([&](moecomm::inproc_communicator comm) {
        std::int32_t const me = comm.rank();
        std::vector<std::uint8_t> owners(static_cast<std::size_t>(bytes));  // names the owner and the offset
        for (std::int64_t i = 0; i < bytes; ++i) owners[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(set.owner * 37 + i * 11 + (i >> 8));
        std::vector<std::uint8_t> data(static_cast<std::size_t>(bytes) + 3, 0xA5);  // poisoned, with a tail
        if (me == set.owner) std::copy(owners.begin(), owners.end(), data.begin());
        moecomm::replica_broadcast(comm, set, bytes, moecomm::array_view<std::uint8_t>(data), path);
        for (std::int64_t i = 0; i < bytes; ++i)
          REQUIRE_MESSAGE(data[static_cast<std::size_t>(i)] == (set.holds(me) ? owners[static_cast<std::size_t>(i)] : 0xA5),
                          "rank ", me, " byte ", i, (set.holds(me) ? " (in the set)" : " (outside the set)"));
        for (std::size_t i = static_cast<std::size_t>(bytes); i < data.size(); ++i) REQUIRE(data[i] == 0xA5);
      });
    }
  }
}

TEST_CASE("replica_broadcast copies the owner's bytes to exactly the replica set") {
  for (std::int32_t ranks : {1, 4, 8}) {
    CAPTURE(ranks);
    check_broadcasts(moecomm::collective_path{1024}, ranks, 1.0, 1);
    check_broadcasts(moecomm::point_to_point_path{1024}, ranks, 0.5, 2);  // subsets, some empty
    check_broadcasts(moecomm::point_to_point_path{1024}, ranks, 0.0, 3);  // always empty
    check_broadcasts(moecomm::point_to_point_path{1024}, ranks, 1.0, 4);  // everyone
  }
}

template <class T, class Path, class Op>
void check_reduces(Path const& path, Op const& reduce_or_allreduce, bool everyone_gets_it, std::int32_t ranks,
                   double p, std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{257}, std::int64_t{1000}}) {
    for (int iteration = 0; iteration < 3; ++iteration) {
      moecomm::replica_set const set =
          std::is_same_v<Path, moecomm::collective_path> ? moecomm::replica_set::everyone(rng() % ranks, ranks)
                                                         : random_set(rng, ranks, p);
      CAPTURE(count);
      CAPTURE(set.owner);
      auto const want = ordered_sum<T>(set, count, seed);
      moecomm::inproc_world const world(ranks, std::chrono::seconds(30));
      world.run([&](moecomm::inproc_communicator comm) {
        std::int32_t const me = comm.rank();
        auto const mine = gradient_of<T>(me, count, seed);
        auto grads = mine;
        moecomm::workspace<moecomm::host_backend> scratch;
        reduce_or_allreduce(moecomm::host_backend{}, comm, set, count, moecomm::array_view<T>(grads), scratch, path);
        bool const gets_sum = me == set.owner || (everyone_gets_it && set.holds(me));
        CAPTURE(me);
        check_bitwise(grads, gets_sum ? want : mine, 1, gets_sum ? "ordered sum" : "untouched gradient");
      });
    }
  }
}

struct reduce_to_owner {
  template <class... A>
  void operator()(A&&... a) const { moecomm::gradient_reduce(std::forward<A>(a)...); }
};
struct allreduce_in_set {
  template <class... A>
  void operator()(A&&... a) const { moecomm::replica_allreduce(std::forward<A>(a)...); }
};

TEST_CASE("gradient_reduce sums every member's gradient into the owner's in ascending rank order") {
  for (std::int32_t ranks : {1, 4, 8}) {
    CAPTURE(ranks);
    // 100-byte chunks: 25 floats or 12 doubles per piece, so most buffers take several, with a tail.
    check_reduces<float>(moecomm::point_to_point_path{100}, reduce_to_owner{}, false, ranks, 0.6, 5);
    check_reduces<double>(moecomm::point_to_point_path{100}, reduce_to_owner{}, false, ranks, 0.3, 6);
    check_reduces<float>(moecomm::collective_path{100}, reduce_to_owner{}, false, ranks, 1.0, 7);
  }
}

TEST_CASE("gradient_reduce reuses one workspace across calls of growing and shrinking sizes and sets") {
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::workspace<moecomm::host_backend> workspace;
    std::uint32_t seed = 20;
    for (std::int64_t count : {std::int64_t{10}, std::int64_t{1000}, std::int64_t{3}, std::int64_t{257}}) {
      for (moecomm::replica_set const& set : {moecomm::replica_set::everyone(2, 4), moecomm::replica_set{0, {3}}}) {
        auto grads = gradient_of<float>(comm.rank(), count, ++seed);
        moecomm::gradient_reduce(be, comm, set, count, moecomm::array_view<float>(grads), workspace,
                                 moecomm::point_to_point_path{100});
        CAPTURE(count);
        if (comm.rank() == set.owner) check_bitwise(grads, ordered_sum<float>(set, count, seed), 1, "ordered sum");
      }
    }
  });
}

TEST_CASE("replica_allreduce leaves the same ordered sum on every member") {
  for (std::int32_t ranks : {1, 4, 8}) {
    CAPTURE(ranks);
    check_reduces<float>(moecomm::point_to_point_path{100}, allreduce_in_set{}, true, ranks, 0.6, 8);
    check_reduces<float>(moecomm::collective_path{100}, allreduce_in_set{}, true, ranks, 1.0, 9);
    check_reduces<double>(moecomm::collective_path{1 << 20}, allreduce_in_set{}, true, ranks, 1.0, 10);
  }
}

TEST_CASE("replica operations reject bad sets and buffers, naming the argument") {
  moecomm::inproc_world const world(4, std::chrono::seconds(20));
  std::vector<float> g(8, 1.0f);
  auto expect = [&](moecomm::replica_set const& set, auto const& path, std::vector<std::string> const& fragments) {
    world.run([&](moecomm::inproc_communicator comm) {
      check_error([&] { moecomm::replica_broadcast(comm, set, 8, moecomm::array_view<float>(g), path); },
                  moecomm::status::invalid_argument, fragments);
      moecomm::workspace<moecomm::host_backend> scratch;
      check_error([&] { moecomm::gradient_reduce(moecomm::host_backend{}, comm, set, 8, moecomm::array_view<float>(g), scratch, path); },
                  moecomm::status::invalid_argument, fragments);
    });
  };
  moecomm::point_to_point_path const p2p{};
  expect({4, {}}, p2p, {"owner = 4 is not a rank of this group of 4"});
  expect({1, {0, 1}}, p2p, {"replicas[1] = 1 is the owner"});
  expect({1, {3, 2}}, p2p, {"replicas[1] = 2 does not follow replicas[0] = 3"});
  expect({1, {2, 2}}, p2p, {"replicas[1] = 2 does not follow replicas[0] = 2"});
  expect({0, {-1}}, p2p, {"replicas[0] = -1 is not a rank"});
  expect({0, {1}}, moecomm::point_to_point_path{0}, {"point_to_point_path.chunk_bytes = 0 must be positive"});
  expect({0, {1, 3}}, moecomm::collective_path{}, {"collective_path needs every rank", "rank 2 is not"});
  // A member with a buffer too small fails on that rank; the others stop instead of waiting for it.
  CHECK_THROWS_WITH_AS(world.run([&](moecomm::inproc_communicator comm) {
    moecomm::array_view<float> const data{g.data(), comm.rank() == 2 ? 7 : 8};
    moecomm::replica_broadcast(comm, {0, {1, 2}}, 8, data, p2p);
  }),
                       doctest::Contains("argument 'data' has 7 elements; needs at least 8"), moecomm::error);
  moecomm::inproc_world const fresh(4, std::chrono::seconds(20));  // a failed run leaves its world aborted
  CHECK_THROWS_WITH_AS(fresh.run([&](moecomm::inproc_communicator comm) {
    moecomm::array_view<float> const grads{comm.rank() == 1 ? nullptr : g.data(), 8};
    moecomm::workspace<moecomm::host_backend> scratch;
    moecomm::gradient_reduce(moecomm::host_backend{}, comm, {0, {1, 2}}, 8, grads, scratch, p2p);
  }),
                       doctest::Contains("argument 'grads' is null but must hold 8 elements"), moecomm::error);
}

}  // namespace test
