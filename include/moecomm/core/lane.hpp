// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Lanes: how the library overlaps work. A lane runs a job's units one after another, each as soon
//! as the caller has released it, while the caller goes on with its own work; the caller later waits
//! for a unit, which rethrows the job's failure. It is a stream with events: `release(u)` records
//! "unit u's inputs are ready", `wait(u)` waits for "unit u is done".
//!
//! | member | meaning |
//! |---|---|
//! | `start(job, units)` | `job(u)` for u = 0 .. units − 1 will run in order, each after `release(u)`; `job` must outlive `finish` |
//! | `release(u)` | unit u (and every earlier one) may run |
//! | `wait(u)` | returns when unit u has run; rethrows the failure of any unit up to u |
//! | `finish()` | units not released never run; returns when the lane no longer touches the job |
//!
//! Which lane a back-end uses is `lane_t<Backend>`: the back-end's `lane_type` if it names one,
//! else `thread_lane`. Models: `thread_lane` (a thread kept between uses: host and CUDA back-ends),
//! `actor_lane` (a second S4U actor on the rank's host: the simulated back-end, so the overlap shows
//! in simulated time). A lane is made once and kept, so a step that overlaps allocates nothing.

#include <moecomm/config.hpp>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

//! A lane on a thread of its own, started on first use and kept until destruction.
class thread_lane {
 public:
  template <class Backend>
  explicit thread_lane(Backend const&) {}
  thread_lane(thread_lane const&) = delete;
  thread_lane& operator=(thread_lane const&) = delete;
  ~thread_lane() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  template <class Job>
  void start(Job& job, std::int32_t units) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &job;
    run_ = [](void* j, std::int32_t unit) { (*static_cast<Job*>(j))(unit); };
    units_ = units;
    released_ = finished_ = 0;
    failure_ = nullptr;
    cancelled_ = false;
    active_ = true;
    wake_.notify_all();
  }

  void release(std::int32_t unit) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (unit + 1 > released_) released_ = unit + 1;
    wake_.notify_all();
  }

  void wait(std::int32_t unit) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return finished_ > unit || failure_ || !active_; });
    if (failure_) std::rethrow_exception(failure_);
  }

  void finish() {
    std::unique_lock<std::mutex> lock(mutex_);
    cancelled_ = true;
    wake_.notify_all();
    wake_.wait(lock, [&] { return !active_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return quit_ || active_; });
      if (quit_) return;
      for (std::int32_t unit = 0; unit < units_; ++unit) {
        wake_.wait(lock, [&] { return cancelled_ || released_ > unit; });
        if (cancelled_) break;
        lock.unlock();
        std::exception_ptr failure;
        try {
          run_(job_, unit);
        } catch (...) {
          failure = std::current_exception();
        }
        lock.lock();
        failure_ = failure;
        finished_ = unit + 1;
        wake_.notify_all();
        if (failure_) break;
      }
      active_ = false;
      wake_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
  void* job_ = nullptr;
  void (*run_)(void*, std::int32_t) = nullptr;
  std::int32_t units_ = 0, released_ = 0, finished_ = 0;
  std::exception_ptr failure_;
  bool cancelled_ = false, active_ = false, quit_ = false;
};

namespace detail {
template <class Backend, class = void>
struct lane_of {
  using type = thread_lane;
};
template <class Backend>
struct lane_of<Backend, std::void_t<typename Backend::lane_type>> {
  using type = typename Backend::lane_type;
};
}  // namespace detail

//! The lane `Backend` overlaps work with.
template <class Backend>
using lane_t = typename detail::lane_of<Backend>::type;

MOECOMM_NAMESPACE_END
