"""CUDA streams, events and timing: the side stream's ordering and overlap, stream waits timed by events,
``SyncMonitor``'s step times on a GPU, and the compressors' codecs on CUDA (fused by default there) against the
CPU's and the eager ones."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from _gpu import (
    ACCELERATOR,
    DEVICE,
    DRY_RUN,
    EMULATED,
    gpu_tests,
    lightning_accelerator,
    lightning_strategy,
    needs_cuda,
)
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_syncasync.algorithms._comm import CommThread
from lightning_syncasync.algorithms.compression import _codec
from lightning_syncasync.algorithms.compression._codec import Kernels
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.stats import StatsRecorder, timing_event
from lightning_syncasync.algorithms.streams import SideStream
from lightning_syncasync.callbacks.monitor import SyncMonitor

pytestmark = gpu_tests


def _cycles_for(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` (measured here: clocks vary)."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm-up (clock ramp)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / (start.elapsed_time(end) / 1000.0))


@needs_cuda
@pytest.mark.timeout(60)
def test_a_job_sees_what_the_loop_wrote_before_it_and_is_finished_when_delivered():
    x = torch.zeros(1 << 20, device="cuda")
    thread = CommThread("test-side", device=torch.device("cuda"))
    try:
        torch.cuda._sleep(_cycles_for(0.1))  # the loop's stream is busy: the fill below runs 0.1 s from now
        x.fill_(1.0)
        done = torch.cuda.Event()

        def job() -> torch.Tensor:
            total = x.sum()
            done.record()
            return total

        total = thread.submit(job).result(timeout=30)
        # Ordered after the fill (without the handoff event the side stream would have summed zeros), and finished:
        # the event recorded at the job's end has completed when the future is done.
        assert done.query()
        assert float(total) == x.numel()
    finally:
        thread.close()


@needs_cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("enabled", [True, False])
def test_the_side_stream_runs_beside_the_loop_and_without_it_after(enabled):
    side = SideStream("cuda", enabled=enabled)
    cycles = _cycles_for(0.1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    single = time.perf_counter() - start  # one sleep, as this GPU's clock runs it now
    start = time.perf_counter()
    handoff = side.handoff()
    torch.cuda._sleep(cycles)  # the loop's compute, enqueued after the handoff

    def job() -> None:
        torch.cuda._sleep(cycles)  # the exchange's work

    import threading

    worker = threading.Thread(target=lambda: side.run(handoff, job))
    worker.start()
    worker.join(timeout=30)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if enabled:
        assert elapsed < 1.6 * single, f"two sleeps of {single:.3f}s side by side took {elapsed:.3f}s: no overlap"
    else:
        assert elapsed > 1.8 * single, f"the default stream serialises two sleeps of {single:.3f}s, yet: {elapsed:.3f}s"


def _stall_the_current_stream(cycles: int) -> None:
    """What an NCCL collective with ``async_op=False`` does: the current stream waits for work on another stream
    (``cycles`` of sleep there), and the host returns at once."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        arrived = torch.cuda.Event()
        arrived.record(side)
    torch.cuda.current_stream().wait_event(arrived)


@needs_cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["record_stream_wait", "timed"])
def test_a_stream_wait_is_timed_by_events_not_by_the_host(how):
    # Both ways the pack records it: events it brackets the wait with itself (the delayed averager's due round), and
    # StatsRecorder.timed around a collective run to completion (the averager's gather, ddp_measured's averaging,
    # Lightning's reduce), which picks events on CUDA where a host clock would read the launch.
    recorder = StatsRecorder()
    recorder.begin_step()
    cycles = _cycles_for(0.05)
    host = time.perf_counter()
    if how == "timed":
        with recorder.timed(torch.device("cuda"), 128, "inter"):
            _stall_the_current_stream(cycles)
    else:
        before = timing_event(torch.device("cuda"))
        _stall_the_current_stream(cycles)
        recorder.record_stream_wait(before, timing_event(torch.device("cuda")))
    host = time.perf_counter() - host
    torch.cuda.current_stream().synchronize()  # as SyncMonitor does before it closes a step
    stats = recorder.end_step(step=0, samples=1)
    assert host < 0.02 and stats.bytes_inter == (128 if how == "timed" else 0)
    assert 0.035 < stats.wait_s < 0.08, stats


class SleepyModel(LightningModule):
    """A training step that keeps the GPU busy for ``seconds`` after the host has moved on."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        if self.device.type == "cuda":
            torch.cuda._sleep(self.cycles)
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8)


@needs_cuda
@pytest.mark.timeout(120)
def test_sync_monitor_times_the_gpus_step_not_its_launch():
    monitor = SyncMonitor(progress_bar=False, print_summary=False, warmup_steps=2)
    trainer = Trainer(
        accelerator=ACCELERATOR,
        devices=1,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    trainer.fit(SleepyModel(_cycles_for(0.03)))
    ranks = monitor.summary["ranks"]
    per_step = 1.0 / ranks[0]["samples_per_s"] * 8  # seconds per step of 8 samples
    # At least most of the 30 ms the GPU spends (the cycle count is calibrated, within a few percent).
    assert per_step > 0.024, f"{per_step:.4f}s per step: the monitor read the clock before the GPU was done"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cuda_sync", [True, False])
def test_sync_monitor_waits_for_the_accelerator_at_each_steps_end_only_when_asked(monkeypatch, tmp_path, cuda_sync):
    from _models import TinyModel

    # The accelerator's own current stream (torch.accelerator.current_stream), with the monitor's waits on it
    # counted: XPU and MPS steps are timed as CUDA's are, and no other stream is waited for (the next test). The
    # emulated device runs every operation before it returns, so it has nothing to wait for, and a device guard set up
    # from Python has no streams to synchronise: there the call is counted only.
    waits: list[torch.device] = []
    real = torch.accelerator.current_stream

    class Counted:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            waits.append(torch.device(self.device))
            if not EMULATED:
                real(self.device).synchronize()

    def current_stream(device=None):
        if sys._getframe(2).f_code.co_filename == monitor_file:  # SyncMonitor -> wait_for_current_stream -> here
            return Counted(device)
        return real(device)

    monitor_file = sys.modules[SyncMonitor.__module__].__file__
    monkeypatch.setattr(torch.accelerator, "current_stream", current_stream)
    monitor = SyncMonitor(progress_bar=False, print_summary=False, cuda_sync=cuda_sync)
    trainer = Trainer(
        accelerator=lightning_accelerator(), strategy=lightning_strategy(), devices=1, max_steps=6, logger=False,
        limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(TinyModel())
    assert monitor.summary["ranks"][0]["samples_per_s"] > 0
    if not cuda_sync or DRY_RUN:  # asked not to, or nothing queued on the CPU
        assert waits == []
    else:  # once at the end of each step (and of validation, when it runs)
        assert len(waits) >= 6 and {d.type for d in waits} == {torch.device(DEVICE).type}, waits


class SideStreamModel(SleepyModel):
    """Each step also queues ``cycles`` of work on a side stream the loop never waits for: what a background
    exchange's collective is while it waits for a slower rank (async_ssp's rounds, hier_sync's delayed averages)."""

    def training_step(self, batch, batch_idx):
        if not hasattr(self, "side"):
            self.side = torch.cuda.Stream()
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.cycles)
        return self.net(batch[0]).pow(2).mean()


@needs_cuda
@pytest.mark.timeout(120)
def test_sync_monitor_does_not_wait_for_the_background_streams(tmp_path):
    # A device-wide synchronize at each step's end would wait for the side stream's 0.1 s per step too, pacing an
    # asynchronous strategy by its slowest peer and counting the stall as compute; the monitor waits for the loop's
    # stream only, so a step here is the loop's few milliseconds.
    monitor = SyncMonitor(progress_bar=False, print_summary=False, warmup_steps=2)
    trainer = Trainer(
        accelerator=ACCELERATOR, devices=1, max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(SideStreamModel(_cycles_for(0.1)))
    per_step = 1.0 / monitor.summary["ranks"][0]["samples_per_s"] * 8  # seconds per step of 8 samples
    torch.cuda.synchronize()  # the side stream's backlog, for the next test
    assert per_step < 0.05, f"{per_step:.4f}s per step: the step's end waited for the side stream's work"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["int8", "int4", "sign"])
def test_the_codecs_give_on_the_gpu_what_they_give_on_the_cpu(method):
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    comp = Compressor(method)
    payload_cpu, own_cpu = comp._encode(x)
    payload_dev, own_dev = comp._encode(x.to(DEVICE))
    assert payload_dev.device.type == torch.device(DEVICE).type
    decoded = comp._decode(payload_dev, x.numel()).cpu()
    torch.testing.assert_close(decoded, own_dev.cpu())
    # The same codes and (up to the last bits of a reduction's sum: sign's scale is a mean) the same values; a code
    # can differ only where a value sits on a rounding boundary to the last bit: a handful of elements at most.
    differ = (decoded - own_cpu).abs() > 1e-5 * x.abs().max()
    assert int(differ.sum()) <= 10
    codes = {"int8": x.numel(), "int4": x.numel() // 2, "sign": x.numel() // 8}[method]
    assert int((payload_dev.cpu()[:codes] != payload_cpu[:codes]).sum()) <= 10


@needs_cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["int8", "int4", "sign"])
def test_on_a_gpu_the_codec_is_fused_and_gives_the_eager_codes(method):
    # codec="auto" compiles on CUDA (Triton); its first calls are checked against the eager codec, which drops the
    # fused one for the process if they disagree (Kernels._broken says why): here it must not have.
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    held = torch.randn_like(x) * 0.01
    fused, eager = Compressor(method), Compressor(method, codec="eager")
    assert fused.kernels.mode(x.device) == "compiled"
    chunks = -(-x.numel() // 256)
    for rows, length in ((1, chunks * 256), (4, -(-chunks // 4) * 256)):
        for residual, feedback in ((None, False), (held, True)):
            got = fused._encode_rows(x, residual, feedback, rows, length)
            want = eager._encode_rows(x, residual, feedback, rows, length)
            assert Kernels._broken is None, Kernels._broken
            assert _codec._disagreement(method, got, want, length) is None
            assert got[0].device == x.device and got[1].device == x.device
            decoded = fused._decode_rows(got[0], length, mean=True)
            assert _codec._disagreement(method, decoded, eager._decode_rows(got[0], length, mean=True), length) is None


@pytest.mark.timeout(180)
def test_stochastic_rounding_draws_on_the_device_and_is_unbiased():
    if EMULATED:
        pytest.skip("a generator of the emulated device cannot be made from Python (torch asks its C++ hooks)")
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    comp = Compressor("int8", rounding="stochastic")
    _, own = comp._encode(x)
    assert own.device == x.device
    scale = x.abs().max() / 127
    assert float((own - x).mean().abs()) < 0.01 * float(scale)


@needs_cuda
def test_the_environment_switch_leaves_no_side_stream(monkeypatch):
    assert SideStream("cuda").stream is not None
    monkeypatch.setenv("SYNCASYNC_SIDE_STREAM", "0")
    side = SideStream("cuda")
    assert not side.enabled and side.stream is None  # the jobs then run on the default stream
