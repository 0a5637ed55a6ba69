"""The images of the running requests and the vision tower's output for them.

The tower runs in the first step that needs any of an image's tokens; its merged tokens stay here until
the request's prefill has passed the whole image, so a chunked prefill that cuts through an image takes
the rest from here in the next step instead of encoding again. Preemption drops a request's outputs (its
recomputation encodes again), a finish or abort drops everything of it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.engine.multimodal import MultiModalPrompt

Encoder = Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor]


class EncoderCache:
    def __init__(self) -> None:
        self.prompts: dict[str, MultiModalPrompt] = {}  # request id -> its images and mRoPE positions
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}  # (request id, image index) -> [n, H]
        self.num_encoded = 0  # images run through the tower, all steps
        self.num_encoded_tokens = 0  # their merged tokens

    def add(self, request_id: str, prompt: MultiModalPrompt) -> None:
        self.prompts[request_id] = prompt

    def remove(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self.prompts.pop(request_id, None)
        self.drop_outputs(request_id)

    def drop_outputs(self, request_id: str) -> None:
        """The request was preempted: its cache is gone, and so are its encoder outputs."""
        for key in [k for k in self.outputs if k[0] == request_id]:
            del self.outputs[key]

    def release_done(self, request_id: str, num_computed_tokens: int) -> None:
        """Drop the outputs of images whose every token is now in the KV/GDN cache."""
        prompt = self.prompts.get(request_id)
        if prompt is None:
            return
        for i, image in enumerate(prompt.images):
            if image.end <= num_computed_tokens:
                self.outputs.pop((request_id, i), None)

    def clip_to_budget(self, request_id: str, start: int, n: int, budget: int, fresh: bool) -> tuple[int, int]:
        """The scheduler's encoder budget: a chunk [start, start+n) must encode every image it reaches that
        is not encoded yet, whole. Returns the chunk length that stays within `budget` merged tokens (it ends
        before the first image that does not fit) and what it spends. `fresh`: nothing was spent this step,
        so an image larger than the whole budget still runs (alone), or the request could never progress."""
        prompt = self.prompts.get(request_id)
        if prompt is None:
            return n, 0
        cost = 0
        for i, image in enumerate(prompt.images):
            if image.end <= start or image.offset >= start + n or (request_id, i) in self.outputs:
                continue
            if cost + image.num_tokens > budget and not (fresh and cost == 0):
                return max(image.offset - start, 0), cost
            cost += image.num_tokens
        return n, cost

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.outputs.values())

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
            self.num_encoded += len(keys)
            self.num_encoded_tokens += merged.shape[0]
        rows, embeds = [], []
        for rid, i, image, lo, hi, first_row in hits:
            embeds.append(self.outputs[(rid, i)][lo - image.offset : hi - image.offset])
            rows.append(torch.arange(first_row, first_row + hi - lo))
        return torch.cat(rows), torch.cat(embeds)
