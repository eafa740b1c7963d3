// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `detail::step_worker`: the thread on which the smart schedule computes while its exchanges run.
//! It is made once and kept between calls, so a pipelined step allocates nothing (a thread and a
//! shared state per pairwise step, as `std::async` costs, would).

#include <moecomm/config.hpp>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Runs one job at a time: `job(-1)` (the home experts) at once, then `job(j)` for j = 0, 1, ...,
//! each as soon as the caller has marked step j ready, one after the other, in order.
class step_worker {
 public:
  step_worker() = default;
  step_worker(step_worker const&) = delete;
  step_worker& operator=(step_worker const&) = delete;
  ~step_worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  //! Starts `job` over `steps` steps. The job must outlive the matching `finish`.
  template <class Job>
  void start(Job& job, std::int32_t steps) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &job;
    run_ = [](void* j, std::int32_t step) { (*static_cast<Job*>(j))(step); };
    steps_ = steps;
    ready_ = finished_ = 0;
    failure_ = nullptr;
    cancelled_ = false;
    active_ = true;
    wake_.notify_all();
  }

  //! Step `step`'s rows have arrived: the worker may compute it.
  void mark_ready(std::int32_t step) {
    std::lock_guard<std::mutex> lock(mutex_);
    ready_ = step + 1;
    wake_.notify_all();
  }

  //! Waits until step `step` is computed; rethrows the job's failure (from the home experts or any
  //! step up to this one).
  void wait_done(std::int32_t step) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return finished_ >= step + 2 || failure_ || !active_; });
    if (failure_) std::rethrow_exception(failure_);
  }

  //! Ends the job: what has not started never will, and on return the worker no longer touches it.
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
      for (std::int32_t unit = 0; unit <= steps_; ++unit) {  // unit 0: the home experts; unit j + 1: step j
        wake_.wait(lock, [&] { return cancelled_ || unit == 0 || ready_ >= unit; });
        if (cancelled_) break;
        lock.unlock();
        std::exception_ptr failure;
        try {
          run_(job_, unit - 1);
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
  std::int32_t steps_ = 0, ready_ = 0, finished_ = 0;
  std::exception_ptr failure_;
  bool cancelled_ = false, active_ = false, quit_ = false;
};

}  // namespace detail
MOECOMM_NAMESPACE_END
