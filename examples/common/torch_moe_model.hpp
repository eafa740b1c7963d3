// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 09's libtorch model, one template for moecomm's MoE (per rank) and for the dense
//! single-process reference: token embedding -> blocks (x += MLP(x), then x += MoE(x)) -> a linear
//! head over the vocabulary; the sizes it is built from, and the initial parameters every copy of
//! it starts from.

#include "training_options.hpp"

#include <moecomm/torch/moe_module.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace example_support {

using moecomm::libtorch::mlp_expert;

//! The model's sizes and losses: the training's, and its blocks, vocabulary and z-loss weight.
struct torch_model_options : training_options {
  std::int32_t blocks = 2;
  std::int64_t vocab = 64;
  double z = 1e-3;  //!< the router's z loss coefficient
};

// The dense reference of one MoE: the router's rule in torch ops (top-K of the logits, softmax over
// the K; Megatron's aux loss and z loss per rank's tokens, as each rank's router computes them) and
// every expert on its tokens.
struct dense_moe : torch::nn::Module {
  dense_moe(torch_model_options const& o, at::Tensor const& weights) : o_(o), mlp_{o.hidden, o.inner} {
    experts = register_parameter("experts", weights.clone());
  }

  at::Tensor forward(at::Tensor const& x, at::Tensor const& logits) {
    auto const [values, idx] = logits.topk(o_.topk, 1);
    at::Tensor const w = values.softmax(1);
    at::Tensor y = at::zeros_like(x);
    for (std::int32_t e = 0; e < o_.experts; ++e) {
      at::Tensor const hit = idx.eq(e);  // [T][K]
      at::Tensor const rows = hit.any(1).nonzero().squeeze(1);
      if (rows.numel() == 0) continue;
      at::Tensor const weight = (w * hit).sum(1).index_select(0, rows).unsqueeze(1);
      y = y.index_add(0, rows, mlp_(experts[e], x.index_select(0, rows)) * weight);
    }
    aux_and_z = at::zeros({}, at::kFloat);
    std::int64_t const T = o_.tokens;
    for (std::int64_t r = 0; r * T < logits.size(0); ++r) {
      at::Tensor const l = logits.narrow(0, r * T, T);
      at::Tensor const c = at::one_hot(idx.narrow(0, r * T, T).to(at::kLong), o_.experts).sum(at::IntArrayRef{0, 1}).to(at::kFloat);
      double const scale = o_.aux * o_.experts / (o_.topk * static_cast<double>(T) * static_cast<double>(T));
      aux_and_z = aux_and_z + scale * (l.softmax(1).sum(0) * c).sum() + o_.z * l.logsumexp(1).pow(2).mean();
    }
    return y;
  }

  at::Tensor experts, aux_and_z;
  torch_model_options o_;
  mlp_expert mlp_;
};

template <class Moe>
struct block : torch::nn::Module {
  block(torch_model_options const& o, std::shared_ptr<Moe> m)
      : up(register_module("up", torch::nn::Linear(o.hidden, o.inner))),
        down(register_module("down", torch::nn::Linear(o.inner, o.hidden))),
        gate(register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(o.hidden, o.experts).bias(false)))),
        moe(register_module("moe", std::move(m))) {}

  at::Tensor forward(at::Tensor x) {
    x = x + down(at::relu(up(x)));
    return x + moe->forward(x, gate(x));
  }

  torch::nn::Linear up, down, gate;
  std::shared_ptr<Moe> moe;
};

template <class Moe>
struct model : torch::nn::Module {
  // make_moe(b): block b's MoE.
  template <class MakeMoe>
  model(torch_model_options const& o, MakeMoe&& make_moe)
      : embed(register_module("embed", torch::nn::Embedding(o.vocab, o.hidden))),
        head(register_module("head", torch::nn::Linear(o.hidden, o.vocab))) {
    for (std::int32_t b = 0; b < o.blocks; ++b)
      blocks.push_back(register_module("block" + std::to_string(b), std::make_shared<block<Moe>>(o, make_moe(b))));
  }

  at::Tensor forward(at::Tensor const& tokens) {
    at::Tensor x = embed(tokens);
    for (auto& b : blocks) x = b->forward(x);
    return head(x);
  }

  torch::nn::Embedding embed;
  torch::nn::Linear head;
  std::vector<std::shared_ptr<block<Moe>>> blocks;
};

// The initial parameters, drawn once (seeded) and copied into every model: name -> tensor, and
// per block the [E][P] expert parameters.
struct initial_parameters {
  std::vector<std::pair<std::string, at::Tensor>> dense;
  std::vector<at::Tensor> experts;
};

inline initial_parameters draw_initial(torch_model_options const& o) {
  torch::manual_seed(static_cast<uint64_t>(o.seed));
  mlp_expert const mlp{o.hidden, o.inner};
  initial_parameters init;
  for (std::int32_t b = 0; b < o.blocks; ++b) init.experts.push_back(at::randn({o.experts, mlp.parameter_count()}) * 0.15);
  model<dense_moe> shape(o, [&](std::int32_t b) { return std::make_shared<dense_moe>(o, init.experts[static_cast<std::size_t>(b)]); });
  for (auto const& p : shape.named_parameters())
    if (p.key().find("moe.experts") == std::string::npos) init.dense.emplace_back(p.key(), p.value().detach().clone());
  return init;
}

template <class M>
void load_dense(M& m, initial_parameters const& init) {
  torch::NoGradGuard const no_grad;
  auto params = m.named_parameters();
  for (auto const& [name, value] : init.dense) params[name].copy_(value);
}

}  // namespace example_support
