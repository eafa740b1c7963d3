// SPDX-License-Identifier: Apache-2.0
// The emulated CUDA runtime: devices, memory, streams, events and the ordering contract.
//
// Ordering is checked with vector clocks. Every stream counts the operations enqueued on it; a
// stream's clock says, for every other stream, how many of its operations are ordered before the
// stream's latest one (through events, the legacy stream's implicit synchronisation, or a host
// wait of the enqueueing thread). Every allocation remembers, by byte range, its last writes and the
// reads since (a kernel's use runs from the lowest address it was given to the allocation's end);
// an operation that uses it on another stream must find them in its stream's clock.
//
// A capture keeps clocks of its own, over its nodes: each stream of the capture counts its nodes,
// and knows, for every stream of the capture, how many of its nodes are ordered before its next
// one (through events); the origin must know every stream's last node when the capture ends.

#include "core.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <unistd.h>
#include <sys/mman.h>

namespace moecomm_emulation {
namespace detail {
namespace {

constexpr std::size_t page = 4096;

using clock_vector = std::vector<std::pair<int, std::uint64_t>>;  // (stream id, operations), by id

std::uint64_t clock_of(clock_vector const& c, int id) {
  auto it = std::lower_bound(c.begin(), c.end(), std::make_pair(id, std::uint64_t{0}));
  return it != c.end() && it->first == id ? it->second : 0;
}
void advance(clock_vector& c, int id, std::uint64_t value) {
  auto it = std::lower_bound(c.begin(), c.end(), std::make_pair(id, std::uint64_t{0}));
  if (it != c.end() && it->first == id) it->second = std::max(it->second, value);
  else c.insert(it, {id, value});
}
void merge(clock_vector& into, clock_vector const& from) {
  for (auto const& [id, value] : from) advance(into, id, value);
}

struct capture_state;

struct stream_state {
  int id = 0;
  int device = 0;
  bool legacy = false;    // the device's legacy default stream (handle 0)
  bool blocking = true;   // synchronises with the legacy stream (cudaStreamDefault)
  std::uint64_t enqueued = 0;
  std::atomic<std::uint64_t> completed{0};
  clock_vector knows;     // ordered before the latest enqueued operation
  std::mutex queue_lock;
  std::condition_variable queue_ready;
  std::deque<std::function<void()>> queue;
  bool stopping = false;
  std::string last_operation;
  std::shared_ptr<capture_state> capture;  // the capture it records into: its own, or one it joined
  clock_vector capture_knows;              // per stream of the capture: its nodes ordered before this one's next
};

struct event_state {
  int device = 0;         // the device current when it was created: it is recorded on that device's streams only
  bool recorded = false;
  std::shared_ptr<stream_state> stream;
  std::uint64_t seq = 0;
  clock_vector knows;
  std::shared_ptr<capture_state> capture;  // last recorded during this capture: a point of its graph
  clock_vector capture_knows;
};

//! A captured operation: enqueues it, checked, on the stream a graph is launched on.
using graph_node = std::function<cudaError_t(cudaStream_t)>;

struct capture_state {
  unsigned long long id = 0;  // unique in the process (cudaStreamGetCaptureInfo)
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;     // the thread that began it
  std::shared_ptr<stream_state> origin;
  std::vector<std::shared_ptr<stream_state>> members;  // the origin and the streams that joined it
  clock_vector captured;      // per member: its nodes so far
  std::vector<graph_node> nodes;  // in capture order
  bool invalidated = false, ended = false;
  std::string invalidated_by;  // the refused call's message
};

struct graph_state {  // a captured graph, or an instantiated one (a copy)
  std::vector<graph_node> nodes;
};

struct access_record {
  int stream = 0;
  std::uint64_t seq = 0;
  std::string what;
  std::uintptr_t begin = 0, end = 0;  // the bytes used
  bool write = false;
};

struct allocation {
  std::uintptr_t base = 0;
  std::size_t bytes = 0, reserved = 0;
  bool device = true;     // false: pinned host memory
  bool released = false;  // cudaFreeAsync was called; the memory goes when its stream gets there
  int dev = 0;
  std::string origin;
  std::vector<access_record> uses;  // the last write of each byte range and the reads since
};

struct thread_state {
  int device = 0;
  clock_vector knows;
  cudaError_t last_error = cudaSuccess;
  std::string message;                        // the last violation's text
  cudaError_t message_error = cudaSuccess;    // the error it explains
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;  // cudaThreadExchangeStreamCaptureMode's
};
thread_local thread_state this_thread;

// The kernel a worker thread is running, for the fault handler's message.
thread_local char const* running_kernel = nullptr;

// Device memory is inaccessible until a stream's worker touches it: the fault opens the page for
// the job, which closes it when it ends. A host thread's touch faults, and stops the process.
// Fixed-size and trivially destructible: the fault handler may neither allocate nor register a
// thread-local destructor. A job that opens more pages leaves the rest open until it is freed.
constexpr int max_opened_pages = 8192;
thread_local bool is_worker = false;
thread_local std::uintptr_t opened_pages[max_opened_pages];  // by this worker's current job
thread_local int opened_count = 0;

struct emulator {
  std::mutex lock;  // everything below but the queues
  int devices = 8;
  int next_stream = 1;
  std::map<std::uintptr_t, std::shared_ptr<allocation>> memory;  // by base address
  std::map<stream_state*, std::shared_ptr<stream_state>> streams;
  std::vector<std::shared_ptr<stream_state>> legacy;              // per device, made on first use
  std::map<event_state*, std::shared_ptr<event_state>> events;
  std::vector<std::string> violations;
  std::set<std::pair<int, int>> peer_access;  // (from, to): kernels on `from` may use memory of `to`
  std::vector<std::int64_t> waits;            // per device: host waits for its streams and events
  std::vector<std::int64_t> allocations;      // per device: cudaMalloc and cudaMallocAsync of its memory
  std::deque<std::shared_ptr<allocation>> freed;  // the latest frees, kept inaccessible to name a use after free
  std::vector<std::shared_ptr<capture_state>> captures;  // the ongoing ones
  unsigned long long next_capture = 1;
  std::map<graph_state*, std::shared_ptr<graph_state>> graphs, executables;
  std::vector<std::int64_t> graph_launches;   // per device: cudaGraphLaunch on its streams
  std::mutex done_lock;
  std::condition_variable done;

  emulator() {
    if (char const* n = std::getenv("MOECOMM_EMULATED_DEVICES")) devices = std::max(1, std::atoi(n));
    legacy.resize(static_cast<std::size_t>(devices));
    waits.resize(static_cast<std::size_t>(devices));
    allocations.resize(static_cast<std::size_t>(devices));
    graph_launches.resize(static_cast<std::size_t>(devices));
  }
};

emulator& emu() {
  static emulator* const e = new emulator;  // never destroyed: detached workers may outlive main
  return *e;
}

//! One host wait for work of `device`, by any thread (emu().lock held; a function of its own, so
//! that a debugger can stop on each).
[[gnu::noinline]] void count_host_wait(int device) { ++emu().waits[static_cast<std::size_t>(device)]; }

void close_opened_pages();

void worker_loop(std::shared_ptr<stream_state> s) {
  is_worker = true;
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> hold(s->queue_lock);
      s->queue_ready.wait(hold, [&] { return !s->queue.empty() || s->stopping; });
      if (s->queue.empty()) return;
      job = std::move(s->queue.front());
      s->queue.pop_front();
    }
    job();
    close_opened_pages();
    {
      std::lock_guard<std::mutex> hold(emu().done_lock);
      s->completed.fetch_add(1, std::memory_order_release);
    }
    emu().done.notify_all();
  }
}

std::shared_ptr<stream_state> new_stream(int device, bool legacy, bool blocking) {  // emu().lock held
  auto s = std::make_shared<stream_state>();
  s->id = emu().next_stream++;
  s->device = device;
  s->legacy = legacy;
  s->blocking = blocking;
  std::thread(worker_loop, s).detach();
  return s;
}

std::shared_ptr<stream_state> legacy_stream(int device) {  // emu().lock held
  auto& slot = emu().legacy[static_cast<std::size_t>(device)];
  if (!slot) slot = new_stream(device, true, true);
  return slot;
}

//! The stream of a handle, or null for an unknown one (emu().lock held).
std::shared_ptr<stream_state> find_stream(cudaStream_t handle) {
  if (handle == nullptr || handle == cudaStreamLegacy) return legacy_stream(this_thread.device);
  auto it = emu().streams.find(reinterpret_cast<stream_state*>(handle));
  return it == emu().streams.end() ? nullptr : it->second;
}

std::string stream_label(stream_state const& s) {
  std::ostringstream out;
  if (s.legacy) out << "the legacy default stream of device " << s.device;
  else out << "stream " << s.id << " (device " << s.device << ")";
  return out.str();
}

void wait_until(stream_state const& s, std::uint64_t target) {
  std::unique_lock<std::mutex> hold(emu().done_lock);
  emu().done.wait(hold, [&] { return s.completed.load(std::memory_order_acquire) >= target; });
}

//! The allocation holding `p`, also one past its end (emu().lock held).
allocation* find_allocation(void const* p) {
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  auto it = emu().memory.upper_bound(a);
  if (it == emu().memory.begin()) return nullptr;
  --it;
  return a <= it->second->base + it->second->bytes ? it->second.get() : nullptr;
}

std::string describe_allocation(allocation const& a) {
  std::ostringstream out;
  out << "a " << a.bytes << "-byte " << (a.device ? "device allocation of " : "pinned host allocation of ") << a.origin;
  if (a.device) out << " on device " << a.dev;
  return out.str();
}

cudaError_t fail(cudaError_t e) {
  this_thread.last_error = e;
  return e;
}

//! Fails the call with `error`, which `cudaGetErrorString(error)` then explains by `message` on
//! this thread.
cudaError_t fail_with(cudaError_t error, std::string message) {
  this_thread.message = std::move(message);
  this_thread.message_error = error;
  return fail(error);
}

//! Records a violation that call fails with `error` (emu().lock held): `cudaGetErrorString(error)`
//! then returns the message on this thread.
cudaError_t record_violation(std::string message, cudaError_t error = cudaErrorNotPermitted) {
  emu().violations.push_back(message);
  return fail_with(error, std::move(message));
}

//! Checks `use` by operation `seq` on stream `s`, then records it (emu().lock held).
cudaError_t check_use(stream_state const& s, std::uint64_t seq, char const* call, buffer_use const& use) {
  allocation* a = find_allocation(use.ptr);
  if (a == nullptr || use.bytes == 0) return cudaSuccess;  // host memory: TSan watches it
  std::uintptr_t const p = reinterpret_cast<std::uintptr_t>(use.ptr);
  if (a->released) {
    std::ostringstream out;
    out << call << " on " << stream_label(s) << " uses '" << use.role << "' in " << describe_allocation(*a)
        << " after cudaFreeAsync released it";
    return record_violation(out.str());
  }
  if (p + use.bytes > a->base + a->bytes) {
    std::ostringstream out;
    out << call << " on " << stream_label(s) << ": '" << use.role << "' spans " << use.bytes << " bytes from byte "
        << (p - a->base) << " of " << describe_allocation(*a) << ", past its end";
    return record_violation(out.str());
  }
  bool const writes = use.mode != access::read;
  std::uintptr_t const end = p + use.bytes;
  auto unordered = [&](access_record const& r) { return r.stream != s.id && clock_of(s.knows, r.stream) < r.seq; };
  for (access_record const& r : a->uses) {
    if (r.end <= p || end <= r.begin || !(r.write || writes) || !unordered(r)) continue;
    std::ostringstream out;
    out << call << " on " << stream_label(s) << (writes ? " writes '" : " reads '") << use.role << "' (bytes "
        << (p - a->base) << " to " << (end - a->base) << " of " << describe_allocation(*a) << ") while " << r.what << " ("
        << (r.write ? "a write" : "a read") << " of bytes " << (r.begin - a->base) << " to " << (r.end - a->base)
        << ") is not ordered before it: no event recorded after it was waited for on this stream, and no host wait "
           "in between (cudaEventRecord + cudaStreamWaitEvent)";
    return record_violation(out.str());
  }
  if (writes)  // a write supersedes what it covers
    a->uses.erase(std::remove_if(a->uses.begin(), a->uses.end(), [&](access_record const& r) { return p <= r.begin && r.end <= end; }),
                  a->uses.end());
  else  // this stream's earlier read of the same bytes
    a->uses.erase(std::remove_if(a->uses.begin(), a->uses.end(),
                                 [&](access_record const& r) { return !r.write && r.stream == s.id && r.begin == p && r.end == end; }),
                  a->uses.end());
  if (a->uses.size() >= 4096) a->uses.erase(a->uses.begin());  // bounded: the oldest goes unchecked
  a->uses.push_back({s.id, seq, std::string(call) + " on " + stream_label(s), p, end, writes});
  return cudaSuccess;
}

char const* mode_name(cudaStreamCaptureMode mode) {
  switch (mode) {
    case cudaStreamCaptureModeGlobal: return "cudaStreamCaptureModeGlobal";
    case cudaStreamCaptureModeThreadLocal: return "cudaStreamCaptureModeThreadLocal";
    default: return "cudaStreamCaptureModeRelaxed";
  }
}

//! Invalidates capture `c` (emu().lock held): its streams record nothing more, and
//! cudaStreamEndCapture returns cudaErrorStreamCaptureInvalidated and no graph.
void invalidate(capture_state& c, std::string const& why) {
  if (!c.invalidated) c.invalidated_by = why;
  c.invalidated = true;
  c.nodes.clear();
}

//! Refuses a call that breaks a rule of stream capture (emu().lock held): a violation, and, as CUDA
//! does, the captures in `spoiled` (null: none) are invalidated.
cudaError_t refuse_in_capture(std::string message, cudaError_t error, std::vector<capture_state*> const& spoiled) {
  for (capture_state* c : spoiled)
    if (c != nullptr) invalidate(*c, message);
  return record_violation(std::move(message), error);
}

//! The error of `call` on `s`, whose capture was invalidated (emu().lock held).
cudaError_t invalidated_capture(stream_state const& s, char const* call) {
  return fail_with(cudaErrorStreamCaptureInvalidated, std::string(call) + " on " + stream_label(s) +
                                                          ", whose CUDA graph capture was invalidated: " + s.capture->invalidated_by);
}

//! Records `replay` as the next node of the capture `s` records into (emu().lock held).
cudaError_t record_node(stream_state& s, char const* call, graph_node replay) {
  capture_state& c = *s.capture;
  if (c.invalidated) return invalidated_capture(s, call);
  c.nodes.push_back(std::move(replay));
  std::uint64_t const mine = clock_of(c.captured, s.id) + 1;
  advance(c.captured, s.id, mine);
  advance(s.capture_knows, s.id, mine);
  return cudaSuccess;
}

//! The capture of a blocking stream of `device`, which work on the legacy stream would implicitly
//! depend on, or null (emu().lock held).
capture_state* blocking_capture(int device) {
  for (auto const& [key, other] : emu().streams)
    if (other->device == device && other->blocking && other->capture) return other->capture.get();
  return nullptr;
}

//! Refuses `call` on the legacy stream while a blocking stream of its device captures (emu().lock
//! held); cudaSuccess when none does.
cudaError_t refuse_implicit_dependency(stream_state const& legacy, char const* call) {
  capture_state* const c = blocking_capture(legacy.device);
  if (c == nullptr) return cudaSuccess;
  std::ostringstream out;
  out << call << " on " << stream_label(legacy) << " while " << stream_label(*c->origin)
      << ", a blocking stream, captures a CUDA graph: the legacy stream would depend on the capture (create the capturing "
         "stream with cudaStreamNonBlocking, or use another stream)";
  return refuse_in_capture(out.str(), cudaErrorStreamCaptureImplicit, {c});
}

//! Whether capture `c` forbids the calling thread's potentially unsafe calls: CUDA's rule, by the
//! thread's mode (cudaThreadExchangeStreamCaptureMode). Global: the thread's own captures not
//! begun relaxed, and other threads' captures begun global; thread-local: its own captures not
//! begun relaxed; relaxed: none.
bool forbids_unsafe_calls(capture_state const& c) {
  bool const own = c.thread == std::this_thread::get_id();
  switch (this_thread.capture_mode) {
    case cudaStreamCaptureModeGlobal: return own ? c.mode != cudaStreamCaptureModeRelaxed : c.mode == cudaStreamCaptureModeGlobal;
    case cudaStreamCaptureModeThreadLocal: return own && c.mode != cudaStreamCaptureModeRelaxed;
    default: return false;
  }
}

//! Refuses potentially unsafe `call` (an allocation, a free, a synchronous copy, a device
//! synchronisation: work no capture sees) while a capture forbids it (emu().lock held); cudaSuccess
//! when none does.
cudaError_t refuse_unsafe(char const* call) {
  std::vector<capture_state*> forbidding;
  for (auto const& c : emu().captures)
    if (forbids_unsafe_calls(*c)) forbidding.push_back(c.get());
  if (forbidding.empty()) return cudaSuccess;
  capture_state const& c = *forbidding.front();
  std::ostringstream out;
  out << call << " while " << stream_label(*c.origin) << " captures a CUDA graph (begun with " << mode_name(c.mode) << " on "
      << (c.thread == std::this_thread::get_id() ? "this" : "another") << " thread; this thread's capture mode is "
      << mode_name(this_thread.capture_mode)
      << "): a potentially unsafe call during a capture (allocate, free and synchronise before cudaStreamBeginCapture or after "
         "cudaStreamEndCapture)";
  return refuse_in_capture(out.str(), cudaErrorStreamCaptureUnsupported, forbidding);
}

//! Refuses host wait `call` for capturing stream `s`, in any mode: its captured work never runs
//! (emu().lock held).
cudaError_t refuse_host_wait(stream_state const& s, char const* call) {
  return refuse_in_capture(std::string(call) + " on " + stream_label(s) +
                               " while it captures a CUDA graph: a captured step may not wait on the host",
                           cudaErrorStreamCaptureUnsupported, {s.capture.get()});
}

//! Refuses `call` on an event last recorded during a capture, in any mode (emu().lock held): that
//! record is a point of the graph, never reached as such. The capture, unless it ended, and
//! `waiting`, the capture of a stream that would wait for it, are invalidated.
cudaError_t refuse_captured_event(event_state const& ev, char const* call, capture_state* waiting = nullptr) {
  std::ostringstream out;
  out << call << " of an event last recorded on " << stream_label(*ev.stream)
      << " during a CUDA graph's capture: that record is a point of the graph, not work the host or a stream can wait for "
         "(record the event again outside the capture)";
  return refuse_in_capture(out.str(), cudaErrorCapturedEvent, {ev.capture->ended ? nullptr : ev.capture.get(), waiting});
}

//! Refuses `call` on capturing stream `s`, stricter than CUDA: `what` says why (emu().lock held).
cudaError_t refuse_on_capturing_stream(stream_state const& s, char const* call, char const* what) {
  return refuse_in_capture(std::string(call) + " on " + stream_label(s) + " while it captures a CUDA graph: " + what,
                           cudaErrorStreamCaptureUnsupported, {s.capture.get()});
}

//! Enqueues `job` on `s` now (emu().lock held): the stream learns what the host thread knows and
//! what the legacy stream's rules order before it; `uses` are checked first.
cudaError_t queue_locked(std::shared_ptr<stream_state> const& s, char const* call, std::vector<buffer_use> const& uses,
                         std::function<void()> job) {
  clock_vector knows = s->knows;
  merge(knows, this_thread.knows);
  std::vector<std::pair<std::shared_ptr<stream_state>, std::uint64_t>> after;  // implicit waits
  auto order_after = [&](std::shared_ptr<stream_state> const& other) {
    if (other == s || other->enqueued == 0) return;
    merge(knows, other->knows);
    after.emplace_back(other, other->enqueued);
  };
  if (s->legacy) {
    for (auto const& [key, other] : emu().streams)
      if (other->device == s->device && other->blocking) order_after(other);
  } else if (s->blocking) {
    order_after(legacy_stream(s->device));
  }
  std::uint64_t const seq = s->enqueued + 1;
  advance(knows, s->id, seq);
  stream_state probe;
  probe.id = s->id;
  probe.device = s->device;
  probe.legacy = s->legacy;
  probe.knows = knows;
  for (buffer_use const& use : uses)
    if (cudaError_t const e = check_use(probe, seq, call, use); e != cudaSuccess) return e;
  s->knows = std::move(knows);
  s->enqueued = seq;
  s->last_operation = call;
  {
    std::lock_guard<std::mutex> hold(s->queue_lock);
    s->queue.push_back([after = std::move(after), job = std::move(job), call] {
      for (auto const& [other, target] : after) wait_until(*other, target);
      running_kernel = call;
      job();
      running_kernel = nullptr;
    });
  }
  s->queue_ready.notify_one();
  return cudaSuccess;
}

//! Enqueues `job` on `s` (emu().lock held), or, while `s` captures, records it as a node that
//! enqueues it on a launch's stream, checked then: a captured job runs at every launch.
cudaError_t enqueue_locked(std::shared_ptr<stream_state> const& s, char const* call, std::vector<buffer_use> const& uses,
                           std::function<void()> job) {
  if (s->legacy)
    if (cudaError_t const e = refuse_implicit_dependency(*s, call); e != cudaSuccess) return e;
  if (s->capture)
    return record_node(*s, call, [call, uses, job](cudaStream_t on) { return moecomm_emulation::enqueue(on, call, uses, job); });
  return queue_locked(s, call, uses, std::move(job));
}

//! The host thread waited for everything enqueued on `s` so far.
void learn_from(stream_state const& s) { merge(this_thread.knows, s.knows); }

// Device addresses come from one reserved, inaccessible range. No allocation holds an address
// whose low 32 bits are below 2^20: a kernel argument word that is a small int32 beside four bytes
// of padding (which may hold the high half of any pointer) is then never taken for a device pointer.
std::uintptr_t arena_bytes = 0;  // set with the arena: the largest reservation the process allows
constexpr std::uintptr_t window = std::uintptr_t{1} << 32, window_gap = std::uintptr_t{1} << 20;

//! `reserved` bytes of device address space (emu().lock held); 0 when the range is used up.
std::uintptr_t arena_base() {
  static std::uintptr_t const base = [] {
    for (int log2 = 42; log2 >= 34; --log2) {  // 4 TiB of addresses, less where a sanitizer keeps the rest
      void* p = mmap(nullptr, std::uintptr_t{1} << log2, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) continue;
      arena_bytes = std::uintptr_t{1} << log2;
      return reinterpret_cast<std::uintptr_t>(p);
    }
    return std::uintptr_t{0};
  }();
  return base;
}

bool in_arena(std::uintptr_t a) { return arena_base() != 0 && a >= arena_base() && a < arena_base() + arena_bytes; }

std::uintptr_t device_addresses(std::size_t reserved) {
  std::uintptr_t const base = arena_base();
  static std::uintptr_t next = base;
  if (base == 0) return 0;
  std::uintptr_t at = next;
  if (at % window < window_gap) at += window_gap - at % window;
  if ((at + reserved - 1) / window != at / window) at = (at / window + 1) * window + window_gap;  // never across a window
  if (reserved > window - window_gap || at + reserved > base + arena_bytes) return 0;
  next = at + reserved;
  return at;
}

// A host access to device memory faults on its reserved, inaccessible pages: say which.
struct sigaction previous_segv;

void say(char const* text, int n) {
  if (n > 0) (void)!write(2, text, static_cast<std::size_t>(n));
}

void on_segv(int sig, siginfo_t* info, void* context) {
  auto const a = reinterpret_cast<std::uintptr_t>(info->si_addr);
  if (in_arena(a)) {
    // No thread touches device memory while it holds the lock (the emulation's own code reads
    // only host memory under it), so the faulting thread may wait for it.
    std::unique_lock<std::mutex> hold(emu().lock);
    {
      char text[512];
      auto it = emu().memory.upper_bound(a);
      if (it != emu().memory.begin()) {
        --it;
        allocation const& m = *it->second;
        if (m.device && a < m.base + m.bytes) {
          if (is_worker) {  // a stream's job: open the page for it
            std::uintptr_t const first = a & ~(std::uintptr_t{page} - 1);
            mprotect(reinterpret_cast<void*>(first), page, PROT_READ | PROT_WRITE);
            if (opened_count < max_opened_pages) opened_pages[opened_count++] = first;
            return;
          }
          say(text, std::snprintf(text, sizeof text,
                                  "moecomm CUDA emulation: the host touched device memory at byte %zu of a %zu-byte "
                                  "device allocation of %s on device %d; device memory is read by cudaMemcpy (after a "
                                  "wait), never dereferenced on the host\n",
                                  static_cast<std::size_t>(a - m.base), m.bytes, m.origin.c_str(), m.dev));
          std::abort();
        }
      }
      for (auto const& f : emu().freed)
        if (a >= f->base && a < f->base + f->reserved) {
          say(text, std::snprintf(text, sizeof text,
                                  "moecomm CUDA emulation: %s touched byte %zu of a %zu-byte device allocation of %s on "
                                  "device %d after it was freed\n",
                                  running_kernel != nullptr ? running_kernel : "the host", static_cast<std::size_t>(a - f->base),
                                  f->bytes, f->origin.c_str(), f->dev));
          std::abort();
        }
      say(text, std::snprintf(text, sizeof text, "moecomm CUDA emulation: %s touched device address 0x%zx, which no allocation holds\n",
                              running_kernel != nullptr ? running_kernel : "the host", static_cast<std::size_t>(a)));
      std::abort();
    }
  }
  if (previous_segv.sa_flags & SA_SIGINFO) previous_segv.sa_sigaction(sig, info, context);
  else if (previous_segv.sa_handler != SIG_DFL && previous_segv.sa_handler != SIG_IGN) previous_segv.sa_handler(sig);
  else {
    signal(sig, SIG_DFL);
    raise(sig);
  }
}

//! Closes the pages the worker's job opened.
void close_opened_pages() {
  for (int i = 0; i < opened_count; ++i) mprotect(reinterpret_cast<void*>(opened_pages[i]), page, PROT_NONE);
  opened_count = 0;
}

//! Installs the fault handler unless it is in place (a test framework may have replaced it).
void install_segv_handler() {
  static std::mutex lock;
  std::lock_guard<std::mutex> hold(lock);
  struct sigaction current {};
  sigaction(SIGSEGV, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_segv) return;
  struct sigaction action {};
  action.sa_sigaction = on_segv;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &previous_segv);
}

cudaError_t allocate_device(void** out, std::size_t bytes, std::string origin, int device, std::shared_ptr<stream_state> const& s,
                            char const* call) {
  *out = nullptr;
  if (bytes == 0) return cudaSuccess;
  ++emu().allocations[static_cast<std::size_t>(device)];
  install_segv_handler();
  std::size_t const mapped = (bytes + page - 1) / page * page;
  std::size_t const reserved = mapped + page;  // a guard page: one past the end is never another allocation
  std::uintptr_t const address = device_addresses(reserved);
  void* const at = reinterpret_cast<void*>(address);
  if (address == 0 || mmap(at, mapped, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) == MAP_FAILED)
    return fail(cudaErrorMemoryAllocation);
  std::memset(at, 0xff, bytes);  // never zeroed, as on a GPU: unwritten floats read as NaN
  mprotect(at, mapped, PROT_NONE);
  auto a = std::make_shared<allocation>();
  a->base = address;
  a->bytes = bytes;
  a->reserved = reserved;
  a->dev = device;
  a->origin = std::move(origin);
  if (s) {  // stream-ordered: the allocation is a write by the stream
    a->uses.push_back({s->id, s->enqueued, std::string(call) + " on " + stream_label(*s), a->base, a->base + bytes, true});
  }
  emu().memory[a->base] = a;
  *out = reinterpret_cast<void*>(address);
  return cudaSuccess;
}

//! Frees `a` once its stream reached the free (emu().lock held): its pages stay reserved and
//! inaccessible for a while, so that a late use faults with a message instead of reading garbage.
void quarantine(std::shared_ptr<allocation> const& a) {
  std::size_t const mapped = (a->bytes + page - 1) / page * page;
  void* const at = reinterpret_cast<void*>(a->base);
  mprotect(at, mapped, PROT_NONE);
  madvise(at, mapped, MADV_DONTNEED);
  emu().freed.push_back(a);
  if (emu().freed.size() > 1024) emu().freed.pop_front();  // its device addresses are never handed out again
}

// Why cudaMallocAsync and cudaFreeAsync are refused on a capturing stream.
constexpr char const* stream_ordered_memory =
    "the emulation refuses stream-ordered allocation in a capture, where CUDA would make a memory node: a captured step "
    "allocates and frees nothing (allocate before cudaStreamBeginCapture)";

//! Releases `p` (emu().lock held); the memory is unmapped when the stream reaches the free.
cudaError_t release_device(void* p, char const* call, std::shared_ptr<stream_state> const& s) {
  if (p == nullptr) return cudaSuccess;
  auto it = emu().memory.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == emu().memory.end() || !it->second->device || it->second->released) {
    std::ostringstream out;
    out << call << ": " << p << " is not the start of a live device allocation";
    return record_violation(out.str());
  }
  if (s->capture) return refuse_on_capturing_stream(*s, call, stream_ordered_memory);
  std::shared_ptr<allocation> a = it->second;
  std::vector<buffer_use> const uses{{p, a->bytes, access::write, "devPtr"}};
  cudaError_t const e = enqueue_locked(s, call, uses, [a] {
    std::lock_guard<std::mutex> hold(emu().lock);
    emu().memory.erase(a->base);
    quarantine(a);
  });
  if (e == cudaSuccess) a->released = true;
  return e;
}

}  // namespace

memory_info describe(void const* p, std::size_t bytes) {
  std::lock_guard<std::mutex> hold(emu().lock);
  memory_info info;
  allocation const* a = find_allocation(p);
  if (a == nullptr) {
    info.description = "pageable host memory";
    return info;
  }
  info.kind = a->device ? memory_info::device_memory : memory_info::pinned_host;
  info.device = a->device ? a->dev : -1;
  info.whole = reinterpret_cast<std::uintptr_t>(p) + bytes <= a->base + a->bytes;
  info.description = describe_allocation(*a);
  return info;
}

int current_device() { return this_thread.device; }

int stream_device(cudaStream_t stream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  return s ? s->device : -1;
}

int stream_id(cudaStream_t stream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  return s ? s->id : -1;
}

cudaError_t violation(std::string message) {
  std::lock_guard<std::mutex> hold(emu().lock);
  return record_violation(std::move(message));
}

bool capturing(cudaStream_t stream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  return s && s->capture;
}

cudaError_t capture_node(cudaStream_t stream, char const* call, std::function<cudaError_t(cudaStream_t)> replay) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s || !s->capture) return fail(cudaErrorIllegalState);
  return record_node(*s, call, std::move(replay));
}

}  // namespace detail

using namespace detail;

cudaError_t enqueue(cudaStream_t stream, char const* call, std::vector<buffer_use> const& uses, std::function<void()> job) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  cudaError_t const e = enqueue_locked(s, call, uses, std::move(job));
  return e == cudaSuccess ? e : fail(e);
}

cudaError_t check_kernel_launch(cudaStream_t stream, char const* kernel, std::vector<detail::kernel_pointer> const& pointers,
                                std::vector<buffer_use>& uses) {
  install_segv_handler();
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  if (s->device != this_thread.device) {
    std::ostringstream out;
    out << "kernel '" << kernel << "' launched on " << stream_label(*s) << " from a thread whose current device is "
        << this_thread.device << ": call cudaSetDevice(" << s->device << ") on this thread first";
    return fail(record_violation(out.str()));
  }
  for (std::size_t k = 0; k < pointers.size(); ++k) {
    // A pointer into an allocation of this device (or of a peer whose memory this device may
    // access) is a buffer the kernel may use: a sized view's bytes, or from a raw pointer to the
    // allocation's end (moecomm's kernels index forward from the pointers they are given, so a
    // pipeline's piece c + 1 does not overlap piece c). The kernel's real accesses open the pages
    // they touch.
    detail::kernel_pointer const& p = pointers[k];
    std::uintptr_t const w = p.address;
    allocation const* a = find_allocation(reinterpret_cast<void const*>(w));
    if (a == nullptr) {
      // A typed pointer into no allocation, outside the device range (a freed device address faults
      // when touched), is pageable host memory, which a kernel cannot read. A word of a functor read
      // word by word may be anything.
      if (!p.typed || w == 0 || in_arena(w)) continue;
      std::ostringstream out;
      out << "kernel '" << kernel << "' launched on " << stream_label(*s) << " is given " << reinterpret_cast<void const*>(w)
          << " (its pointer argument " << k + 1 << " of " << pointers.size()
          << "), which is pageable host memory: a kernel reads device memory or pinned host memory "
             "(cudaHostAlloc, cudaMallocHost), never pageable host memory";
      return fail(record_violation(out.str()));
    }
    if (!a->device || w >= a->base + a->bytes) continue;  // pinned host memory, or one past the end
    if (!p.typed && a->released) continue;  // a word that may be no pointer: a stale one faults when touched
    if (a->dev != s->device) {
      if (!p.typed) continue;
      if (emu().peer_access.count({s->device, a->dev}) == 0) {
        std::ostringstream out;
        out << "kernel '" << kernel << "' launched on " << stream_label(*s) << " is given "
            << reinterpret_cast<void const*>(w) << " (its pointer argument " << k + 1 << " of " << pointers.size()
            << "), in " << describe_allocation(*a) << ", without peer access from device " << s->device << " to device "
            << a->dev << ": call cudaDeviceEnablePeerAccess(" << a->dev << ", 0) with device " << s->device
            << " current first";
        return fail(record_violation(out.str()));
      }
    }
    if (p.bytes != detail::kernel_pointer::unknown) {
      uses.push_back({reinterpret_cast<void const*>(w), std::min<std::size_t>(p.bytes, a->base + a->bytes - w), access::read_write, kernel});
      continue;
    }
    auto it = std::find_if(uses.begin(), uses.end(), [&](buffer_use const& u) {
      return reinterpret_cast<std::uintptr_t>(u.ptr) + u.bytes == a->base + a->bytes;  // this allocation's
    });
    if (it == uses.end()) uses.push_back({reinterpret_cast<void const*>(w), a->base + a->bytes - w, access::read_write, kernel});
    else if (w < reinterpret_cast<std::uintptr_t>(it->ptr)) *it = {reinterpret_cast<void const*>(w), a->base + a->bytes - w, access::read_write, kernel};
  }
  return cudaSuccess;
}

std::vector<std::string> violations() {
  std::lock_guard<std::mutex> hold(emu().lock);
  return emu().violations;
}

void clear_violations() {
  std::lock_guard<std::mutex> hold(emu().lock);
  emu().violations.clear();
}

std::int64_t host_waits(int device) {
  std::lock_guard<std::mutex> hold(emu().lock);
  return device >= 0 && device < emu().devices ? emu().waits[static_cast<std::size_t>(device)] : 0;
}
std::int64_t host_waits() { return host_waits(this_thread.device); }

std::int64_t device_allocations(int device) {
  std::lock_guard<std::mutex> hold(emu().lock);
  return device >= 0 && device < emu().devices ? emu().allocations[static_cast<std::size_t>(device)] : 0;
}
std::int64_t device_allocations() { return device_allocations(this_thread.device); }

std::int64_t graph_launches(int device) {
  std::lock_guard<std::mutex> hold(emu().lock);
  return device >= 0 && device < emu().devices ? emu().graph_launches[static_cast<std::size_t>(device)] : 0;
}

int device_count() { return emu().devices; }

}  // namespace moecomm_emulation

using namespace moecomm_emulation;
using namespace moecomm_emulation::detail;

namespace {

bool is_pageable(void const* p) { return find_allocation(p) == nullptr; }  // emu().lock held

//! The host waits for everything enqueued on `s` so far, and learns what it knew.
void host_wait(std::shared_ptr<stream_state> const& s, std::uint64_t target) {
  wait_until(*s, target);
  std::lock_guard<std::mutex> hold(emu().lock);
  learn_from(*s);
  count_host_wait(s->device);
}

//! Copies `bytes` from `src` to `dst` in the order of `stream`. Pageable host memory is read when
//! the call is made (CUDA stages it); a copy into pageable memory returns when it is done.
cudaError_t copy_on(cudaStream_t stream, void* dst, void const* src, std::size_t bytes, char const* call, bool wait) {
  if (bytes == 0) return cudaSuccess;
  std::shared_ptr<stream_state> s;
  std::uint64_t target = 0;
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    s = find_stream(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (s->capture && (is_pageable(src) || is_pageable(dst)))
      return refuse_on_capturing_stream(*s, call,
                                        "it copies pageable host memory, which CUDA copies synchronously through a staging "
                                        "buffer: a captured copy moves device or pinned host memory (cudaMallocHost)");
    wait = wait || is_pageable(dst);
    char* const to = static_cast<char*>(dst);
    std::function<void()> job;
    if (is_pageable(src)) {
      auto staged = std::make_shared<std::vector<char>>(static_cast<char const*>(src), static_cast<char const*>(src) + bytes);
      job = [staged, to] { std::memcpy(to, staged->data(), staged->size()); };
    } else {
      char const* const from = static_cast<char const*>(src);
      job = [from, to, bytes] { std::memmove(to, from, bytes); };
    }
    std::vector<buffer_use> const uses{{src, bytes, access::read, "src"}, {dst, bytes, access::write, "dst"}};
    if (cudaError_t const e = enqueue_locked(s, call, uses, std::move(job)); e != cudaSuccess) return fail(e);
    target = s->enqueued;
  }
  if (wait) host_wait(s, target);
  return cudaSuccess;
}

//! `size` bytes of pinned host memory, allocated by `call` (cudaHostAlloc, cudaMallocHost).
cudaError_t host_alloc(void** pHost, std::size_t size, char const* call) {
  *pHost = nullptr;
  std::lock_guard<std::mutex> hold(emu().lock);
  if (cudaError_t const e = refuse_unsafe(call); e != cudaSuccess) return e;
  if (size == 0) return cudaSuccess;
  void* p = std::aligned_alloc(page, (size + page - 1) / page * page);
  if (p == nullptr) return fail(cudaErrorMemoryAllocation);
  auto a = std::make_shared<allocation>();
  a->base = reinterpret_cast<std::uintptr_t>(p);
  a->bytes = size;
  a->reserved = size;
  a->device = false;
  a->origin = call;
  emu().memory[a->base] = a;
  *pHost = p;
  return cudaSuccess;
}

//! The first stream that joined capture `c` whose last node the origin did not wait for (through
//! events), or null (emu().lock held).
stream_state const* unjoined_stream(capture_state const& c) {
  for (auto const& m : c.members)
    if (m != c.origin && clock_of(c.origin->capture_knows, m->id) < clock_of(c.captured, m->id)) return m.get();
  return nullptr;
}

//! Ends capture `c` (emu().lock held): its streams leave capture mode.
void end_capture(capture_state& c) {
  for (auto const& m : c.members) {
    m->capture = nullptr;
    m->capture_knows.clear();
  }
  c.members.clear();
  c.ended = true;
  auto& ongoing = emu().captures;
  ongoing.erase(std::remove_if(ongoing.begin(), ongoing.end(), [&](auto const& o) { return o.get() == &c; }), ongoing.end());
}

//! Records `ev` on capturing stream `s` (emu().lock held): a point of the capture that a stream
//! waiting for it depends on. No node: a launch runs the nodes in order on one stream.
cudaError_t record_in_capture(event_state& ev, std::shared_ptr<stream_state> const& s) {
  if (s->capture->invalidated) return invalidated_capture(*s, "cudaEventRecord");
  ev.recorded = true;
  ev.stream = s;
  ev.capture = s->capture;
  ev.capture_knows = s->capture_knows;
  return cudaSuccess;
}

//! `s` waits for `ev`, recorded during a capture (emu().lock held): `s` joins the capture (a fork),
//! or, already in it, its next nodes come after the event's (a join).
cudaError_t wait_in_capture(std::shared_ptr<stream_state> const& s, event_state const& ev) {
  capture_state& c = *ev.capture;
  if (c.ended) return refuse_captured_event(ev, "cudaStreamWaitEvent", s->capture.get());
  if (c.invalidated) return invalidated_capture(*ev.stream, "cudaStreamWaitEvent");
  if (s->capture && s->capture.get() != &c) {
    std::ostringstream out;
    out << "cudaStreamWaitEvent on " << stream_label(*s) << ", which captures a CUDA graph, of an event recorded during the "
        << "capture begun on " << stream_label(*c.origin) << ": two captures cannot merge";
    return refuse_in_capture(out.str(), cudaErrorStreamCaptureMerge, {s->capture.get()});
  }
  if (s->legacy)
    return refuse_in_capture("cudaStreamWaitEvent on " + stream_label(*s) + " of an event recorded during the capture begun on " +
                                 stream_label(*c.origin) + ": the legacy default stream never captures",
                             cudaErrorStreamCaptureUnsupported, {&c});
  if (!s->capture) {
    s->capture = ev.capture;
    c.members.push_back(s);
  }
  merge(s->capture_knows, ev.capture_knows);
  return cudaSuccess;
}

//! Refuses capturing stream `s`'s wait for `ev`, recorded outside any capture (emu().lock held).
cudaError_t refuse_isolation(stream_state const& s, event_state const& ev) {
  std::ostringstream out;
  out << "cudaStreamWaitEvent on " << stream_label(s) << ", which captures a CUDA graph, of an event recorded outside the "
      << "capture (on " << stream_label(*ev.stream) << "): a captured step depends only on work of its capture (order that "
      << "work before cudaStreamBeginCapture, or record the event inside the capture)";
  return refuse_in_capture(out.str(), cudaErrorStreamCaptureIsolation, {s.capture.get()});
}

//! The capture status of `s` (emu().lock held); for the legacy stream while a blocking stream of
//! its device captures, cudaErrorStreamCaptureImplicit, the capture left as it is.
cudaError_t capture_status(stream_state const& s, cudaStreamCaptureStatus* status, unsigned long long* id) {
  if (status == nullptr) return fail(cudaErrorInvalidValue);
  if (s.legacy && blocking_capture(s.device) != nullptr) return fail(cudaErrorStreamCaptureImplicit);
  *status = !s.capture ? cudaStreamCaptureStatusNone
            : s.capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                     : cudaStreamCaptureStatusActive;
  if (id != nullptr && s.capture) *id = s.capture->id;
  return cudaSuccess;
}

char const* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorNotPermitted: return "cudaErrorNotPermitted";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessNotEnabled: return "cudaErrorPeerAccessNotEnabled";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    default: return "cudaError (other)";
  }
}

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = emu().devices;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = this_thread.device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= emu().devices) return fail(cudaErrorInvalidDevice);
  this_thread.device = device;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() { return std::exchange(this_thread.last_error, cudaSuccess); }
cudaError_t cudaPeekAtLastError() { return this_thread.last_error; }
const char* cudaGetErrorName(cudaError_t error) { return error_name(error); }
const char* cudaGetErrorString(cudaError_t error) {
  if (error == this_thread.message_error && !this_thread.message.empty()) return this_thread.message.c_str();
  return error == cudaSuccess ? "no error" : "an error of the emulated CUDA runtime";
}

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  std::lock_guard<std::mutex> hold(emu().lock);
  if (cudaError_t const e = refuse_unsafe("cudaMalloc"); e != cudaSuccess) return e;
  return allocate_device(devPtr, size, "cudaMalloc", this_thread.device, nullptr, "cudaMalloc");
}

cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(hStream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  if (s->device != this_thread.device) {
    std::ostringstream out;
    out << "cudaMallocAsync on " << stream_label(*s) << " from a thread whose current device is " << this_thread.device;
    return record_violation(out.str());
  }
  if (s->capture) return refuse_on_capturing_stream(*s, "cudaMallocAsync", stream_ordered_memory);
  return allocate_device(devPtr, size, "cudaMallocAsync", s->device, s, "cudaMallocAsync");
}

cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(hStream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  return release_device(devPtr, "cudaFreeAsync", s);
}

cudaError_t cudaFree(void* devPtr) {
  if (devPtr == nullptr) return cudaSuccess;
  std::vector<std::pair<std::shared_ptr<stream_state>, std::uint64_t>> busy;
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    if (cudaError_t const e = refuse_unsafe("cudaFree"); e != cudaSuccess) return e;
    auto it = emu().memory.find(reinterpret_cast<std::uintptr_t>(devPtr));
    if (it == emu().memory.end() || !it->second->device) return fail(cudaErrorInvalidValue);
    for (auto const& [key, s] : emu().streams)
      if (s->device == it->second->dev) busy.emplace_back(s, s->enqueued);
    if (auto const& l = emu().legacy[static_cast<std::size_t>(it->second->dev)]) busy.emplace_back(l, l->enqueued);
  }
  for (auto const& [s, target] : busy) wait_until(*s, target);  // cudaFree synchronises the device
  std::lock_guard<std::mutex> hold(emu().lock);
  auto it = emu().memory.find(reinterpret_cast<std::uintptr_t>(devPtr));
  if (it == emu().memory.end()) return fail(cudaErrorInvalidValue);
  quarantine(it->second);
  emu().memory.erase(it);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int) { return host_alloc(pHost, size, "cudaHostAlloc"); }

cudaError_t cudaMallocHost(void** ptr, size_t size) { return host_alloc(ptr, size, "cudaMallocHost"); }

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> hold(emu().lock);
  if (cudaError_t const e = refuse_unsafe("cudaFreeHost"); e != cudaSuccess) return e;
  auto it = emu().memory.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == emu().memory.end() || it->second->device) return fail(cudaErrorInvalidValue);
  emu().memory.erase(it);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind, cudaStream_t stream) {
  return copy_on(stream, dst, src, count, "cudaMemcpyAsync", false);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind) {
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    if (cudaError_t const e = refuse_unsafe("cudaMemcpy"); e != cudaSuccess) return e;
  }
  return copy_on(nullptr, dst, src, count, "cudaMemcpy", true);
}

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  char* const to = static_cast<char*>(devPtr);
  return enqueue(stream, "cudaMemsetAsync", {{devPtr, count, access::write, "devPtr"}},
                 [to, value, count] { std::memset(to, value, count); });
}

cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    if (cudaError_t const e = refuse_unsafe("cudaMemset"); e != cudaSuccess) return e;
  }
  cudaError_t const e = cudaMemsetAsync(devPtr, value, count, nullptr);
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(nullptr);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = new_stream(this_thread.device, false, (flags & cudaStreamNonBlocking) == 0);
  emu().streams[s.get()] = s;
  *pStream = reinterpret_cast<cudaStream_t>(s.get());
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* pStream) { return cudaStreamCreateWithFlags(pStream, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto it = emu().streams.find(reinterpret_cast<stream_state*>(stream));
  if (it == emu().streams.end()) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<stream_state> s = it->second;
  emu().streams.erase(it);
  {
    std::lock_guard<std::mutex> queue(s->queue_lock);
    s->stopping = true;  // the worker finishes the queue, then ends
  }
  s->queue_ready.notify_one();
  return cudaSuccess;
}

cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int* device) {
  int const d = stream_device(hStream);
  if (d < 0) return fail(cudaErrorInvalidResourceHandle);
  *device = d;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::shared_ptr<stream_state> s;
  std::uint64_t target = 0;
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    s = find_stream(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (s->capture) return refuse_host_wait(*s, "cudaStreamSynchronize");
    target = s->enqueued;
  }
  host_wait(s, target);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  if (s->capture) return refuse_host_wait(*s, "cudaStreamQuery");
  if (s->completed.load(std::memory_order_acquire) < s->enqueued) return cudaErrorNotReady;
  learn_from(*s);
  count_host_wait(s->device);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  std::vector<std::pair<std::shared_ptr<stream_state>, std::uint64_t>> busy;
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    if (cudaError_t const e = refuse_unsafe("cudaDeviceSynchronize"); e != cudaSuccess) return e;
    for (auto const& [key, s] : emu().streams)
      if (s->device == this_thread.device) busy.emplace_back(s, s->enqueued);
    busy.emplace_back(legacy_stream(this_thread.device), legacy_stream(this_thread.device)->enqueued);
  }
  for (auto const& [s, target] : busy) wait_until(*s, target);
  std::lock_guard<std::mutex> hold(emu().lock);
  for (auto const& [s, target] : busy) learn_from(*s);
  count_host_wait(this_thread.device);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  auto e = std::make_shared<event_state>();
  e->device = this_thread.device;
  std::lock_guard<std::mutex> hold(emu().lock);
  emu().events[e.get()] = e;
  *event = reinterpret_cast<cudaEvent_t>(e.get());
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> hold(emu().lock);
  return emu().events.erase(reinterpret_cast<event_state*>(event)) == 1 ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto it = emu().events.find(reinterpret_cast<event_state*>(event));
  auto s = find_stream(stream);
  if (it == emu().events.end() || !s) return fail(cudaErrorInvalidResourceHandle);
  event_state& ev = *it->second;
  if (ev.device != s->device) {  // CUDA: cudaErrorInvalidResourceHandle (a stream may wait on any device's event)
    std::ostringstream out;
    out << "cudaEventRecord of an event created on device " << ev.device << " on " << stream_label(*s)
        << ": an event belongs to the device current when it was created and is recorded on that device's streams "
           "(record it on a stream of device "
        << ev.device << ", or create it with device " << s->device << " current)";
    return record_violation(out.str(), cudaErrorInvalidResourceHandle);
  }
  if (s->capture) return record_in_capture(ev, s);
  if (cudaError_t const e = enqueue_locked(s, "cudaEventRecord", {}, [] {}); e != cudaSuccess) return fail(e);
  ev.recorded = true;
  ev.stream = s;
  ev.seq = s->enqueued;
  ev.knows = s->knows;
  ev.capture = nullptr;
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto it = emu().events.find(reinterpret_cast<event_state*>(event));
  auto s = find_stream(stream);
  if (it == emu().events.end() || !s) return fail(cudaErrorInvalidResourceHandle);
  event_state const ev = *it->second;  // a later record does not change this wait
  if (!ev.recorded) return cudaSuccess;  // CUDA: waiting on a never-recorded event does nothing
  if (ev.capture) return wait_in_capture(s, ev);
  if (s->capture) return refuse_isolation(*s, ev);
  merge(s->knows, ev.knows);
  auto const source = ev.stream;
  std::uint64_t const target = ev.seq;
  return enqueue_locked(s, "cudaStreamWaitEvent", {}, [source, target] { wait_until(*source, target); });
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  event_state ev;  // as recorded now: a later record does not change this wait
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    auto it = emu().events.find(reinterpret_cast<event_state*>(event));
    if (it == emu().events.end()) return fail(cudaErrorInvalidResourceHandle);
    ev = *it->second;
    if (ev.capture) return refuse_captured_event(ev, "cudaEventSynchronize");
  }
  if (!ev.recorded) return cudaSuccess;
  wait_until(*ev.stream, ev.seq);
  std::lock_guard<std::mutex> hold(emu().lock);
  merge(this_thread.knows, ev.knows);
  count_host_wait(ev.stream->device);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto it = emu().events.find(reinterpret_cast<event_state*>(event));
  if (it == emu().events.end()) return fail(cudaErrorInvalidResourceHandle);
  event_state const& ev = *it->second;
  if (!ev.recorded) return cudaSuccess;
  if (ev.capture) return refuse_captured_event(ev, "cudaEventQuery");
  if (ev.stream->completed.load(std::memory_order_acquire) < ev.seq) return cudaErrorNotReady;
  merge(this_thread.knows, ev.knows);
  count_host_wait(ev.stream->device);
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
  if (device < 0 || device >= emu().devices || peerDevice < 0 || peerDevice >= emu().devices) return fail(cudaErrorInvalidDevice);
  *canAccessPeer = device != peerDevice ? 1 : 0;  // every pair of emulated devices is connected
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags) {
  if (flags != 0) return fail(cudaErrorInvalidValue);
  if (peerDevice < 0 || peerDevice >= emu().devices || peerDevice == this_thread.device) return fail(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> hold(emu().lock);
  if (!emu().peer_access.insert({this_thread.device, peerDevice}).second) return fail(cudaErrorPeerAccessAlreadyEnabled);
  return cudaSuccess;
}

cudaError_t cudaDeviceDisablePeerAccess(int peerDevice) {
  if (peerDevice < 0 || peerDevice >= emu().devices || peerDevice == this_thread.device) return fail(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> hold(emu().lock);
  if (emu().peer_access.erase({this_thread.device, peerDevice}) == 0) return fail(cudaErrorPeerAccessNotEnabled);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr) {
  std::lock_guard<std::mutex> hold(emu().lock);
  *attributes = cudaPointerAttributes{};
  allocation const* a = find_allocation(ptr);
  attributes->type = a == nullptr ? cudaMemoryTypeUnregistered : a->device ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
  attributes->device = a != nullptr && a->device ? a->dev : -2;
  attributes->devicePointer = a != nullptr ? const_cast<void*>(ptr) : nullptr;
  attributes->hostPointer = a != nullptr && !a->device ? const_cast<void*>(ptr) : nullptr;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal && mode != cudaStreamCaptureModeRelaxed)
    return fail(cudaErrorInvalidValue);
  if (s->legacy)
    return record_violation("cudaStreamBeginCapture on " + stream_label(*s) + ": CUDA captures created streams only",
                            cudaErrorStreamCaptureUnsupported);
  if (s->capture)
    return record_violation("cudaStreamBeginCapture on " + stream_label(*s) + ", which already captures a CUDA graph",
                            cudaErrorIllegalState);
  auto c = std::make_shared<capture_state>();
  c->id = emu().next_capture++;
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->origin = s;
  c->members = {s};
  s->capture = c;
  emu().captures.push_back(c);
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* mode) {
  if (mode == nullptr ||
      (*mode != cudaStreamCaptureModeGlobal && *mode != cudaStreamCaptureModeThreadLocal && *mode != cudaStreamCaptureModeRelaxed))
    return fail(cudaErrorInvalidValue);
  std::swap(*mode, this_thread.capture_mode);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  if (pGraph == nullptr) return fail(cudaErrorInvalidValue);
  *pGraph = nullptr;
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  if (!s->capture)
    return record_violation("cudaStreamEndCapture on " + stream_label(*s) + ", which does not capture", cudaErrorIllegalState);
  std::shared_ptr<capture_state> const c = s->capture;
  if (c->origin != s)
    return refuse_in_capture("cudaStreamEndCapture on " + stream_label(*s) + ", which joined the capture begun on " +
                                 stream_label(*c->origin) + ": a capture ends on the stream it began on",
                             cudaErrorStreamCaptureUnmatched, {c.get()});
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
    return refuse_in_capture("cudaStreamEndCapture on " + stream_label(*s) + " from another thread than the one that began its "
                                 "capture with " + mode_name(c->mode) + " (only a relaxed capture ends on any thread)",
                             cudaErrorStreamCaptureWrongThread, {c.get()});
  std::string unjoined;  // a stream whose last captured work the origin did not wait for
  if (stream_state const* const u = unjoined_stream(*c)) unjoined = stream_label(*u);
  end_capture(*c);
  if (c->invalidated)
    return fail_with(cudaErrorStreamCaptureInvalidated,
                     "cudaStreamEndCapture on " + stream_label(*s) + ": the capture was invalidated: " + c->invalidated_by);
  if (!unjoined.empty())
    return record_violation("cudaStreamEndCapture on " + stream_label(*s) + ": " + unjoined +
                                " joined the capture and its last captured work is not waited for on the origin stream (record "
                                "an event on it and cudaStreamWaitEvent on the origin before ending the capture)",
                            cudaErrorStreamCaptureUnjoined);
  auto g = std::make_shared<graph_state>();
  g->nodes = std::move(c->nodes);
  emu().graphs[g.get()] = g;
  *pGraph = reinterpret_cast<cudaGraph_t>(g.get());
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* pCaptureStatus) {
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  return capture_status(*s, pCaptureStatus, nullptr);
}

// The status and the capture's id; the graph and the dependencies are not emulated.
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus* captureStatus_out,
                                     unsigned long long* id_out, cudaGraph_t* graph_out, const cudaGraphNode_t** dependencies_out,
                                     const cudaGraphEdgeData** edgeData_out, size_t* numDependencies_out) {
  if (graph_out != nullptr || dependencies_out != nullptr || edgeData_out != nullptr || numDependencies_out != nullptr)
    return fail_with(cudaErrorNotSupported, "cudaStreamGetCaptureInfo: the emulation answers the capture status and id only");
  std::lock_guard<std::mutex> hold(emu().lock);
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  return capture_status(*s, captureStatus_out, id_out);
}

// The flags (upload, auto-free, device launch, node priority) change nothing a host launch does here.
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph, unsigned long long) {
  if (pGraphExec == nullptr) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> hold(emu().lock);
  auto it = emu().graphs.find(reinterpret_cast<graph_state*>(graph));
  if (it == emu().graphs.end()) return fail(cudaErrorInvalidValue);
  auto exec = std::make_shared<graph_state>(*it->second);
  emu().executables[exec.get()] = exec;
  *pGraphExec = reinterpret_cast<cudaGraphExec_t>(exec.get());
  return cudaSuccess;
}

// Enqueues the nodes on `stream` in capture order, each checked as an eager call; no host wait.
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  std::shared_ptr<graph_state> exec;
  int device = 0;
  {
    std::lock_guard<std::mutex> hold(emu().lock);
    auto it = emu().executables.find(reinterpret_cast<graph_state*>(graphExec));
    if (it == emu().executables.end()) return fail(cudaErrorInvalidValue);
    auto s = find_stream(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    exec = it->second;
    device = s->device;
  }
  for (graph_node const& node : exec->nodes)  // each takes the lock: an NCCL node enqueues through the NCCL emulation
    if (cudaError_t const e = node(stream); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> hold(emu().lock);
  ++emu().graph_launches[static_cast<std::size_t>(device)];
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  std::lock_guard<std::mutex> hold(emu().lock);
  return emu().executables.erase(reinterpret_cast<graph_state*>(graphExec)) == 1 ? cudaSuccess : fail(cudaErrorInvalidValue);
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard<std::mutex> hold(emu().lock);
  return emu().graphs.erase(reinterpret_cast<graph_state*>(graph)) == 1 ? cudaSuccess : fail(cudaErrorInvalidValue);
}

}  // extern "C"
