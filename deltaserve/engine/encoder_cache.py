"""The images of the running requests and the vision tower's output for them.

The tower runs in the first step that needs any of an image's tokens; its merged tokens stay here until
the request's prefill has passed the whole image, so a chunked prefill that cuts through an image takes
the rest from here in the next step instead of encoding again. Preemption drops a request's outputs (its
recomputation encodes again), a finish or abort drops everything of it.

It holds at most `capacity_tokens` merged tokens (encoder_cache_tokens, vLLM's arithmetic, which
`deltaserve plan` counts too): the scheduler cuts a chunk before an image that would overfill it, so that
image waits until requests ahead of it have passed theirs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.engine.multimodal import MultiModalPrompt

Encoder = Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor]


def encoder_cache_tokens(max_num_batched_tokens: int, max_tokens_per_image: int) -> int:
    """The encoder cache's capacity in merged tokens, as vLLM sizes it (compute_encoder_budget:
    max(max_num_batched_tokens, the largest item's tokens)): one step's token budget, or one largest picture
    if that is more, since a picture's tokens are encoded and kept whole."""
    return max(max_num_batched_tokens, max_tokens_per_image)


class EncoderCache:
    def __init__(self, capacity_tokens: int, bytes_per_token: int) -> None:
        """bytes_per_token: one merged token's output row (the text width in the activation dtype)."""
        self.capacity_tokens = capacity_tokens
        self.bytes_per_token = bytes_per_token
        # request id -> its images and mRoPE positions. The images keep their pixels after encoding: a
        # preempted request's recomputation encodes them again (drop_outputs), and the inspector draws them.
        self.prompts: dict[str, MultiModalPrompt] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}  # (request id, image index) -> [n, H]
        # the outputs' merged tokens and bytes, kept as they come and go (the scheduler reads them every step)
        self.num_cached_tokens = 0
        self.num_bytes = 0
        self.num_encoded = 0  # images run through the tower, all steps
        self.num_encoded_tokens = 0  # their merged tokens
        self.max_cached_tokens = 0  # the most merged tokens held at once, all steps (capacity_tokens bounds it)

    def add(self, request_id: str, prompt: MultiModalPrompt) -> None:
        self.prompts[request_id] = prompt

    def remove(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self.prompts.pop(request_id, None)
        self.drop_outputs(request_id)

    def drop_outputs(self, request_id: str) -> None:
        """The request was preempted: its cache is gone, and so are its encoder outputs."""
        for key in [k for k in self.outputs if k[0] == request_id]:
            self._drop(key)

    def release_done(self, request_id: str, num_computed_tokens: int) -> None:
        """Drop the outputs of images whose every token is now in the KV/GDN cache."""
        prompt = self.prompts.get(request_id)
        if prompt is None:
            return
        for i, image in enumerate(prompt.images):
            if image.end <= num_computed_tokens and (request_id, i) in self.outputs:
                self._drop((request_id, i))

    def _drop(self, key: tuple[str, int]) -> None:
        out = self.outputs.pop(key)
        self.num_cached_tokens -= out.shape[0]
        self.num_bytes -= out.numel() * out.element_size()

    def clip_to_budget(self, request_id: str, start: int, n: int, budget: int, spent: int) -> tuple[int, int]:
        """The scheduler's encoder budget: a chunk [start, start+n) must encode every image it reaches that
        is not encoded yet, whole. Returns the chunk length that stays within `budget` merged tokens a step
        (`spent` of it already spent this step) and within the cache's capacity (it ends before the first
        image that does not fit), and what it spends. An image larger than the whole budget still runs alone
        in a step, and one larger than the capacity alone in an empty cache, or its request could never
        progress."""
        prompt = self.prompts.get(request_id)
        if prompt is None:
            return n, 0
        cached = self.num_cached_tokens
        cost = 0
        for i, image in enumerate(prompt.images):
            if image.end <= start or image.offset >= start + n or (request_id, i) in self.outputs:
                continue
            first = spent + cost == 0  # the first image this step
            over_step = spent + cost + image.num_tokens > budget and not first
            over_cache = cached + spent + cost + image.num_tokens > self.capacity_tokens and not (first and cached == 0)
            if over_step or over_cache:
                return max(image.offset - start, 0), cost
            cost += image.num_tokens
        return n, cost

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def embeddings_for(
        self, spans: list[tuple[str, int, int, int]], encode: Encoder
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """spans: (request id, first token index, token count, first row in the flat batch) of each scheduled
        chunk. Returns the rows of the batch that hold visual tokens and their embeddings, encoding (in one
        tower call) the images this step reaches for the first time; None when no chunk touches an image."""
        hits = []  # (request id, image index, image, first token of it in the chunk, last + 1, batch row)
        for rid, start, count, row in spans:
            prompt = self.prompts.get(rid)
            if prompt is None:
                continue
            for i, image in enumerate(prompt.images):
                lo, hi = max(start, image.offset), min(start + count, image.end)
                if lo < hi:
                    hits.append((rid, i, image, lo, hi, row + lo - start))
        if not hits:
            return None
        todo = {(rid, i): image for rid, i, image, *_ in hits if (rid, i) not in self.outputs}
        if todo:
            keys = list(todo)
            merged = encode(torch.cat([todo[k].pixel_values for k in keys]), [todo[k].grid for k in keys])
            for key, part in zip(keys, merged.split([todo[k].num_tokens for k in keys]), strict=True):
                self.outputs[key] = part
                self.num_cached_tokens += part.shape[0]
                self.num_bytes += part.numel() * part.element_size()
            self.num_encoded += len(keys)
            self.num_encoded_tokens += merged.shape[0]
            self.max_cached_tokens = max(self.max_cached_tokens, self.num_cached_tokens)
        rows, embeds = [], []
        for rid, i, image, lo, hi, first_row in hits:
            embeds.append(self.outputs[(rid, i)][lo - image.offset : hi - image.offset])
            rows.append(torch.arange(first_row, first_row + hi - lo))
        return torch.cat(rows), torch.cat(embeds)
