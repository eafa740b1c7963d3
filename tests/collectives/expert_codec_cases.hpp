// SPDX-License-Identifier: Apache-2.0
#pragma once
// Test bodies of the expert codec's encode and decode (moecomm/collectives/expert_codec.hpp), for any
// back-end: every result is compared with an oracle written here from the definition (plain loops,
// std::sort with an explicit comparator), bit for bit, and bad input is rejected with its message
// before anything is written (outputs are NaN-poisoned and checked unchanged).

#include "../support/test_support.hpp"

#include <moecomm/collectives/expert_codec.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace test {

namespace codec_oracle {

struct encoded {
  std::vector<int32_t> indices;
  std::vector<float> values;
};

// The k parameters of largest |expert - shared| (ties: the smaller index), in ascending index,
// with the expert's own values.
inline encoded encode(std::vector<float> const& expert, std::vector<float> const& shared, int64_t k) {
  std::vector<int32_t> order(expert.size());
  std::iota(order.begin(), order.end(), 0);
  auto const magnitude = [&](int32_t i) { return std::fabs(expert[static_cast<std::size_t>(i)] - shared[static_cast<std::size_t>(i)]); };
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (magnitude(a) != magnitude(b)) return magnitude(a) > magnitude(b);
    return a < b;
  });
  order.resize(static_cast<std::size_t>(k));
  std::sort(order.begin(), order.end());
  encoded e{order, {}};
  for (int32_t i : order) e.values.push_back(expert[static_cast<std::size_t>(i)]);
  return e;
}

// shared everywhere, then the kept values at their indices.
inline std::vector<float> decode(std::vector<float> const& shared, encoded const& e) {
  std::vector<float> params = shared;
  for (std::size_t j = 0; j < e.indices.size(); ++j) params[static_cast<std::size_t>(e.indices[j])] = e.values[j];
  return params;
}

inline bool kept(encoded const& e, int32_t i) { return std::binary_search(e.indices.begin(), e.indices.end(), i); }

}  // namespace codec_oracle

// Encodes and decodes on the back-end; checks the encoding and the decoded expert against the
// oracle bit for bit, each dropped parameter's error against its residual, and the error bound.
template <class Backend>
void check_codec_round_trip(Backend const& be, moecomm::workspace<Backend>& scratch, std::vector<float> const& expert,
                            std::vector<float> const& shared, int64_t k) {
  auto const n = static_cast<int64_t>(expert.size());
  CAPTURE(n);
  CAPTURE(k);
  auto const want = codec_oracle::encode(expert, shared, k);
  auto const x = upload(be, expert), s = upload(be, shared);
  auto indices = upload(be, std::vector<int32_t>(static_cast<std::size_t>(k) + 3, -7));  // 3 past the end stay -7
  auto values = upload(be, poisoned<float>(k + 3));
  moecomm::encode_expert(be, moecomm::array_view<float const>(x.data(), n), moecomm::array_view<float const>(s.data(), n),
                         k, moecomm::array_view<int32_t>(indices.data(), k + 3),
                         moecomm::array_view<float>(values.data(), k + 3), scratch);
  auto const got_indices = download(be, indices.data(), k + 3);
  auto const got_values = download(be, values.data(), k + 3);
  CHECK(std::vector<int32_t>(got_indices.begin(), got_indices.begin() + k) == want.indices);
  CHECK(std::vector<int32_t>(got_indices.begin() + k, got_indices.end()) == std::vector<int32_t>(3, -7));
  check_bitwise(got_values, want.values, 1, "encode_expert values");
  check_untouched(got_values, static_cast<std::size_t>(k), "encode_expert values");

  auto params = upload(be, poisoned<float>(n + 2));
  moecomm::decode_expert(be, moecomm::array_view<float const>(s.data(), n), moecomm::array_view<int32_t const>(indices.data(), k),
                         moecomm::array_view<float const>(values.data(), k), moecomm::array_view<float>(params.data(), n + 2));
  auto const decoded = download(be, params.data(), n + 2);
  check_bitwise(decoded, codec_oracle::decode(shared, want), 1, "decode_expert");
  check_untouched(decoded, static_cast<std::size_t>(n), "decode_expert");

  // What decode loses is exactly the dropped residuals: kept parameters are the expert's bits,
  // dropped ones are off by their residual; the bound is the largest of those.
  float largest_error = 0.0f;
  for (int32_t i = 0; i < n; ++i) {
    auto const u = static_cast<std::size_t>(i);
    float const error = decoded[u] - expert[u];
    if (codec_oracle::kept(want, i)) {
      if (std::memcmp(&decoded[u], &expert[u], sizeof(float)) != 0) FAIL_CHECK("kept parameter ", i, " is not the expert's");
    } else if (std::fabs(error) != std::fabs(expert[u] - shared[u])) {
      FAIL_CHECK("dropped parameter ", i, " is off by ", error, ", not by its residual ", expert[u] - shared[u]);
    }
    largest_error = std::max(largest_error, std::fabs(error));
  }
  float const bound = moecomm::dropped_residual_max_abs(be, moecomm::array_view<float const>(x.data(), n),
                                                        moecomm::array_view<float const>(s.data(), n),
                                                        moecomm::array_view<int32_t const>(indices.data(), k));
  CHECK(bound == largest_error);
  if (k == n) CHECK(bound == 0.0f);
}

TEST_CASE_TEMPLATE_DEFINE("codec: encode and decode equal the oracle for every size and k", Config, codec_sweep) {
  auto const be = Config::make_backend();
  moecomm::workspace<typename Config::backend> scratch;  // shared by every call: sizes grow and shrink
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{7}, int64_t{2039}, int64_t{300}}) {
    auto const expert = finite_rows<float>(1, n, static_cast<std::uint32_t>(n) + 1);
    auto const shared = finite_rows<float>(1, n, static_cast<std::uint32_t>(n) + 1000);
    std::vector<int64_t> ks = {0, 1, n / 50, moecomm::top_k_for_ratio(n, 50.0), n / 2, n - 1, n};
    std::sort(ks.begin(), ks.end());
    ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
    for (int64_t k : ks)
      if (k >= 0 && k <= n) check_codec_round_trip(be, scratch, expert, shared, k);
  }
}

TEST_CASE_TEMPLATE_DEFINE("codec: ties in |residual|, +x and -x alike, go to the smaller index", Config, codec_ties) {
  auto const be = Config::make_backend();
  moecomm::workspace<typename Config::backend> scratch;
  SUBCASE("a worked example") {
    // |residual| = 1, 2, 2, 1, 0.5, 2, 1, 0 (shared 1: residuals -1, +1 tie as well).
    std::vector<float> const expert = {2.0f, -1.0f, 3.0f, 0.0f, 1.5f, 3.0f, 2.0f, 1.0f};
    std::vector<float> const shared(8, 1.0f);
    auto encode = [&](int64_t k) {
      auto const x = upload(be, expert), s = upload(be, shared);
      auto indices = upload(be, std::vector<int32_t>(static_cast<std::size_t>(k) + 1, -7));
      auto values = upload(be, poisoned<float>(k + 1));
      moecomm::encode_expert(be, moecomm::array_view<float const>(x.data(), 8), moecomm::array_view<float const>(s.data(), 8), k,
                             moecomm::array_view<int32_t>(indices.data(), k), moecomm::array_view<float>(values.data(), k),
                             scratch);
      return download(be, indices.data(), k);
    };
    CHECK(encode(1) == std::vector<int32_t>{1});
    CHECK(encode(3) == std::vector<int32_t>{1, 2, 5});
    CHECK(encode(4) == std::vector<int32_t>{0, 1, 2, 5});
    CHECK(encode(6) == std::vector<int32_t>{0, 1, 2, 3, 5, 6});
    CHECK(encode(7) == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6});
  }
  SUBCASE("many equal magnitudes of both signs") {
    for (int64_t n : {int64_t{64}, int64_t{2039}}) {
      std::mt19937 rng(static_cast<std::uint32_t>(n));
      std::uniform_int_distribution<int> level(-3, 3);
      std::vector<float> expert(static_cast<std::size_t>(n)), shared(static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < expert.size(); ++i) {
        shared[i] = 0.25f * static_cast<float>(level(rng));
        expert[i] = shared[i] + 0.5f * static_cast<float>(level(rng));  // exact: residuals are multiples of 0.5
      }
      for (int64_t k : {int64_t{1}, n / 50, n / 7, n / 2, n - 1, n}) check_codec_round_trip(be, scratch, expert, shared, k);
    }
  }
  SUBCASE("all residuals zero, signed zeros included: the first k indices") {
    std::vector<float> const expert = {0.0f, -0.0f, 1.0f, -0.0f, 5.0f};
    std::vector<float> const shared = {-0.0f, 0.0f, 1.0f, -0.0f, 5.0f};
    for (int64_t k : {int64_t{0}, int64_t{2}, int64_t{5}}) check_codec_round_trip(be, scratch, expert, shared, k);
  }
}

TEST_CASE_TEMPLATE_DEFINE("codec: compression off (k = n) gives back the expert bit for bit", Config, codec_exact) {
  auto const be = Config::make_backend();
  moecomm::workspace<typename Config::backend> scratch;
  float const big = std::numeric_limits<float>::max();
  float const tiny = std::numeric_limits<float>::denorm_min();
  // Values where shared + (expert - shared) != expert: cancellation, a residual that overflows to
  // +Inf (and sorts first), denormals and signed zeros.
  std::vector<float> const expert = {1e-8f, -0.0f, big, tiny, 3.0f, -big, 0.1f, 1.0f + 1e-7f, 0.0f};
  std::vector<float> const shared = {1.0f, 0.0f, -big, -tiny, 3.0f, big, 0.3f, 1e7f, -0.0f};
  REQUIRE(1.0f + (1e-8f - 1.0f) != 1e-8f);  // the naive residual codec would lose this one
  auto const n = static_cast<int64_t>(expert.size());
  check_codec_round_trip(be, scratch, expert, shared, n);
  check_codec_round_trip(be, scratch, expert, shared, moecomm::top_k_for_ratio(n, 1.0));
  check_codec_round_trip(be, scratch, expert, shared, 2);  // the two infinite residuals
  auto const two = codec_oracle::encode(expert, shared, 2);
  CHECK(two.indices == std::vector<int32_t>{2, 5});
}

TEST_CASE_TEMPLATE_DEFINE("codec: bad input is rejected, named, before anything is written", Config, codec_errors) {
  using moecomm::status;
  auto const be = Config::make_backend();
  moecomm::workspace<typename Config::backend> scratch;
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int64_t const n = 16;
  auto const good = finite_rows<float>(1, n, 5);
  auto indices = upload(be, std::vector<int32_t>(n, -7));
  auto values = upload(be, poisoned<float>(n));
  auto params = upload(be, poisoned<float>(n));
  auto const unchanged = [&] {
    CHECK(download(be, indices.data(), n) == std::vector<int32_t>(n, -7));
    check_untouched(download(be, values.data(), n), 0, "values");
    check_untouched(download(be, params.data(), n), 0, "params");
  };
  auto encode = [&](std::vector<float> const& expert, std::vector<float> const& shared, int64_t k, int64_t indices_size,
                    int64_t values_size) {
    return [&, expert, shared, k, indices_size, values_size] {
      auto const x = upload(be, expert), s = upload(be, shared);
      moecomm::encode_expert(be, moecomm::array_view<float const>(x.data(), static_cast<int64_t>(expert.size())),
                             moecomm::array_view<float const>(s.data(), static_cast<int64_t>(shared.size())), k,
                             moecomm::array_view<int32_t>(indices.data(), indices_size),
                             moecomm::array_view<float>(values.data(), values_size), scratch);
    };
  };
  auto with = [&](int64_t i, float v) {
    auto x = good;
    x[static_cast<std::size_t>(i)] = v;
    return x;
  };

  SUBCASE("NaN and Inf in either input, with the argument and index") {
    check_error(encode(with(7, nan), good, 4, n, n), status::invalid_argument,
                {"moecomm::encode_expert: argument 'expert' holds nan at index 7", "finite parameters only"});
    check_error(encode(good, with(3, inf), 4, n, n), status::invalid_argument, {"argument 'shared' holds inf at index 3"});
    check_error(encode(with(15, -inf), with(9, nan), 0, 0, 0), status::invalid_argument,
                {"argument 'shared' holds nan at index 9"});  // the first bad index, even with k = 0
    check_error([&] {
      auto const x = upload(be, with(2, inf));
      (void)moecomm::dropped_residual_max_abs(be, moecomm::array_view<float const>(x.data(), n),
                                              moecomm::array_view<float const>(x.data(), n),
                                              moecomm::array_view<int32_t const>(nullptr, 0));
    }, status::invalid_argument, {"moecomm::dropped_residual_max_abs: argument 'expert' holds inf at index 2"});
  }
  SUBCASE("k out of range, sizes that differ or fall short") {
    check_error(encode(good, good, n + 1, n + 1, n + 1), status::invalid_argument,
                {"moecomm::encode_expert: argument 'k' = 17 is not in [0, 16]"});
    check_error(encode(good, good, -1, n, n), status::invalid_argument, {"argument 'k' = -1 is not in [0, 16]"});
    check_error(encode(good, good, 5, 4, n), status::invalid_argument,
                {"argument 'indices' holds 4 elements, fewer than the 5 it receives"});
    check_error(encode(good, good, 5, n, 0), status::invalid_argument,
                {"argument 'values' holds 0 elements, fewer than the 5 it receives"});
    check_error(encode(good, std::vector<float>(good.begin(), good.end() - 1), 1, n, n), status::invalid_argument,
                {"argument 'shared' has 15 elements and argument 'expert' has 16; they must match"});
  }
  SUBCASE("decode: indices out of range or not strictly ascending, with the position") {
    auto decode = [&](std::vector<int32_t> const& kept, int64_t params_size, int64_t values_size = -1) {
      return [&, kept, params_size, values_size] {
        auto const s = upload(be, good);
        auto const i = upload(be, kept);
        auto const k = static_cast<int64_t>(kept.size());
        moecomm::decode_expert(be, moecomm::array_view<float const>(s.data(), n), moecomm::array_view<int32_t const>(i.data(), k),
                               moecomm::array_view<float const>(values.data(), values_size < 0 ? k : values_size),
                               moecomm::array_view<float>(params.data(), params_size));
      };
    };
    check_error(decode({0, 3, 16}, n), status::invalid_argument,
                {"moecomm::decode_expert: argument 'indices' has indices[2] = 16, outside [0, 16)"});
    check_error(decode({-1, 3}, n), status::invalid_argument, {"indices[0] = -1, outside [0, 16)"});
    check_error(decode({1, 4, 4, 9}, n), status::invalid_argument,
                {"indices[2] = 4, not above indices[1] = 4; indices must be strictly ascending"});
    check_error(decode({5, 2}, n), status::invalid_argument, {"indices[1] = 2, not above indices[0] = 5"});
    check_error(decode({1, 2}, n - 1), status::invalid_argument,
                {"argument 'params' holds 15 elements, fewer than the 16 it receives"});
    check_error(decode({1, 2}, n, 3), status::invalid_argument,
                {"argument 'values' has 3 elements and argument 'indices' has 2; one value per index"});
  }
  unchanged();
}

TEST_CASE_TEMPLATE_DEFINE("codec: decode in place over the shared expert", Config, codec_in_place) {
  auto const be = Config::make_backend();
  moecomm::workspace<typename Config::backend> scratch;
  int64_t const n = 2039, k = moecomm::top_k_for_ratio(n, 50.0);
  auto const expert = finite_rows<float>(1, n, 77), shared = finite_rows<float>(1, n, 78);
  auto const x = upload(be, expert);
  auto s = upload(be, shared);
  auto indices = be.template allocate<int32_t>(k);
  auto values = be.template allocate<float>(k);
  moecomm::encode_expert(be, moecomm::array_view<float const>(x.data(), n), moecomm::array_view<float const>(s.data(), n), k,
                         moecomm::array_view<int32_t>(indices.data(), k), moecomm::array_view<float>(values.data(), k), scratch);
  moecomm::decode_expert(be, moecomm::array_view<float const>(s.data(), n), moecomm::array_view<int32_t const>(indices.data(), k),
                         moecomm::array_view<float const>(values.data(), k), moecomm::array_view<float>(s.data(), n));
  check_bitwise(download(be, s.data(), n), codec_oracle::decode(shared, codec_oracle::encode(expert, shared, k)), 1,
                "decode_expert in place");
}

}  // namespace test
