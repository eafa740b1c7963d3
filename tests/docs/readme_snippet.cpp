// SPDX-License-Identifier: Apache-2.0
// The permute snippet of docs/guide.md, compiled and run. The lines between the example markers are
// the guide's code block verbatim (host.docs.readme_snippet_in_sync checks that); the checks after
// them pin down what the snippet computes (Example P1 of docs/semantics.md).

#include <moecomm/moecomm.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

TEST_CASE("README snippet runs") {
  // example-begin readme
  moecomm::host_backend be;  // the CPU back-end: host memory, the same row kernels as the GPU
  // 4 tokens, each routed to top_k = 2 of 3 experts; -1 masks a slot (its weight is never read).
  std::int32_t const idx[] = {2, 0,  1, -1,  0, 2,  1, 0};
  float const w[] = {.6f, .4f,  1.f, 0.f,  .7f, .3f,  .5f, .5f};
  moecomm::routing_view const routing{idx, w, /*num_tokens=*/4, /*top_k=*/2};
  auto const plan = moecomm::make_permute_plan(be, routing, /*num_experts=*/3);  // checks ids, sorts by (e, t, k)

  std::int64_t const T = 4, H = 8, P = plan.num_rows();  // P = 7 kept slots
  std::vector<float> x(T * H), y(P * H), out(T * H);
  for (std::int64_t i = 0; i < T * H; ++i) x[i] = float(i / H);  // token row t holds t
  moecomm::permute(be, plan, moecomm::matrix_view<float const>{x.data(), T, H},
                   moecomm::matrix_view<float>{y.data(), P, H});
  // ... expert e works on rows [plan.expert_offsets()[e], plan.expert_offsets()[e + 1]) of y ...
  moecomm::unpermute<moecomm::weighted>(be, plan, moecomm::matrix_view<float const>{y.data(), P, H},
                                        moecomm::matrix_view<float>{out.data(), T, H});
  // out[t] = sum of w[t][k] * y[plan.row_of()[t * 2 + k]] over unmasked k: fp32, ascending k, explicit FMA
  // example-end readme

  // The plan is Example P1 of docs/semantics.md: rows in (expert, token, slot) order.
  REQUIRE(P == 7);
  std::vector<std::int32_t> const row_of(plan.row_of(), plan.row_of() + T * 2);
  std::vector<std::int32_t> const token_of(plan.token_of(), plan.token_of() + P);
  std::vector<std::int32_t> const slot_of(plan.slot_of(), plan.slot_of() + P);
  std::vector<std::int32_t> const expert_offsets(plan.expert_offsets(), plan.expert_offsets() + 4);
  CHECK(row_of == std::vector<std::int32_t>{5, 0, 3, -1, 1, 6, 4, 2});
  CHECK(token_of == std::vector<std::int32_t>{0, 2, 3, 1, 3, 0, 2});
  CHECK(slot_of == std::vector<std::int32_t>{1, 0, 1, 0, 0, 0, 1});
  CHECK(expert_offsets == std::vector<std::int32_t>{0, 3, 5, 7});

  // permute: row r of y is a copy of the row of token token_of[r].
  for (std::int64_t r = 0; r < P; ++r)
    for (std::int64_t h = 0; h < H; ++h) CHECK(y[static_cast<std::size_t>(r * H + h)] == float(token_of[r]));

  // unpermute: the identity experts give out[t] = fma over the valid slots in ascending k, from +0.0,
  // bit for bit (token 1's masked slot is skipped, not multiplied by 0).
  for (std::int64_t t = 0; t < T; ++t) {
    float want = 0.0f;
    for (int k = 0; k < 2; ++k)
      if (idx[t * 2 + k] >= 0) want = std::fma(w[t * 2 + k], float(t), want);
    for (std::int64_t h = 0; h < H; ++h) {
      float const got = out[static_cast<std::size_t>(t * H + h)];
      CAPTURE(t);
      CAPTURE(h);
      CHECK(std::memcmp(&got, &want, sizeof got) == 0);
    }
  }
}
