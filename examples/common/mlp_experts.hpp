// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The examples' experts: FasterMoE's 2-layer MLP (H -> I -> H with ReLU) as parametric experts
//! (moecomm/patterns/experts.hpp), written with plain loops, and their seeded initial parameters.

#include <moecomm/core/matrix.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace example_support {

//! y[j] += a * x[j]. Every loop of the experts is this one: each output element is a sum whose
//! terms come in a fixed order, one per call, so a row's result does not depend on which other
//! rows share its batch (the shadowed layer hands an expert other batches than plain EP does), and
//! the compiler may vectorise over j without changing a bit (-ffp-contract=off: no FMA either).
inline void axpy(float a, float const* __restrict x, float* __restrict y, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

//! One rank's experts: expert(x) = relu(x W1 + b1) W2 + b2, W1 [H][I], W2 [I][H], I = alpha * H.
//! One expert's flat parameters (and gradient accumulator) are W1, b1, W2, b2 in that order.
//! Without `output_bias` the experts leave b2 out (its gradient stays 0): a slice that is not the
//! first of a sliced expert (`sliced_mlp_experts`).
struct mlp_experts {
  std::int64_t hidden = 0, inner = 0;  //!< H, I
  std::vector<float> params, grads;    //!< [local expert][parameter_count()]
  bool output_bias = true;

  [[nodiscard]] std::int64_t parameter_count() const { return 2 * hidden * inner + inner + hidden; }
  float* parameters(std::int32_t l) { return params.data() + l * parameter_count(); }
  float* gradients(std::int32_t l) { return grads.data() + l * parameter_count(); }
  //! One expert's forward FLOPs over `rows` rows: two GEMMs of 2 * rows * H * I each. A simulated
  //! back-end charges them to the device (patterns/experts.hpp); others ignore them.
  [[nodiscard]] double flops(std::int64_t rows) const {
    return 4.0 * static_cast<double>(rows) * static_cast<double>(hidden) * static_cast<double>(inner);
  }

  void forward(float const* p, moecomm::matrix_view<float const> in, moecomm::matrix_view<float> out) const {
    std::vector<float> z(static_cast<std::size_t>(inner));
    float const* const w2 = p + hidden * inner + inner;
    float const* const b2 = w2 + inner * hidden;
    for (std::int64_t r = 0; r < in.rows; ++r) {
      hidden_layer(p, in.row(r), z.data());
      float* const y = out.row(r);
      if (output_bias) std::copy(b2, b2 + hidden, y);
      else std::fill(y, y + hidden, 0.0f);
      for (std::int64_t j = 0; j < inner; ++j)
        axpy(std::max(z[static_cast<std::size_t>(j)], 0.0f), w2 + j * hidden, y, hidden);
    }
  }

  //! Writes d_in and adds this batch's gradient to d_p, row by row. The hidden layer is computed
  //! again (the interface passes the inputs, not the activations).
  void backward(float const* p, moecomm::matrix_view<float const> in, moecomm::matrix_view<float const> d_out, moecomm::matrix_view<float> d_in,
                float* d_p) const {
    auto const I = static_cast<std::size_t>(inner);
    float const* const w1 = p;
    float const* const w2 = p + hidden * inner + inner;
    // Transposed copies, so that d_a = W2 g and d_x = W1 d_z are axpys over contiguous rows too.
    std::vector<float> w1t(I * static_cast<std::size_t>(hidden)), w2t(w1t.size());
    for (std::int64_t i = 0; i < hidden; ++i)
      for (std::int64_t j = 0; j < inner; ++j) {
        w1t[static_cast<std::size_t>(j * hidden + i)] = w1[i * inner + j];
        w2t[static_cast<std::size_t>(i * inner + j)] = w2[j * hidden + i];
      }
    float* const dw1 = d_p;
    float* const db1 = dw1 + hidden * inner;
    float* const dw2 = db1 + inner;
    float* const db2 = dw2 + inner * hidden;
    std::vector<float> z(I), d_a(I), d_z(I);
    for (std::int64_t r = 0; r < in.rows; ++r) {
      float const* const x = in.row(r);
      float const* const g = d_out.row(r);
      hidden_layer(p, x, z.data());
      if (output_bias) axpy(1.0f, g, db2, hidden);
      for (std::int64_t j = 0; j < inner; ++j)
        axpy(std::max(z[static_cast<std::size_t>(j)], 0.0f), g, dw2 + j * hidden, hidden);
      std::fill(d_a.begin(), d_a.end(), 0.0f);
      for (std::int64_t k = 0; k < hidden; ++k) axpy(g[k], w2t.data() + k * inner, d_a.data(), inner);
      for (std::size_t j = 0; j < I; ++j) d_z[j] = z[j] > 0.0f ? d_a[j] : 0.0f;
      axpy(1.0f, d_z.data(), db1, inner);
      for (std::int64_t i = 0; i < hidden; ++i) axpy(x[i], d_z.data(), dw1 + i * inner, inner);
      float* const dx = d_in.row(r);
      std::fill(dx, dx + hidden, 0.0f);
      for (std::int64_t j = 0; j < inner; ++j) axpy(d_z[static_cast<std::size_t>(j)], w1t.data() + j * hidden, dx, hidden);
    }
  }

 private:
  //! z = x W1 + b1, before the ReLU.
  void hidden_layer(float const* p, float const* x, float* z) const {
    float const* const b1 = p + hidden * inner;
    std::copy(b1, b1 + inner, z);
    for (std::int64_t i = 0; i < hidden; ++i) axpy(x[i], p + i * inner, z, inner);
  }
};

//! Expert e's parameters (W1, b1, W2, b2): uniform in +-1/sqrt(fan-in) for the weights, +-0.1 for
//! the biases, from a generator of its own (the same values whichever rank or layer copies them).
inline std::vector<float> mlp_initial_parameters(std::uint64_t seed, std::int64_t hidden, std::int64_t inner,
                                                 std::int32_t e) {
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32), 0x5eedu,
                    static_cast<std::uint32_t>(e)};
  std::mt19937_64 rng(seq);
  auto const uniform = [&](std::vector<float>& v, std::int64_t n, double limit) {
    std::uniform_real_distribution<float> u(static_cast<float>(-limit), static_cast<float>(limit));
    for (std::int64_t i = 0; i < n; ++i) v.push_back(u(rng));
  };
  std::vector<float> p;
  uniform(p, hidden * inner, 1.0 / std::sqrt(static_cast<double>(hidden)));  // W1
  uniform(p, inner, 0.1);                                                     // b1
  uniform(p, inner * hidden, 1.0 / std::sqrt(static_cast<double>(inner)));   // W2
  uniform(p, hidden, 0.1);                                                    // b2
  return p;
}

//! A rank's experts `parameters[first .. first + count)` (each expert's initial values, e.g. from
//! `mlp_initial_parameters`) with zeroed gradients: a fresh copy for each layer that trains them.
inline mlp_experts mlp_experts_of(std::int64_t hidden, std::int64_t inner,
                                  std::vector<std::vector<float>> const& parameters, std::int32_t first,
                                  std::int32_t count) {
  mlp_experts m;
  m.hidden = hidden;
  m.inner = inner;
  for (std::int32_t l = first; l < first + count; ++l) {
    auto const& init = parameters[static_cast<std::size_t>(l)];
    m.params.insert(m.params.end(), init.begin(), init.end());
  }
  m.grads.assign(m.params.size(), 0.0f);
  return m;
}

//! A rank's experts in `slots` slots, slot l a copy of expert `expert_of(l)`'s initial values
//! (replicated experts: a placement decides which expert a slot holds), with zeroed gradients.
template <class ExpertOf>
mlp_experts mlp_experts_in_slots(std::int64_t hidden, std::int64_t inner, std::vector<std::vector<float>> const& parameters,
                                 std::int32_t slots, ExpertOf&& expert_of) {
  mlp_experts m;
  m.hidden = hidden;
  m.inner = inner;
  for (std::int32_t l = 0; l < slots; ++l) {
    auto const& init = parameters[static_cast<std::size_t>(expert_of(l))];
    m.params.insert(m.params.end(), init.begin(), init.end());
  }
  m.grads.assign(m.params.size(), 0.0f);
  return m;
}

//! Experts sliced for expert-slicing parallelism (moecomm/patterns/experts.hpp, 3.): slice `part`
//! of `parts` of each expert, cut along I: W1's columns and b1's entries `[part·I/parts, (part+1)·I/parts)`,
//! the same rows of W2, and b2 in slice 0 only. The slices' outputs are partial sums of the expert's.
struct sliced_mlp_experts : mlp_experts {
  std::int32_t part = 0, parts = 1;
  [[nodiscard]] std::int32_t slices() const { return parts; }
  [[nodiscard]] std::int32_t slice() const { return part; }
};

//! A rank's slice `part` of `parts` of experts `[first, first + count)` (each expert's whole
//! initial values, as `mlp_initial_parameters` makes them, of inner width `inner`), zeroed gradients.
inline sliced_mlp_experts sliced_mlp_experts_of(std::int64_t hidden, std::int64_t inner,
                                                std::vector<std::vector<float>> const& parameters, std::int32_t first,
                                                std::int32_t count, std::int32_t part, std::int32_t parts) {
  sliced_mlp_experts m;
  m.hidden = hidden;
  m.inner = inner / parts;
  m.part = part;
  m.parts = parts;
  m.output_bias = part == 0;
  std::int64_t const w = m.inner, begin = part * w;
  for (std::int32_t e = first; e < first + count; ++e) {
    float const* const whole = parameters[static_cast<std::size_t>(e)].data();
    float const* const b1 = whole + hidden * inner;
    float const* const w2 = b1 + inner;
    for (std::int64_t i = 0; i < hidden; ++i)  // W1's columns of the slice, row by row
      m.params.insert(m.params.end(), whole + i * inner + begin, whole + i * inner + begin + w);
    m.params.insert(m.params.end(), b1 + begin, b1 + begin + w);
    m.params.insert(m.params.end(), w2 + begin * hidden, w2 + (begin + w) * hidden);  // W2's rows
    m.params.insert(m.params.end(), w2 + inner * hidden, w2 + inner * hidden + hidden);  // b2
  }
  m.grads.assign(m.params.size(), 0.0f);
  return m;
}

}  // namespace example_support
