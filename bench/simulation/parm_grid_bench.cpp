// SPDX-License-Identifier: Apache-2.0
//! @file
//! Parm's evaluation in simulated time: a grid of MoE layers, each run with DeepSpeed-MoE's MP
//! schedule (`deepspeed_mp`), `parm_s1`, `parm_s2` and `parm_auto`, one training step (forward and
//! backward) each, on one of Parm's two platforms (SimGrid holds one platform per process):
//!
//!     bench_parm_grid --platform=parm-2080ti          (8 nodes x 4 RTX 2080 Ti, 32 ranks; the default)
//!     bench_parm_grid --platform=parm-2080ti-server   (one node of 8)
//!     bench_parm_grid ... --csv=FILE                  (one line per layer; scripts/plot-parm-grid draws it)
//!     bench_parm_grid ... --gradients=layer           (PauseMP sums its expert gradients over the MP peers
//!                                                      in the layer; default: trainer, as Parm measures)
//!     bench_parm_grid ... --grid=padded               (instead of the grid: each schedule padded, the step
//!                                                      a CUDA graph captures, against itself unpadded)
//!
//! The grid is FSMoE's (ASPLOS'25 Table 4; reference/systems.md §6 item 4), the nearest documented
//! analogue of Parm's 1296 layers: batch B {1, 2, 4} x sequence L {512, 1024, 2048} (T = B·L tokens
//! per MP group) x hidden H {1024, 2048, 4096} x FFN/H {2, 3, 4} x capacity factor {1.2, 2.4,
//! dropless}, = 243 layers per (MP, ESP) split, over the splits (2, 1), (2, 2), (4, 1), (4, 2),
//! (4, 4) (MP inside a node, ESP dividing MP, DP 1, EP = ranks / MP). Our choices, not the papers':
//! E = the number of ranks, top-2, uniform routing (a fixed random permutation of a flat
//! popularity), fp16 rows, S2 and `parm_auto` with 4 pieces, `parm_auto` priced with
//! `parm_cost_params::from_cluster` of the platform. Under PauseMP with ESP < MP the MP peers holding
//! one slice see different tokens; by default their gradients are left to the trainer's expert
//! data-parallel all-reduce (`replica_gradients::left_to_trainer`), which Parm, like DeepSpeed-MoE's
//! layer timings, does not count in the layer: with DP 1 the baseline has no such all-reduce, so
//! the default favours PauseMP by one all-reduce of the local experts' slices over MP / ESP ranks,
//! which `--gradients=layer` charges to the layer. The real rows hold 4 floats and the experts
//! are MLPs 4 -> 8 -> 4 cut into ESP slices; `simulation_scale` prices every message, copy and
//! GEMM at the model's size.
//!
//! The strongest baseline runs beside them: DeepSpeed-MoE with `drop_tokens`, each MP
//! rank dispatching its share of the tokens to whole experts replicated on the MP ranks, the outputs
//! all-gathered over MP (PauseMP with ESP 1, holding MP / ESP times a slice's parameters; its
//! replicas' gradients left to the trainer's expert-DP all-reduce, as DeepSpeed does). Its experts
//! are the slices' concatenated, so its results equal deepspeed_mp's within rounding (1e-5 of their
//! magnitude: whole experts round once where slices round twice).
//!
//! One benchmark per (split, B) runs its 81 layers; its counters are medians over them. After the
//! benchmarks, the program prints, per split and overall, min / median / max of each schedule's
//! speedup over `deepspeed_mp` and over `drop_tokens`, the share of layers each of S1 / S2 is fastest on, and how often
//! `parm_auto` picked the faster one (and its worst regret). Times are simulated seconds (SimGrid
//! 3.32, CM02, no cross-traffic): a model of the cluster, not a measurement of it.
//!
//! Check: every schedule's output and input gradient, summed over all ranks, equal `deepspeed_mp`'s
//! bit for bit (the slices' partial sums are added in the same order by every schedule).

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/parm.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

using backend = moecomm::simulated_backend<>;
using comm_t = moecomm::simgrid_communicator;

constexpr std::int64_t real_hidden = 4, real_ffn = 8;
constexpr double fp32 = 4.0, fp16 = 2.0;
constexpr std::int32_t top_k = 2, pieces = 4;

using moecomm_bench::sliced_mlp;

struct layer_shape {
  std::int32_t batch, sequence;
  std::int64_t hidden, ffn_ratio;
  double capacity;  // 0: dropless
  moecomm::parallel_sizes sizes;
  [[nodiscard]] std::int64_t tokens() const { return std::int64_t{batch} * sequence; }
};

//! One schedule's simulated step, and its results' checksum and magnitude.
struct step_result {
  double seconds = 0, checksum = 0, magnitude = 0;
  char const* ran = "";  // the schedule that ran (parm_auto's pick)
  double predicted_s1 = 0, predicted_s2 = 0;
};

//! One layer of the grid: what each schedule measured.
struct layer_result {
  layer_shape shape;
  step_result baseline, s1, s2, automatic, drop_tokens;
};
std::vector<layer_result> g_results;
moecomm::replica_gradients g_gradients = moecomm::replica_gradients::left_to_trainer;

//! Rank (ep, esp)'s experts for a layer cut into `slices`: its slices of the grid's experts, whose
//! parameters are drawn per (ep, slice) for the grid's `grid_slices`; whole experts (`slices` 1) are
//! those slices concatenated along F.
sliced_mlp experts_of(std::int32_t locals, std::int32_t ep, std::int32_t esp, std::int32_t slices, std::int32_t grid_slices) {
  auto const seed = [&](std::int32_t slice) { return 100 + static_cast<std::uint64_t>(ep * 8 + slice); };
  if (slices == grid_slices) return sliced_mlp(locals, real_hidden, real_ffn / slices, esp, slices, seed(esp));
  sliced_mlp whole(locals, real_hidden, real_ffn, 0, 1, 0);
  std::int64_t const h = real_hidden, f = real_ffn / grid_slices;
  for (std::int32_t part = 0; part < grid_slices; ++part) {
    sliced_mlp const slice(locals, real_hidden, real_ffn / grid_slices, part, grid_slices, seed(part));
    for (std::int32_t l = 0; l < locals; ++l) {
      float const* const from = slice.params.data() + l * slice.parameter_count();
      float* const to = whole.parameters(l);
      for (std::int64_t r = 0; r < h; ++r)  // W1 [H][F]: the slice's columns
        std::copy_n(from + r * f, f, to + r * real_ffn + part * f);
      std::copy_n(from + h * f, f * h, to + h * real_ffn + part * f * h);  // W2 [F][H]: the slice's rows
    }
  }
  return whole;
}

template <class Schedule, class Capacity>
step_result run_schedule(moecomm::simulated_platform const& platform, layer_shape const& s, Schedule const& schedule,
                         Capacity const& capacity, std::int32_t grid_slices = 0) {
  std::int32_t const ranks = platform.spec().num_gpus(), experts = ranks;
  std::int32_t const mp_groups = ranks / s.sizes.model;
  auto const routing = moecomm_bench::skewed_routing(mp_groups, s.tokens(), top_k, experts, 0.0, 2024);
  backend const be(moecomm::host_backend{},
                   moecomm_bench::model_scale(double(s.hidden), double(s.hidden * s.ffn_ratio), fp16, real_hidden, real_ffn, fp32));
  moecomm_bench::step_span span(ranks);
  std::vector<double> sums(static_cast<std::size_t>(ranks)), magnitudes(sums.size());
  step_result result;
  moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, ranks);
  world.run([&](comm_t comm) {
    auto const me = static_cast<std::size_t>(comm.rank());
    moecomm::parallel_groups<comm_t> groups(comm, s.sizes, moecomm::topology(ranks, platform.gpus_per_node()));
    auto const at = groups.coordinates();
    std::int32_t const group = at.dp * s.sizes.expert + at.ep, locals = experts / s.sizes.expert;
    moecomm::parm_layer<float, backend, comm_t, Schedule, Capacity> layer(be, groups, experts, real_hidden, schedule, capacity);
    sliced_mlp mlp = experts_of(locals, at.ep, at.esp, s.sizes.expert_slicing, grid_slices > 0 ? grid_slices : s.sizes.expert_slicing);
    std::int64_t const elements = s.tokens() * real_hidden;
    std::vector<float> const x = moecomm_bench::random_rows(elements, 200 + static_cast<std::uint64_t>(group));
    std::vector<float> const d_out = moecomm_bench::random_rows(elements, 300 + static_cast<std::uint64_t>(group));
    std::vector<float> out(x.size()), d_x(x.size()), d_w(static_cast<std::size_t>(s.tokens() * top_k));
    comm.barrier();
    span.start[me] = moecomm::simulated_seconds{}();
    layer.forward(routing[static_cast<std::size_t>(group)].view(), {x.data(), s.tokens(), real_hidden},
                  {out.data(), s.tokens(), real_hidden}, mlp);
    layer.backward({d_out.data(), s.tokens(), real_hidden}, moecomm::matrix_view<float>{d_x.data(), s.tokens(), real_hidden},
                   moecomm::array_view<float>{d_w.data(), static_cast<std::int64_t>(d_w.size())}, mlp);
    span.end[me] = moecomm::simulated_seconds{}();
    sums[me] = moecomm_bench::checksum(out, d_x);
    magnitudes[me] = moecomm_bench::magnitude(out, d_x);
    if (me == 0) {  // actors run one at a time
      result.ran = layer.report().schedule;
      result.predicted_s1 = layer.report().choice.s1.step_total;
      result.predicted_s2 = layer.report().choice.s2.step_total;
    }
  });
  result.seconds = span.seconds();
  for (double v : sums) result.checksum += v;
  for (double v : magnitudes) result.magnitude += v;
  return result;
}

template <class Capacity>
layer_result run_layer(moecomm::simulated_platform const& platform, layer_shape const& s, Capacity const& capacity) {
  moecomm::parm_auto const automatic{moecomm::parm_cost_model(moecomm::parm_cost_params::from_cluster(platform.spec())), real_ffn,
                                     pieces, g_gradients};
  layer_shape whole = s;
  whole.sizes.expert_slicing = 1;
  layer_result r{s, run_schedule(platform, s, moecomm::deepspeed_mp{}, capacity),
                 run_schedule(platform, s, moecomm::parm_s1{g_gradients}, capacity),
                 run_schedule(platform, s, moecomm::parm_s2{pieces, g_gradients}, capacity),
                 run_schedule(platform, s, automatic, capacity),
                 run_schedule(platform, whole, moecomm::parm_s1{moecomm::replica_gradients::left_to_trainer}, capacity,
                              s.sizes.expert_slicing)};
  return r;
}

std::string shape_name(layer_shape const& s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "B%d/L%d/H%lld/F%lldH/%s", s.batch, s.sequence, static_cast<long long>(s.hidden),
                static_cast<long long>(s.ffn_ratio), s.capacity > 0 ? (s.capacity > 2 ? "f2.4" : "f1.2") : "dropless");
  return buf;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  std::size_t const n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void register_split(moecomm::simulated_platform const& platform, moecomm::parallel_sizes sizes, std::int32_t batch) {
  std::string const name = "parm_grid/MP:" + std::to_string(sizes.model) + "/ESP:" + std::to_string(sizes.expert_slicing) +
                           "/B:" + std::to_string(batch);
  moecomm_bench::register_simulated(name, benchmark::kSecond, [&platform, sizes, batch](benchmark::State& state) {
    std::vector<double> s1, s2, au, s1_drop, s2_drop;
    double simulated = 0;
    for (auto _ : state) {
      for (std::int32_t sequence : {512, 1024, 2048})
        for (std::int64_t hidden : {1024, 2048, 4096})
          for (std::int64_t ratio : {2, 3, 4})
            for (double f : {1.2, 2.4, 0.0}) {
              layer_shape const s{batch, sequence, hidden, ratio, f, sizes};
              layer_result const r = f > 0 ? run_layer(platform, s, moecomm::capacity<moecomm::drop_by_position>{f})
                                           : run_layer(platform, s, moecomm::dropless{});
              for (step_result const* o : {&r.s1, &r.s2, &r.automatic})
                if (o->checksum != r.baseline.checksum)
                  return moecomm_bench::fail(state, shape_name(s) + ": " + (o == &r.automatic ? "parm_auto running " : "") + o->ran +
                                                        " differs from deepspeed_mp's output and input gradient");
              if (!(std::fabs(r.drop_tokens.checksum - r.baseline.checksum) <= 1e-5 * r.baseline.magnitude))
                return moecomm_bench::fail(state, shape_name(s) + ": drop_tokens differs from deepspeed_mp's output and input "
                                                  "gradient beyond rounding");
              s1.push_back(r.baseline.seconds / r.s1.seconds);
              s2.push_back(r.baseline.seconds / r.s2.seconds);
              au.push_back(r.baseline.seconds / r.automatic.seconds);
              s1_drop.push_back(r.drop_tokens.seconds / r.s1.seconds);
              s2_drop.push_back(r.drop_tokens.seconds / r.s2.seconds);
              simulated += r.baseline.seconds + r.s1.seconds + r.s2.seconds + r.automatic.seconds + r.drop_tokens.seconds;
              g_results.push_back(r);
            }
      state.SetIterationTime(simulated);
    }
    state.counters["layers"] = double(s1.size());
    state.counters["speedup_s1"] = median(s1);
    state.counters["speedup_s2"] = median(s2);
    state.counters["speedup_auto"] = median(au);
    state.counters["s1_vs_drop_tokens"] = median(s1_drop);
    state.counters["s2_vs_drop_tokens"] = median(s2_drop);
  });
}

//! `--grid=padded`: the price of a step a CUDA graph can capture. Each schedule with `pad_to_capacity`
//! against itself unpadded, on the grid's layers with capacity at hidden {1024, 4096} and L {512,
//! 2048} (F = 4H): the same bits (checked), but every expert's block is C rows, and under PauseMP the
//! MP all-gather carries E·C rows instead of T (semantics §15b).
void register_padded(moecomm::simulated_platform const& platform, moecomm::parallel_sizes sizes, std::int32_t batch) {
  std::string const name = "parm_padded/MP:" + std::to_string(sizes.model) + "/ESP:" + std::to_string(sizes.expert_slicing) +
                           "/B:" + std::to_string(batch);
  moecomm_bench::register_simulated(name, benchmark::kSecond, [&platform, sizes, batch](benchmark::State& state) {
    std::vector<double> ratio[3], speedup[2];
    double simulated = 0;
    for (auto _ : state) {
      for (std::int32_t sequence : {512, 2048})
        for (std::int64_t hidden : {1024, 4096})
          for (double f : {1.2, 2.4}) {
            layer_shape const s{batch, sequence, hidden, 4, f, sizes};
            moecomm::capacity<moecomm::drop_by_position> const unpadded{f}, padded{f, 0, true, {}};
            step_result const plain[3] = {run_schedule(platform, s, moecomm::deepspeed_mp{}, unpadded),
                                          run_schedule(platform, s, moecomm::parm_s1{g_gradients}, unpadded),
                                          run_schedule(platform, s, moecomm::parm_s2{pieces, g_gradients}, unpadded)};
            step_result const pad[3] = {run_schedule(platform, s, moecomm::deepspeed_mp{}, padded),
                                        run_schedule(platform, s, moecomm::parm_s1{g_gradients}, padded),
                                        run_schedule(platform, s, moecomm::parm_s2{pieces, g_gradients}, padded)};
            for (int i = 0; i < 3; ++i) {
              if (pad[i].checksum != plain[0].checksum)
                return moecomm_bench::fail(state, shape_name(s) + ": padded " + (i == 0 ? "deepspeed_mp" : i == 1 ? "parm_s1" : "parm_s2") +
                                                      " differs from unpadded deepspeed_mp's output and input gradient");
              ratio[i].push_back(pad[i].seconds / plain[i].seconds);
              simulated += pad[i].seconds + plain[i].seconds;
            }
            for (int i = 0; i < 2; ++i) speedup[i].push_back(pad[0].seconds / pad[i + 1].seconds);
          }
      state.SetIterationTime(simulated);
    }
    state.counters["layers"] = double(ratio[0].size());
    state.counters["padded_over_unpadded_deepspeed_mp"] = median(ratio[0]);
    state.counters["padded_over_unpadded_s1"] = median(ratio[1]);
    state.counters["padded_over_unpadded_s2"] = median(ratio[2]);
    state.counters["padded_speedup_s1"] = median(speedup[0]);
    state.counters["padded_speedup_s2"] = median(speedup[1]);
  });
}

//! min / median / max of `v` as text.
std::string spread(std::vector<double> const& v) {
  if (v.empty()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f / %.2f / %.2f", *std::min_element(v.begin(), v.end()), median(v),
                *std::max_element(v.begin(), v.end()));
  return buf;
}

//! The summary of the layers `pick` selects.
template <class Pick>
void print_summary(char const* label, Pick&& pick) {
  std::vector<double> s1, s2, au, best_drop;
  std::int64_t n = 0, s1_wins = 0, agree = 0;
  double worst_regret = 0;
  for (layer_result const& r : g_results) {
    if (!pick(r.shape)) continue;
    ++n;
    s1.push_back(r.baseline.seconds / r.s1.seconds);
    s2.push_back(r.baseline.seconds / r.s2.seconds);
    au.push_back(r.baseline.seconds / r.automatic.seconds);
    best_drop.push_back(r.drop_tokens.seconds / std::min(r.s1.seconds, r.s2.seconds));
    bool const s1_faster = r.s1.seconds <= r.s2.seconds;
    s1_wins += s1_faster;
    agree += (std::strcmp(r.automatic.ran, "parm_s1") == 0) == s1_faster;
    worst_regret = std::max(worst_regret, r.automatic.seconds / std::min(r.s1.seconds, r.s2.seconds) - 1);
  }
  if (n == 0) return;
  std::printf("%-14s %6lld  %-20s %-20s %-20s %5.1f%% / %5.1f%%   %5.1f%%   %+6.1f%%   %s\n", label, static_cast<long long>(n),
              spread(s1).c_str(), spread(s2).c_str(), spread(au).c_str(), 100.0 * double(s1_wins) / double(n),
              100.0 * double(n - s1_wins) / double(n), 100.0 * double(agree) / double(n), 100.0 * worst_regret,
              spread(best_drop).c_str());
}

void write_csv(std::string const& path) {
  std::ofstream f(path);
  f << "mp,esp,batch,sequence,hidden,ffn_ratio,capacity,deepspeed_mp_s,parm_s1_s,parm_s2_s,parm_auto_s,auto_ran,"
       "predicted_s1_s,predicted_s2_s,drop_tokens_s\n";
  for (layer_result const& r : g_results) {
    layer_shape const& s = r.shape;
    f << s.sizes.model << ',' << s.sizes.expert_slicing << ',' << s.batch << ',' << s.sequence << ',' << s.hidden << ','
      << s.ffn_ratio << ',' << (s.capacity > 0 ? std::to_string(s.capacity).substr(0, 3) : "dropless") << ','
      << r.baseline.seconds << ',' << r.s1.seconds << ',' << r.s2.seconds << ',' << r.automatic.seconds << ','
      << r.automatic.ran << ',' << r.automatic.predicted_s1 << ',' << r.automatic.predicted_s2 << ',' << r.drop_tokens.seconds
      << '\n';
  }
  std::printf("wrote %s (%zu layers)\n", path.c_str(), g_results.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "parm-2080ti");
  moecomm_bench::take_contention_flag(argc, argv);
  std::string const csv = moecomm_bench::take_flag(argc, argv, "--csv=", "");
  std::string const gradients = moecomm_bench::take_choice_flag(argc, argv, "--gradients", {"trainer", "layer"});
  bool const padded = moecomm_bench::take_choice_flag(argc, argv, "--grid", {"fsmoe", "padded"}) == "padded";
  if (gradients == "layer") g_gradients = moecomm::replica_gradients::summed_here;
  if (!moecomm_bench::start(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name);
  benchmark::AddCustomContext("workload", padded ? "padded against unpadded: B {1,2,4} x L {512,2048} x H {1024,4096} x F/H 4 x "
                                                   "f {1.2,2.4}; E = ranks, top-2, uniform routing, fp16 rows, 4 pieces"
                                                 : "FSMoE's grid: B {1,2,4} x L {512,1024,2048} x H {1024,2048,4096} x F/H {2,3,4} x "
                                                   "f {1.2,2.4,dropless}; E = ranks, top-2, uniform routing, fp16 rows, 4 pieces");
  benchmark::AddCustomContext("expert gradients over MP peers", gradients == "layer" ? "summed in the layer"
                                                                                    : "left to the trainer's expert-DP all-reduce");
  std::int32_t const per_node = platform.gpus_per_node();
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 0, 1}, moecomm::parallel_sizes{2, 0, 2},
                                              moecomm::parallel_sizes{4, 0, 1}, moecomm::parallel_sizes{4, 0, 2},
                                              moecomm::parallel_sizes{4, 0, 4}}) {
    if (per_node % sizes.model != 0) continue;  // an MP group inside a node
    moecomm::parallel_sizes s = sizes;
    s.expert = platform.spec().num_gpus() / sizes.model;
    for (std::int32_t batch : {1, 2, 4})
      if (padded) register_padded(platform, s, batch);
      else register_split(platform, s, batch);
  }
  int const rc = moecomm_bench::finish("bench_parm_grid");
  if (g_results.empty()) return rc;
  std::printf("\nParm's schedules against deepspeed_mp on %s, simulated step time (forward + backward):\n", platform.name().c_str());
  std::printf("%-14s %6s  %-20s %-20s %-20s %-17s %-8s %-9s %s\n", "split", "layers", "S1 min/med/max", "S2 min/med/max",
              "auto min/med/max", "S1 / S2 fastest", "auto ok", "auto worst", "best of S1, S2 over drop_tokens");
  for (std::int32_t mp : {2, 4})
    for (std::int32_t esp : {1, 2, 4}) {
      std::string const label = "MP" + std::to_string(mp) + " ESP" + std::to_string(esp);
      print_summary(label.c_str(), [&](layer_shape const& s) { return s.sizes.model == mp && s.sizes.expert_slicing == esp; });
    }
  print_summary("all", [](layer_shape const&) { return true; });
  std::printf("(speedup = deepspeed_mp's time / the schedule's; 'auto ok' = parm_auto picked the faster of S1 and S2; "
              "'auto worst' = its largest excess over the faster; the last column: drop_tokens' time / the faster of S1 and "
              "S2, DeepSpeed-MoE's strongest setting; Parm reports 1.13-5.77x over DeepSpeed-MoE)\n");
  if (!csv.empty()) write_csv(csv);
  return rc;
}
