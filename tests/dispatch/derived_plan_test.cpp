// SPDX-License-Identifier: Apache-2.0
// Plans derived from a plan without a second sort equal build_permute_plan on their routing, array
// for array: relabel_permute_plan by expert (the home-expert path) and by row blocks (the replicated
// layer's replicas), and build_kept_permute_plan (the capacity and receiver-budget paths). Odd
// sizes, masked slots, E = 7 and 16, K = 1, 2, 5, 8 (up to E), padded and unpadded.

#include "../support/test_support.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/rows/permute_plan.hpp>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace test {

inline std::vector<std::int32_t> copied(std::int32_t const* p, std::int64_t n) { return {p, p + n}; }

// Every array of two plans that must be equal.
inline void check_same_plan(moecomm::permute_plan<moecomm::host_backend> const& derived,
                            moecomm::permute_plan<moecomm::host_backend> const& fresh) {
  std::int64_t const slots = fresh.routing().num_tokens * fresh.routing().top_k;
  REQUIRE(derived.num_rows() == fresh.num_rows());
  REQUIRE(derived.num_experts() == fresh.num_experts());
  CHECK(derived.padded_capacity() == fresh.padded_capacity());
  CHECK(derived.num_invalid_slots() == fresh.num_invalid_slots());
  CHECK(derived.routing().topk_idx == fresh.routing().topk_idx);
  CHECK(copied(derived.expert_offsets(), fresh.num_experts() + 1) == copied(fresh.expert_offsets(), fresh.num_experts() + 1));
  CHECK(copied(derived.row_of(), slots) == copied(fresh.row_of(), slots));
  CHECK(copied(derived.token_of(), derived.num_rows()) == copied(fresh.token_of(), fresh.num_rows()));
  CHECK(copied(derived.slot_of(), derived.num_rows()) == copied(fresh.slot_of(), fresh.num_rows()));
}

// The largest block + 1, so that every expert fits (0 when unpadded).
inline std::int64_t fitting_capacity(std::vector<std::int32_t> const& idx, std::int32_t experts, bool padded) {
  std::vector<std::int64_t> per_expert(static_cast<std::size_t>(experts), 0);
  for (std::int32_t e : idx)
    if (e >= 0 && e < experts) ++per_expert[static_cast<std::size_t>(e)];
  return padded ? *std::max_element(per_expert.begin(), per_expert.end()) + 1 : 0;
}

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
          std::int64_t const capacity = fitting_capacity(r.idx, experts, padded);
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

          check_same_plan(moved, fresh);
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
              moecomm::status::invalid_argument, {"relabel_permute_plan", "label[2] = 1 is given to two blocks"});
  check_error([&] { moecomm::relabel_permute_plan(be, plan, routing, moecomm::array_view<std::int32_t const>(out_of_range), scratch); },
              moecomm::status::invalid_argument, {"label[3] = 4 is not an expert id"});
  check_error([&] { moecomm::relabel_permute_plan(be, plan, routing, moecomm::array_view<std::int32_t const>(short_label), scratch); },
              moecomm::status::invalid_argument, {"argument 'label' has 3 elements; needs at least 4"});
  CHECK(copied(plan.row_of(), 80) == before);
}

// The replicated layer's relabel: each expert's rows cut into runs, each run a replica's slot id.
TEST_CASE("relabel_permute_plan by row blocks equals a plan built from scratch on the finer routing") {
  moecomm::host_backend const be;
  std::mt19937 rng(11);
  moecomm::workspace<moecomm::host_backend> scratch;
  moecomm::permute_plan<moecomm::host_backend> moved;  // reused: rebuilt in place every case
  for (std::int64_t tokens : {0, 1, 2, 97, 2039})
    for (std::int32_t experts : {7, 16})
      for (std::int32_t k : {1, 2, 5, 8}) {
        if (k > experts) continue;
        CAPTURE(tokens);
        CAPTURE(experts);
        CAPTURE(k);
        auto const r = make_routing({tokens, k, experts, 0.1, true, 1.0, static_cast<std::uint32_t>(tokens * 7 + k)});
        moecomm::routing_view const routing{r.idx.data(), r.w.data(), tokens, k};
        moecomm::build_permute_plan(be, routing, experts, moved, scratch);
        std::vector<std::int32_t> const offsets = copied(moved.expert_offsets(), experts + 1);
        // Up to 3 runs per expert (some empty), each given a distinct id of 3E.
        std::int32_t const new_experts = 3 * experts;
        std::vector<std::int32_t> ids(static_cast<std::size_t>(new_experts));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<std::int32_t> ends, labels, block_of_row(static_cast<std::size_t>(moved.num_rows()));
        for (std::int32_t e = 0; e < experts; ++e) {
          std::int32_t const lo = offsets[static_cast<std::size_t>(e)], hi = offsets[static_cast<std::size_t>(e) + 1];
          std::vector<std::int32_t> cuts{lo, hi};
          for (int c = 0; c < 2; ++c) cuts.push_back(lo + static_cast<std::int32_t>(rng() % static_cast<unsigned>(hi - lo + 1)));
          std::sort(cuts.begin(), cuts.end());
          for (std::size_t c = 1; c < cuts.size(); ++c) {
            for (std::int32_t row = cuts[c - 1]; row < cuts[c]; ++row) block_of_row[static_cast<std::size_t>(row)] = static_cast<std::int32_t>(ends.size());
            ends.push_back(cuts[c]);
            labels.push_back(ids[static_cast<std::size_t>(3 * e) + c - 1]);
          }
        }
        std::vector<std::int32_t> finer(r.idx.size(), -1);
        for (std::size_t i = 0; i < finer.size(); ++i) {
          std::int32_t const row = moved.row_of()[i];
          if (row >= 0) finer[i] = labels[static_cast<std::size_t>(block_of_row[static_cast<std::size_t>(row)])];
        }
        moecomm::routing_view const relabeled{finer.data(), r.w.data(), tokens, k};
        moecomm::relabel_permute_plan(be, moved, relabeled,
                                      moecomm::row_blocks{moecomm::array_view<std::int32_t const>(ends),
                                                          moecomm::array_view<std::int32_t const>(labels)},
                                      new_experts, scratch);
        check_same_plan(moved, moecomm::make_permute_plan(be, relabeled, new_experts));
      }
}

TEST_CASE("relabel_permute_plan by row blocks names bad blocks, and leaves the plan as it was") {
  moecomm::host_backend const be;
  auto const r = make_routing({40, 2, 4, 0.0, false, 0.0, 3});  // 80 rows
  moecomm::routing_view const routing{r.idx.data(), r.w.data(), 40, 2};
  moecomm::workspace<moecomm::host_backend> scratch;
  moecomm::permute_plan<moecomm::host_backend> plan;
  moecomm::build_permute_plan(be, routing, 4, plan, scratch);
  std::vector<std::int32_t> const before = copied(plan.row_of(), 80);
  auto relabel = [&](std::vector<std::int32_t> const& ends, std::vector<std::int32_t> const& labels, std::int32_t experts) {
    moecomm::relabel_permute_plan(be, plan, routing,
                                  moecomm::row_blocks{moecomm::array_view<std::int32_t const>(ends),
                                                      moecomm::array_view<std::int32_t const>(labels)},
                                  experts, scratch);
  };
  check_error([&] { relabel({30, 20, 80}, {0, 1, 2}, 4); }, moecomm::status::invalid_argument,
              {"relabel_permute_plan", "blocks.ends[1] = 20 is below the end before it"});
  check_error([&] { relabel({30, 70}, {0, 1}, 4); }, moecomm::status::invalid_argument,
              {"blocks.ends ends at 70; the plan has 80 rows"});
  check_error([&] { relabel({30, 90}, {0, 1}, 4); }, moecomm::status::invalid_argument, {"blocks.ends[1] = 90 is past the plan's rows 80"});
  check_error([&] { relabel({30, 80}, {5, 5}, 6); }, moecomm::status::invalid_argument, {"label[1] = 5 is given to two blocks"});
  check_error([&] { relabel({30, 80}, {0, 6}, 6); }, moecomm::status::invalid_argument, {"label[1] = 6 is not an expert id"});
  check_error([&] { relabel({30, 80}, {0}, 6); }, moecomm::status::invalid_argument, {"argument 'blocks' has 2 ends and 1 labels"});
  CHECK(copied(plan.row_of(), 80) == before);
  // A padded plan stays padded only with whole blocks of C rows.
  moecomm::build_permute_plan(be, routing, 4, plan, scratch, {}, 40);
  std::vector<std::int32_t> const padded = copied(plan.row_of(), 80);
  check_error([&] { relabel({40, 80, 120, 160}, {1, 0, 2, 3}, 5); }, moecomm::status::invalid_argument,
              {"the plan is padded to 40 rows per expert", "id 4 takes none"});
  check_error([&] { relabel({20, 60, 120, 160}, {0, 1, 2, 3}, 4); }, moecomm::status::invalid_argument,
              {"id 0 takes a block of another length"});
  CHECK(copied(plan.row_of(), 80) == padded);
}

// The capacity paths' kept plan, from masks of every kind: random, and each drop rule's survivors.
TEST_CASE("build_kept_permute_plan equals a plan built from scratch on the kept routing") {
  moecomm::host_backend const be;
  std::mt19937 rng(17);
  moecomm::workspace<moecomm::host_backend> scratch;
  moecomm::permute_plan<moecomm::host_backend> dropless, kept;  // reused: rebuilt in place every case
  for (std::int64_t tokens : {0, 1, 2, 97, 2039})
    for (std::int32_t experts : {7, 16})
      for (std::int32_t k : {1, 2, 5, 8})
        for (bool invalid_ids : {false, true})
          for (int mask : {0, 1, 2, 3}) {  // random, by position, by probability, random priority
            if (k > experts) continue;
            CAPTURE(tokens);
            CAPTURE(experts);
            CAPTURE(k);
            CAPTURE(invalid_ids);
            CAPTURE(mask);
            auto r = make_routing({tokens, k, experts, 0.1, true, 1.0, static_cast<std::uint32_t>(tokens * 13 + k + mask)});
            if (invalid_ids)  // ids out of range, treated as masked with the value scan off
              for (std::size_t i = 0; i < r.idx.size(); i += 5) r.idx[i] = experts + static_cast<std::int32_t>(i % 3);
            moecomm::routing_view const routing{r.idx.data(), r.w.data(), tokens, k};
            moecomm::build_permute_plan(be, routing, experts, dropless, scratch,
                                        invalid_ids ? moecomm::unchecked_routing : moecomm::routing_checks{});
            std::int64_t const slots = tokens * k;
            std::vector<std::int32_t> kept_idx(static_cast<std::size_t>(slots), -1);
            moecomm::array_view<std::int32_t> const out{kept_idx.data(), slots};
            std::int64_t const c = std::max<std::int64_t>(1, slots / experts / 2);
            if (mask == 0) {
              std::bernoulli_distribution keep(0.6);
              for (std::int64_t i = 0; i < slots; ++i)
                if (dropless.row_of()[i] >= 0 && keep(rng)) kept_idx[static_cast<std::size_t>(i)] = r.idx[static_cast<std::size_t>(i)];
            } else if (mask == 1) {
              (void)moecomm::drop_to_capacity(be, dropless, c, out, scratch, moecomm::drop_by_position{});
            } else if (mask == 2) {
              (void)moecomm::drop_to_capacity(be, dropless, c, out, scratch, moecomm::drop_by_probability{});
            } else {
              (void)moecomm::drop_to_capacity(be, dropless, c, out, scratch, moecomm::drop_random{7, 1});
            }
            moecomm::routing_view const kept_routing{kept_idx.data(), r.w.data(), tokens, k};
            for (bool padded : {false, true}) {
              CAPTURE(padded);
              std::int64_t const capacity = fitting_capacity(kept_idx, experts, padded);
              moecomm::build_kept_permute_plan(be, dropless, kept_routing, kept, scratch, {}, capacity);
              check_same_plan(kept, moecomm::make_permute_plan(be, kept_routing, experts, {}, capacity));
            }
          }
}

TEST_CASE("build_kept_permute_plan names a kept routing that is not a masking, a capacity too small, a padded or aliased plan") {
  moecomm::host_backend const be;
  std::vector<std::int32_t> idx{2, 0, 1, -1, 0, 2, 1, 0};
  std::vector<float> const w(8, .5f);
  moecomm::routing_view const routing{idx.data(), w.data(), 4, 2};
  moecomm::workspace<moecomm::host_backend> scratch;
  moecomm::permute_plan<moecomm::host_backend> dropless, kept, padded;
  moecomm::build_permute_plan(be, routing, 3, dropless, scratch);
  auto derive = [&](std::vector<std::int32_t> kept_idx, std::int64_t capacity = 0) {
    moecomm::build_kept_permute_plan(be, dropless, {kept_idx.data(), w.data(), 4, 2}, kept, scratch, {}, capacity);
  };
  check_error([&] { derive({2, 0, 1, -1, 1, 2, 1, 0}); }, moecomm::status::invalid_argument,
              {"build_kept_permute_plan", "argument 'kept_routing' has expert 1 at token 2, slot 0 where the dropless routing has 0"});
  check_error([&] { derive({2, 0, 1, 0, 0, 2, 1, 0}); }, moecomm::status::invalid_argument,
              {"expert 0 at token 1, slot 1 where the dropless routing has -1"});
  CHECK(kept.num_rows() == 0);  // empty after an error
  check_error([&] { derive({2, 0, 1, -1, 0, 2, 1, 0}, 2); }, moecomm::status::invalid_argument,
              {"expert 0 keeps 3 slots, more than padded_capacity = 2"});
  check_error([&] { moecomm::build_kept_permute_plan(be, dropless, {idx.data(), w.data(), 2, 2}, kept, scratch); },
              moecomm::status::invalid_argument, {"argument 'kept_routing' has 2 x 2 slots; the dropless plan's routing 4 x 2"});
  check_error([&] { moecomm::build_kept_permute_plan(be, dropless, routing, dropless, scratch); },
              moecomm::status::invalid_argument, {"argument 'kept' is 'dropless'"});
  moecomm::build_permute_plan(be, routing, 3, padded, scratch, {}, 4);
  check_error([&] { moecomm::build_kept_permute_plan(be, padded, routing, kept, scratch); }, moecomm::status::invalid_argument,
              {"argument 'dropless' is padded to 4 rows per expert"});
  derive({-1, 0, 1, -1, -1, 2, -1, 0}, 2);  // and a good one still works after the errors
  CHECK(kept.num_rows() == 6);
  CHECK(copied(kept.expert_offsets(), 4) == std::vector<std::int32_t>{0, 2, 4, 6});
  // Without the scan, an id that is not a masking keeps its slot under the dropless id, and a
  // negative one drops it: never a write out of bounds (1000 * C would be, padded).
  std::vector<std::int32_t> unscanned{2, 0, 1000, -1, -7, 2, 1, 0}, meant{2, 0, 1, -1, -1, 2, 1, 0};
  moecomm::build_kept_permute_plan(be, dropless, {unscanned.data(), w.data(), 4, 2}, kept, scratch, moecomm::unchecked_routing, 3);
  auto const fresh = moecomm::make_permute_plan(be, {meant.data(), w.data(), 4, 2}, 3, {}, 3);
  REQUIRE(kept.num_rows() == fresh.num_rows());
  CHECK(copied(kept.row_of(), 8) == copied(fresh.row_of(), 8));
  CHECK(copied(kept.token_of(), 9) == copied(fresh.token_of(), 9));
  CHECK(copied(kept.slot_of(), 9) == copied(fresh.slot_of(), 9));
}

}  // namespace test
