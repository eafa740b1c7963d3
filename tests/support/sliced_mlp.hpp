// SPDX-License-Identifier: Apache-2.0
#pragma once
// Sliced experts for tests (patterns/experts.hpp, 3.): MLPs H -> F -> H with ReLU, of which this
// holds slice s of N, cut along F: W1[:, F_s], b1[F_s], W2[F_s, :], and b2 (added by slice 0 only).
// With N = 1 it is the unsliced expert. Rows of T, parameters in fp32; every product and sum in
// fp32 in a fixed order, so with dyadic values (exact arithmetic) the slices' partial outputs sum
// to the unsliced output bit for bit.

#include "oracle.hpp"

#include <moecomm/core/matrix.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace test {

template <class T>
struct sliced_mlp_experts {
  std::int64_t hidden = 0, inner = 0;  // H, and F of the whole expert
  std::int32_t part = 0, parts = 1;    // slice `part` of `parts`
  std::vector<float> params, grads;    // [local][parameter_count()]

  [[nodiscard]] std::int32_t slices() const { return parts; }
  [[nodiscard]] std::int32_t slice() const { return part; }
  [[nodiscard]] std::int64_t width() const { return inner / parts; }  // F / N
  //! W1 [H][F/N], b1 [F/N], W2 [F/N][H], b2 [H].
  [[nodiscard]] std::int64_t parameter_count() const { return 2 * hidden * width() + width() + hidden; }
  float* parameters(std::int32_t l) { return params.data() + l * parameter_count(); }
  float* gradients(std::int32_t l) { return grads.data() + l * parameter_count(); }

  //! This slice's hidden activations of one row: relu(x W1_s + b1_s), before and after the ReLU.
  void hidden_layer(float const* p, T const* x, float* pre) const {
    std::int64_t const w = width();
    for (std::int64_t j = 0; j < w; ++j) {
      float acc = p[hidden * w + j];  // b1
      for (std::int64_t i = 0; i < hidden; ++i) acc += oracle::f32(x[i]) * p[i * w + j];
      pre[j] = acc;
    }
  }

  void forward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out) const {
    std::int64_t const w = width();
    float const* const w2 = p + hidden * w + w;
    float const* const b2 = w2 + w * hidden;
    std::vector<float> pre(static_cast<std::size_t>(w));
    for (std::int64_t r = 0; r < in.rows; ++r) {
      hidden_layer(p, in.row(r), pre.data());
      for (std::int64_t h = 0; h < hidden; ++h) {
        float acc = part == 0 ? b2[h] : 0.0f;
        for (std::int64_t j = 0; j < w; ++j) acc += std::max(pre[static_cast<std::size_t>(j)], 0.0f) * w2[j * hidden + h];
        out.row(r)[h] = oracle::from32<T>(acc);
      }
    }
  }

  void backward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T const> d_out,
                moecomm::matrix_view<T> d_in, float* d_p) const {
    std::int64_t const w = width();
    float const* const w2 = p + hidden * w + w;
    float* const dw1 = d_p;
    float* const db1 = dw1 + hidden * w;
    float* const dw2 = db1 + w;
    float* const db2 = dw2 + w * hidden;
    std::vector<float> pre(static_cast<std::size_t>(w)), d_pre(static_cast<std::size_t>(w));
    for (std::int64_t r = 0; r < in.rows; ++r) {
      T const* const x = in.row(r);
      T const* const g = d_out.row(r);
      hidden_layer(p, x, pre.data());
      for (std::int64_t j = 0; j < w; ++j) {
        float const a = std::max(pre[static_cast<std::size_t>(j)], 0.0f);
        float acc = 0.0f;
        for (std::int64_t h = 0; h < hidden; ++h) {
          acc += oracle::f32(g[h]) * w2[j * hidden + h];
          dw2[j * hidden + h] += a * oracle::f32(g[h]);
        }
        d_pre[static_cast<std::size_t>(j)] = pre[static_cast<std::size_t>(j)] > 0.0f ? acc : 0.0f;
        db1[j] += d_pre[static_cast<std::size_t>(j)];
      }
      if (part == 0)
        for (std::int64_t h = 0; h < hidden; ++h) db2[h] += oracle::f32(g[h]);
      for (std::int64_t i = 0; i < hidden; ++i) {
        float acc = 0.0f;
        for (std::int64_t j = 0; j < w; ++j) {
          acc += d_pre[static_cast<std::size_t>(j)] * p[i * w + j];
          dw1[i * w + j] += oracle::f32(x[i]) * d_pre[static_cast<std::size_t>(j)];
        }
        d_in.row(r)[i] = oracle::from32<T>(acc);
      }
    }
  }
};

// Slice `part` of `parts` of one unsliced expert's parameters (a sliced_mlp_experts with parts = 1).
inline std::vector<float> slice_parameters(std::vector<float> const& full, std::int64_t hidden, std::int64_t inner,
                                           std::int32_t part, std::int32_t parts) {
  std::int64_t const w = inner / parts, first = part * w;
  std::vector<float> s;
  for (std::int64_t i = 0; i < hidden; ++i)
    for (std::int64_t j = 0; j < w; ++j) s.push_back(full[static_cast<std::size_t>(i * inner + first + j)]);  // W1
  for (std::int64_t j = 0; j < w; ++j) s.push_back(full[static_cast<std::size_t>(hidden * inner + first + j)]);  // b1
  for (std::int64_t j = 0; j < w; ++j)
    for (std::int64_t h = 0; h < hidden; ++h)
      s.push_back(full[static_cast<std::size_t>(hidden * inner + inner + (first + j) * hidden + h)]);  // W2
  for (std::int64_t h = 0; h < hidden; ++h) s.push_back(full[static_cast<std::size_t>(2 * hidden * inner + inner + h)]);  // b2
  return s;
}

}  // namespace test
