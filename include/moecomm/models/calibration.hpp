// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Calibration: the cost models' machine constants measured on the running system. A compute rate
//! from a user callable timed over a few row counts; each link class's latency and bandwidth from
//! timed exchanges of a few message sizes; and their conversion to `fastermoe_cost_params` and to
//! `parm_cost_params`.
//!
//! Why measure/ and not plan/: the planners are pure host functions of their inputs and never touch
//! a buffer, a communicator or a clock, so they give the same answer on every rank by construction.
//! Measuring needs all three; its results become equal on every rank only through an allreduce.
//! Nor is it an op: it moves no user data.
//!
//! Every measurement times each size once untimed (first touch of memory, cold caches), then
//! `repeats` times, and keeps the median. A straight line `seconds = intercept + slope · size` is
//! fitted to the medians by least squares on the relative error (see `fit_line`).

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/error.hpp>
#include <moecomm/collectives/alltoall/exchange_groups.hpp>
#include <moecomm/planners/fastermoe_cost_model.hpp>
#include <moecomm/models/parm_cost_model.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! The default clock: `std::chrono::steady_clock` in seconds. Any callable `double()` returning
//! seconds can replace it (tests pass a fake one). It is read right before and right after each
//! timed call.
struct steady_seconds {
  double operator()() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
};

//! What a measurement times.
struct calibration_options {
  //! Rows (compute) or bytes per message (links); at least two distinct values, none negative.
  std::vector<std::int64_t> sizes;
  //! Timed calls per size, after one untimed call; the median counts.
  std::int32_t repeats = 5;
};

//! `seconds = intercept + slope · size`, with what it was fitted on.
struct linear_fit {
  double intercept = 0;             //!< seconds of a call of size 0: the fixed cost (a link's latency α)
  double slope = 0;                 //!< seconds per row, or per byte (a link's 1/bandwidth, β)
  std::vector<std::int64_t> sizes;  //!< the sizes timed, as given
  std::vector<double> seconds;      //!< the time the line was fitted to at each size
  double relative_residual = 0;     //!< root mean square of (fitted - measured) / measured
};

//! The time of a compute callable against its row count.
struct compute_calibration {
  linear_fit time;           //!< seconds of one call `f(rows)`
  double flops_per_row = 0;  //!< as stated to `measure_compute_rate`; 0 when not stated

  //! `flops_per_row / time.slope`: the FLOP rate of the rows, with the call's fixed cost excluded.
  //! @throws error (invalid_argument) when `flops_per_row` was not stated or the slope is not positive.
  [[nodiscard]] double flops_per_second() const;
};

//! Latency and bandwidth of the link classes of an `exchange_groups`. A class the topology does
//! not have is absent: no intra-node links with one rank per node, no inter-node links with one node.
struct link_calibration {
  std::optional<linear_fit> intra_node;  //!< seconds of one message of `size` bytes within a node
  std::optional<linear_fit> inter_node;  //!< seconds of one message of `size` bytes between nodes
};

namespace detail {

inline void check_calibration_options(char const* op, calibration_options const& options) {
  auto const& sizes = options.sizes;
  require(!sizes.empty(), op, "options.sizes is empty: a line needs at least two distinct sizes");
  for (std::size_t i = 0; i < sizes.size(); ++i)
    require(sizes[i] >= 0, op, "options.sizes[", i, "] = ", sizes[i], " is negative");
  require(std::any_of(sizes.begin(), sizes.end(), [&](std::int64_t s) { return s != sizes[0]; }), op,
          "options.sizes holds only the size ", sizes[0], ": a line needs at least two distinct sizes");
  // Each repeat's time is kept for the median: a bound keeps that vector small (and a typo such as
  // INT32_MAX an error, not std::bad_alloc).
  require(options.repeats > 0 && options.repeats <= 1'000'000, op, "options.repeats = ", options.repeats,
          " must be in [1, 1000000]");
}

//! The median of `repeats` results of `timed_call()` (seconds), after one call whose result is dropped.
template <class TimedCall>
double median_seconds(TimedCall&& timed_call, std::int32_t repeats) {
  (void)timed_call();
  std::vector<double> seconds(static_cast<std::size_t>(repeats));
  for (double& s : seconds) s = timed_call();
  std::sort(seconds.begin(), seconds.end());
  std::size_t const n = seconds.size();
  return n % 2 == 1 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]);
}

//! The weighted least-squares line through `(sizes[i], seconds[i])`, minimising
//! Σ ((intercept + slope·size − seconds) / seconds)². Times span orders of magnitude across the
//! sizes: weighting each point by 1/seconds² lets the small sizes set the intercept and the large
//! ones the slope, where a plain fit lets the noise of the largest size swamp the intercept.
//! Computed around the weighted means, so large sizes lose no precision.
inline linear_fit fit_line(char const* op, std::vector<std::int64_t> sizes, std::vector<double> seconds) {
  std::size_t const n = sizes.size();
  std::vector<double> weight(n);
  double total = 0, mean_x = 0, mean_y = 0;
  for (std::size_t i = 0; i < n; ++i) {
    require(std::isfinite(seconds[i]) && seconds[i] > 0, op, "the clock measured ", seconds[i], " s at size ", sizes[i],
            ": it must advance, by a finite time, over a timed call");
    weight[i] = 1.0 / (seconds[i] * seconds[i]);
    total += weight[i];
    mean_x += weight[i] * static_cast<double>(sizes[i]);
    mean_y += weight[i] * seconds[i];
  }
  mean_x /= total;
  mean_y /= total;
  double spread = 0, covariance = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double const dx = static_cast<double>(sizes[i]) - mean_x;
    spread += weight[i] * dx * dx;
    covariance += weight[i] * dx * (seconds[i] - mean_y);
  }
  // Distinct sizes that are equal as doubles (above 2^53) leave no spread: no line through them.
  require(spread > 0 && std::isfinite(covariance / spread), op,
          "options.sizes differ only beyond a double's precision (or the times are too far apart): no line fits; "
          "use sizes that differ by more");
  linear_fit fit;
  fit.slope = covariance / spread;
  fit.intercept = mean_y - fit.slope * mean_x;
  double squares = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double const error = (fit.intercept + fit.slope * static_cast<double>(sizes[i]) - seconds[i]) / seconds[i];
    squares += error * error;
  }
  fit.relative_residual = std::sqrt(squares / static_cast<double>(n));
  fit.sizes = std::move(sizes);
  fit.seconds = std::move(seconds);
  return fit;
}

//! Refuses a fit whose slope is not positive, naming it as `prefix` + `name` (e.g. "links." "intra_node").
inline void require_rising(char const* op, linear_fit const& fit, char const* prefix, char const* name) {
  require(fit.slope > 0, op, prefix, name, ".slope = ", fit.slope,
          " s is not positive: the time did not grow with the size; time larger sizes or more repeats");
}

//! `units / fit.slope`: what one second buys (FLOPs, bytes), once the slope is known to be positive.
inline double per_second(char const* op, linear_fit const& fit, char const* prefix, char const* name, double units) {
  require_rising(op, fit, prefix, name);
  return units / fit.slope;
}

//! A link fit as Parm's α and β: its intercept and slope, once the slope is known to be positive and
//! the intercept not negative. The fit is named `links.<name>`.
inline parm_link parm_link_of(char const* op, linear_fit const& fit, char const* name) {
  require_rising(op, fit, "links.", name);
  require(fit.intercept >= 0, op, "links.", name, ".intercept = ", fit.intercept,
          " s is negative: a message cannot take less than no time; time smaller sizes or more repeats");
  return {fit.intercept, fit.slope};
}

//! `flops_per_row / time.slope`; a message names the fields after `prefix` ("compute." or "").
inline double flop_rate(char const* op, char const* prefix, compute_calibration const& compute) {
  require(compute.flops_per_row > 0, op, prefix, "flops_per_row = ", compute.flops_per_row,
          " was not stated; pass it to measure_compute_rate");
  return per_second(op, compute.time, prefix, "time", compute.flops_per_row);
}

//! Each size's median time of a ring exchange on `group` (every rank sends `size` bytes to the next
//! rank and receives as many from the previous one, all at once, as in an all-to-all): this rank's
//! clock, from the end of a barrier to the end of the exchange.
template <class Backend, class Comm, class Clock>
std::vector<double> ring_exchange_seconds(Backend const& be, Comm& group, calibration_options const& options,
                                          Clock& clock) {
  std::int32_t const ranks = group.size(), me = group.rank();
  std::int64_t const largest = std::max<std::int64_t>(
      1, *std::max_element(options.sizes.begin(), options.sizes.end()));
  auto sent = be.template allocate<char>(largest);
  auto received = be.template allocate<char>(largest);
  be.for_each_index(largest, fill_value<char>{sent.data(), char(1)});
  be.synchronize();
  std::vector<double> seconds;
  for (std::int64_t bytes : options.sizes) {
    std::vector<send_block> const sends{{(me + 1) % ranks, sent.data(), bytes}};
    std::vector<recv_block> const recvs{{(me + ranks - 1) % ranks, received.data(), bytes}};
    seconds.push_back(median_seconds(
        [&] {
          group.barrier();
          double const start = clock();
          group.exchange(sends, recvs);
          be.synchronize();
          return clock() - start;
        },
        options.repeats));
  }
  return seconds;
}

//! One link class: ring exchanges on `group`, each size's time the maximum over the world's
//! ranks (the slowest rank, which an exchange waits for), fitted; the same on every rank. The times
//! are host values: they are all-gathered (`allgather_host`, which takes host memory on every
//! communicator, NCCL's too) and their maximum taken here, as the capacity agreement does.
template <class Backend, class Comm, class Clock>
linear_fit measure_link_class(Backend const& be, Comm& world, Comm& group, calibration_options const& options,
                              Clock& clock) {
  std::vector<double> const mine = ring_exchange_seconds(be, group, options, clock);
  std::size_t const n = mine.size();
  std::vector<double> all(n * static_cast<std::size_t>(world.size()));
  allgather_host(world, mine.data(), all.data(), static_cast<std::int64_t>(n * sizeof(double)));
  std::vector<double> seconds(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n));
  for (std::size_t i = n; i < all.size(); ++i) seconds[i % n] = std::max(seconds[i % n], all[i]);
  return fit_line("measure_links", options.sizes, std::move(seconds));
}

}  // namespace detail

inline double compute_calibration::flops_per_second() const {
  return detail::flop_rate("compute_calibration::flops_per_second", "", *this);
}

//! Times `compute(rows)` for each of `options.sizes` and fits `seconds = a + b · rows`.
//! @param compute called as `compute(std::int64_t rows)`; it must have finished its work on return.
//! @param flops_per_row the FLOPs one row costs, for `flops_per_second()`; 0 when not known.
//! @param clock a callable returning seconds, read before and after each timed call.
//! @throws error (invalid_argument) naming a bad option or `flops_per_row`, before anything runs.
template <class Compute, class Clock = steady_seconds>
[[nodiscard]] compute_calibration measure_compute_rate(Compute&& compute, double flops_per_row,
                                                       calibration_options const& options, Clock clock = {}) {
  char const* op = "measure_compute_rate";
  detail::check_calibration_options(op, options);
  detail::require(flops_per_row >= 0, op, "flops_per_row = ", flops_per_row, " must be >= 0 (0: not known)");
  std::vector<double> seconds;
  for (std::int64_t rows : options.sizes)
    seconds.push_back(detail::median_seconds(
        [&] {
          double const start = clock();
          compute(rows);
          return clock() - start;
        },
        options.repeats));
  return {detail::fit_line(op, options.sizes, std::move(seconds)), flops_per_row};
}

//! Measures the latency and bandwidth of the intra-node and of the inter-node links: ring exchanges
//! of `options.sizes` bytes on `groups.intra()`, then on `groups.inter()`, every ring of a class at
//! once. The per-size times are agreed as the maximum over ranks (an all-gather of host values, as
//! the dispatcher's capacity agreement), so every rank returns the same numbers. Collective over
//! `groups.world()`, on any communicator.
//! @param be the back-end whose memory the communicator moves (the message buffers are its).
//! @param clock a callable returning seconds, read before and after each timed exchange.
//! @throws error (invalid_argument) naming a bad option, or the two streams when the back-end's and
//!         the communicator's differ, before any message is sent.
template <class Backend, class Comm, class Clock = steady_seconds>
[[nodiscard]] link_calibration measure_links(Backend const& be, exchange_groups<Comm>& groups,
                                             calibration_options const& options, Clock clock = {}) {
  detail::check_calibration_options("measure_links", options);
  detail::require_one_stream(be, groups.world(), "measure_links");  // the messages are the back-end's buffers
  link_calibration links;
  if (groups.topo().ranks_per_node() > 1)
    links.intra_node = detail::measure_link_class(be, groups.world(), groups.intra(), options, clock);
  if (groups.topo().num_nodes() > 1)
    links.inter_node = detail::measure_link_class(be, groups.world(), groups.inter(), options, clock);
  return links;
}

//! `base` with the measured machine constants: `gemm_flops` = `compute.flops_per_second()`
//! (state `flops_per_row` as the model counts a row: 4·alpha·H² for the forward),
//! `local_bandwidth` and `net_bandwidth` = 1 / slope of the intra- and inter-node links. A class
//! the topology lacks takes the other's bandwidth (with one node, shadowed parameters cross the
//! intra-node links that `net_bandwidth` prices); with neither (one rank), `base`'s stay. The
//! model has no latency term, so the intercepts are not used.
//! @throws error (invalid_argument) naming a fit whose slope is not positive, or a missing `flops_per_row`.
[[nodiscard]] inline fastermoe_cost_params to_fastermoe_cost_params(compute_calibration const& compute,
                                                                    link_calibration const& links,
                                                                    fastermoe_cost_params base = {}) {
  char const* op = "to_fastermoe_cost_params";
  base.gemm_flops = detail::flop_rate(op, "compute.", compute);
  if (links.intra_node) base.local_bandwidth = detail::per_second(op, *links.intra_node, "links.", "intra_node", 1.0);
  if (links.inter_node) base.net_bandwidth = detail::per_second(op, *links.inter_node, "links.", "inter_node", 1.0);
  if (!links.intra_node && links.inter_node) base.local_bandwidth = base.net_bandwidth;
  if (links.intra_node && !links.inter_node) base.net_bandwidth = base.local_bandwidth;
  return base;
}

//! `base` with the measured machine constants: `gemm_flops` = `compute.flops_per_second()`
//! (state `flops_per_row` as the model counts a row: 4·hidden·ffn/G for the forward), `intra` and
//! `inter` = (intercept, slope) of the intra- and inter-node links, as α and β. A class the topology
//! lacks takes the other's fit, so that no prediction mixes measured and default links; with
//! neither (one rank), `base`'s stay. `copy_bytes_per_second` is not measured: `base`'s stays.
//! @throws error (invalid_argument) naming a fit whose slope is not positive or whose intercept is
//!         negative, or a missing `flops_per_row`.
[[nodiscard]] inline parm_cost_params to_parm_cost_params(compute_calibration const& compute,
                                                          link_calibration const& links, parm_cost_params base = {}) {
  char const* op = "to_parm_cost_params";
  base.gemm_flops = detail::flop_rate(op, "compute.", compute);
  if (links.intra_node) base.intra = detail::parm_link_of(op, *links.intra_node, "intra_node");
  if (links.inter_node) base.inter = detail::parm_link_of(op, *links.inter_node, "inter_node");
  if (!links.intra_node && links.inter_node) base.intra = base.inter;
  if (links.intra_node && !links.inter_node) base.inter = base.intra;
  return base;
}

MOECOMM_NAMESPACE_END
