// SPDX-License-Identifier: Apache-2.0
// Regression tests for sizes that overflow, with the exact inputs the fuzzing report found: each
// used to wrap, pass the size check and crash, hang in an allocation, or leak a standard-library
// exception. Each must now be a moecomm::error naming the product and its factors, raised before
// anything is allocated or written. Host back-end only: the checks are host code.

#include "../support/test_support.hpp"

#include <limits>

namespace test {

using moecomm::status;

namespace {

constexpr int64_t int64_max = std::numeric_limits<int64_t>::max();
constexpr int32_t int32_max = std::numeric_limits<int32_t>::max();

// Two valid tokens with top-2 over 16 experts.
oracle::routing two_tokens() { return {{0, 15, 3, -1}, {.5f, .5f, 1.f, 0.f}, 2, 2}; }

}  // namespace

TEST_CASE("padded_capacity * num_experts that wraps int64 is rejected before allocation") {
  moecomm::host_backend const be;
  auto const r = two_tokens();
  moecomm::routing_view const view{r.idx.data(), r.w.data(), r.tokens, r.top_k};
  // Used to wrap to a small row count, pass the int32 check and write through a null pointer.
  check_error([&] { (void)moecomm::make_permute_plan(be, view, 16, {}, int64_max); }, status::invalid_argument,
              {"moecomm::make_permute_plan", "padded_capacity * num_experts = 9223372036854775807 * 16 overflows int64"});
  check_error([&] { (void)moecomm::make_permute_plan(be, view, 16, {}, 1'000'000'000'000'000'000); },
              status::invalid_argument,
              {"padded_capacity * num_experts = 1000000000000000000 * 16 overflows int64"});
  // Fits int64 but not the plan's int32 row ids: refused before 128 GB are requested.
  check_error([&] { (void)moecomm::make_permute_plan(be, view, 16, {}, 1'000'000'000); }, status::invalid_argument,
              {"padded_capacity * num_experts = 16000000000 exceeds int32 (2^31 - 1)", "the plan's row ids are int32"});
  // A capacity that fits is still accepted.
  auto const plan = moecomm::make_permute_plan(be, view, 16, {}, 3);
  CHECK(plan.num_rows() == 48);
}

TEST_CASE("num_experts = INT_MAX is rejected by the plan builder instead of wrapping num_experts + 1") {
  moecomm::host_backend const be;
  auto const r = two_tokens();
  for (int64_t tokens : {int64_t{0}, r.tokens}) {
    CAPTURE(tokens);
    moecomm::routing_view const view{r.idx.data(), r.w.data(), tokens, r.top_k};
    check_error([&] { (void)moecomm::make_permute_plan(be, view, int32_max); }, status::invalid_argument,
                {"moecomm::make_permute_plan", "num_experts + 1 = 2147483648 exceeds int32 (2^31 - 1)"});
  }
}

TEST_CASE("num_tokens * top_k that wraps int64 is rejected by validation, the plan and the layout") {
  moecomm::host_backend const be;
  std::vector<int32_t> const idx{0, 1, 2, 3};
  int64_t const huge = int64_t{1} << 62;
  // T = 2^62, K = 4 wrapped to 0 slots and produced a plan with 0 rows.
  moecomm::routing_view const view{idx.data(), nullptr, huge, 4};
  std::vector<std::string> const message{"routing.num_tokens * routing.top_k = 4611686018427387904 * 4 overflows int64"};
  check_error([&] { moecomm::validate_routing(be, view, 16, moecomm::unchecked_routing); }, status::invalid_argument,
              message);
  check_error([&] { (void)moecomm::make_permute_plan(be, view, 16); }, status::invalid_argument, message);
  check_error([&] { (void)moecomm::make_dispatch_layout(be, view, moecomm::contiguous_placement(16, 4)); },
              status::invalid_argument, message);
  // A product that fits int64 but not the int32 row ids.
  check_error([&] { (void)moecomm::make_permute_plan(be, moecomm::routing_view{idx.data(), nullptr, int64_t{1} << 30, 4}, 16); },
              status::invalid_argument,
              {"routing.num_tokens * routing.top_k = 4294967296 exceeds int32 (2^31 - 1)", "int32 row id"});
}

TEST_CASE("sort_chunks rejects num_ranks * num_local_experts beyond int32 before sizing its tables") {
  moecomm::host_backend const be;
  std::vector<int32_t> const counts{1, 1, 1, 1};
  std::vector<float> const in{1, 2, 3, 4};
  auto out = poisoned<float>(4);
  // Used to overflow int32 and throw std::length_error (INT_MAX^2) or std::bad_alloc (2^16 x 2^16).
  struct shape { int32_t ranks, locals; char const* message; };
  for (shape const s : {shape{int32_max, int32_max, "num_ranks * num_local_experts = 4611686014132420609 exceeds int32"},
                        shape{65536, 65536, "num_ranks * num_local_experts = 4294967296 exceeds int32"}}) {
    CAPTURE(s.ranks);
    check_error([&] { moecomm::sort_chunks(be, moecomm::matrix_view<float const>{in.data(), 4, 1},
                                           moecomm::array_view<int32_t const>(counts), s.ranks, s.locals,
                                           moecomm::matrix_view<float>{out.data(), 4, 1}); },
                status::invalid_argument, {"moecomm::sort_chunks", s.message, "int32 expert id"});
  }
  check_untouched(out, 0, "sort_chunks output after rejected calls");
}

TEST_CASE("a matrix whose byte size overflows int64 is rejected before any row is read") {
  moecomm::host_backend const be;
  auto const r = two_tokens();
  auto const plan = moecomm::make_permute_plan(be, moecomm::routing_view{r.idx.data(), r.w.data(), r.tokens, r.top_k}, 16);
  std::vector<float> x(8);
  auto out = poisoned<float>(8);
  int64_t const hidden = int64_t{1} << 61;  // 2^61 floats = 2^63 bytes per row
  check_error([&] { moecomm::permute(be, plan, moecomm::matrix_view<float const>{x.data(), 2, hidden},
                                     moecomm::matrix_view<float>{out.data(), 3, hidden}); },
              status::invalid_argument,
              {"moecomm::permute", "argument 'x' has 2 rows of hidden = 2305843009213693952",
               "size in bytes overflows int64"});
  check_untouched(out, 0, "permute output after a rejected call");
}

// Under AddressSanitizer this needs ASAN_OPTIONS=allocator_may_return_null=1 (the test preset `asan`
// sets it): ASan otherwise aborts on the oversized request itself instead of returning null from the
// nothrow operator new.
TEST_CASE("failed allocations are moecomm::error(out_of_memory) with the byte count") {
  moecomm::host_backend const be;
  // 2^62 bytes exceed any address space: operator new fails, and used to throw std::bad_alloc.
  check_error([&] { (void)be.allocate<int32_t>(int64_t{1} << 60); }, status::out_of_memory,
              {"moecomm::host_allocator", "cannot allocate 4611686018427387904 bytes of host memory"});
  check_error([] { (void)moecomm::host_allocator{}.allocate(std::size_t{1} << 62); }, status::out_of_memory,
              {"cannot allocate 4611686018427387904 bytes"});
  // 2^62 int32 elements are 2^64 bytes, which wrapped to 0 in the byte count.
  check_error([&] { (void)be.allocate<int32_t>(int64_t{1} << 62); }, status::out_of_memory,
              {"moecomm::host_backend::allocate", "cannot allocate 4611686018427387904 elements of 4 bytes",
               "overflows int64"});
  CHECK(std::string(moecomm::to_string(status::out_of_memory)) == "out_of_memory");
}

}  // namespace test
