"""Codes an all-reduce can sum: the compressed body of the fault-tolerant strategies' rounds (issue 65).

torchft manages one collective, the all-reduce, so the pack's two-phase layout (an all-to-all, then an all-gather)
cannot cross its replica groups. Quantised values that share one scale can be summed directly (THC, Li et al. 2023):
one small all-reduce agrees the scales, one all-reduce of the codes, packed with headroom bits for the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LEVELS", "SUMMABLE", "compress_summable"]

# Levels each side of zero: int8 (127, as the pack's int8 codec), int4 (7, as its int4 codec).
LEVELS = {"int8": 127, "int4": 7}
SUMMABLE = tuple(LEVELS)


def compress_summable(
    x: torch.Tensor, levels: int, chunk_size: int, groups: int, all_reduce: Callable[[torch.Tensor, Any], None]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The sum over ``groups`` of every group's ``x``, as codes an all-reduce can add: ``(sum, own, bytes sent)``,
    ``own`` this group's decoded share (``x - own`` is what the codes dropped: the caller's residual).

    Two all-reduces, both of which torchft's manager runs (it manages no other collective, so the pack's two-phase
    layout, an all-to-all then an all-gather, cannot cross its groups): the chunks' largest magnitudes (``MAX``), so
    every group quantises chunk ``c`` with the same step ``scale_c = max_g |x_g|_c / levels``; then the codes, each
    shifted by ``levels`` to ``0 .. 2 * levels`` and packed into 64-bit words in fields of ``w`` bits, where ``w``
    holds the sum of ``groups`` codes (``2 * groups * levels``): a ``SUM`` of the words adds every field without a
    carry into the next (THC's headroom, Li et al. 2023). Integers add exactly in any order, so every group decodes
    bitwise the same sum. 63 bits of a word are used (the sign bit never sees a carry).

    On the wire per element, 2 groups: ``int8`` (127 levels, ``w`` 9, 7 fields a word) 9.1 bits plus 32 bits of
    scale per chunk of 256, 29% of fp32; ``int4`` (7 levels, ``w`` 5, 12 a word) 5.3 bits plus scales, 17%. The
    field grows with log2 of the groups: ``int8`` is 33% of fp32 on 3 and 4 groups."""
    n = x.numel()
    chunks = -(-n // chunk_size)
    padded = torch.zeros(chunks * chunk_size, dtype=torch.float32, device=x.device)
    padded[:n] = x.float()
    rows = padded.view(chunks, chunk_size)
    scale = rows.abs().amax(dim=1)
    all_reduce(scale, dist.ReduceOp.MAX)
    step = torch.where(scale > 0, scale / levels, torch.ones_like(scale))
    codes = torch.round(rows / step[:, None]).clamp_(-levels, levels).to(torch.int64)
    own = (codes.to(torch.float32) * step[:, None]).view(-1)[:n]
    width = (2 * groups * levels).bit_length()
    per = 63 // width
    if per < 1:
        raise ValueError(f"{groups} groups at {levels} levels need fields of {width} bits: more than a 64-bit word")
    shifted = (codes.view(-1) + levels).contiguous()
    words_n = -(-shifted.numel() // per)
    fields = torch.zeros(words_n * per, dtype=torch.int64, device=x.device)
    fields[: shifted.numel()] = shifted
    shifts = torch.arange(per, dtype=torch.int64, device=x.device) * width
    words = (fields.view(words_n, per) << shifts).sum(dim=1)
    all_reduce(words, dist.ReduceOp.SUM)
    summed = ((words[:, None] >> shifts) & ((1 << width) - 1)).view(-1)[: shifted.numel()] - groups * levels
    total = (summed.view(chunks, chunk_size).to(torch.float32) * step[:, None]).view(-1)[:n]
    return total, own, scale.numel() * scale.element_size() + words.numel() * words.element_size()
