// SPDX-License-Identifier: Apache-2.0
// The expert codec (moecomm/collectives/expert_codec.hpp): the encode/decode bodies of expert_codec_cases.hpp
// on the serial and two-thread host back-ends; the compression-ratio helper; and the shared
// expert's mean over in-process ranks, bitwise equal on every rank to the fixed-order sum computed
// here, with bad arguments and disagreements failing on every rank before any write.

#include "../comm/inproc_support.hpp"
#include "expert_codec_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>

#include <chrono>

namespace test {

using moecomm::inproc_communicator;
using moecomm::status;

#define MOECOMM_CODEC_CONFIGS host_config<float, 1>, host_config<float, 2>

TEST_CASE_TEMPLATE_INVOKE(codec_sweep, MOECOMM_CODEC_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(codec_ties, MOECOMM_CODEC_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(codec_exact, MOECOMM_CODEC_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(codec_errors, MOECOMM_CODEC_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(codec_in_place, MOECOMM_CODEC_CONFIGS);

TEST_CASE("codec: top_k_for_ratio is ceil(n / ratio), and rejects a ratio below 1 or not finite") {
  CHECK(moecomm::top_k_for_ratio(2039, 50.0) == 41);
  CHECK(moecomm::top_k_for_ratio(100, 50.0) == 2);
  CHECK(moecomm::top_k_for_ratio(101, 50.0) == 3);
  CHECK(moecomm::top_k_for_ratio(2039, 1.0) == 2039);
  // n / ratio rounds up to 2^63 for the largest n: the result is n, not the conversion's INT64_MIN.
  CHECK(moecomm::top_k_for_ratio(INT64_MAX, 1.0) == INT64_MAX);
  CHECK(moecomm::top_k_for_ratio(INT64_MAX, 2.0) == std::int64_t{1} << 62);
  CHECK(moecomm::top_k_for_ratio(0, 50.0) == 0);
  CHECK(moecomm::top_k_for_ratio(1, 1e300) == 1);
  CHECK(moecomm::top_k_for_ratio(7, 2.5) == 3);
  for (double bad : {0.5, 0.0, -50.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()})
    check_error([&] { (void)moecomm::top_k_for_ratio(100, bad); }, status::invalid_argument,
                {"moecomm::top_k_for_ratio: argument 'ratio' = ", "must be finite and >= 1"});
  check_error([] { (void)moecomm::top_k_for_ratio(-1, 2.0); }, status::invalid_argument, {"argument 'n' = -1 is negative"});
}

// Rank r's experts: `rows` rows of n values with full mantissas, so that the order of the
// additions shows in the bits.
std::vector<float> experts_of_rank(int rank, int64_t rows, int64_t n) {
  return finite_rows<float>(rows, n, 100u + static_cast<std::uint32_t>(rank));
}

// The definition: each rank's experts added left to right, the ranks' sums left to right in
// ascending rank, divided by the number of experts.
std::vector<float> sequential_mean(std::vector<int64_t> const& rows, int64_t n) {
  std::vector<float> total(static_cast<std::size_t>(n));
  int64_t experts = 0;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    auto const mine = experts_of_rank(static_cast<int>(r), rows[r], n);
    for (int64_t i = 0; i < n; ++i) {
      float partial = rows[r] > 0 ? mine[static_cast<std::size_t>(i)] : 0.0f;
      for (int64_t e = 1; e < rows[r]; ++e) partial += mine[static_cast<std::size_t>(e * n + i)];
      auto& t = total[static_cast<std::size_t>(i)];
      t = r == 0 ? partial : t + partial;
    }
    experts += rows[r];
  }
  for (float& t : total) t /= static_cast<float>(experts);
  return total;
}

TEST_CASE("codec: shared_expert_mean is the fixed-order mean of the domain's experts, bit for bit on every rank") {
  struct domain {
    char const* name;
    std::vector<int64_t> rows;  // experts per rank
  };
  domain const domains[] = {
      {"one rank, one expert", {1}},
      {"one expert per rank", {1, 1, 1, 1}},
      {"two experts per rank", {2, 2, 2}},
      {"uneven, one rank with none", {3, 0, 1, 2}},
  };
  for (domain const& d : domains) {
    CAPTURE(d.name);
    auto const ranks = static_cast<int>(d.rows.size());
    moecomm::inproc_world const world(ranks, std::chrono::seconds(60));
    world.run([&](inproc_communicator comm) {
      moecomm::host_backend const be{2};
      moecomm::workspace<moecomm::host_backend> scratch;  // reused by every call below
      int64_t const rows = d.rows[static_cast<std::size_t>(comm.rank())];
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{2039}, int64_t{5}}) {
        CAPTURE(n);
        auto const experts = experts_of_rank(comm.rank(), rows, n);
        auto shared = poisoned<float>(n + 1);
        moecomm::shared_expert_mean(be, comm, moecomm::matrix_view<float const>(experts.data(), rows, n),
                                    moecomm::array_view<float>(shared), scratch);
        check_bitwise(shared, sequential_mean(d.rows, n), 1, "shared_expert_mean");
        check_untouched(shared, static_cast<std::size_t>(n), "shared_expert_mean");
      }
    });
  }
}

TEST_CASE("codec: the experts' values tell the orders of the mean's additions apart") {
  auto const forward = sequential_mean({1, 1, 1, 1}, 2039);
  std::vector<float> backward(2039, 0.0f);
  for (int r = 3; r >= 0; --r) {
    auto const mine = experts_of_rank(r, 1, 2039);
    for (std::size_t i = 0; i < backward.size(); ++i) backward[i] += mine[i];
  }
  for (float& b : backward) b /= 4.0f;
  CHECK(std::memcmp(forward.data(), backward.data(), forward.size() * sizeof(float)) != 0);
}

TEST_CASE("codec: shared_expert_mean fails on every rank before any write") {
  moecomm::inproc_world const world(3, std::chrono::seconds(20));
  moecomm::host_backend const be;
  struct bad_case {
    char const* name;
    int64_t rows[3];
    int64_t n[3];
    int64_t shared_size[3];
    status want[3];
    char const* message[3];
  };
  bad_case const cases[] = {
      {"shared too small on rank 1", {1, 1, 1}, {4, 4, 4}, {4, 3, 4},
       {status::aborted, status::invalid_argument, status::aborted},
       {"moecomm::shared_expert_mean: rank 1 passed an invalid argument (see its error); nothing was written",
        "moecomm::shared_expert_mean: argument 'shared' holds 3 elements, fewer than the 4 it receives",
        "rank 1 passed an invalid argument"}},
      {"parameter counts that differ", {1, 1, 1}, {4, 4, 5}, {5, 5, 5},
       {status::invalid_usage, status::invalid_usage, status::invalid_usage},
       {"ranks disagree: rank 0 has experts of 4 parameters, but rank 2 has experts of 5",
        "ranks disagree: rank 0 has experts of 4 parameters", "ranks disagree: rank 0 has experts of 4 parameters"}},
      {"no expert anywhere", {0, 0, 0}, {4, 4, 4}, {4, 4, 4},
       {status::invalid_argument, status::invalid_argument, status::invalid_argument},
       {"argument 'local_experts' has no rows on any of the 3 ranks", "the domain holds no expert to average",
        "the domain holds no expert to average"}},
      {"negative rows on rank 2", {1, 1, -1}, {4, 4, 4}, {4, 4, 4},
       {status::aborted, status::aborted, status::invalid_argument},
       {"rank 2 passed an invalid argument", "rank 2 passed an invalid argument",
        "argument 'local_experts' is -1 x 4; both must be >= 0"}},
  };
  for (bad_case const& c : cases) {
    CAPTURE(c.name);
    std::vector<std::vector<float>> shared(3, poisoned<float>(5));
    std::vector<float> const experts(8, 1.5f);
    auto const outcomes = on_every_rank(world, [&](inproc_communicator comm) {
      auto const r = static_cast<std::size_t>(comm.rank());
      moecomm::workspace<moecomm::host_backend> scratch;
      moecomm::shared_expert_mean(be, comm, moecomm::matrix_view<float const>(experts.data(), c.rows[r], c.n[r]),
                                  moecomm::array_view<float>(shared[r].data(), c.shared_size[r]), scratch);
    });
    for (std::size_t r = 0; r < 3; ++r) {
      CAPTURE(r);
      CHECK(outcomes[r].code == c.want[r]);
      CHECK_MESSAGE(outcomes[r].message.find(c.message[r]) != std::string::npos, outcomes[r].message);
      check_untouched(shared[r], 0, "shared");
    }
  }
}

}  // namespace test
