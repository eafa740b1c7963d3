// SPDX-License-Identifier: Apache-2.0
#pragma once
// Sliced experts for tests (patterns/experts.hpp, 3.): MLPs H -> F -> H with ReLU, of which this
// holds slice s of N, cut along F: W1[:, F_s], b1[F_s], W2[F_s, :], and b2 (added by slice 0 only).
// With N = 1 it is the unsliced expert. Rows of T, parameters in fp32; every product and sum in
// fp32 in a fixed order, so with dyadic values (exact arithmetic) the slices' partial outputs sum
// to the unsliced output bit for bit.

#include "oracle.hpp"

#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace test {

//! One slice's arithmetic on rows, as kernels over an index space (the host loops over them; a
//! device back-end launches them), so that every back-end computes the same bits.
inline constexpr std::int64_t sliced_mlp_max_width = 64;

template <class T>
struct sliced_mlp_slice {
  std::int64_t hidden = 0, width = 0;  // H, and F / N
  bool adds_b2 = true;                 // slice 0 adds b2

  MOECOMM_HOST_DEVICE static float relu(float v) { return v < 0.0f ? 0.0f : v; }  // std::max(v, 0.0f)
  //! relu's input for row `x`: x W1_s + b1_s.
  MOECOMM_HOST_DEVICE void hidden_layer(float const* p, T const* x, float* pre) const {
    for (std::int64_t j = 0; j < width; ++j) {
      float acc = p[hidden * width + j];  // b1
      for (std::int64_t i = 0; i < hidden; ++i) acc += moecomm::dtype_traits<T>::to_float(x[i]) * p[i * width + j];
      pre[j] = acc;
    }
  }
  //! The hidden layer's gradient for row `x` with output gradient `g`.
  MOECOMM_HOST_DEVICE void hidden_gradient(float const* p, float const* pre, T const* g, float* d_pre) const {
    float const* const w2 = p + hidden * width + width;
    for (std::int64_t j = 0; j < width; ++j) {
      float acc = 0.0f;
      for (std::int64_t h = 0; h < hidden; ++h) acc += moecomm::dtype_traits<T>::to_float(g[h]) * w2[j * hidden + h];
      d_pre[j] = pre[j] > 0.0f ? acc : 0.0f;
    }
  }
};

template <class T>
struct sliced_mlp_forward_kernel {  // over rows
  sliced_mlp_slice<T> s;
  float const* p;
  T const* in;
  T* out;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    float pre[sliced_mlp_max_width];
    s.hidden_layer(p, in + r * s.hidden, pre);
    float const* const w2 = p + s.hidden * s.width + s.width;
    float const* const b2 = w2 + s.width * s.hidden;
    for (std::int64_t h = 0; h < s.hidden; ++h) {
      float acc = s.adds_b2 ? b2[h] : 0.0f;
      for (std::int64_t j = 0; j < s.width; ++j) acc += s.relu(pre[j]) * w2[j * s.hidden + h];
      out[r * s.hidden + h] = moecomm::dtype_traits<T>::from_float(acc);
    }
  }
};

template <class T>
struct sliced_mlp_input_grad_kernel {  // over rows
  sliced_mlp_slice<T> s;
  float const* p;
  T const* in;
  T const* d_out;
  T* d_in;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    float pre[sliced_mlp_max_width], d_pre[sliced_mlp_max_width];
    s.hidden_layer(p, in + r * s.hidden, pre);
    s.hidden_gradient(p, pre, d_out + r * s.hidden, d_pre);
    for (std::int64_t i = 0; i < s.hidden; ++i) {
      float acc = 0.0f;
      for (std::int64_t j = 0; j < s.width; ++j) acc += d_pre[j] * p[i * s.width + j];
      d_in[r * s.hidden + i] = moecomm::dtype_traits<T>::from_float(acc);
    }
  }
};

template <class T>
struct sliced_mlp_param_grad_kernel {  // over parameters: each adds its rows' terms in ascending row
  sliced_mlp_slice<T> s;
  float const* p;
  T const* in;
  T const* d_out;
  std::int64_t rows;
  float* d_p;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t q) const {
    std::int64_t const H = s.hidden, w = s.width;
    float pre[sliced_mlp_max_width], d_pre[sliced_mlp_max_width];
    for (std::int64_t r = 0; r < rows; ++r) {
      T const* const x = in + r * H;
      T const* const g = d_out + r * H;
      if (q >= H * w + w + w * H) {  // b2
        if (s.adds_b2) d_p[q] += moecomm::dtype_traits<T>::to_float(g[q - (H * w + w + w * H)]);
        continue;
      }
      s.hidden_layer(p, x, pre);
      if (q >= H * w + w) {  // W2[j][h]
        std::int64_t const j = (q - H * w - w) / H, h = (q - H * w - w) % H;
        d_p[q] += s.relu(pre[j]) * moecomm::dtype_traits<T>::to_float(g[h]);
        continue;
      }
      s.hidden_gradient(p, pre, g, d_pre);
      if (q >= H * w) d_p[q] += d_pre[q - H * w];  // b1[j]
      else d_p[q] += moecomm::dtype_traits<T>::to_float(x[q / w]) * d_pre[q % w];  // W1[i][j]
    }
  }
};

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
  [[nodiscard]] sliced_mlp_slice<T> arithmetic() const { return {hidden, width(), part == 0}; }

  //! This slice's hidden activations of one row: relu(x W1_s + b1_s), before the ReLU.
  void hidden_layer(float const* p, T const* x, float* pre) const { arithmetic().hidden_layer(p, x, pre); }

  void forward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out) const {
    sliced_mlp_forward_kernel<T> const k{arithmetic(), p, in.data, out.data};
    for (std::int64_t r = 0; r < in.rows; ++r) k(r);
  }

  void backward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T const> d_out,
                moecomm::matrix_view<T> d_in, float* d_p) const {
    sliced_mlp_input_grad_kernel<T> const d{arithmetic(), p, in.data, d_out.data, d_in.data};
    for (std::int64_t r = 0; r < in.rows; ++r) d(r);
    sliced_mlp_param_grad_kernel<T> const g{arithmetic(), p, in.data, d_out.data, in.rows, d_p};
    for (std::int64_t q = 0; q < parameter_count(); ++q) g(q);
  }
};

//! `sliced_mlp_experts` whose parameters and gradients live in a back-end's memory and whose
//! arithmetic runs as that back-end's kernels (the same functors): the experts of the layer tests
//! on any back-end, a GPU's included.
template <class T, class Backend>
struct backend_sliced_mlp_experts {
  Backend be;
  sliced_mlp_experts<T> shape;  //!< its host parameters are the initial ones
  typename Backend::template buffer_type<float> params, grads;

  backend_sliced_mlp_experts(Backend const& b, sliced_mlp_experts<T> const& host)
      : be(b), shape(host), params(upload_floats(b, host.params)), grads(upload_floats(b, host.grads)) {}
  [[nodiscard]] std::int32_t slices() const { return shape.parts; }
  [[nodiscard]] std::int32_t slice() const { return shape.part; }
  [[nodiscard]] std::int64_t parameter_count() const { return shape.parameter_count(); }
  float* parameters(std::int32_t l) { return params.data() + l * parameter_count(); }
  float* gradients(std::int32_t l) { return grads.data() + l * parameter_count(); }
  // On the back-end the layer gives each call (its own, or a lane's).
  void forward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out, Backend const& on) const {
    on.for_each_index(in.rows, sliced_mlp_forward_kernel<T>{shape.arithmetic(), p, in.data, out.data});
  }
  void backward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T const> d_out,
                moecomm::matrix_view<T> d_in, float* d_p, Backend const& on) const {
    on.for_each_index(in.rows, sliced_mlp_input_grad_kernel<T>{shape.arithmetic(), p, in.data, d_out.data, d_in.data});
    on.for_each_index(parameter_count(), sliced_mlp_param_grad_kernel<T>{shape.arithmetic(), p, in.data, d_out.data, in.rows, d_p});
  }
  [[nodiscard]] std::vector<float> gradients_on_host() const {
    std::vector<float> host(static_cast<std::size_t>(grads.size()));
    be.copy(host.data(), grads.data(), grads.size());
    be.synchronize();
    return host;
  }

 private:
  static typename Backend::template buffer_type<float> upload_floats(Backend const& b, std::vector<float> const& v) {
    auto buf = b.template allocate<float>(static_cast<std::int64_t>(v.size()));
    b.copy(buf.data(), v.data(), static_cast<std::int64_t>(v.size()));
    b.synchronize();
    return buf;
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
