// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the emulated NCCL needs of the emulated CUDA runtime (device.cpp).

#include <moecomm_emulation/emulation.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace moecomm_emulation::detail {

//! Where a buffer lives.
struct memory_info {
  enum kind_t { pageable_host, device_memory, pinned_host } kind = pageable_host;
  int device = -1;             //!< device memory: its device
  bool whole = false;          //!< the range lies inside one allocation
  std::string description;     //!< "a 4096-byte allocation of cudaMallocAsync on device 1", for messages
};

//! Describes the `bytes` at `p`.
memory_info describe(void const* p, std::size_t bytes);

//! The calling thread's current device.
int current_device();

//! The device of `stream` (null: the current device's legacy stream), or -1 for an unknown handle.
int stream_device(cudaStream_t stream);

//! A stream's identity, never reused (null: the current device's legacy stream), or -1 for an
//! unknown handle.
int stream_id(cudaStream_t stream);

//! Records a contract violation: it is kept for `violations()` and becomes the message of the
//! thread's next `cudaGetErrorString(cudaErrorNotPermitted)`. Returns cudaErrorNotPermitted.
cudaError_t violation(std::string message);

//! Whether `stream` belongs to a CUDA graph's capture (its own, or one it joined): its operations
//! are recorded, not run. False for an unknown handle.
bool capturing(cudaStream_t stream);

//! Records, on capturing `stream`, a node of operation `call` (a name that outlives the graph):
//! `replay(launch_stream)` enqueues the operation again, checked, at each cudaGraphLaunch. Returns
//! cudaErrorStreamCaptureInvalidated (explained by cudaGetErrorString) when the capture was
//! invalidated, cudaErrorIllegalState when `stream` does not capture.
cudaError_t capture_node(cudaStream_t stream, char const* call, std::function<cudaError_t(cudaStream_t)> replay);

//! How long a job waits for peers (an emulated NCCL kernel) before it gives up: long enough for
//! any test, short enough that a missing peer ends the process's wait instead of hanging it.
inline constexpr std::chrono::seconds peer_wait{120};

}  // namespace moecomm_emulation::detail
