// SPDX-License-Identifier: Apache-2.0
//! Example 09: a libtorch model with moecomm's MoE layer, trained with torch::optim::Adam.
//!
//! The model: token embedding -> `blocks` blocks -> a linear head over the vocabulary. Each block is
//! x += MLP(x) (dense, torch::nn::Linear) then x += MoE(x), the MoE being a gate (a Linear to E logits),
//! moecomm's router (top-K, aux and z losses) and E expert MLPs, expert parallel over R ranks
//! (`moecomm::libtorch::moe_module`: the router and the layer are autograd functions, so
//! `loss.backward()` runs everything). The task: predict a fixed random successor of each token;
//! tokens are Zipf distributed, so a few experts are hot.
//!
//! The same training runs with plain expert parallelism, FasterMoE's shadowing and FineMoE's
//! replicated experts (`--pattern`), on in-process ranks (threads, the default) or one rank per
//! process: `--processes 4` starts 4 copies of this program with torchrun's environment, and
//! `torchrun --no-python --nproc-per-node 4 example_09_torch` works alike (Gloo over a TCPStore,
//! `moecomm::c10d_communicator`). The dense parameters are replicated: their gradients are summed over
//! the ranks by `ordered_allreduce`. It is checked against a single-process dense libtorch model
//! of the same MoE (the same routing rule in torch ops, every expert on every token, autograd for
//! the gradients) started from the same parameters: the loss curves must agree within --tolerance.
//!
//! Run with --help for the flags.

#include "../common/flags.hpp"
#include "../common/format.hpp"
#include "../common/torch_moe_model.hpp"
#include "../common/torch_training_report.hpp"
#include "../common/training_options.hpp"
#include "../common/zipf_successor_task.hpp"

#include <moecomm/comm/c10d.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/torch/launch.hpp>
#include <moecomm/torch/moe_module.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace example_support;
using moecomm::libtorch::mlp_expert;
using std::int32_t;
using std::int64_t;

struct options : torch_model_options {
  // ranks, experts, top-k, tokens, hidden, inner, steps, every, lr, aux, tolerance, seed | blocks, vocab, z
  options() : torch_model_options{{4, 8, 2, 128, 32, 64, 60, 10, 1e-3, 1e-2, 1e-4, 1}, 2, 64, 1e-3} {}
  int processes = 0;
  bool unchecked = false;  // the c10d communicator without its checked mode (processes only)
  std::string pattern = "all";
};

options parse(int argc, char** argv) {
  options o;
  char const* program = "example_09_torch";
  flag_set flags(program,
                 "%s [flags]\n"
                 "       torchrun --no-python --nproc-per-node N %s [flags]",
                 "A libtorch model (embedding, blocks of MLP + MoE, head) trained with Adam, the MoE layer being\n"
                 "moecomm's, expert parallel over in-process ranks or processes; checked against a dense model.");
  flags.add("--pattern", "P", "plain, fastermoe, finemoe or all", o.pattern, {"plain", "fastermoe", "finemoe", "all"})
      .add("--processes", "N",
           "one rank per process: start N copies of this program (torchrun's environment);\n"
           "under torchrun (RANK set) the world is the launcher's; without either, the\n"
           "ranks are threads",
           o.processes, 1, 64)
      .add("--ranks", "R", "in-process ranks", o.ranks, 1, 64)
      .add("--experts", "E", "experts per MoE layer; a multiple of R", o.experts, 1, 1024)
      .add("--topk", "K", "experts per token", o.topk, 1, 8)
      .add("--blocks", "N", "blocks", o.blocks, 1, 16)
      .add("--tokens", "T", "tokens per rank and step", o.tokens, 1, 1 << 20)
      .add("--hidden", "H", "model width", o.hidden, 1, 4096)
      .add("--inner", "F", "hidden width of the MLPs and the experts, H -> F -> H", o.inner, 1, 16384)
      .add("--vocab", "V", "vocabulary size", o.vocab, 2, 1 << 20);
  add_step_flags(flags, o, "Adam steps", "Adam's learning rate", 10.0)
      .add("--aux", "X", "the router's aux loss coefficient", o.aux, 0.0, 10.0)
      .add("--z", "X", "the router's z loss coefficient", o.z, 0.0, 10.0)
      .add("--tolerance", "X", "largest |loss - dense loss| / dense loss allowed", o.tolerance, 0.0, 1.0)
      .add_switch("--unchecked", "with processes: the c10d communicator without its checked mode (no agreement per call)",
                  o.unchecked)
      .add("--seed", "N", "seed of the data and the initial parameters", o.seed, 0, INT64_MAX);
  flags.parse(argc, argv);
  if (o.topk > o.experts) usage_error(program, "--topk must not exceed --experts");
  return o;
}

// ---- training -------------------------------------------------------------------------------

curve train_dense(options const& o, initial_parameters const& init) {
  int32_t const R = o.ranks;
  model<dense_moe> m(o, [&](int32_t b) { return std::make_shared<dense_moe>(o, init.experts[static_cast<std::size_t>(b)]); });
  load_dense(m, init);
  torch::optim::Adam adam(m.parameters(), torch::optim::AdamOptions(o.lr));
  curve c;
  c.name = "dense";
  auto const start = std::chrono::steady_clock::now();
  for (int step = 0; step < o.steps; ++step) {
    std::vector<at::Tensor> tokens, targets;
    for (int r = 0; r < R; ++r) {
      batch const b = make_batch(o, r, step);
      tokens.push_back(b.tokens);
      targets.push_back(b.targets);
    }
    adam.zero_grad();
    at::Tensor const ce = torch::nn::functional::cross_entropy(m.forward(at::cat(tokens)), at::cat(targets));
    at::Tensor loss = ce;
    for (auto& b : m.blocks) loss = loss + b->moe->aux_and_z;
    loss.backward();
    adam.step();
    c.loss.push_back(ce.item<double>());
  }
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return c;
}

template <class Layer, class = void>
struct shadows : std::false_type {};
template <class Layer>
struct shadows<Layer, std::void_t<decltype(std::declval<Layer const&>().shadow_state().decision())>> : std::true_type {};

template <class Layer>
using moe_of = moecomm::libtorch::moe_module<Layer, mlp_expert>;

// One rank's training with the layers `make_layer()` makes; `expert_at(l)` is the global expert
// local slot l holds. Returns the curve (every rank's the same).
template <class Comm, class MakeLayer, class ExpertAt>
curve train_rank(options const& o, std::string const& name, Comm& comm, initial_parameters const& init, MakeLayer&& make_layer,
                 ExpertAt&& expert_at, int32_t slots) {
  using layer_t = decltype(make_layer());
  moecomm::router_config router;
  router.top_k = o.topk;
  router.aux_loss_coeff = static_cast<float>(o.aux);
  router.z_loss_coeff = static_cast<float>(o.z);
  model<moe_of<layer_t>> m(o, [&](int32_t b) {
    std::vector<at::Tensor> rows;
    for (int32_t l = 0; l < slots; ++l) rows.push_back(init.experts[static_cast<std::size_t>(b)][expert_at(l)]);
    return std::make_shared<moe_of<layer_t>>(make_layer(), mlp_expert{o.hidden, o.inner}, at::stack(rows), router);
  });
  load_dense(m, init);
  torch::optim::Adam adam(m.parameters(), torch::optim::AdamOptions(o.lr));
  moecomm::host_backend const be;
  moecomm::workspace<moecomm::host_backend> scratch;
  curve c;
  c.name = name;
  double const scale = 1.0 / static_cast<double>(comm.size());  // each rank's share of the global mean
  auto const start = std::chrono::steady_clock::now();
  for (int step = 0; step < o.steps; ++step) {
    batch const b = make_batch(o, comm.rank(), step);
    adam.zero_grad();
    at::Tensor const ce = torch::nn::functional::cross_entropy(m.forward(b.tokens), b.targets) * scale;
    ce.backward();
    for (auto const& p : m.named_parameters())  // the replicated parameters: the sum over the ranks
      if (p.key().find("moe.experts") == std::string::npos)
        moecomm::ordered_allreduce(be, comm, moecomm::libtorch::array_of<float>(p.value().grad(), p.key().c_str(), "gradient sum"),
                                   scratch);
    adam.step();
    double loss = ce.item<double>();
    moecomm::ordered_allreduce(be, comm, moecomm::array_view<double>(&loss, 1), scratch);
    c.loss.push_back(loss);
    if (step == 0 || step == o.steps - 1) {
      at::Tensor const idx = m.blocks[0]->moe->topk_idx();
      at::Tensor const mine = at::bincount(idx.flatten().to(at::kLong), {}, o.experts);
      std::vector<std::int64_t> load(mine.data_ptr<std::int64_t>(), mine.data_ptr<std::int64_t>() + o.experts);
      comm.allreduce(load.data(), load.data(), o.experts, moecomm::reduce_op::sum);
      (step == 0 ? c.first_load : c.last_load) = load;
    }
    if constexpr (shadows<layer_t>::value)
      c.shadowed.push_back(m.blocks[0]->moe->layer().shadow_state().decision().shadowed);
  }
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return c;
}

// The patterns, each on this rank's communicator.
template <class Comm>
std::vector<curve> train_patterns(options const& o, Comm& comm, initial_parameters const& init) {
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(comm.size(), comm.size() % 2 == 0 ? 2 : 1));
  int32_t const L = o.experts / comm.size(), first = comm.rank() * L;
  auto const own = [&](int32_t l) { return first + l; };
  moecomm::host_backend const be;
  std::vector<curve> curves;
  if (o.pattern == "plain" || o.pattern == "all")
    curves.push_back(train_rank(o, "plain", comm, init,
                                [&] { return moecomm::make_expert_parallel_layer<float>(be, groups, o.experts, o.hidden); },
                                own, L));
  if (o.pattern == "fastermoe" || o.pattern == "all") {
    moecomm::fastermoe_cost_params model;  // shadow an expert when its tokens cost more to send than its weights
    model.hidden = o.hidden;
    model.alpha = static_cast<double>(o.inner) / static_cast<double>(o.hidden);
    model.gemm_flops = 1e9;
    model.net_bandwidth = model.local_bandwidth = 1e9;
    curves.push_back(train_rank(o, "fastermoe", comm, init, [&] {
      return moecomm::make_expert_parallel_layer<float>(be, groups, o.experts, o.hidden, moecomm::fastermoe_shadowing<>{model});
    }, own, L));
  }
  if (o.pattern == "finemoe" || o.pattern == "all") {
    // Every expert on two ranks (FineMoE's symmetric placement): 2 E / R slots per rank.
    auto const placement = moecomm::replica_placement::cyclic(comm.size(), 2 * L, 2);
    curves.push_back(train_rank(o, "finemoe", comm, init, [&] {
      return moecomm::make_expert_parallel_layer<float>(be, groups, o.experts, o.hidden, moecomm::finemoe{placement});
    }, [&](int32_t l) { return placement.expert_at(comm.rank(), l); }, 2 * L));
  }
  return curves;
}

}  // namespace

int main(int argc, char** argv) {
  options o = parse(argc, argv);
  at::set_num_threads(1);  // ranks are threads or processes already
  if (o.processes > 0) {  // the launcher: its copies do the work
    std::vector<std::string> args;
    for (int i = 1; i < argc; ++i) {
      std::string const a = argv[i];
      if (a == "--processes") ++i;
      else if (a.rfind("--processes=", 0) != 0) args.push_back(a);
    }
    return moecomm::libtorch::spawn_local_processes(o.processes, args, std::chrono::seconds(600));
  }
  try {
    if (auto const env = moecomm::libtorch::launch_environment::from_env()) {  // one rank of a world
      o.ranks = env->size;
      if (o.experts % o.ranks != 0) usage_error("example_09_torch", "--experts must be a multiple of the world size");
      auto const store = moecomm::libtorch::connect_store(*env, std::chrono::seconds(120));
      moecomm::c10d_options checks;
      checks.check_collectives = !o.unchecked;
      moecomm::c10d_communicator comm = moecomm::libtorch::gloo_communicator(store, env->rank, env->size, checks);
      initial_parameters const init = draw_initial(o);
      std::vector<curve> const curves = train_patterns(o, comm, init);
      if (env->rank != 0) return 0;
      return report(o, train_dense(o, init), curves, o.ranks, o.unchecked ? "processes, Gloo, unchecked" : "processes, Gloo");
    }
    if (o.experts % o.ranks != 0) usage_error("example_09_torch", "--experts must be a multiple of --ranks");
    initial_parameters const init = draw_initial(o);
    std::vector<std::vector<curve>> per_rank(static_cast<std::size_t>(o.ranks));
    moecomm::inproc_world const world(o.ranks);
    world.run([&](moecomm::inproc_communicator comm) { per_rank[static_cast<std::size_t>(comm.rank())] = train_patterns(o, comm, init); });
    return report(o, train_dense(o, init), per_rank[0], o.ranks, "in-process threads");
  } catch (moecomm::error const& e) {
    std::fprintf(stderr, "example_09_torch: %s\n", e.what());
    return 1;
  }
}
