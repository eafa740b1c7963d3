// SPDX-License-Identifier: Apache-2.0
// The replica schedulers against an LP solver (GLPK, test-only: nothing under include/ uses it).
// Min-max: the LP optimum of FineMoE §5.1 is eq. 3 as a real number; the integral optimum must be
// its ceiling. Communication-aware: GLPK's branch and bound on the same integer program gives the
// integral optimum, which the flow solver must match; its LP relaxation bounds both from below.

#include "../support/test_support.hpp"
#include "replica_schedule_cases.hpp"

#include <moecomm/core/topology.hpp>
#include <moecomm/planners/replica_schedule.hpp>

#include <glpk.h>

#include <cmath>

namespace test {

// A GLPK problem assembled column by column, rows added up front; freed on destruction.
class lp {
 public:
  explicit lp(int rows) : p_(glp_create_prob()) {
    glp_term_out(GLP_OFF);
    glp_set_obj_dir(p_, GLP_MIN);
    if (rows > 0) glp_add_rows(p_, rows);
    ia_.push_back(0);
    ja_.push_back(0);
    ar_.push_back(0);
  }
  ~lp() { glp_delete_prob(p_); }
  lp(lp const&) = delete;
  lp& operator=(lp const&) = delete;

  // Row i (1-based) = value, or <= value.
  void fix_row(int i, double value) { glp_set_row_bnds(p_, i, GLP_FX, value, value); }
  void cap_row(int i, double value) { glp_set_row_bnds(p_, i, GLP_UP, 0.0, value); }
  // A column >= 0 with objective coefficient `cost`, entries (row, coefficient).
  int add_column(double cost, std::vector<std::pair<int, double>> const& entries, bool integer) {
    int const j = glp_add_cols(p_, 1);
    glp_set_col_bnds(p_, j, GLP_LO, 0.0, 0.0);
    glp_set_obj_coef(p_, j, cost);
    if (integer) glp_set_col_kind(p_, j, GLP_IV);
    for (auto const& [i, a] : entries) {
      ia_.push_back(i);
      ja_.push_back(j);
      ar_.push_back(a);
    }
    return j;
  }
  // The LP optimum.
  double relaxation() {
    glp_load_matrix(p_, static_cast<int>(ia_.size()) - 1, ia_.data(), ja_.data(), ar_.data());
    glp_smcp parm;
    glp_init_smcp(&parm);
    parm.presolve = GLP_ON;
    REQUIRE(glp_simplex(p_, &parm) == 0);
    REQUIRE(glp_get_status(p_) == GLP_OPT);
    return glp_get_obj_val(p_);
  }
  // The integral optimum (after `relaxation`).
  double integral() {
    glp_iocp parm;
    glp_init_iocp(&parm);
    parm.mip_gap = 0;
    REQUIRE(glp_intopt(p_, &parm) == 0);
    REQUIRE(glp_mip_status(p_) == GLP_OPT);
    return glp_mip_obj_val(p_);
  }

 private:
  glp_prob* p_;
  std::vector<int> ia_, ja_;
  std::vector<double> ar_;
};

// min z s.t. Σ_{k of e} x_k = load_e, Σ_{k on g} x_k <= z, x >= 0: the LP of FineMoE §5.1.
double min_max_lp(moecomm::replica_sets const& sets, std::vector<int64_t> const& load) {
  int const E = sets.num_experts(), R = sets.num_ranks;
  lp p(E + R);
  for (int e = 0; e < E; ++e) p.fix_row(1 + e, static_cast<double>(load[static_cast<std::size_t>(e)]));
  for (int g = 0; g < R; ++g) p.cap_row(1 + E + g, 0);
  for (int e = 0; e < E; ++e)
    for (int k = sets.offsets[static_cast<std::size_t>(e)]; k < sets.offsets[static_cast<std::size_t>(e) + 1]; ++k)
      p.add_column(0, {{1 + e, 1.0}, {1 + E + sets.ranks[static_cast<std::size_t>(k)], 1.0}}, false);
  std::vector<std::pair<int, double>> z;
  for (int g = 0; g < R; ++g) z.push_back({1 + E + g, -1.0});
  p.add_column(1, z, false);
  return p.relaxation();
}

TEST_CASE("replica_schedule: min-max equals the ceiling of GLPK's LP optimum on 1000 random instances") {
  std::mt19937 rng(31337);
  moecomm::replica_schedule_workspace workspace;
  moecomm::replica_schedule out;
  for (int i = 0; i < 1000; ++i) {
    CAPTURE(i);
    std::int32_t const ranks = std::uniform_int_distribution<std::int32_t>(1, 10)(rng);
    std::int32_t const experts = std::uniform_int_distribution<std::int32_t>(1, 16)(rng);
    moecomm::replica_sets const sets = random_sets(rng, ranks, experts, 1, 4);
    double const skew = std::uniform_int_distribution<int>(0, 2)(rng) == 0 ? 8.0 : 1.2;
    std::vector<int64_t> const load = zipf_loads(rng, experts, std::uniform_int_distribution<int64_t>(0, 2000)(rng), skew);
    moecomm::schedule_replicas(sets, load, out, workspace);
    check_split(sets, load, out.split, out.rank_load, out.bound);
    // The LP optimum is eq. 3 (a fraction with denominator <= R); GLPK's is within its tolerance.
    fraction const exact = eq3_by_subsets(sets, load);
    double const z = min_max_lp(sets, load);
    CHECK(z == doctest::Approx(static_cast<double>(exact.num) / static_cast<double>(exact.den)).epsilon(1e-9));
    CHECK(out.bound == ceil_of(exact));
    CHECK(out.bound == static_cast<int64_t>(std::ceil(z - 1e-6)));
  }
}

TEST_CASE("replica_schedule: min-max at 32 ranks x 128 experts against GLPK") {
  std::mt19937 rng(4242);
  for (int i = 0; i < 40; ++i) {
    CAPTURE(i);
    moecomm::replica_sets const sets = random_sets(rng, 32, 128, 1, 4);
    std::vector<int64_t> const load = zipf_loads(rng, 128, 32 * 512, i % 2 == 0 ? 1.2 : 8.0);
    moecomm::replica_schedule const out = moecomm::schedule_replicas(sets, load);
    check_split(sets, load, out.split, out.rank_load, out.bound);
    double const z = min_max_lp(sets, load);
    CHECK(out.bound == static_cast<int64_t>(std::ceil(z - 1e-6 * std::max(1.0, z))));
  }
}

// min B + Σ α(s, g)·y s.t. Σ_{k of e} y_{k,s} = counts[s][e], Σ_{y into g} <= B: App. A.1 with the
// communication as total volume. Returns {LP relaxation, integral optimum}.
std::pair<double, double> comm_aware_ip(moecomm::replica_sets const& sets, moecomm::topology const& topo, moecomm::link_weights alpha,
                                        std::vector<int64_t> const& counts) {
  int const E = sets.num_experts(), R = sets.num_ranks;
  lp p(R * E + R);
  for (int c = 0; c < R * E; ++c) p.fix_row(1 + c, static_cast<double>(counts[static_cast<std::size_t>(c)]));
  for (int g = 0; g < R; ++g) p.cap_row(1 + R * E + g, 0);
  for (int s = 0; s < R; ++s)
    for (int e = 0; e < E; ++e) {
      if (counts[static_cast<std::size_t>(s * E + e)] == 0) continue;
      for (int k = sets.offsets[static_cast<std::size_t>(e)]; k < sets.offsets[static_cast<std::size_t>(e) + 1]; ++k) {
        int const g = sets.ranks[static_cast<std::size_t>(k)];
        double const cost = g == s ? 0 : topo.same_node(s, g) ? alpha.intra_node : alpha.inter_node;
        p.add_column(cost, {{1 + s * E + e, 1.0}, {1 + R * E + g, 1.0}}, true);
      }
    }
  std::vector<std::pair<int, double>> bound;
  for (int g = 0; g < R; ++g) bound.push_back({1 + R * E + g, -1.0});
  p.add_column(1, bound, true);
  double const relaxed = p.relaxation();
  return {relaxed, p.integral()};
}

TEST_CASE("replica_schedule: comm-aware equals GLPK's integral optimum on 300 random instances") {
  std::mt19937 rng(2718);
  moecomm::replica_schedule_workspace workspace;
  moecomm::comm_aware_schedule out;
  double worst_relaxation_gap = 0;
  for (int i = 0; i < 300; ++i) {
    CAPTURE(i);
    std::int32_t const per_node = std::uniform_int_distribution<std::int32_t>(1, 4)(rng);
    std::int32_t const ranks = per_node * std::uniform_int_distribution<std::int32_t>(1, 3)(rng);
    std::int32_t const experts = std::uniform_int_distribution<std::int32_t>(1, 8)(rng);
    moecomm::replica_sets const sets = random_sets(rng, ranks, experts, 1, 4);
    std::vector<int64_t> const counts = zipf_counts(rng, ranks, experts, std::uniform_int_distribution<int64_t>(0, 40)(rng), 1.2);
    // The paper's weights half of the time, random ones otherwise (not multiples of 2^-20).
    moecomm::link_weights alpha{0.1, 1.0};
    if (i % 2 == 1) alpha = {std::uniform_real_distribution<double>(0, 1)(rng), std::uniform_real_distribution<double>(0, 3)(rng)};
    moecomm::topology const topo(ranks, per_node);
    moecomm::schedule_replicas_comm_aware(sets, topo, alpha, counts, out, workspace);
    check_route(sets, topo, alpha, counts, out);
    auto const [relaxed, integral] = comm_aware_ip(sets, topo, alpha, counts);
    // The solver rounds α to multiples of 2^-20: each moved token may be off by 2^-21.
    double total = 0;
    for (int64_t c : counts) total += static_cast<double>(c);
    CHECK(out.objective <= integral + 1e-7 * (1 + integral) + total * std::ldexp(1.0, -20));
    CHECK(out.objective >= integral - 1e-7 * (1 + integral) - total * std::ldexp(1.0, -20));
    CHECK(relaxed <= integral + 1e-7 * (1 + integral));
    worst_relaxation_gap = std::max(worst_relaxation_gap, (integral - relaxed) / std::max(1.0, integral));
  }
  MESSAGE("largest gap of the integral optimum above GLPK's LP relaxation: ", worst_relaxation_gap * 100, "%");
}

}  // namespace test
