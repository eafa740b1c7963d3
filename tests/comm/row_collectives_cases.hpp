// SPDX-License-Identifier: Apache-2.0
#pragma once
// Bodies of the row-collective and parallel-group tests, generic over the communicator so that
// in-process and simulated ranks run the same checks.
//
// row_allgather and ordered_reduce_scatter against a single-process oracle, bit for bit, with
// self-identifying rows (each element names rank, row and column through its seed), poisoned
// outputs and odd sizes; parallel_groups' memberships against the layout formulas.

#include "../support/test_support.hpp"

#include <moecomm/comm/parallel_groups.hpp>
#include <moecomm/collectives/row_collectives.hpp>

#include <cstdint>
#include <vector>

namespace test {

// Rank r's matrix of `rows x hidden`, the same on every call.
template <class T>
std::vector<T> rank_rows(std::int32_t rank, std::int64_t rows, std::int64_t hidden) {
  return finite_rows<T>(rows, hidden, static_cast<std::uint32_t>(1000 + 7 * rank + rows));
}

// One rank: for every shape, both collectives equal the oracle built from every rank's matrix.
template <class T, class Backend, class Comm>
void check_row_collectives_on_rank(Backend const& be, Comm& comm) {
  std::int32_t const n = comm.size(), me = comm.rank();
  moecomm::workspace<Backend> scratch;
  for (std::int64_t rows : {0, 1, 7, 2039})
    for (std::int64_t hidden : {1, 5}) {
      CAPTURE(rows);
      CAPTURE(hidden);
      moecomm::row_range const own = moecomm::row_slice(rows, n, me);
      // All-gather: slice r of the result is rank r's slice of its own matrix.
      std::vector<T> const mine_all = rank_rows<T>(me, rows, hidden);
      std::vector<T> gathered = poisoned<T>(rows * hidden);
      moecomm::row_allgather(be, comm, moecomm::matrix_view<T const>{mine_all.data() + own.begin * hidden, own.count, hidden},
                             moecomm::matrix_view<T>{gathered.data(), rows, hidden}, scratch);
      std::vector<T> want(static_cast<std::size_t>(rows * hidden));
      for (std::int32_t r = 0; r < n; ++r) {
        moecomm::row_range const s = moecomm::row_slice(rows, n, r);
        std::vector<T> const theirs = rank_rows<T>(r, rows, hidden);
        std::copy(theirs.begin() + s.begin * hidden, theirs.begin() + (s.begin + s.count) * hidden, want.begin() + s.begin * hidden);
      }
      check_bitwise(gathered, want, hidden, "row_allgather");
      // Reduce-scatter: this rank's slice of the ascending-rank sum of every rank's matrix.
      std::vector<T> reduced = poisoned<T>(own.count * hidden + 3);  // 3 past the end stay poisoned
      moecomm::ordered_reduce_scatter(be, comm, moecomm::matrix_view<T const>{mine_all.data(), rows, hidden},
                                      moecomm::matrix_view<T>{reduced.data(), own.count, hidden}, scratch);
      std::vector<T> sum(static_cast<std::size_t>(own.count * hidden));
      for (std::int64_t i = 0; i < own.count * hidden; ++i) {
        float acc32 = 0;
        T acc{};
        for (std::int32_t r = 0; r < n; ++r) {
          T const v = rank_rows<T>(r, rows, hidden)[static_cast<std::size_t>(own.begin * hidden + i)];
          if constexpr (std::is_same_v<T, float>) acc = r == 0 ? v : acc + v;
          else acc32 = r == 0 ? oracle::f32(v) : acc32 + oracle::f32(v);
        }
        if constexpr (std::is_same_v<T, float>) sum[static_cast<std::size_t>(i)] = acc;
        else sum[static_cast<std::size_t>(i)] = oracle::from32<T>(acc32);
      }
      check_bitwise(reduced, sum, hidden, "ordered_reduce_scatter");
      check_untouched(reduced, static_cast<std::size_t>(own.count * hidden), "ordered_reduce_scatter");
    }
}

// One rank of `sizes`: each group's members (world ranks, all-gathered over the group) are those
// the layout gives, in the layout's order.
template <class Comm>
void check_parallel_groups_on_rank(Comm& world, moecomm::parallel_sizes const sizes) {
  moecomm::parallel_groups<Comm> g(world, sizes);
  std::int32_t const me = world.rank(), W = world.size();
  auto const at = moecomm::parallel_groups<Comm>::coordinates_of;
  auto const members = [&](Comm& group) {
    std::vector<std::int32_t> ranks(static_cast<std::size_t>(group.size()));
    group.allgather(&me, ranks.data(), sizeof(std::int32_t));
    return ranks;
  };
  auto const expected = [&](auto same, auto order) {  // world ranks r with same(r), ordered by order(r)
    std::vector<std::pair<std::int64_t, std::int32_t>> keyed;
    for (std::int32_t r = 0; r < W; ++r)
      if (same(at(r, sizes))) keyed.emplace_back(order(at(r, sizes)), r);
    std::sort(keyed.begin(), keyed.end());
    std::vector<std::int32_t> ranks;
    for (auto const& k : keyed) ranks.push_back(k.second);
    return ranks;
  };
  moecomm::parallel_coordinates const c = g.coordinates();
  std::int32_t const groups_per_mp = sizes.model / sizes.expert_slicing;
  CHECK(members(g.mp()) == expected([&](auto o) { return o.dp == c.dp && o.ep == c.ep; }, [](auto o) { return o.mp; }));
  CHECK(members(g.ep()) == expected([&](auto o) { return o.dp == c.dp && o.mp == c.mp; }, [](auto o) { return o.ep; }));
  CHECK(members(g.esp()) == expected([&](auto o) { return o.dp == c.dp && o.ep == c.ep && o.mp / sizes.expert_slicing == c.mp / sizes.expert_slicing; },
                                     [](auto o) { return o.esp; }));
  CHECK(members(g.dp()) == expected([&](auto o) { return o.ep == c.ep && o.mp == c.mp; }, [](auto o) { return o.dp; }));
  CHECK(members(g.expert_dp()) == expected([&](auto o) { return o.ep == c.ep && o.esp == c.esp; },
                                           [&](auto o) { return o.dp * groups_per_mp + o.mp / sizes.expert_slicing; }));
  CHECK(g.data_parallel_size() * sizes.model * sizes.expert == W);
}

}  // namespace test
