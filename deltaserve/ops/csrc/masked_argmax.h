// Greedy tokens under a grammar (structured outputs): each row's argmax over the tokens its bitmask allows,
// projecting only the lm_head panels that hold an allowed token.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "linear.h"

namespace deltaserve {

// argmax[t] = torch.argmax of row t of the masked logits of h [R, K] (deltaserve/ops/token_mask.py): the
// logits apply(lm, h) gives for these R rows, with -inf for every token that bit v & 31 of word v >> 5 of
// allowed[t * words ...] refuses, and for every NaN. A refused token's value does not depend on its logit,
// so only the panels holding an allowed token are projected (by apply's own kernel for R rows, project_panel:
// the very same numbers), the others count as -inf; a row with no finite allowed value is all -inf, and
// torch.argmax gives 0. The rows that allow tokens of one panel are projected together. A grammar's mask
// usually allows a handful of tokens where the model's argmax is refused (a closing quote, a comma), so this
// costs a few panels instead of the whole lm_head.
void masked_argmax(const Linear& lm, const at::Tensor& h, const int32_t* allowed, int64_t words, int64_t* argmax);

}  // namespace deltaserve
