"""What the host machine reports, and fakes of it: tests decide from these, never from what one machine did."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch


def deepspeed_runs_fp16() -> bool:
    """Whether DeepSpeed trains fp16 here: on CUDA, or where its CPU accelerator reports fp16 support (oneDNN's fp16
    kernels, present on some CPUs and not on others)."""
    from deepspeed.accelerator import get_accelerator

    return torch.cuda.is_available() or bool(get_accelerator().is_fp16_supported())


class _FakeAccelerator:
    """DeepSpeed's accelerator as seen by the fp16 check: its name and whether it supports fp16."""

    def __init__(self, fp16: bool) -> None:
        self._fp16 = fp16

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def is_fp16_supported(self) -> bool:
        return self._fp16


@contextlib.contextmanager
def deepspeed_cpu_fp16(supported: bool) -> Iterator[None]:
    """Inside the block, DeepSpeed's accelerator says it does (or does not) support fp16, whatever this CPU does."""
    with mock.patch("deepspeed.accelerator.get_accelerator", return_value=_FakeAccelerator(supported)):
        yield
