// How the fused step spends threads, memory and time: the grain that decides whether a loop is split over
// threads, the allocator setting that keeps a step's activations on the heap, and the step profile's timer.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace deltaserve {

// Splitting a loop over threads costs a fork/join and wakes threads that may be serving HTTP: only worth it
// for this much work per thread (multiply-adds, about 20-50 us on one core).
constexpr int64_t kMinWorkPerThread = 1 << 20;

// The grain for at::parallel_for over n items of `work_per_item` each: the whole range inline when it is
// small, else chunks of at least kMinWorkPerThread.
inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(work_per_item, 1));
}

// glibc hands allocations above 128 KB (raising that bar only as such blocks are freed) to fresh mmaps and
// returns freed heap tops to the kernel past 128 KB: a step's activations, a few hundred KB to a few MB,
// were faulted in page by page at every step (the 64-request benchmark on the demo spent 15% there).
// Keeping them on the heap is what servers get from tcmalloc or jemalloc; it is process-wide, and costs
// up to the trim threshold of freed memory held back from the kernel. Set at every stack's construction:
// the loader sets the opposite while it converts weights (deltaserve/model/loader.py return_freed_memory).
// Blocks of 1 to 32 MiB no longer reach the heap: they come from the step's own pool (step_memory.h).
inline void keep_step_memory_on_the_heap() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's ceiling for this setting on 64-bit
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
}

// Adds the wall time of its scope to *slot (when slot is not null): the step profile (FusedStack::profile).
class Timed {
 public:
  explicit Timed(double* slot) : slot_(slot), start_(slot ? Clock::now() : Clock::time_point()) {}
  ~Timed() {
    if (slot_) *slot_ += std::chrono::duration<double>(Clock::now() - start_).count();
  }

 private:
  using Clock = std::chrono::steady_clock;
  double* slot_;
  Clock::time_point start_;
};

}  // namespace deltaserve
