// SPDX-License-Identifier: Apache-2.0
#pragma once
// Test bodies for sort_chunks.

#include "../support/test_support.hpp"

namespace test {

TEST_CASE_TEMPLATE_DEFINE("sort_chunks equals the oracle and inverts itself", Config, sort_chunks_sweep) {
  using T = typename Config::value_type;
  auto const be = Config::make_backend();
  std::mt19937 rng(3);
  struct shape { int32_t ranks, locals; };
  for (shape const s : {shape{1, 1}, shape{2, 2}, shape{4, 4}, shape{8, 2}, shape{3, 5}})
    for (int32_t max_count : {0, 1, 9, 300, -5})  // -5: every chunk 5 rows (a padded exchange's, moved without a table)
      for (int64_t hidden : {1, 7, 64}) {
        CAPTURE(s.ranks);
        CAPTURE(s.locals);
        CAPTURE(max_count);
        CAPTURE(hidden);
        std::vector<int32_t> counts(static_cast<std::size_t>(s.ranks * s.locals));
        int64_t total = 0;
        for (auto& c : counts) total += c = max_count <= 0 ? -max_count : static_cast<int32_t>(rng() % (max_count + 1));
        auto const in_host = identity_rows<T>(total, hidden, 9);
        auto const in = upload(be, in_host);
        auto mid = upload(be, poisoned<T>((total + 2) * hidden));
        auto back = upload(be, poisoned<T>(total * hidden));
        moecomm::sort_chunks(be, moecomm::matrix_view<T const>{in.data(), total, hidden},
                             moecomm::array_view<int32_t const>(counts), s.ranks, s.locals,
                             moecomm::matrix_view<T>{mid.data(), total + 2, hidden});
        auto const got = download(be, mid.data(), mid.size());
        check_bitwise(got, oracle::sort_chunks(in_host, hidden, counts, s.ranks, s.locals, true), hidden, "to expert-major");
        check_untouched(got, static_cast<std::size_t>(total * hidden), "to expert-major");
        moecomm::sort_chunks(be, moecomm::matrix_view<T const>{mid.data(), total, hidden},
                             moecomm::array_view<int32_t const>(counts), s.ranks, s.locals,
                             moecomm::matrix_view<T>{back.data(), total, hidden}, moecomm::chunk_order::expert_major_to_rank_major);
        check_bitwise(download(be, back.data(), back.size()), in_host, hidden, "back to rank-major");
      }
}

TEST_CASE_TEMPLATE_DEFINE("sort_chunks reproduces semantics example S1", Config, sort_chunks_example) {
  auto const be = Config::make_backend();
  // Rank-major [a0 a1 | b0 | c0 | d0 d1 d2] with counts [2, 1, 1, 3] (R = 2, L = 2) becomes
  // expert-major [a0 a1 c0 | b0 d0 d1 d2] (docs/semantics.md §10, Example S1).
  std::vector<float> const in{10, 11, 20, 30, 40, 41, 42};
  std::vector<int32_t> const counts{2, 1, 1, 3};
  auto const d_in = upload(be, in);
  auto out = upload(be, poisoned<float>(7));
  moecomm::sort_chunks(be, moecomm::matrix_view<float const>{d_in.data(), 7, 1},
                       moecomm::array_view<int32_t const>(counts), 2, 2, moecomm::matrix_view<float>{out.data(), 7, 1});
  CHECK(download(be, out.data(), 7) == std::vector<float>{10, 11, 30, 20, 40, 41, 42});
}

}  // namespace test
