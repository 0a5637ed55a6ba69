// The memory of a step's large activations: a pool of mapped pages of their own, outside glibc's heap.
//
// On the heap, a step's activations of many sizes (1-21 MB at the 0.8B shape) were placed around each other and
// around the small blocks that outlive them (torch's and Python's), and the heap kept the holes: the 0.8B int8
// engine's 1,024-row step took the heap 52 MB above its start for at most 28 MB of live activations, and that
// step set the process's peak. In the pool, blocks of kPoolMinBytes to kPoolMaxBytes are placed best fit among
// themselves only, the lowest address first; freed blocks keep their pages, so the next step does not fault
// them in again (what the heap gave, parallel.h), until release_step_memory hands the free ones back. Measured
// (bench_formats' int8 workload, 1 thread, three processes each): VmHWM 1.444-1.455 -> 1.422-1.424 GiB, the
// prefill, decode and batched speeds unchanged (within 2-5% either way, both orders).
#pragma once

#include <cstdint>
#include <utility>

namespace deltaserve {

// The block sizes the pool serves; others go to the allocator it replaces (glibc's heap and, past its mmap
// threshold, mappings of their own).
constexpr int64_t kPoolMinBytes = int64_t{1} << 20, kPoolMaxBytes = int64_t{32} << 20;

// Makes the pool torch's CPU allocator, process-wide, from the first call on (later calls do nothing). A block
// allocated before keeps its own deleter.
void use_step_memory_pool();

// Hands the pool's free pages back to the system (madvise); returns their bytes.
int64_t release_step_memory();

// (bytes the pool has mapped, bytes of them in live blocks).
std::pair<int64_t, int64_t> step_memory_stats();

}  // namespace deltaserve
