// SPDX-License-Identifier: Apache-2.0
// The installed torch component: a moe_module on 2 in-process ranks, one step forward and backward,
// with nothing but the installed headers and libtorch.

#include <moecomm/moecomm.hpp>
#include <moecomm/torch/moe_module.hpp>

#include <cstdio>
#include <memory>

int main() {
  int ok = 0;
  moecomm::inproc_world const world(2);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(2, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 2, 4);
    moecomm::libtorch::mlp_expert const mlp{4, 8};
    moecomm::router_config router;
    router.top_k = 2;
    auto moe = std::make_shared<moecomm::libtorch::moe_module<decltype(layer), moecomm::libtorch::mlp_expert>>(
        std::move(layer), mlp, torch::ones({1, mlp.parameter_count()}) * 0.1, router);
    torch::Tensor const x = torch::ones({3, 4}), logits = torch::zeros({3, 2});
    moe->forward(x, logits).sum().backward();
    if (comm.rank() == 0 && moe->experts().weights().grad().defined()) ok = 1;
  });
  std::printf("consumer: moe_module trained one step: %s\n", ok ? "yes" : "no");
  return ok ? 0 : 1;
}
