// SPDX-License-Identifier: Apache-2.0
// relabel_permute_plan (the home-expert path's plan, made by moving expert blocks instead of a second
// sort) equals build_permute_plan on the relabeled routing, array for array: odd sizes, masked
// slots, E = 7 and 16, K = 1, 2, 5, 8 (up to E), padded and unpadded, random permutations of the expert ids.

#include "../support/test_support.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/ops/permute_plan.hpp>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace test {

inline std::vector<std::int32_t> copied(std::int32_t const* p, std::int64_t n) { return {p, p + n}; }

TEST_CASE("relabel_permute_plan equals a plan built from scratch on the relabeled routing") {
  moecomm::host_backend const be;
  std::mt19937 rng(5);
  for (std::int64_t tokens : {0, 1, 2, 97, 2039})
    for (std::int32_t experts : {7, 16})
      for (std::int32_t k : {1, 2, 5, 8})
        for (bool padded : {false, true}) {
          if (k > experts) continue;  // the plan refuses top_k > num_experts
          CAPTURE(tokens);
          CAPTURE(experts);
          CAPTURE(k);
          CAPTURE(padded);
          auto const r = make_routing({tokens, k, experts, 0.1, true, 1.0, static_cast<std::uint32_t>(tokens * 31 + k)});
          moecomm::routing_view const routing{r.idx.data(), r.w.data(), tokens, k};
          // Padded to the largest block, so every expert fits.
          std::vector<std::int64_t> per_expert(static_cast<std::size_t>(experts), 0);
          for (std::int32_t e : r.idx)
            if (e >= 0) ++per_expert[static_cast<std::size_t>(e)];
          std::int64_t const capacity = padded ? *std::max_element(per_expert.begin(), per_expert.end()) + 1 : 0;
          std::vector<std::int32_t> label(static_cast<std::size_t>(experts));
          std::iota(label.begin(), label.end(), 0);
          std::shuffle(label.begin(), label.end(), rng);
          std::vector<std::int32_t> renamed(r.idx.size());
          for (std::size_t i = 0; i < renamed.size(); ++i) renamed[i] = r.idx[i] < 0 ? r.idx[i] : label[static_cast<std::size_t>(r.idx[i])];
          moecomm::routing_view const relabeled{renamed.data(), r.w.data(), tokens, k};

          moecomm::workspace<moecomm::host_backend> scratch;
          moecomm::permute_plan<moecomm::host_backend> moved;
          moecomm::build_permute_plan(be, routing, experts, moved, scratch, {}, capacity);
          moecomm::relabel_permute_plan(be, moved, relabeled, moecomm::array_view<std::int32_t const>(label), scratch);
          auto const fresh = moecomm::make_permute_plan(be, relabeled, experts, {}, capacity);

          REQUIRE(moved.num_rows() == fresh.num_rows());
          CHECK(moved.routing().topk_idx == renamed.data());
          CHECK(copied(moved.expert_offsets(), experts + 1) == copied(fresh.expert_offsets(), experts + 1));
          CHECK(copied(moved.row_of(), tokens * k) == copied(fresh.row_of(), tokens * k));
          CHECK(copied(moved.token_of(), moved.num_rows()) == copied(fresh.token_of(), fresh.num_rows()));
          CHECK(copied(moved.slot_of(), moved.num_rows()) == copied(fresh.slot_of(), fresh.num_rows()));
        }
}

TEST_CASE("relabel_permute_plan names a label that is not a permutation, and leaves the plan as it was") {
  moecomm::host_backend const be;
  auto const r = make_routing({40, 2, 4, 0.0, false, 0.0, 3});
  moecomm::routing_view const routing{r.idx.data(), r.w.data(), 40, 2};
  moecomm::workspace<moecomm::host_backend> scratch;
  moecomm::permute_plan<moecomm::host_backend> plan;
  moecomm::build_permute_plan(be, routing, 4, plan, scratch);
  std::vector<std::int32_t> const before = copied(plan.row_of(), 80);
  std::vector<std::int32_t> const twice{0, 1, 1, 3}, out_of_range{0, 1, 2, 4}, short_label{0, 1, 2};
  check_error([&] { moecomm::relabel_permute_plan(be, plan, routing, moecomm::array_view<std::int32_t const>(twice), scratch); },
              moecomm::status::invalid_argument, {"relabel_permute_plan", "label[2] = 1 is given to two experts"});
  check_error([&] { moecomm::relabel_permute_plan(be, plan, routing, moecomm::array_view<std::int32_t const>(out_of_range), scratch); },
              moecomm::status::invalid_argument, {"label[3] = 4 is not an expert id"});
  check_error([&] { moecomm::relabel_permute_plan(be, plan, routing, moecomm::array_view<std::int32_t const>(short_label), scratch); },
              moecomm::status::invalid_argument, {"argument 'label' has 3 elements; needs at least 4"});
  CHECK(copied(plan.row_of(), 80) == before);
}

}  // namespace test
