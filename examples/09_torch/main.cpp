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

struct options {
  int32_t ranks = 4;
  int32_t experts = 8;
  int32_t topk = 2;
  int32_t blocks = 2;
  int64_t vocab = 64;
  int64_t tokens = 128;  // per rank and step
  int64_t hidden = 32;
  int64_t inner = 64;
  int steps = 60;
  int every = 10;
  double lr = 1e-3;
  double aux = 1e-2;
  double z = 1e-3;
  double tolerance = 1e-4;
  int64_t seed = 1;
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
      .add("--vocab", "V", "vocabulary size", o.vocab, 2, 1 << 20)
      .add("--steps", "S", "Adam steps", o.steps, 1, 100000)
      .add("--every", "N", "print the losses every N steps", o.every, 1, 100000)
      .add("--lr", "X", "Adam's learning rate", o.lr, 0.0, 10.0)
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

// ---- data: Zipf tokens, each to be followed by its fixed random successor ------------------------

struct batch {
  at::Tensor tokens, targets;  // [T] int64
};

batch make_batch(options const& o, int rank, int step) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(o.seed) * 1000003u + static_cast<std::uint64_t>(step) * 101u +
                      static_cast<std::uint64_t>(rank));
  std::vector<double> weight(static_cast<std::size_t>(o.vocab));
  for (int64_t v = 0; v < o.vocab; ++v) weight[static_cast<std::size_t>(v)] = 1.0 / static_cast<double>(v + 1);
  std::discrete_distribution<int64_t> zipf(weight.begin(), weight.end());
  std::vector<int64_t> successor(static_cast<std::size_t>(o.vocab));
  std::mt19937_64 fixed(static_cast<std::uint64_t>(o.seed));
  for (int64_t v = 0; v < o.vocab; ++v) successor[static_cast<std::size_t>(v)] = static_cast<int64_t>(fixed() % o.vocab);
  std::vector<int64_t> tokens(static_cast<std::size_t>(o.tokens)), targets(tokens.size());
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    tokens[t] = zipf(rng);
    targets[t] = successor[static_cast<std::size_t>(tokens[t])];
  }
  return {at::tensor(tokens), at::tensor(targets)};
}

// ---- the model: one template for moecomm's MoE (per rank) and the dense reference ----------------

// The dense reference of one MoE: the router's rule in torch ops (top-K of the logits, softmax over
// the K; Megatron's aux loss and z loss per rank's tokens, as each rank's router computes them) and
// every expert on its tokens.
struct dense_moe : torch::nn::Module {
  dense_moe(options const& o, at::Tensor const& weights) : o_(o), mlp_{o.hidden, o.inner} {
    experts = register_parameter("experts", weights.clone());
  }

  at::Tensor forward(at::Tensor const& x, at::Tensor const& logits) {
    auto const [values, idx] = logits.topk(o_.topk, 1);
    at::Tensor const w = values.softmax(1);
    at::Tensor y = at::zeros_like(x);
    for (int32_t e = 0; e < o_.experts; ++e) {
      at::Tensor const hit = idx.eq(e);  // [T][K]
      at::Tensor const rows = hit.any(1).nonzero().squeeze(1);
      if (rows.numel() == 0) continue;
      at::Tensor const weight = (w * hit).sum(1).index_select(0, rows).unsqueeze(1);
      y = y.index_add(0, rows, mlp_(experts[e], x.index_select(0, rows)) * weight);
    }
    aux_and_z = at::zeros({}, at::kFloat);
    int64_t const T = o_.tokens;
    for (int64_t r = 0; r * T < logits.size(0); ++r) {
      at::Tensor const l = logits.narrow(0, r * T, T);
      at::Tensor const c = at::one_hot(idx.narrow(0, r * T, T).to(at::kLong), o_.experts).sum(at::IntArrayRef{0, 1}).to(at::kFloat);
      double const scale = o_.aux * o_.experts / (o_.topk * static_cast<double>(T) * static_cast<double>(T));
      aux_and_z = aux_and_z + scale * (l.softmax(1).sum(0) * c).sum() + o_.z * l.logsumexp(1).pow(2).mean();
    }
    return y;
  }

  at::Tensor experts, aux_and_z;
  options o_;
  mlp_expert mlp_;
};

template <class Moe>
struct block : torch::nn::Module {
  block(options const& o, std::shared_ptr<Moe> m)
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
  model(options const& o, MakeMoe&& make_moe)
      : embed(register_module("embed", torch::nn::Embedding(o.vocab, o.hidden))),
        head(register_module("head", torch::nn::Linear(o.hidden, o.vocab))) {
    for (int32_t b = 0; b < o.blocks; ++b)
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

initial_parameters draw_initial(options const& o) {
  torch::manual_seed(static_cast<uint64_t>(o.seed));
  mlp_expert const mlp{o.hidden, o.inner};
  initial_parameters init;
  for (int32_t b = 0; b < o.blocks; ++b) init.experts.push_back(at::randn({o.experts, mlp.parameter_count()}) * 0.15);
  model<dense_moe> shape(o, [&](int32_t b) { return std::make_shared<dense_moe>(o, init.experts[static_cast<std::size_t>(b)]); });
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

// ---- training -------------------------------------------------------------------------------

struct curve {
  std::string name;
  std::vector<double> loss;  // the mean cross-entropy over every rank's tokens, per step
  double seconds = 0;        // wall time of the steps
  std::vector<std::vector<int32_t>> shadowed;  // FasterMoE: block 0's shadow set per step
  std::vector<std::int64_t> first_load, last_load;  // block 0's tokens per expert, every rank's, at the first and last step
};

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

// ---- printing -------------------------------------------------------------------------------

int report(options const& o, curve const& dense, std::vector<curve> const& curves, int ranks, char const* where) {
  std::printf("moecomm example 09: a libtorch model trained with moecomm's MoE layer and torch::optim::Adam\n");
  std::printf("  %d blocks of [Linear %lld->%lld->%lld] + [gate, router top-%d of %d, expert MLPs %lld->%lld->%lld], vocab %lld\n",
              o.blocks, static_cast<long long>(o.hidden), static_cast<long long>(o.inner), static_cast<long long>(o.hidden),
              o.topk, o.experts, static_cast<long long>(o.hidden), static_cast<long long>(o.inner),
              static_cast<long long>(o.hidden), static_cast<long long>(o.vocab));
  std::printf("  %d ranks (%s), %lld tokens per rank and step, Adam lr %g, aux %g, z %g\n\n", ranks, where,
              static_cast<long long>(o.tokens), o.lr, o.aux, o.z);
  std::printf("1. Loss (mean cross-entropy over every rank's tokens); 'dense' is one process, every expert on every token\n\n");
  std::printf("  %6s  %10s", "step", "dense");
  for (auto const& c : curves) std::printf("  %10s", c.name.c_str());
  std::printf("\n");
  for (int s = 0; s < o.steps; ++s) {
    if (s % o.every != 0 && s != o.steps - 1) continue;
    std::printf("  %6d  %10.6f", s, dense.loss[static_cast<std::size_t>(s)]);
    for (auto const& c : curves) std::printf("  %10.6f", c.loss[static_cast<std::size_t>(s)]);
    std::printf("\n");
  }
  int status = 0;
  std::printf("\n2. Against the dense model (largest |loss - dense| / dense over the steps; tolerance %g)\n\n", o.tolerance);
  for (auto const& c : curves) {
    double worst = 0;
    for (std::size_t s = 0; s < c.loss.size(); ++s) worst = std::max(worst, std::abs(c.loss[s] - dense.loss[s]) / dense.loss[s]);
    bool const ok = worst <= o.tolerance;
    std::printf("  %-10s %.2e  %s   %s per step\n", c.name.c_str(), worst, ok ? "ok" : "TOO FAR",
                format_time(c.seconds / o.steps).c_str());
    if (!ok) status = 1;
  }
  std::printf("  %-10s            %s per step (one process)\n", "dense", format_time(dense.seconds / o.steps).c_str());
  for (auto const& c : curves) {
    if (c.shadowed.empty()) continue;
    int steps = 0;
    for (auto const& s : c.shadowed) steps += s.empty() ? 0 : 1;
    std::printf("\n3. FasterMoE shadowed an expert of block 0 in %d of %d steps (last: {", steps, o.steps);
    for (std::size_t i = 0; i < c.shadowed.back().size(); ++i) std::printf("%s%d", i ? ", " : "", c.shadowed.back()[i]);
    std::printf("})\n");
  }
  if (!curves.empty()) {
    curve const& c = curves.front();
    std::printf("\n4. Tokens per expert of block 0 (every rank's slots), first and last step: the router learns the load\n\n");
    std::int64_t const most = std::max(*std::max_element(c.first_load.begin(), c.first_load.end()),
                                       *std::max_element(c.last_load.begin(), c.last_load.end()));
    for (int32_t e = 0; e < o.experts; ++e)
      std::printf("  expert %2d  %5lld %-24s %5lld %s\n", e, static_cast<long long>(c.first_load[static_cast<std::size_t>(e)]),
                  bar(static_cast<double>(c.first_load[static_cast<std::size_t>(e)]), static_cast<double>(most), 24).c_str(),
                  static_cast<long long>(c.last_load[static_cast<std::size_t>(e)]),
                  bar(static_cast<double>(c.last_load[static_cast<std::size_t>(e)]), static_cast<double>(most), 24).c_str());
  }
  bool const learned = dense.loss.back() < 0.8 * dense.loss.front();
  std::printf("\n%s\n", learned ? "The loss decreased." : "The loss did not decrease enough (by 20%).");
  return status != 0 || !learned ? 1 : 0;
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
