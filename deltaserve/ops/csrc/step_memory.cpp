#include "step_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>

namespace deltaserve {

namespace {

constexpr size_t kBlockAlign = size_t{64} << 10;   // block sizes and starts: whole pages
constexpr size_t kChunkBytes = size_t{256} << 20;  // address space mapped at a time (a page is resident once touched)
static_assert(kChunkBytes >= static_cast<size_t>(kPoolMaxBytes), "a chunk holds the largest block");

class StepMemoryPool final : public c10::Allocator {
 public:
  explicit StepMemoryPool(c10::Allocator* fallback) : fallback_(fallback) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < static_cast<size_t>(kPoolMinBytes) || n > static_cast<size_t>(kPoolMaxBytes)) {
      return fallback_->allocate(n);
    }
    void* p = take((n + kBlockAlign - 1) / kBlockAlign * kBlockAlign);
    return {p, p, &free_block, c10::Device(c10::DeviceType::CPU)};
  }

  // (raw_allocate's blocks: the pool's or the fallback's, told apart by the pool's table)
  c10::DeleterFnPtr raw_deleter() const override { return &free_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t release() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t bytes = 0;
    for (const auto& [p, n] : free_) {
      madvise(p, n, MADV_DONTNEED);
      bytes += static_cast<int64_t>(n);
    }
    return bytes;
  }

  std::pair<int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t in_use = 0;
    for (const auto& [p, n] : used_) in_use += static_cast<int64_t>(n);
    return {static_cast<int64_t>(mapped_), in_use};
  }

  static StepMemoryPool* instance;  // set once by use_step_memory_pool, never destroyed (blocks may outlive all)

 private:
  static void free_block(void* p) { instance->give(p); }
  static void free_any(void* p) {
    if (p != nullptr && !instance->give(p)) instance->fallback_->raw_deleter()(p);
  }

  // A block of n bytes (a multiple of kBlockAlign): the smallest free one that holds it, the lowest address
  // among equals, its tail left free; a fresh mapping when none does.
  char* take(size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= n && (best == free_.end() || it->second < best->second)) best = it;
    }
    if (best == free_.end()) {
      void* m = mmap(nullptr, kChunkBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      TORCH_CHECK(m != MAP_FAILED, "out of memory: the fused step's activation pool could not map ",
                  kChunkBytes >> 20, " MiB more");
      mapped_ += kChunkBytes;
      best = put_free(static_cast<char*>(m), kChunkBytes);
    }
    char* p = best->first;
    const size_t left = best->second - n;
    free_.erase(best);
    if (left > 0) free_.emplace(p + n, left);
    used_.emplace(p, n);
    return p;
  }

  // Returns block p to the free ranges, merged with its free neighbours; false if p is not the pool's.
  bool give(void* block) {
    char* p = static_cast<char*>(block);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = used_.find(p);
    if (it == used_.end()) return false;
    const size_t n = it->second;
    used_.erase(it);
    put_free(p, n);
    return true;
  }

  // (mutex_ held) Adds [p, p + n) to the free ranges, merged with the ranges that touch it.
  std::map<char*, size_t>::iterator put_free(char* p, size_t n) {
    auto next = free_.lower_bound(p);
    if (next != free_.end() && p + n == next->first) {
      n += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      const auto prev = std::prev(next);
      if (prev->first + prev->second == p) {
        prev->second += n;
        return prev;
      }
    }
    return free_.emplace_hint(next, p, n);
  }

  c10::Allocator* fallback_;
  std::mutex mutex_;
  std::map<char*, size_t> free_;             // start -> bytes, in address order, none touching another
  std::unordered_map<char*, size_t> used_;  // live blocks: start -> bytes
  size_t mapped_ = 0;
};

StepMemoryPool* StepMemoryPool::instance = nullptr;

}  // namespace

void use_step_memory_pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    StepMemoryPool::instance = new StepMemoryPool(c10::GetCPUAllocator());
    c10::SetCPUAllocator(StepMemoryPool::instance, /*priority=*/1);  // (above the default allocator's 0)
  });
}

int64_t release_step_memory() {
  return StepMemoryPool::instance != nullptr ? StepMemoryPool::instance->release() : 0;
}

std::pair<int64_t, int64_t> step_memory_stats() {
  return StepMemoryPool::instance != nullptr ? StepMemoryPool::instance->stats() : std::pair<int64_t, int64_t>{0, 0};
}

}  // namespace deltaserve
