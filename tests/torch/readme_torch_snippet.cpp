// SPDX-License-Identifier: Apache-2.0
// The README's libtorch snippet (region readme-torch), compiled and run: a few Adam steps of a
// gate (replicated, its gradient summed over the ranks) + FasterMoE layer on 2 in-process ranks; the
// loss must fall. torch.docs.readme_torch_snippet_in_sync
// checks that README.md holds the same lines.

#include "torch_doctest.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/torch/moe_module.hpp>

#include <memory>
#include <vector>

TEST_CASE("readme torch snippet runs, and its loss falls") {
  std::vector<std::vector<float>> losses(2);
  // example-begin readme-torch
  moecomm::inproc_world const world(/*ranks=*/2);  // or a torch.distributed world: moecomm/torch/launch.hpp
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(2, /*ranks_per_node=*/2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/4,
                                                            /*hidden=*/8, moecomm::fastermoe_shadowing<>{});
    moecomm::router_config router;  // Megatron-LM's TopKRouter: top-k of the logits, softmax over the k
    router.top_k = 2;
    router.aux_loss_coeff = 1e-2f;  // its gradient enters the logits' in the backward
    moecomm::libtorch::mlp_expert const mlp{/*hidden=*/8, /*inner=*/16};
    torch::manual_seed(0);  // the gate is replicated: the same on every rank
    torch::nn::Linear gate(torch::nn::LinearOptions(8, 4).bias(false));
    torch::manual_seed(1 + comm.rank());  // this rank's 2 experts and tokens
    auto moe = std::make_shared<moecomm::libtorch::moe_module<decltype(layer), moecomm::libtorch::mlp_expert>>(
        std::move(layer), mlp, torch::randn({2, mlp.parameter_count()}) * 0.3, router);
    std::vector<torch::Tensor> trained = moe->parameters();
    trained.push_back(gate->weight);
    torch::optim::Adam adam(trained, torch::optim::AdamOptions(1e-2));
    torch::Tensor const x = torch::randn({16, 8}), target = torch::randn({16, 8});
    for (int step = 0; step < 20; ++step) {
      adam.zero_grad();
      torch::Tensor const loss = (moe->forward(x, gate(x)) - target).pow(2).mean();
      loss.backward();  // collective: every rank backpropagates its layer's output
      torch::Tensor const g = gate->weight.grad();  // the gate's gradient, summed over the ranks
      comm.allreduce(g.data_ptr<float>(), g.data_ptr<float>(), g.numel(), moecomm::reduce_op::sum);
      adam.step();
      losses[comm.rank()].push_back(loss.item<float>());
    }
  });
  // example-end readme-torch
  for (auto const& l : losses) CHECK(l.back() < 0.8f * l.front());
}
