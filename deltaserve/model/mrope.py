"""Multimodal RoPE positions of a prompt, as transformers' Qwen3_5Model.get_rope_index computes them.

Text tokens count up on all three rows (t, h, w). An image's merged tokens, laid out row by row over its
merged grid (t, h/m, w/m), take start + (t, row, column) where start is the position after the text before
it; the text after the image continues from start + max(h/m, w/m), one past the image's largest position.
Past the prompt (generated tokens) every row is index + delta, delta = max position + 1 - prompt length."""

from __future__ import annotations

import torch

Grid = tuple[int, int, int]  # (t, h, w) in patches


def mrope_positions(num_tokens: int, images: list[tuple[int, Grid]], merge: int) -> tuple[torch.Tensor, int]:
    """images: (offset of the first placeholder token, grid) per image, in prompt order, not overlapping.
    Returns positions [3, num_tokens] long and the delta that generated tokens add to their index."""
    rows = []
    pos = 0  # the next position
    cursor = 0  # the next token index
    for offset, (t, h, w) in images:
        if offset > cursor:
            rows.append(torch.arange(offset - cursor).expand(3, -1) + pos)
            pos += offset - cursor
        gh, gw = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        cursor = offset + t * gh * gw
        pos += max(gh, gw)
    if num_tokens > cursor:
        rows.append(torch.arange(num_tokens - cursor).expand(3, -1) + pos)
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    if positions.shape[1] != num_tokens:
        raise ValueError(f"image placeholders run past the prompt's {num_tokens} tokens")
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def positions_for(prompt_positions: torch.Tensor, delta: int, index: torch.Tensor) -> torch.Tensor:
    """The [3, len(index)] positions of token indices `index` of a sequence whose prompt has these mRoPE
    positions: prompt tokens read them, later tokens are index + delta on every row."""
    P = prompt_positions.shape[1]
    inside = index < P
    picked = prompt_positions[:, index.clamp(max=max(P - 1, 0))]
    return torch.where(inside, picked, (index + delta).expand(3, -1))
