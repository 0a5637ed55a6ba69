"""Suite-wide settings."""

import torch

# The test models are tiny: one thread avoids oversubscribing the (shared, 2-core) machine, which made
# some engine tests 30x slower with torch's default thread count.
torch.set_num_threads(1)
