// SPDX-License-Identifier: Apache-2.0
//! @file
//! moecomm on a GPU, as ratios to the device's own limits measured in the same run. Self-timed
//! (CUDA events), no Google Benchmark, so that it builds wherever nvcc and NCCL are.
//!
//! - `bench_device`: `memcpy_d2d` (`cudaMemcpyAsync` device to device, 256 MiB), then `permute`,
//!   `unpermute` (weighted) and `sort_chunks` of bf16 rows (T = 4096 tokens, H = 4096, K = 8 of
//!   E = 64 experts; sort_chunks as 8 ranks x 8 local experts): bytes read + written per second,
//!   and that as a fraction of the memcpy's (`of memcpy`). Each op: 5 warm-up calls, then 21
//!   repetitions of 10 calls between two events; the table gives the median and the fastest
//!   repetition.
//! - `bench_device --alltoall`: on every visible GPU (one thread each, NCCL), moecomm's `flat`
//!   all-to-all-v of 32 MiB blocks against NCCL's own grouped `ncclSend`/`ncclRecv`: algorithm
//!   bandwidth (bytes each rank sends per second, median) and the ratio.
//!
//! Results are checked after timing, every row: permute's rows are the tokens' rows, unpermute
//! (weights 1/8, exact in fp32) gives back each token's row, sort_chunks moved every chunk; each
//! output is poisoned (NaN) before its op runs. The all-to-all checks the received bytes. A
//! mismatch or a CUDA error fails the run (exit 1). Without a GPU it says so and exits with 77.
//! scripts/gpu-check runs it.

#include <moecomm/comm/nccl.cuh>
#include <moecomm/moecomm.cuh>

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
constexpr std::int64_t tokens = 4096, hidden = 4096;
constexpr std::int32_t experts = 64, top_k = 8;
constexpr int warmup_calls = 5, repetitions = 21, calls_per_repetition = 10;

void check(cudaError_t result, char const* what) { moecomm::detail::cuda_check(result, what); }

struct timing {
  double median_s = 0;  //!< seconds per call, median of the repetitions
  double best_s = 0;    //!< seconds per call, the fastest repetition
};

//! `work()` on `stream`: warm-up calls, then `repetitions` x `calls` calls, each repetition timed
//! by two events; seconds per call.
template <class Work>
timing time_on_stream(cudaStream_t stream, Work&& work, int calls = calls_per_repetition) {
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warmup_calls; ++i) work();
  check(cudaGetLastError(), "a launch (warm-up)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (warm-up)");
  std::vector<double> per_call;
  for (int r = 0; r < repetitions; ++r) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < calls; ++i) work();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    check(cudaGetLastError(), "a launch");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    per_call.push_back(static_cast<double>(ms) / 1e3 / calls);
  }
  check(cudaEventDestroy(start), "cudaEventDestroy");
  check(cudaEventDestroy(stop), "cudaEventDestroy");
  std::sort(per_call.begin(), per_call.end());
  return {per_call[per_call.size() / 2], per_call.front()};
}

cudaStream_t make_stream() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;
}

template <class T>
std::vector<T> to_host(moecomm::cuda_backend const& be, T const* src, std::int64_t n) {
  std::vector<T> host(static_cast<std::size_t>(n));
  be.copy(host.data(), src, n);
  be.synchronize();
  return host;
}

bool same_row(bf16 const* a, bf16 const* b) { return std::memcmp(a, b, hidden * sizeof(bf16)) == 0; }

struct row {
  char const* name;
  double bytes;  //!< read + written per call
  timing t;
};

int row_ops() {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  moecomm::cuda_backend const be(make_stream());

  // The routing: each token picks K distinct experts, weight 1/K each.
  std::mt19937 rng(7);
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<std::int32_t> picks(experts);
    for (std::int32_t e = 0; e < experts; ++e) picks[static_cast<std::size_t>(e)] = e;
    std::shuffle(picks.begin(), picks.end(), rng);
    for (std::int32_t k = 0; k < top_k; ++k) {
      idx.push_back(picks[static_cast<std::size_t>(k)]);
      w.push_back(1.0f / top_k);
    }
  }
  auto d_idx = be.allocate<std::int32_t>(tokens * top_k);
  auto d_w = be.allocate<float>(tokens * top_k);
  be.copy(d_idx.data(), idx.data(), tokens * top_k);
  be.copy(d_w.data(), w.data(), tokens * top_k);
  std::int64_t const slots = tokens * top_k;
  auto x = be.allocate<bf16>(tokens * hidden);
  auto rows = be.allocate<bf16>(slots * hidden);
  auto sorted = be.allocate<bf16>(slots * hidden);
  auto out = be.allocate<bf16>(tokens * hidden);
  std::vector<bf16> hx(static_cast<std::size_t>(tokens * hidden));
  for (std::size_t i = 0; i < hx.size(); ++i) hx[i] = __float2bfloat16(static_cast<float>(i % 251 + 1) / 251.0f);
  be.copy(x.data(), hx.data(), tokens * hidden);
  auto plan = moecomm::make_permute_plan(be, {d_idx.data(), d_w.data(), tokens, top_k}, experts);
  be.synchronize();
  std::int64_t const p = plan.num_rows();
  cudaStream_t const s = be.stream();
  auto const poison = [&](bf16* data, std::int64_t n) {  // 0xFFFF: a NaN in bf16
    check(cudaMemsetAsync(data, 0xFF, static_cast<std::size_t>(n) * sizeof(bf16), s), "cudaMemsetAsync");
  };

  std::vector<row> table;
  // The device's own copy rate: `rows` to `sorted`, 256 MiB (sorted is poisoned again below).
  std::size_t const copy_bytes = static_cast<std::size_t>(slots * hidden) * sizeof(bf16);
  table.push_back({"memcpy_d2d", 2.0 * static_cast<double>(copy_bytes), time_on_stream(s, [&] {
                     check(cudaMemcpyAsync(sorted.data(), rows.data(), copy_bytes, cudaMemcpyDeviceToDevice, s),
                           "cudaMemcpyAsync");
                   })});

  poison(rows.data(), slots * hidden);
  table.push_back({"permute", 2.0 * static_cast<double>(p * hidden) * sizeof(bf16), time_on_stream(s, [&] {
                     moecomm::permute(be, plan, moecomm::matrix_view<bf16 const>{x.data(), tokens, hidden},
                                      moecomm::matrix_view<bf16>{rows.data(), p, hidden});
                   })});

  poison(out.data(), tokens * hidden);
  table.push_back({"unpermute", static_cast<double>(p * hidden + tokens * hidden) * sizeof(bf16) + 4.0 * tokens * top_k,
                   time_on_stream(s, [&] {
                     moecomm::unpermute<moecomm::weighted>(be, plan, moecomm::matrix_view<bf16 const>{rows.data(), p, hidden},
                                                           moecomm::matrix_view<bf16>{out.data(), tokens, hidden});
                   })});

  std::int32_t const ranks = 8, locals = experts / ranks;
  std::int32_t const per_chunk = static_cast<std::int32_t>(p / (ranks * locals));
  std::vector<std::int32_t> counts(static_cast<std::size_t>(ranks * locals), per_chunk);
  std::int64_t const total = std::int64_t{per_chunk} * ranks * locals;
  moecomm::workspace<moecomm::cuda_backend> scratch;
  poison(sorted.data(), slots * hidden);
  table.push_back({"sort_chunks", 2.0 * static_cast<double>(total * hidden) * sizeof(bf16), time_on_stream(s, [&] {
                     moecomm::sort_chunks<moecomm::cuda_backend, bf16>(
                         be, moecomm::matrix_view<bf16 const>{rows.data(), total, hidden},
                         moecomm::array_view<std::int32_t const>{counts.data(), static_cast<std::int64_t>(counts.size())},
                         ranks, locals, moecomm::matrix_view<bf16>{sorted.data(), total, hidden}, scratch);
                   })});
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");

  double const memcpy_bps = table.front().bytes / table.front().t.median_s;
  std::printf("bench_device on %s (sm_%d%d, %d SMs): bf16 rows, T = %lld, H = %lld, K = %d of E = %d\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, static_cast<long long>(tokens),
              static_cast<long long>(hidden), top_k, experts);
  std::printf("median of %d repetitions of %d calls after %d warm-up calls; bytes = read + written\n\n", repetitions,
              calls_per_repetition, warmup_calls);
  std::printf("| %-11s | %9s | %9s | %9s | %8s | %9s |\n", "op", "MiB/call", "median us", "best us", "GB/s",
              "of memcpy");
  std::printf("|-------------|-----------|-----------|-----------|----------|-----------|\n");
  for (row const& r : table) {
    double const bps = r.bytes / r.t.median_s;
    std::printf("| %-11s | %9.1f | %9.1f | %9.1f | %8.1f | %9.3f |\n", r.name, r.bytes / (1 << 20), r.t.median_s * 1e6,
                r.t.best_s * 1e6, bps / 1e9, bps / memcpy_bps);
  }

  // Checks, every row.
  int failures = 0;
  auto const fail = [&](char const* op, std::string const& what) {
    std::printf("CHECK FAILED: %s: %s\n", op, what.c_str());
    ++failures;
  };
  auto const token_of = to_host(be, plan.token_of(), p);
  auto const got_rows = to_host(be, rows.data(), p * hidden);
  for (std::int64_t r = 0; r < p; ++r)
    if (!same_row(&got_rows[static_cast<std::size_t>(r * hidden)], &hx[static_cast<std::size_t>(token_of[static_cast<std::size_t>(r)]) * hidden])) {
      fail("permute", "row " + std::to_string(r) + " is not token " + std::to_string(token_of[static_cast<std::size_t>(r)]) + "'s row");
      break;
    }
  auto const got_out = to_host(be, out.data(), tokens * hidden);
  for (std::int64_t t = 0; t < tokens; ++t)
    if (!same_row(&got_out[static_cast<std::size_t>(t * hidden)], &hx[static_cast<std::size_t>(t * hidden)])) {
      fail("unpermute", "token " + std::to_string(t) + " is not the sum of its 8 rows x 1/8 (its own row)");
      break;
    }
  auto const got_sorted = to_host(be, sorted.data(), total * hidden);
  for (std::int64_t src = 0, c = 0; c < std::int64_t{ranks} * locals; ++c) {  // chunk (s, l), rank-major
    std::int64_t const sr = c / locals, l = c % locals;
    std::int64_t const dst = (l * ranks + sr) * per_chunk;
    for (std::int64_t i = 0; i < per_chunk; ++i)
      if (!same_row(&got_sorted[static_cast<std::size_t>((dst + i) * hidden)], &got_rows[static_cast<std::size_t>((src + i) * hidden)])) {
        fail("sort_chunks", "chunk (" + std::to_string(sr) + ", " + std::to_string(l) + ") row " + std::to_string(i));
        c = std::int64_t{ranks} * locals;
        break;
      }
    src += per_chunk;
  }
  std::printf("\nchecks: %s\n", failures == 0 ? "permute, unpermute and sort_chunks equal the reference, every row"
                                               : "FAILED (above)");
  return failures == 0 ? 0 : 1;
}

//! The all-to-all on every GPU: moecomm's flat against NCCL's grouped send/recv of the same blocks.
int alltoall() {
  int gpus = 0;
  check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  std::int64_t const block = std::int64_t{32} << 20;  // bytes to each peer
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) throw std::runtime_error("ncclGetUniqueId failed");
  std::vector<double> ours(static_cast<std::size_t>(gpus)), theirs(ours.size());
  std::vector<std::string> failures(ours.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < gpus; ++r)
    threads.emplace_back([&, r] {
      try {
        check(cudaSetDevice(r), "cudaSetDevice");
        cudaStream_t stream = make_stream();
        auto comm = moecomm::nccl_communicator::create(gpus, id, r, stream);
        moecomm::cuda_backend const be(stream);
        moecomm::exchange_groups<moecomm::nccl_communicator> groups(comm, moecomm::topology(gpus, gpus));
        auto send = be.allocate<char>(block * gpus), recv = be.allocate<char>(block * gpus);
        check(cudaMemsetAsync(send.data(), r + 1, static_cast<std::size_t>(block * gpus), stream), "cudaMemsetAsync");
        std::vector<std::int64_t> cells(static_cast<std::size_t>(gpus * gpus), block);
        moecomm::byte_matrix const m(gpus, cells);
        moecomm::alltoall_stats stats;
        moecomm::alltoall_workspace<moecomm::cuda_backend> scratch;
        auto const bytes = moecomm::array_view<char const>{send.data(), block * gpus};
        ours[static_cast<std::size_t>(r)] = time_on_stream(stream, [&] {
          moecomm::alltoallv(be, groups, m, bytes, moecomm::array_view<char>{recv.data(), block * gpus}, stats, scratch);
        }, 1).median_s;
        check(cudaMemsetAsync(recv.data(), 0, static_cast<std::size_t>(block * gpus), stream), "cudaMemsetAsync");
        theirs[static_cast<std::size_t>(r)] = time_on_stream(stream, [&] {
          ncclGroupStart();
          for (int p = 0; p < gpus; ++p) {
            ncclSend(send.data() + p * block, static_cast<std::size_t>(block), ncclChar, p, comm.native_handle(), stream);
            ncclRecv(recv.data() + p * block, static_cast<std::size_t>(block), ncclChar, p, comm.native_handle(), stream);
          }
          if (ncclGroupEnd() != ncclSuccess) throw std::runtime_error("ncclGroupEnd failed");
        }, 1).median_s;
        std::vector<char> got(static_cast<std::size_t>(block * gpus));
        be.copy(got.data(), recv.data(), block * gpus);
        be.synchronize();
        for (int p = 0; p < gpus; ++p)
          if (got[static_cast<std::size_t>(p * block)] != static_cast<char>(p + 1) ||
              got[static_cast<std::size_t>((p + 1) * block - 1)] != static_cast<char>(p + 1))
            failures[static_cast<std::size_t>(r)] = "wrong bytes from rank " + std::to_string(p);
      } catch (std::exception const& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  int status = 0;
  std::printf("alltoall on %d GPUs, %lld MiB to each peer, median of %d after %d warm-up calls\n\n", gpus,
              static_cast<long long>(block >> 20), repetitions, warmup_calls);
  std::printf("| rank | moecomm flat GB/s | NCCL send/recv GB/s | ratio | check |\n|---|---|---|---|---|\n");
  for (int r = 0; r < gpus; ++r) {
    double const a = static_cast<double>(block * gpus) / ours[static_cast<std::size_t>(r)] / 1e9;
    double const b = static_cast<double>(block * gpus) / theirs[static_cast<std::size_t>(r)] / 1e9;
    std::string const& f = failures[static_cast<std::size_t>(r)];
    std::printf("| %d | %.1f | %.1f | %.3f | %s |\n", r, a, b, a / b, f.empty() ? "ok" : ("FAILED: " + f).c_str());
    if (!f.empty()) status = 1;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  bool all_to_all = false;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--alltoall") {
      all_to_all = true;
    } else {
      std::printf("usage: bench_device [--alltoall]\n"
                  "  the row ops against cudaMemcpy device-to-device on device 0, or (--alltoall) moecomm's\n"
                  "  all-to-all against NCCL's send/recv on every visible GPU\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (!moecomm::cuda_device_available()) {
    std::printf("SKIPPED: no CUDA device on this machine; the device benchmarks were compiled but not run\n");
    return 77;
  }
  try {
    return all_to_all ? alltoall() : row_ops();
  } catch (std::exception const& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
}
