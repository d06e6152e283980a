"""Blocks of a 2-D tensor: the tiles that fine-grained scaling gives one scale each.

A block is ``(rows, cols)``. A tensor whose shape is not a multiple of it is padded with zeros
virtually (zeros change no block's amax), so the last block along each dim may be partial.
`to_blocks` views the padded tensor as ``(grid_rows, rows, grid_cols, cols)``, `per_block` shapes
one value per block to broadcast over that view, and `from_blocks` drops the padding again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Block", "grid", "to_blocks", "from_blocks", "per_block", "block_amax"]

Block = tuple[int, int]


def grid(shape: tuple[int, ...] | torch.Size, block: Block) -> tuple[int, int]:
    """Blocks along each dim of a 2-D ``shape``: ``(ceil(R / rows), ceil(C / cols))``."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def to_blocks(x: torch.Tensor, block: Block) -> torch.Tensor:
    """``x`` (R, C), padded with zeros to whole blocks, as ``(grid_rows, rows, grid_cols, cols)``."""
    if x.dim() != 2:
        raise ValueError(f"block scaling takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = grid(x.shape, block)
    pad_r, pad_c = rows * block[0] - x.shape[0], cols * block[1] - x.shape[1]
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(rows, block[0], cols, block[1])


def from_blocks(xb: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """The inverse of `to_blocks`: the 2-D tensor of ``shape``, padding dropped (contiguous)."""
    flat = xb.reshape(xb.shape[0] * xb.shape[1], xb.shape[2] * xb.shape[3])
    if tuple(flat.shape) == tuple(shape):
        return flat
    return flat[: shape[0], : shape[1]].contiguous()


def per_block(values: torch.Tensor) -> torch.Tensor:
    """One value per block (grid_rows, grid_cols), shaped to broadcast over a `to_blocks` view."""
    return values[:, None, :, None]


def block_amax(xb: torch.Tensor) -> torch.Tensor:
    """Largest absolute value of each block of a `to_blocks` view, float32 (NaN where one is NaN)."""
    return xb.abs().amax(dim=(1, 3)).to(torch.float32)
