"""Qwen-VL's multimodal rotary positions (M-RoPE): three position ids per token,
(frame, row, column), which the text model's rotary turns different slices of each head
by.

A text token has its sequence position on all three. An image's tokens (its merged
patches, row-major) all start from the position the image begins at: the frame id is
that start (a still image is one frame), the row and column ids that start plus the
merged patch's row and column. The text after an image goes on from the start plus the
larger of the image's merged rows and columns, not plus its token count, so positions
run ahead of token indexes less than images are long. Past the prompt every token's
three ids are its index plus the prompt's ``delta``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import LocalserveError


def mrope_positions(token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]],
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """``[3, len(token_ids)]`` position ids (frame, row, column) for a prompt whose image
    tokens (``image_token_id``) stand in runs, one image's tokens after another in the
    order of ``grids`` (each image's patch grid: frames, rows, columns); and the delta
    that later tokens' positions have over their index."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    positions = torch.empty(3, len(ids), dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    used = 0  # images placed so far
    index = 0  # the next token
    position = 0  # the next text token's position
    while index < len(ids):
        if not is_image[index]:
            end = index
            while end < len(ids) and not is_image[end]:
                end += 1
            positions[:, index:end] = torch.arange(position, position + end - index)
            position += end - index
            index = end
            continue
        if used == len(grids):
            raise LocalserveError(f"the prompt has more image tokens than its {len(grids)} image(s) fill")
        grid = grids[used]
        used += 1
        frames, rows, columns = grid[0], grid[1] // merge_size, grid[2] // merge_size
        count = frames * rows * columns
        if index + count > len(ids) or not all(is_image[index:index + count]):
            raise LocalserveError(f"image {used} ({frames} x {grid[1]} x {grid[2]} patches) needs {count} image "
                                  "tokens in a row; the prompt has fewer there")
        frame = torch.arange(frames).repeat_interleave(rows * columns)
        row = torch.arange(rows).repeat_interleave(columns).repeat(frames)
        column = torch.arange(columns).repeat(frames * rows)
        positions[:, index:index + count] = torch.stack((frame, row, column)) + position
        position += max(rows, columns)
        index += count
    if used < len(grids):
        raise LocalserveError(f"the prompt's image tokens fill fewer than its {len(grids)} image(s)")
    delta = (int(positions.max()) + 1 if len(ids) else 0) - len(ids)
    return positions, delta

