// The flat batch of one engine step, as the GDN and attention kernels read it.
//
// B sequences, sequence b owns tokens qsl[b] .. qsl[b+1]-1, each token t at rotary/KV position positions[t].
// A sequence with context_lens[b] == 0 starts its GDN state from zeros. spec_index[b] >= 0 marks a verify
// segment: its GDN states after every token go to the returned per-position tensors (row spec_index[b]) and
// its cache slot is left untouched; other sequences update their slot in place.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace deltaserve {

// Per-step views of the flat batch (all int64, on CPU).
struct Batch {
  int64_t T, B;
  const int64_t *positions, *qsl, *context_lens, *block_tables, *slot_mapping, *state_slots, *spec_index;
  int64_t table_width;
  int64_t spec_rows, spec_width;
};

// The tokens whose final hidden state a step hands back (the rows it samples), when not all of them: the
// last layer still writes every token's K/V or GDN state, but attends, projects out and runs its MLP only
// for these rows. Nothing after the last layer reads the other rows.
struct OutputRows {
  at::Tensor rows;          // int64 [R], ascending
  std::vector<char> wanted;  // [T]: whether token t is one of them
};

// The Batch over T tokens of these tensors (which must outlive it).
inline Batch make_batch(int64_t T, const at::Tensor& positions, const at::Tensor& qsl, const at::Tensor& context_lens,
                        const at::Tensor& block_tables, const at::Tensor& slot_mapping, const at::Tensor& state_slots,
                        const at::Tensor& spec_index, int64_t spec_rows, int64_t spec_width) {
  for (const at::Tensor* t : {&positions, &qsl, &context_lens, &block_tables, &slot_mapping, &state_slots,
                              &spec_index}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "FusedStack: index tensors are int64");
  }
  TORCH_CHECK(positions.dim() == 1, "FusedStack: text positions only ([T])");
  TORCH_CHECK(positions.numel() == T, "FusedStack: ", positions.numel(), " positions for ", T, " tokens");
  TORCH_CHECK(block_tables.dim() == 2, "FusedStack: block_tables is [B, width]");
  const int64_t B = context_lens.size(0);
  TORCH_CHECK(qsl.numel() == B + 1, "FusedStack: query_start_loc has B + 1 = ", B + 1, " entries, not ",
              qsl.numel());
  return Batch{T, B, positions.data_ptr<int64_t>(), qsl.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
               block_tables.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(), state_slots.data_ptr<int64_t>(),
               spec_index.data_ptr<int64_t>(), block_tables.size(1), spec_rows, spec_width};
}

// The kernels index the caches with the batch's numbers unchecked: check them once per step. slots / blocks:
// the GDN state slots and KV cache blocks there are (-1: no such cache here), block_size the KV block's.
inline void check_batch(const Batch& bt, int64_t slots, int64_t blocks, int64_t block_size) {
  TORCH_CHECK(bt.qsl[0] == 0 && bt.qsl[bt.B] == bt.T, "FusedStack: query_start_loc must span the T tokens");
  for (int64_t b = 0; b < bt.B; ++b) {
    TORCH_CHECK(bt.qsl[b] <= bt.qsl[b + 1], "FusedStack: query_start_loc must not decrease");
    TORCH_CHECK(slots < 0 || (bt.state_slots[b] >= 0 && bt.state_slots[b] < slots), "FusedStack: state slot ",
                bt.state_slots[b], " outside [0, ", slots, ")");
    for (int64_t w = 0; blocks >= 0 && w < bt.table_width; ++w) {
      const int64_t block = bt.block_tables[b * bt.table_width + w];
      TORCH_CHECK(block >= 0 && block < blocks, "FusedStack: block ", block, " outside [0, ", blocks, ")");
    }
    for (int64_t t = bt.qsl[b]; t < bt.qsl[b + 1]; ++t) {
      TORCH_CHECK(bt.positions[t] >= 0 && bt.positions[t] < bt.table_width * block_size,
                  "FusedStack: position ", bt.positions[t], " beyond the sequence's block table");
      TORCH_CHECK(blocks < 0 || (bt.slot_mapping[t] >= 0 && bt.slot_mapping[t] < blocks * block_size),
                  "FusedStack: KV slot ", bt.slot_mapping[t], " outside the cache");
    }
  }
}

}  // namespace deltaserve
