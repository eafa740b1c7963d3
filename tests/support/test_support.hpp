// SPDX-License-Identifier: Apache-2.0
#pragma once
// What every test body needs: the (back-end, element type) configurations it is instantiated
// over, moving data to and from a back-end, self-identifying payloads, NaN poison, routing
// generators and bitwise comparison.

#include "oracle.hpp"

#include <moecomm/core/read_back.hpp>
#include <moecomm/moecomm.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace test {

using std::int32_t;
using std::int64_t;

// ---- configurations: one test body runs for each --------------------------------------------

// The host back-end with `Threads` threads, running its tiled row loop or, with `Portable`, the
// exact per-lane loop the CUDA back-end runs.
template <class T, int Threads, bool Portable = false>
struct host_config {
  using backend = moecomm::host_backend;
  using value_type = T;
  static backend make_backend() {
    return backend{Threads, Portable ? moecomm::host_kernels::portable : moecomm::host_kernels::tiled};
  }
};

// ---- moving data ---------------------------------------------------------------------------

template <class Backend, class T>
typename Backend::template buffer_type<T> upload(Backend const& be, std::vector<T> const& host) {
  auto buf = be.template allocate<T>(static_cast<int64_t>(host.size()));
  be.copy(buf.data(), host.data(), static_cast<int64_t>(host.size()));
  be.synchronize();
  return buf;
}

// Through detail::read_back: on a GPU an asynchronous copy and a wait bounded by the back-end's
// timeout (a copy into pageable memory would wait for a hung stream forever).
template <class Backend, class T>
std::vector<T> download(Backend const& be, T const* data, int64_t n) {
  std::vector<T> host(static_cast<std::size_t>(n));
  moecomm::detail::read_back(be, host.data(), data, n);
  return host;
}

// Flags (`bool` arrays) back to the host.
template <class Backend>
std::vector<bool> download_flags(Backend const& be, bool const* data, int64_t n) {
  std::unique_ptr<bool[]> host(new bool[static_cast<std::size_t>(n > 0 ? n : 1)]);
  be.copy(host.get(), data, n);
  be.synchronize();
  return std::vector<bool>(host.get(), host.get() + n);
}

// ---- payloads ------------------------------------------------------------------------------

// Bits of a T built from an integer (so rows carry their identity exactly, NaN patterns included).
template <class T>
T from_bits(std::uint32_t bits) {
  T v;
  if constexpr (sizeof(T) == 4) {
    std::memcpy(static_cast<void*>(&v), &bits, 4);
  } else {
    auto const b16 = static_cast<std::uint16_t>(bits);
    std::memcpy(static_cast<void*>(&v), &b16, 2);
  }
  return v;
}

// Row t, column h of a self-identifying matrix: a hash of (tag, t, h), as raw bits. Data movement
// must reproduce it bit for bit, whatever the pattern means as a number (NaN and Inf included).
template <class T>
std::vector<T> identity_rows(int64_t rows, int64_t hidden, std::uint32_t tag) {
  std::vector<T> m(static_cast<std::size_t>(rows * hidden));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < hidden; ++h) {
      std::uint64_t z = (std::uint64_t{tag} << 48) ^ (static_cast<std::uint64_t>(r) << 20) ^ static_cast<std::uint64_t>(h);
      z = (z ^ (z >> 31)) * 0x9E3779B97F4A7C15ull;
      m[static_cast<std::size_t>(r * hidden + h)] = from_bits<T>(static_cast<std::uint32_t>(z ^ (z >> 29)));
    }
  return m;
}

// Finite values in [-2, 2) with full mantissas, for arithmetic tests: products and sums round, so
// the order of accumulation and the use of FMA show in the result bits.
template <class T>
std::vector<T> finite_rows(int64_t rows, int64_t hidden, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<T> m(static_cast<std::size_t>(rows * hidden));
  for (auto& v : m) v = oracle::from32<T>(value(rng));
  return m;
}

// A quiet NaN with a recognisable payload: unwritten output stays exactly this.
template <class T>
T poison() {
  return from_bits<T>(sizeof(T) == 4 ? 0x7FC0DEADu : 0x7FDEu);  // 0x7FDE is a NaN as half and as bf16
}

template <class T>
std::vector<T> poisoned(int64_t n) {
  return std::vector<T>(static_cast<std::size_t>(n), poison<T>());
}

// ---- routing -------------------------------------------------------------------------------

struct routing_spec {
  int64_t tokens = 0;
  int32_t top_k = 1;
  int32_t experts = 1;
  double masked = 0.0;         // probability that a slot is -1
  bool duplicates = true;      // experts drawn with replacement (duplicates allowed)
  double zipf = 0.0;           // 0: uniform; s > 0: P(e) ∝ 1/(e+1)^s
  std::uint32_t seed = 1;
};

// Random routing. Weights are in (0, 1) with full mantissas; masked slots carry a NaN weight, which must never be read.
inline oracle::routing make_routing(routing_spec const& s) {
  std::mt19937 rng(s.seed);
  std::vector<double> p(static_cast<std::size_t>(s.experts));
  for (int32_t e = 0; e < s.experts; ++e) p[static_cast<std::size_t>(e)] = s.zipf > 0 ? 1.0 / std::pow(e + 1.0, s.zipf) : 1.0;
  std::discrete_distribution<int32_t> pick(p.begin(), p.end());
  std::bernoulli_distribution mask(s.masked);
  std::uniform_real_distribution<float> weight(0.001f, 1.0f);
  oracle::routing r;
  r.tokens = s.tokens;
  r.top_k = s.top_k;
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<int32_t> taken;
    for (int32_t k = 0; k < s.top_k; ++k) {
      int32_t e = pick(rng);
      while (!s.duplicates && std::find(taken.begin(), taken.end(), e) != taken.end()) e = pick(rng);
      taken.push_back(e);
      bool const masked = mask(rng);
      r.idx.push_back(masked ? -1 : e);
      r.w.push_back(masked ? std::numeric_limits<float>::quiet_NaN() : weight(rng));
    }
  }
  return r;
}

inline std::string describe(routing_spec const& s) {
  return "T=" + std::to_string(s.tokens) + " E=" + std::to_string(s.experts) + " K=" + std::to_string(s.top_k) +
         " masked=" + std::to_string(s.masked);
}

// The routing uploaded to a back-end, with the view the library takes.
template <class Backend>
struct device_routing {
  typename Backend::template buffer_type<int32_t> idx;
  typename Backend::template buffer_type<float> w;
  moecomm::routing_view view;
  device_routing(Backend const& be, oracle::routing const& r)
      : idx(upload(be, r.idx)), w(upload(be, r.w)), view{idx.data(), w.data(), r.tokens, r.top_k} {}
};

// ---- comparison ----------------------------------------------------------------------------

// A value as a number doctest can print: doubles as they are, other element types through fp32.
template <class T>
double printable(T v) {
  if constexpr (std::is_same_v<T, double>) return v; else return oracle::f32(v);
}

// Bitwise equality of two matrices (any element type, double included); on failure reports the
// first differing (row, column).
template <class T>
void check_bitwise(std::vector<T> const& got, std::vector<T> const& want, int64_t hidden, char const* what) {
  REQUIRE(got.size() >= want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      int64_t const h = hidden > 0 ? hidden : 1;
      FAIL_CHECK(std::string(what), ": first mismatch at row ", static_cast<int64_t>(i) / h, ", column ",
                 static_cast<int64_t>(i) % h, " (got ", printable(got[i]), ", want ", printable(want[i]), ")");
      return;
    }
  }
}

// The rows from `from` on still hold the poison: nothing was written past the end.
template <class T>
void check_untouched(std::vector<T> const& got, std::size_t from, char const* what) {
  T const p = poison<T>();
  for (std::size_t i = from; i < got.size(); ++i)
    if (std::memcmp(&got[i], &p, sizeof(T)) != 0) {
      FAIL_CHECK(what, ": element ", i, " past the written range was modified");
      return;
    }
}

// Runs `f` and returns the status and message of the moecomm::error it throws (success and "" when
// it throws nothing), for a test that judges them per rank.
template <class F>
std::pair<moecomm::status, std::string> thrown_error(F&& f) {
  try {
    f();
  } catch (moecomm::error const& e) {
    return {e.code(), e.what()};
  }
  return {moecomm::status::success, ""};
}

// Matches values within `relative` of `value`. doctest's own `Approx(v).epsilon(e)` also accepts
// anything within `e` in absolute terms (its scale is 1): every simulated time in seconds would pass.
inline doctest::Approx relatively(double value, double relative) { return doctest::Approx(value).epsilon(relative).scale(0); }

// Runs `f` and checks that it throws moecomm::error with `code` and a message containing every
// one of `fragments`.
template <class F>
void check_error(F&& f, moecomm::status code, std::vector<std::string> const& fragments) {
  try {
    f();
    FAIL_CHECK("expected moecomm::error containing '", fragments.front(), "', but nothing was thrown");
  } catch (moecomm::error const& e) {
    CHECK_MESSAGE(e.code() == code, "status ", moecomm::to_string(e.code()), ", message: ", e.what());
    std::string const what = e.what();
    for (auto const& fragment : fragments)
      CHECK_MESSAGE(what.find(fragment) != std::string::npos, "message '", what, "' lacks '", fragment, "'");
  }
}

// `layer.reserve(bounds, experts)` where the layer takes the experts (the expert-parallel layer: a
// shadowing policy's replica buffers), else `layer.reserve(bounds)`.
template <class Layer, class Experts, class = void>
struct reserves_with_experts : std::false_type {};
template <class Layer, class Experts>
struct reserves_with_experts<Layer, Experts,
                             std::void_t<decltype(std::declval<Layer&>().reserve(moecomm::step_bounds{}, std::declval<Experts&>()))>>
    : std::true_type {};
template <class Layer, class Experts>
void reserve_layer(Layer& layer, moecomm::step_bounds const& bounds, Experts& experts) {
  if constexpr (reserves_with_experts<Layer, Experts>::value) layer.reserve(bounds, experts);
  else layer.reserve(bounds);
}

}  // namespace test
