// SPDX-License-Identifier: Apache-2.0
#pragma once
// The token dispatcher of any exchange and capacity policy behind one interface, for Python, on the
// host (bindings.cpp) or on CUDA (cuda_layers.cu).

#include "capacity_spec.hpp"

#include <torch/extension.h>

#include <moecomm/comm/communicator.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/torch/token_dispatcher.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace moecomm_python {

class dispatcher_handle {
 public:
  virtual ~dispatcher_handle() = default;
  virtual std::vector<at::Tensor> dispatch(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) = 0;
  virtual at::Tensor combine(at::Tensor const& rows, at::Tensor const& topk_weights) = 0;
};

template <class Backend, class Comm, class Capacity, class Algorithm>
class dispatcher_of final : public dispatcher_handle {
 public:
  dispatcher_of(Backend be, Comm comm, std::int32_t ranks_per_node, std::int32_t num_experts, Capacity capacity,
                moecomm::routing_checks checks)
      : comm_(std::move(comm)),
        groups_(comm_, moecomm::topology(comm_.size(), ranks_per_node)),
        dispatcher_(std::move(be), groups_, num_experts, capacity, Algorithm{}, checks) {}

  std::vector<at::Tensor> dispatch(at::Tensor const& x, at::Tensor const& topk_idx, at::Tensor const& topk_weights) override {
    return dispatcher_.dispatch(x, topk_idx, topk_weights);
  }
  at::Tensor combine(at::Tensor const& rows, at::Tensor const& topk_weights) override {
    return dispatcher_.combine(rows, topk_weights);
  }

 private:
  Comm comm_;
  moecomm::exchange_groups<Comm> groups_;
  moecomm::libtorch::token_dispatcher<Backend, Comm, Capacity, Algorithm> dispatcher_;
};

// Throws unless `exchange` names one the dispatcher has.
inline void require_exchange(std::string const& exchange, char const* op) {
  moecomm::detail::require(exchange == "flat" || exchange == "hierarchical" || exchange == "dedup", op, "exchange = '", exchange,
                           "' is not one of flat, hierarchical, dedup");
}

// The dispatcher of `exchange` (require_exchange) with the capacity policy `capacity` names, on `be`
// over `comm`, once every rank agrees on both. Collective.
template <class Backend, class Comm>
std::unique_ptr<dispatcher_handle> make_dispatcher_of(std::string const& exchange, Backend be, Comm comm, std::int32_t ranks_per_node,
                                                      std::int32_t num_experts, capacity_spec const& capacity,
                                                      moecomm::routing_checks checks, char const* op) {
  std::vector<std::int64_t> agreed;
  moecomm::detail::agree_on_text(comm, op, "on the exchange", exchange, agreed);
  moecomm::detail::agree_on_text(comm, op, "on the drop policy", capacity.drop, agreed);
  return with_capacity(capacity, op, [&](auto policy) -> std::unique_ptr<dispatcher_handle> {
    using capacity_t = decltype(policy);
    auto make = [&](auto algorithm) -> std::unique_ptr<dispatcher_handle> {
      return std::make_unique<dispatcher_of<Backend, Comm, capacity_t, decltype(algorithm)>>(std::move(be), std::move(comm),
                                                                                             ranks_per_node, num_experts, policy,
                                                                                             checks);
    };
    if (exchange == "flat") return make(moecomm::flat{});
    if (exchange == "hierarchical") return make(moecomm::hierarchical_2d{});
    return make(moecomm::dedup_per_rank<moecomm::flat>{});
  });
}

}  // namespace moecomm_python
