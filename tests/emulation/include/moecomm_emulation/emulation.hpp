// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The CPU emulation of the CUDA runtime and NCCL that moecomm's device code runs on when no GPU
//! exists. The real `cudaXxx`/`ncclXxx` declarations come from CUDA's and NCCL's own headers; the
//! emulation library defines them (it replaces libcudart and libnccl at link time), so the code
//! under test is moecomm's real device path. What the emulation adds:
//!
//! - devices: several per process (`MOECOMM_EMULATED_DEVICES`, default 8), a current device per
//!   host thread (0 for a new thread), peer access per ordered pair of devices, device memory that
//!   only the streams' workers may touch (its pages open on a worker's fault and close when its job
//!   ends): a host read or write of device memory stops the process with a message naming the
//!   allocation;
//! - streams: each an in-order worker thread (work really is asynchronous), events (each of the
//!   device current at its creation), the legacy default stream's implicit synchronisation;
//! - contracts, checked when work is enqueued and reported by the failing call's error (its
//!   `cudaGetErrorString` / `ncclGetLastError` names the call, the buffer or argument and the
//!   devices) and in `violations()`: a buffer used on one stream while its last use on another is
//!   not ordered before (no event, no host wait), or after `cudaFreeAsync`; a kernel, CUB call or
//!   `cudaMallocAsync` on a stream of another device than the thread's current one; a kernel given
//!   a pointer to pageable host memory, or into another device's memory without peer access;
//!   `cudaEventRecord` of another device's event; a non-device buffer given to NCCL; two ranks of one
//!   NCCL communicator on one device; an NCCL communicator used by a second thread; an NCCL group
//!   left open; collectives or messages the ranks disagree on;
//! - NCCL's results: reductions (sum, prod, max, min, avg; integers, half, bfloat16, float, double)
//!   in ascending rank order, rounded to the type at each step; non-blocking communicators' calls
//!   return ncclInProgress, which `ncclCommGetAsyncError` reports until the work is in place;
//! - CUDA graphs by stream capture, with CUDA's rules (below);
//! - counters: host waits, device allocations and graph launches per device, whatever thread
//!   makes them.
//!
//! Kernels are launched through `launch`, which `moecomm/backend/cuda.cuh` calls where nvcc
//! compiles `<<<...>>>`: the same functor runs on the stream's worker thread, one lane per row.
//!
//! Stream capture (`cudaStreamBeginCapture` ... `cudaStreamEndCapture`, `cudaGraphInstantiate`,
//! `cudaGraphLaunch`). While a stream captures, what is enqueued on it (kernels, CUB calls,
//! `cudaMemcpyAsync` of device or pinned memory, `cudaMemsetAsync`, NCCL calls) does not run: it is
//! checked as when run eagerly (the launching thread's device, the pointers' kinds, NCCL's
//! arguments) and recorded as a node of the capture's graph. `cudaGraphLaunch` enqueues the nodes
//! on its stream, without a host wait, in capture order: a valid linearisation of the captured
//! graph (work forked to another stream, of any device, replays on the launch's stream). Each node
//! goes through the ordinary checked path, so the ordering contract holds at every launch (a node
//! refused there fails the launch, the nodes before it enqueued), and a node reads its buffers
//! when it runs (a launch sees inputs written before it on the stream). An NCCL node
//! launches its operations anew (a new collective of the communicator at each launch, a group as
//! one group), so the ranks' replays match one another as eager calls do, and a rank that does not
//! replay is reported as a missing peer. The rules, as CUDA's:
//! - `cudaStreamWaitEvent` of an event recorded during a capture makes the waiting stream join the
//!   capture (a fork); `cudaStreamEndCapture` on the origin stream fails with
//!   cudaErrorStreamCaptureUnjoined unless the origin waited (through events) for the last node of
//!   every stream that joined; a capturing stream waiting for an event recorded outside its capture
//!   fails with cudaErrorStreamCaptureIsolation; joining two captures, cudaErrorStreamCaptureMerge;
//! - capture is ended on its origin stream (else cudaErrorStreamCaptureUnmatched), by the thread
//!   that began it unless begun with cudaStreamCaptureModeRelaxed (else
//!   cudaErrorStreamCaptureWrongThread); the legacy stream never captures;
//! - potentially unsafe calls (`cudaMalloc`, `cudaMallocHost`/`cudaHostAlloc`, `cudaFree`,
//!   `cudaFreeHost`, the synchronous `cudaMemcpy` and `cudaMemset`, `cudaDeviceSynchronize`) fail
//!   with cudaErrorStreamCaptureUnsupported where CUDA forbids them, by the calling thread's mode
//!   (`cudaThreadExchangeStreamCaptureMode`): global (the default), while the thread has a capture
//!   not begun relaxed or another thread has one begun global; thread-local, while the thread has
//!   one not begun relaxed; relaxed, never;
//! - in any mode: a host wait for a capturing stream (`cudaStreamSynchronize`, `cudaStreamQuery`):
//!   cudaErrorStreamCaptureUnsupported; for an event last recorded during a capture
//!   (`cudaEventSynchronize`, `cudaEventQuery`, and `cudaStreamWaitEvent` once the capture ended):
//!   cudaErrorCapturedEvent; work on the legacy stream while a blocking stream of its device
//!   captures: cudaErrorStreamCaptureImplicit;
//! - stricter than CUDA: `cudaMemcpyAsync` of pageable host memory (CUDA stages it synchronously)
//!   and `cudaMallocAsync`/`cudaFreeAsync` (CUDA makes memory nodes) are refused on a capturing
//!   stream, with cudaErrorStreamCaptureUnsupported: a captured step allocates nothing; a group of
//!   NCCL calls is captured when all its operations are on one stream; launches of one graph on
//!   two streams are not ordered between them (CUDA orders them): order them with events.
//! Each refused call is a violation whose message names the call and the stream, and it
//! invalidates the capture: the capture's later calls fail with cudaErrorStreamCaptureInvalidated,
//! and so does `cudaStreamEndCapture`, which returns no graph and ends the capture.
//! `cudaStreamGetCaptureInfo` answers the status and the capture's id only (cudaErrorNotSupported
//! when asked for the graph or dependencies); `cudaGraphInstantiate`'s flags change nothing; an
//! unknown graph or executable graph handle is cudaErrorInvalidValue.

#include <moecomm_emulation/kernel_arguments.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace moecomm_emulation {

//! How an enqueued operation uses a buffer.
enum class access { read, write, read_write };

//! One buffer an operation uses: `bytes` at `ptr` (host or device memory).
struct buffer_use {
  void const* ptr;
  std::size_t bytes;
  access mode;
  char const* role;  //!< the argument's name, for messages ("sendbuff", "keys_in")
};

//! Enqueues `job` on `stream` (null: the current device's legacy default stream) after checking
//! the contracts for `uses`. The job runs on the stream's worker thread, the only kind of thread
//! that may touch device memory. Returns the error the call reports (also the last error). On a
//! capturing stream the job is a node of the graph: enqueued again, so run again, at each launch.
cudaError_t enqueue(cudaStream_t stream, char const* call, std::vector<buffer_use> const& uses,
                    std::function<void()> job);

//! Checks a kernel's launch on `stream` and adds to `uses` what its pointer arguments `pointers`
//! reach. Refused: a thread whose current device is not the stream's; a typed pointer to pageable
//! host memory (into no allocation, outside the device range); a typed pointer into another
//! device's allocation without peer access from the stream's device to it. For every allocation of
//! the stream's device, or of a peer it may access, that the pointers point into: the bytes a sized
//! view covers, and for raw pointers the bytes from the lowest such address to the allocation's
//! end, read and written, as far as the emulation can tell. Pinned host memory is not tracked.
cudaError_t check_kernel_launch(cudaStream_t stream, char const* kernel, std::vector<detail::kernel_pointer> const& pointers,
                                std::vector<buffer_use>& uses);

//! The pointer arguments of kernel functor `f`: its pointer members by type (kernel_arguments.hpp),
//! or, for a functor that is not a plain aggregate, every aligned word of its bytes.
template <class F>
std::vector<detail::kernel_pointer> pointer_arguments(F const& f) {
  std::vector<detail::kernel_pointer> pointers;
  bool fallback = false;
  detail::collect_pointers(f, pointers, fallback);
  if (fallback) {
    pointers.clear();
    auto const* bytes = reinterpret_cast<unsigned char const*>(&f);
    for (std::size_t at = 0; at + sizeof(std::uintptr_t) <= sizeof(F); at += sizeof(std::uintptr_t)) {
      std::uintptr_t w;
      std::memcpy(&w, bytes + at, sizeof w);
      pointers.push_back({w, detail::kernel_pointer::unknown, false});
    }
  }
  return pointers;
}

//! Launches `run(f)` on `stream` as kernel `name`: `f` is copied (as a kernel's arguments are),
//! checked, and run on the stream's worker thread (captured: at each launch of the graph).
template <class F, class Run>
cudaError_t launch(cudaStream_t stream, char const* name, F const& f, Run run) {
  static_assert(std::is_trivially_copyable_v<F>, "a kernel's functor must be trivially copyable");
  auto copy = std::make_shared<F>(f);
  std::vector<buffer_use> uses;
  cudaError_t const scanned = check_kernel_launch(stream, name, pointer_arguments(f), uses);
  if (scanned != cudaSuccess) return scanned;
  return enqueue(stream, name, uses, [copy, run] { run(*copy); });
}

//! The contract violations seen so far (each a message naming the call and the buffer).
std::vector<std::string> violations();
//! Forgets the violations seen so far.
void clear_violations();

//! The host waits for work of `device`, made by any thread: stream and event synchronisations,
//! successful polls (`cudaStreamQuery`/`cudaEventQuery` returning cudaSuccess), synchronous copies
//! and `cudaDeviceSynchronize`, each counted for the device of the stream, event or current device
//! waited for. A rank's work (its own thread's and its lanes') is its device's.
std::int64_t host_waits(int device);
//! `host_waits` of the calling thread's current device.
std::int64_t host_waits();
//! The device allocations (`cudaMalloc`, `cudaMallocAsync`) of `device`'s memory, by any thread.
std::int64_t device_allocations(int device);
//! `device_allocations` of the calling thread's current device.
std::int64_t device_allocations();
//! The successful `cudaGraphLaunch` calls on `device`'s streams, by any thread.
std::int64_t graph_launches(int device);

//! The number of emulated devices.
int device_count();

}  // namespace moecomm_emulation
