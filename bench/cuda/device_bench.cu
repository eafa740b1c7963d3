// SPDX-License-Identifier: Apache-2.0
//! @file
//! moecomm on a GPU, as ratios to the device's own limits measured in the same run:
//!
//! - `memcpy_d2d`, `permute`, `unpermute`, `sort_chunks` (bf16 rows, T = 4096 tokens, H = 4096,
//!   K = 8 of E = 64 experts): bytes read + written per second by CUDA events, `permute` and the
//!   others also as a fraction of `cudaMemcpy` device-to-device bandwidth (`of_memcpy`).
//! - `--alltoall`: on every visible GPU (one thread each, NCCL), moecomm's `flat` all-to-all-v of
//!   the same blocks against NCCL's own grouped `ncclSend`/`ncclRecv`: algorithm bandwidth (bytes
//!   each rank sends per second) and the ratio.
//!
//! Results are checked after timing (a sampled row of permute; the all-to-all's received bytes) and
//! a mismatch fails the run. Without a GPU it says so and exits with 77. scripts/gpu-check runs it.

#include <moecomm/comm/nccl.cuh>
#include <moecomm/moecomm.cuh>

#include <benchmark/benchmark.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
constexpr std::int64_t tokens = 4096, hidden = 4096;
constexpr std::int32_t experts = 64, top_k = 8;

double memcpy_bytes_per_second = 0;  //!< measured first: the limit the others are divided by

//! Times `work()` on `stream` with events, `reps` times; seconds per call.
template <class Work>
double time_on_stream(cudaStream_t stream, int reps, Work&& work) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  work();  // warm
  cudaEventRecord(start, stream);
  for (int i = 0; i < reps; ++i) work();
  cudaEventRecord(stop, stream);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / 1e3 / reps;
}

struct fixture {
  moecomm::cuda_backend be;
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  moecomm::cuda_backend::buffer_type<std::int32_t> d_idx;
  moecomm::cuda_backend::buffer_type<float> d_w;
  moecomm::cuda_backend::buffer_type<bf16> x, rows, sorted, out;
  moecomm::permute_plan<moecomm::cuda_backend> plan;

  fixture() : be(make_stream()) {
    std::mt19937 rng(7);
    for (std::int64_t t = 0; t < tokens; ++t) {
      std::vector<std::int32_t> picks(experts);
      for (std::int32_t e = 0; e < experts; ++e) picks[static_cast<std::size_t>(e)] = e;
      std::shuffle(picks.begin(), picks.end(), rng);
      for (std::int32_t k = 0; k < top_k; ++k) {
        idx.push_back(picks[static_cast<std::size_t>(k)]);
        w.push_back(1.0f / top_k);
      }
    }
    d_idx = be.allocate<std::int32_t>(tokens * top_k);
    d_w = be.allocate<float>(tokens * top_k);
    be.copy(d_idx.data(), idx.data(), tokens * top_k);
    be.copy(d_w.data(), w.data(), tokens * top_k);
    x = be.allocate<bf16>(tokens * hidden);
    rows = be.allocate<bf16>(tokens * top_k * hidden);
    sorted = be.allocate<bf16>(tokens * top_k * hidden);
    out = be.allocate<bf16>(tokens * hidden);
    std::vector<bf16> host(static_cast<std::size_t>(tokens * hidden));
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = __float2bfloat16(static_cast<float>(i % 251) / 251.0f);
    be.copy(x.data(), host.data(), tokens * hidden);
    plan = moecomm::make_permute_plan(be, {d_idx.data(), d_w.data(), tokens, top_k}, experts);
    be.synchronize();
  }
  static cudaStream_t make_stream() {
    cudaStream_t s = nullptr;
    moecomm::detail::cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return s;
  }
};

fixture& the_fixture() {
  static fixture f;
  return f;
}

void report(benchmark::State& state, double seconds, double bytes) {
  state.SetIterationTime(seconds);
  state.counters["bytes_per_second"] = benchmark::Counter(bytes / seconds);
  if (memcpy_bytes_per_second > 0) state.counters["of_memcpy"] = bytes / seconds / memcpy_bytes_per_second;
}

void memcpy_d2d(benchmark::State& state) {
  fixture& f = the_fixture();
  std::int64_t const n = tokens * top_k * hidden;
  for (auto _ : state) {
    double const s = time_on_stream(f.be.stream(), 10, [&] {
      cudaMemcpyAsync(f.rows.data(), f.rows.data() + n / 2, static_cast<std::size_t>(n / 2) * sizeof(bf16),
                      cudaMemcpyDeviceToDevice, f.be.stream());
    });
    double const bytes = 2.0 * static_cast<double>(n / 2) * sizeof(bf16);
    memcpy_bytes_per_second = bytes / s;
    report(state, s, bytes);
  }
}

void permute(benchmark::State& state) {
  fixture& f = the_fixture();
  std::int64_t const p = f.plan.num_rows();
  for (auto _ : state) {
    double const s = time_on_stream(f.be.stream(), 10, [&] {
      moecomm::permute(f.be, f.plan, moecomm::matrix_view<bf16 const>{f.x.data(), tokens, hidden},
                       moecomm::matrix_view<bf16>{f.rows.data(), p, hidden});
    });
    report(state, s, 2.0 * static_cast<double>(p * hidden) * sizeof(bf16));
  }
  // A sampled row: row 0 of the plan is token token_of[0]'s row.
  std::int32_t token = 0;
  f.be.copy(&token, f.plan.token_of(), 1);
  std::vector<bf16> got(hidden), want(hidden);
  f.be.copy(got.data(), f.rows.data(), hidden);
  f.be.copy(want.data(), f.x.data() + token * hidden, hidden);
  f.be.synchronize();
  if (std::memcmp(got.data(), want.data(), hidden * sizeof(bf16)) != 0) state.SkipWithError("permute: row 0 differs");
}

void unpermute(benchmark::State& state) {
  fixture& f = the_fixture();
  std::int64_t const p = f.plan.num_rows();
  for (auto _ : state) {
    double const s = time_on_stream(f.be.stream(), 10, [&] {
      moecomm::unpermute<moecomm::weighted>(f.be, f.plan, moecomm::matrix_view<bf16 const>{f.rows.data(), p, hidden},
                                            moecomm::matrix_view<bf16>{f.out.data(), tokens, hidden});
    });
    report(state, s, static_cast<double>(p * hidden + tokens * hidden) * sizeof(bf16) + 4.0 * tokens * top_k);
  }
}

void sort_chunks(benchmark::State& state) {
  fixture& f = the_fixture();
  std::int32_t const ranks = 8, locals = experts / ranks;
  std::int32_t const per_chunk = static_cast<std::int32_t>(f.plan.num_rows() / (ranks * locals));
  std::vector<std::int32_t> counts(static_cast<std::size_t>(ranks * locals), per_chunk);
  std::int64_t const total = std::int64_t{per_chunk} * ranks * locals;
  moecomm::workspace<moecomm::cuda_backend> scratch;
  for (auto _ : state) {
    double const s = time_on_stream(f.be.stream(), 10, [&] {
      moecomm::sort_chunks<moecomm::cuda_backend, bf16>(
          f.be, moecomm::matrix_view<bf16 const>{f.rows.data(), total, hidden},
          moecomm::array_view<std::int32_t const>{counts.data(), static_cast<std::int64_t>(counts.size())}, ranks, locals,
          moecomm::matrix_view<bf16>{f.sorted.data(), total, hidden}, scratch);
    });
    report(state, s, 2.0 * static_cast<double>(total * hidden) * sizeof(bf16));
  }
}

//! The all-to-all on every GPU: moecomm's flat against NCCL's grouped send/recv of the same blocks.
int alltoall() {
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  std::int64_t const block = std::int64_t{32} << 20;  // bytes to each peer
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  std::vector<double> ours(static_cast<std::size_t>(gpus)), theirs(ours.size());
  std::vector<std::string> failures(ours.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < gpus; ++r)
    threads.emplace_back([&, r] {
      try {
        cudaSetDevice(r);
        cudaStream_t stream = fixture::make_stream();
        auto comm = moecomm::nccl_communicator::create(gpus, id, r, stream);
        moecomm::cuda_backend const be(stream);
        moecomm::exchange_groups<moecomm::nccl_communicator> groups(comm, moecomm::topology(gpus, gpus));
        auto send = be.allocate<char>(block * gpus), recv = be.allocate<char>(block * gpus);
        cudaMemsetAsync(send.data(), r + 1, static_cast<std::size_t>(block * gpus), stream);
        std::vector<std::int64_t> cells(static_cast<std::size_t>(gpus * gpus), block);
        moecomm::byte_matrix const m(gpus, cells);
        moecomm::alltoall_stats stats;
        moecomm::alltoall_workspace<moecomm::cuda_backend> scratch;
        auto const bytes = moecomm::array_view<char const>{send.data(), block * gpus};
        ours[static_cast<std::size_t>(r)] = time_on_stream(stream, 10, [&] {
          moecomm::alltoallv(be, groups, m, bytes, moecomm::array_view<char>{recv.data(), block * gpus}, stats, scratch);
        });
        theirs[static_cast<std::size_t>(r)] = time_on_stream(stream, 10, [&] {
          ncclGroupStart();
          for (int p = 0; p < gpus; ++p) {
            ncclSend(send.data() + p * block, static_cast<std::size_t>(block), ncclChar, p, comm.native_handle(), stream);
            ncclRecv(recv.data() + p * block, static_cast<std::size_t>(block), ncclChar, p, comm.native_handle(), stream);
          }
          ncclGroupEnd();
        });
        std::vector<char> got(static_cast<std::size_t>(block * gpus));
        be.copy(got.data(), recv.data(), block * gpus);
        be.synchronize();
        for (int p = 0; p < gpus; ++p)
          if (got[static_cast<std::size_t>(p * block)] != static_cast<char>(p + 1)) failures[static_cast<std::size_t>(r)] = "wrong bytes";
      } catch (std::exception const& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  int status = 0;
  std::printf("alltoall on %d GPUs, %lld MiB to each peer: rank, moecomm flat GB/s, NCCL send/recv GB/s, ratio\n", gpus,
              static_cast<long long>(block >> 20));
  for (int r = 0; r < gpus; ++r) {
    double const a = static_cast<double>(block * gpus) / ours[static_cast<std::size_t>(r)] / 1e9;
    double const b = static_cast<double>(block * gpus) / theirs[static_cast<std::size_t>(r)] / 1e9;
    std::printf("  %d  %.1f  %.1f  %.3f %s\n", r, a, b, a / b, failures[static_cast<std::size_t>(r)].c_str());
    if (!failures[static_cast<std::size_t>(r)].empty()) status = 1;
  }
  return status;
}

}  // namespace

BENCHMARK(memcpy_d2d)->UseManualTime()->Iterations(3);
BENCHMARK(permute)->UseManualTime()->Iterations(3);
BENCHMARK(unpermute)->UseManualTime()->Iterations(3);
BENCHMARK(sort_chunks)->UseManualTime()->Iterations(3);

int main(int argc, char** argv) {
  if (!moecomm::cuda_device_available()) {
    std::printf("SKIPPED: no CUDA device on this machine; the device benchmarks were compiled but not run\n");
    return 77;
  }
  if (argc > 1 && std::string(argv[1]) == "--alltoall") return alltoall();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
