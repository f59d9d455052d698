"""Codes an all-reduce can sum: the compressed body of the fault-tolerant strategies' rounds (issue 65) and
``Compressor(collective="summable")`` (issue 68).

torchft manages one collective, the all-reduce, so the pack's two-phase layout (an all-to-all, then an all-gather)
cannot cross its replica groups. Quantised values that share one scale can be summed directly (THC, Li et al. 2023):
one small all-reduce agrees the scales, one all-reduce of the codes, packed with headroom for the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import all_reduce_

__all__ = ["LEVELS", "SUMMABLE", "check_groups", "compress_summable", "max_groups", "packing", "summed_over"]

# Levels each side of zero of the fault-tolerant rounds' codecs: int8 (127, as the pack's int8 codec), int4 (7, as
# its int4 codec). The Compressor's summable collective also takes int2 (1 level: ternary, ``_codec.LEVELS``).
LEVELS = {"int8": 127, "int4": 7}
SUMMABLE = tuple(LEVELS)
# The packed words' budget: a SUM of non-negative int64 words stays below 2**63 (the sign bit never sees a carry).
_WORD = 1 << 63


def packing(levels: int, groups: int) -> tuple[int, int]:
    """``(radix, fields per word)``: the sum of ``groups`` codes shifted to ``0 .. 2 * levels`` lies in
    ``0 .. 2 * groups * levels``, one digit of radix ``2 * groups * levels + 1``; a word holds ``per`` digits while
    ``radix ** per <= 2 ** 63``. ``per`` is 0 when not even one digit fits."""
    radix = 2 * groups * levels + 1
    per, power = 0, 1
    while power * radix <= _WORD:
        power *= radix
        per += 1
    return radix, per


def max_groups(levels: int) -> int:
    """The most groups (ranks) whose summed codes at ``levels`` fit one 64-bit word: ``2 * groups * levels + 1``
    at most ``2 ** 63``."""
    return (_WORD - 1) // (2 * levels)


def check_groups(levels: int, groups: int) -> None:
    """Raise a ``ValueError`` with the limit and the fix when ``groups`` summed codes at ``levels`` overflow a word.

    Only the number of groups matters: every group quantises a chunk with the same (agreed) step, so the chunk size
    sets how many scales travel, never how large a sum grows."""
    if packing(levels, groups)[1] < 1:
        raise ValueError(
            f"collective='summable' takes at most {max_groups(levels)} ranks at {levels} levels, got {groups}: their "
            f"codes sum up to {2 * groups * levels}, more than a 64-bit word holds; HINT: collective='two_phase' (its "
            "traffic per rank does not grow with the ranks)"
        )


def compress_summable(
    x: torch.Tensor,
    levels: int,
    chunk_size: int,
    groups: int,
    all_reduce: Callable[[torch.Tensor, Any], None],
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The sum over ``groups`` of every group's ``x``, as codes an all-reduce can add: ``(sum, own, bytes sent)``,
    ``own`` this group's decoded share (``x - own`` is what the codes dropped: the caller's residual).

    Two all-reduces, both of which torchft's manager runs (it manages no other collective, so the pack's two-phase
    layout, an all-to-all then an all-gather, cannot cross its groups): the chunks' largest magnitudes (``MAX``), so
    every group quantises chunk ``c`` with the same step ``scale_c = max_g |x_g|_c / levels``; then the codes, each
    shifted by ``levels`` to ``0 .. 2 * levels`` and packed into 64-bit words as digits of radix
    ``r = 2 * groups * levels + 1`` (:func:`packing`): a ``SUM`` of the words adds every digit without a carry into
    the next (THC's headroom, Li et al. 2023). Integers add exactly in any order, so every group decodes bitwise the
    same sum. Digits rather than bit fields: ``int2``'s ``r`` is ``2 ** k + 1`` on ``2 ** (k - 1)`` groups, where a
    bit field would waste nearly a bit (2 groups: 27 digits a word instead of 21 fields of 3 bits).

    ``noise`` (stochastic rounding, ``floor(q + u)`` as ``_codec.encode``): uniform [0, 1) draws, one per element of
    the zero-padded chunks, each group its own (the sum is of integers, so the groups need not agree on them).

    On the wire per element at 256 elements a scale: ``int8`` 9.1 bits on 2 groups (29% of fp32), ``int4`` 5.3
    (17%), ``int2`` 2.4 (8%, 4 groups 3.4, 8 groups 4.3): the digit grows with log2 of the groups (the
    ``Compressor``'s module docstring has the measured bytes)."""
    check_groups(levels, groups)
    n = x.numel()
    chunks = -(-n // chunk_size)
    padded = torch.zeros(chunks * chunk_size, dtype=torch.float32, device=x.device)
    padded[:n] = x.float()
    rows = padded.view(chunks, chunk_size)
    scale = rows.abs().amax(dim=1)
    all_reduce(scale, dist.ReduceOp.MAX)
    step = torch.where(scale > 0, scale / levels, torch.ones_like(scale))
    q = rows / step[:, None]
    q = torch.round(q) if noise is None else torch.floor(q + noise.view(chunks, chunk_size))
    codes = q.clamp_(-levels, levels).to(torch.int64)
    own = (codes.to(torch.float32) * step[:, None]).view(-1)[:n]
    radix, per = packing(levels, groups)
    shifted = (codes.view(-1) + levels).contiguous()
    words_n = -(-shifted.numel() // per)
    digits = torch.zeros(words_n * per, dtype=torch.int64, device=x.device)
    digits[: shifted.numel()] = shifted
    powers = torch.tensor([radix**i for i in range(per)], dtype=torch.int64, device=x.device)
    words = (digits.view(words_n, per) * powers).sum(dim=1)
    all_reduce(words, dist.ReduceOp.SUM)
    summed = torch.div(words[:, None], powers, rounding_mode="floor").remainder_(radix)
    summed = summed.view(-1)[: shifted.numel()] - groups * levels
    total = (summed.view(chunks, chunk_size).to(torch.float32) * step[:, None]).view(-1)[:n]
    return total, own, scale.numel() * scale.element_size() + words.numel() * words.element_size()


def summed_over(
    x: torch.Tensor, levels: int, chunk_size: int, group: dist.ProcessGroup | None, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """:func:`compress_summable` over a process group (``Compressor(collective="summable")``): ``(sum, own, bytes
    handed to each all-reduce)``, the scales' then the codes'."""
    handed: list[int] = []

    def all_reduce(t: torch.Tensor, op: Any) -> None:
        all_reduce_(t, group, op)
        handed.append(t.numel() * t.element_size())

    total, own, _ = compress_summable(x, levels, chunk_size, dist.get_world_size(group), all_reduce, noise)
    return total, own, handed
