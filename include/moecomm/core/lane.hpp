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
//! else `thread_lane`. A job runs its device work on `lane_backend(lane, be)` and communicates on
//! communicators of its own (`split_for(comm, lane_backend(lane, be))`, made once): the CUDA lane
//! (`cuda_lane`) has a stream of its own, and two threads never share a communicator or a stream. Models: `thread_lane` (a thread kept between uses: host and CUDA back-ends),
//! `actor_lane` (a second S4U actor on the rank's host: the simulated back-end, so the overlap shows
//! in simulated time). A lane is made once and kept, so a step that overlaps allocates nothing.
//! Work that only enqueues (NCCL's calls) needs no lane thread: `cuda_lane::enqueue(job, u)` runs
//! unit u on the caller's thread with its device work on the lane's stream, and `join()` orders the
//! rank's stream after it (Parm's pipelined collectives over NCCL, which a CUDA graph can capture).
//!
//! A lane's job may call collectives on a communicator of its own while the caller is in another
//! (Parm's fused all-to-all and all-gather). A communicator that looks for deadlocks then needs to
//! know the rank has one more thread that may still arrive: it sets `detail::current_lane_watcher`
//! on the rank's thread, and a `thread_lane` tells that watcher while it has released work to do.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

namespace detail {

//! Told when a lane of the calling rank starts a job and when the job is over.
class lane_watcher {
 public:
  virtual void lane_started() = 0;
  virtual void lane_stopped() = 0;

 protected:
  ~lane_watcher() = default;
};

//! The watcher of the rank whose thread this is (set by `inproc_world::run`; null elsewhere).
inline thread_local lane_watcher* current_lane_watcher = nullptr;

//! What every lane knows of its current job: which, how many units, how far released and done, and
//! its failure. The lane guards it with its own synchronisation; `run_unit` touches none of it.
struct lane_job {
  void* job = nullptr;
  void (*run)(void*, std::int32_t) = nullptr;
  std::int32_t units = 0, released = 0, finished = 0;
  std::exception_ptr failure;
  bool cancelled = false, active = false;

  template <class Job>
  void start(Job& j, std::int32_t n) {
    job = &j;
    run = [](void* p, std::int32_t unit) { (*static_cast<Job*>(p))(unit); };
    units = n;
    released = finished = 0;
    failure = nullptr;
    cancelled = false;
    active = true;
  }
  void release(std::int32_t unit) {
    if (unit + 1 > released) released = unit + 1;
  }
  [[nodiscard]] bool may_run(std::int32_t unit) const { return cancelled || released > unit; }
  [[nodiscard]] bool done(std::int32_t unit) const { return finished > unit || failure || !active; }
  //! Runs `unit` and returns its failure, if any (a `PassThrough` is rethrown unrecorded).
  template <class PassThrough = nothing_passes_through>
  [[nodiscard]] std::exception_ptr run_unit(std::int32_t unit) const {
    try {
      run(job, unit);
    } catch (PassThrough const&) {
      throw;
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }
  //! After `run_unit`: records the unit as done; false once the job failed.
  bool record(std::int32_t unit, std::exception_ptr unit_failure) {
    failure = std::move(unit_failure);
    finished = unit + 1;
    return !failure;
  }
};

}  // namespace detail

namespace detail {
template <class Backend, class = void>
struct has_bind_thread : std::false_type {};
template <class Backend>
struct has_bind_thread<Backend, std::void_t<decltype(std::declval<Backend const&>().bind_thread())>> : std::true_type {};
}  // namespace detail

//! A lane on a thread of its own, started on first use and kept until destruction. A back-end
//! with `bind_thread()` (the CUDA back-end: its device) has it called on the lane's thread before
//! the first unit, since a new thread does not inherit the rank thread's current device.
class thread_lane {
 public:
  template <class Backend>
  explicit thread_lane(Backend const& be) {
    if constexpr (detail::has_bind_thread<Backend>::value) bind_ = [be] { be.bind_thread(); };
  }
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
    watcher_ = detail::current_lane_watcher;
    job_.start(job, units);
    wake_.notify_all();
  }

  void release(std::int32_t unit) {
    std::lock_guard<std::mutex> lock(mutex_);
    job_.release(unit);
    tell_watcher();
    wake_.notify_all();
  }

  void wait(std::int32_t unit) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return job_.done(unit); });
    if (job_.failure) std::rethrow_exception(job_.failure);
  }

  void finish() {
    std::unique_lock<std::mutex> lock(mutex_);
    job_.cancelled = true;
    wake_.notify_all();
    wake_.wait(lock, [&] { return !job_.active; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return quit_ || job_.active; });
      if (quit_) return;
      for (std::int32_t unit = 0; unit < job_.units; ++unit) {
        wake_.wait(lock, [&] { return job_.may_run(unit); });
        if (job_.cancelled) break;
        lock.unlock();
        detail::current_lane_watcher = watcher_;  // a lane started by the job belongs to the same rank
        std::exception_ptr failure = bind_this_thread();
        if (!failure) failure = job_.run_unit(unit);
        lock.lock();
        bool const ok = job_.record(unit, std::move(failure));
        tell_watcher();
        wake_.notify_all();
        if (!ok) break;
      }
      job_.active = false;
      tell_watcher();
      wake_.notify_all();
    }
  }

  //! Binds the lane's thread to the back-end once (e.g. makes its device current); its failure fails
  //! the unit that needed it.
  std::exception_ptr bind_this_thread() {
    if (bound_ || !bind_) return nullptr;
    try {
      bind_();
      bound_ = true;
      return nullptr;
    } catch (...) {
      return std::current_exception();
    }
  }

  //! The lane counts as a thread of its rank while it has released work not yet done: waiting for
  //! a release it depends on the rank's own thread, and must not hide that thread's deadlock.
  //! Needs the lock.
  void tell_watcher() {
    bool const busy = job_.active && !job_.failure && job_.released > job_.finished;
    if (watcher_ == nullptr || busy == watched_) return;
    watched_ = busy;
    if (busy) watcher_->lane_started();
    else watcher_->lane_stopped();
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
  detail::lane_job job_;
  detail::lane_watcher* watcher_ = nullptr;  //!< of the rank that started the job
  bool watched_ = false;                     //!< the watcher counts this lane as busy
  bool quit_ = false;
  std::function<void()> bind_;  //!< the back-end's `bind_thread`, if it has one
  bool bound_ = false;           //!< touched by the lane's thread only
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

namespace detail {
template <class Lane, class = void>
struct has_own_backend : std::false_type {};
template <class Lane>
struct has_own_backend<Lane, std::void_t<decltype(std::declval<Lane const&>().backend())>> : std::true_type {};
}  // namespace detail

//! The back-end a lane's job runs its work on: the rank's own, unless the lane has a back-end of
//! its own (`backend()`: the CUDA lane's, on the lane's stream, ordered with the rank's by events).
template <class Lane, class Backend>
[[nodiscard]] Backend const& lane_backend(Lane const& lane, Backend const& be) {
  if constexpr (detail::has_own_backend<Lane>::value) return lane.backend();
  else return be;
}

//! Waits for unit `unit` of `lane`'s job, rethrowing its failure; on every exit the lane lets go
//! of the job (`finish`), so that the job's state may die.
template <class Lane>
void wait_and_finish(Lane& lane, std::int32_t unit) {
  struct finish_job {
    Lane& l;
    ~finish_job() { l.finish(); }
  } const finish{lane};
  lane.wait(unit);
}

MOECOMM_NAMESPACE_END
