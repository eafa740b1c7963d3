// SPDX-License-Identifier: Apache-2.0
// Byte offsets past 2^31: 1100 rows of 2^19 floats (2 MiB each, 2.3 GB per matrix). A
// 32-bit offset anywhere on the path would wrap and move the wrong rows. Host back-end only: the
// same arithmetic runs on the device (reliability checklist item 13).

#include "../support/test_support.hpp"

namespace test {

TEST_CASE("permute and unpermute address rows beyond 2^31 bytes") {
  using T = float;
  moecomm::host_backend const be{2};
  int64_t const tokens = 1100, hidden = int64_t{1} << 19;
  REQUIRE(tokens * hidden * static_cast<int64_t>(sizeof(T)) > (int64_t{1} << 31));
  // Token t goes to expert (t + 1) % 2: rows are reordered, so row r of the output comes from far away.
  oracle::routing r;
  r.tokens = tokens;
  r.top_k = 1;
  for (int64_t t = 0; t < tokens; ++t) {
    r.idx.push_back(static_cast<int32_t>((t + 1) % 2));
    r.w.push_back(1.0f);
  }
  auto const plan = moecomm::make_permute_plan(be, moecomm::routing_view{r.idx.data(), r.w.data(), tokens, 1}, 2);
  auto const m = oracle::permute_map(r, 2);

  auto x = be.allocate<T>(tokens * hidden);
  auto out = be.allocate<T>(tokens * hidden);
  auto back = be.allocate<T>(tokens * hidden);
  // Every element of row t holds t, plus 0.5 in column 0 and 0.25 elsewhere.
  auto const tag = [](int64_t t, int64_t h) { return static_cast<float>(t) + (h == 0 ? 0.5f : 0.25f); };
  be.for_each_index(tokens * hidden, [&](int64_t i) { x.data()[i] = tag(i / hidden, i % hidden == 0 ? 0 : 1); });
  moecomm::permute(be, plan, moecomm::matrix_view<T const>{x.data(), tokens, hidden},
                   moecomm::matrix_view<T>{out.data(), tokens, hidden});
  moecomm::unpermute<moecomm::unweighted>(be, plan, moecomm::matrix_view<T const>{out.data(), tokens, hidden},
                                          moecomm::matrix_view<T>{back.data(), tokens, hidden});
  for (int64_t row = 0; row < tokens; ++row) {
    int64_t const t = m.token_of[static_cast<std::size_t>(row)];
    for (int64_t h : {int64_t{0}, hidden / 2, hidden - 1}) {
      CAPTURE(row);
      CAPTURE(h);
      REQUIRE(out.data()[row * hidden + h] == tag(t, h == 0 ? 0 : 1));
      REQUIRE(back.data()[row * hidden + h] == tag(row, h == 0 ? 0 : 1));
    }
  }
}

}  // namespace test
