// SPDX-License-Identifier: Apache-2.0
// Sliced experts (patterns/experts.hpp, 3.): the test MLP cut into N slices along its inner
// dimension gives partial outputs and input gradients whose ascending-slice sums equal the
// unsliced expert's bit for bit (dyadic values: exact arithmetic), and slice gradients that are the
// unsliced gradient's pieces; the trait tells sliced experts from the others.

#include "../support/sliced_mlp.hpp"
#include "../support/test_support.hpp"
#include "shadow_cases.hpp"

#include <moecomm/patterns/experts.hpp>

namespace test {

static_assert(moecomm::detail::is_sliced_experts_v<sliced_mlp_experts<float>>);
static_assert(!moecomm::detail::is_sliced_experts_v<scale_bias_experts<float>>);

template <class T>
void check_slices_sum_to_the_expert(std::int64_t hidden, std::int64_t inner, std::int32_t parts, std::int64_t rows) {
  CAPTURE(parts);
  CAPTURE(rows);
  sliced_mlp_experts<T> whole{hidden, inner, 0, 1, {}, {}};
  for (std::int64_t i = 0; i < whole.parameter_count(); ++i) whole.params.push_back(parameter_value(3, i, true));
  whole.grads.assign(whole.params.size(), 0.0f);
  std::vector<T> x(static_cast<std::size_t>(rows * hidden)), g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = oracle::from32<T>(dyadic(static_cast<std::uint32_t>(7 * i + 1)));
    g[i] = oracle::from32<T>(dyadic(static_cast<std::uint32_t>(5 * i + 2)));
  }
  std::vector<T> y(x.size()), d_x(x.size());
  whole.forward(whole.parameters(0), {x.data(), rows, hidden}, {y.data(), rows, hidden});
  whole.backward(whole.parameters(0), {x.data(), rows, hidden}, {g.data(), rows, hidden}, {d_x.data(), rows, hidden},
                 whole.gradients(0));

  std::vector<float> y_sum(x.size(), 0.0f), d_x_sum(x.size(), 0.0f);
  for (std::int32_t s = 0; s < parts; ++s) {
    sliced_mlp_experts<T> slice{hidden, inner, s, parts, slice_parameters(whole.params, hidden, inner, s, parts), {}};
    slice.grads.assign(slice.params.size(), 0.0f);
    std::vector<T> partial = poisoned<T>(rows * hidden), d_partial = poisoned<T>(rows * hidden);
    slice.forward(slice.parameters(0), {x.data(), rows, hidden}, {partial.data(), rows, hidden});
    slice.backward(slice.parameters(0), {x.data(), rows, hidden}, {g.data(), rows, hidden}, {d_partial.data(), rows, hidden},
                   slice.gradients(0));
    for (std::size_t i = 0; i < x.size(); ++i) {
      y_sum[i] += oracle::f32(partial[i]);
      d_x_sum[i] += oracle::f32(d_partial[i]);
    }
    std::vector<float> want = slice_parameters(whole.grads, hidden, inner, s, parts);
    if (s != 0) std::fill(want.end() - hidden, want.end(), 0.0f);  // b2's gradient belongs to slice 0
    CHECK(slice.grads == want);
  }
  std::vector<T> y_sliced(x.size()), d_x_sliced(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    y_sliced[i] = oracle::from32<T>(y_sum[i]);
    d_x_sliced[i] = oracle::from32<T>(d_x_sum[i]);
  }
  check_bitwise(y_sliced, y, hidden, "sum of the slices' outputs");
  check_bitwise(d_x_sliced, d_x, hidden, "sum of the slices' input gradients");
}

TEST_CASE("sliced experts: the slices' partial outputs and gradients sum to the unsliced expert's") {
  for (std::int32_t parts : {1, 2, 4})
    for (std::int64_t rows : {0, 1, 13}) check_slices_sum_to_the_expert<float>(8, 16, parts, rows);
}

}  // namespace test
