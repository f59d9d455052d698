"""The device half of the GPU check (:mod:`lightning_syncasync.bench.gpu`): what the device is, its memory bandwidth
measured by a device-to-device copy, and each compression codec's encode + decode throughput against that bandwidth
and against the fused bound of the module docstring there."""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.metadata
import logging
import os
import platform
import shutil
import socket
import statistics
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_METHODS: tuple[str, ...] = ("int8", "int4", "sign", "fp16", "bf16")
CAST_METHODS: tuple[str, ...] = ("fp16", "bf16")  # timed by Compressor.time_codec as their casts
# Bytes of codes per element of the chunked codecs (their scales, 4 B per chunk of 256, left out), for the fused bound.
CODE_BYTES_PER_ELEMENT: dict[str, float] = {"int8": 1.0, "int4": 0.5, "sign": 0.125}
# Timed with both codecs, eager and fused (``Compressor(codec=...)``); the other methods with the device's default.
COMPARED_METHOD = "int8"
BANDWIDTH_REPS = 10
CODEC_REPS = 5
ERROR_CHARS = 2000  # a strategy's error message in the JSON, cut to this length (tracebacks go to the log)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_info(device: torch.device) -> dict[str, Any]:
    import lightning

    import lightning_syncasync

    info: dict[str, Any] = {
        "kind": device.type,
        "index": device.index,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "lightning_syncasync": lightning_syncasync.__version__,
        "python": platform.python_version(),
        # What the fused codec needs (Triton builds its launcher with a C compiler): without either, "auto" is eager.
        "triton": _version("triton"),
        "c_compiler": shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"),
        "hostname": socket.gethostname(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=torch.cuda.get_device_name(device),
            capability=f"{props.major}.{props.minor}",
            total_memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
        )
        with contextlib.suppress(Exception):  # NCCL's version is informative only; ROCm and CPU-only builds lack it
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info.update(
            name=platform.processor() or platform.machine(), cpus=os.cpu_count(), threads=torch.get_num_threads()
        )
    return info


def measure_bandwidth(device: torch.device, numel: int, reps: int = BANDWIDTH_REPS) -> dict[str, Any]:
    """Device-to-device copy of ``numel`` fp32 elements: (bytes read + bytes written) / median seconds."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):  # two warm-ups: the first copy pays for page mapping and kernel selection
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[2:])
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return {
        "bytes_copied": moved // 2,
        "bytes_moved": moved,
        "median_s": median,
        "reps": reps,
        "gbps": moved / median / 1e9,
    }


def measure_codec(
    method: str, numel: int, device: torch.device, bandwidth_gbps: float, codec_setting: str = "auto"
) -> dict[str, Any]:
    from lightning_syncasync.algorithms.compression.compressor import Compressor

    plain: tuple[float, float] | None = None
    try:
        codec = Compressor(method, codec=codec_setting)  # type: ignore[arg-type]
        encode_s, decode_s = codec.time_codec(numel, reps=CODEC_REPS, device=device)
        if method not in CAST_METHODS:
            # Without error feedback too: the residual's read and write are a fixed share of the bytes a codec moves
            # (the bound in the module docstring), so both figures are needed to see how far from fused the codec is.
            plain = codec.time_codec(numel, reps=CODEC_REPS, device=device, error_feedback=False)
    except Exception as err:  # a codec that fails on this device is a result, not the end of the check
        log.warning("compression %s failed on %s", method, device, exc_info=True)
        return {
            "encode_s": None,
            "decode_s": None,
            "gbps": None,
            "fraction_of_bandwidth": None,
            "error": error_text(err),
        }
    finally:
        free_memory(device)
    gbps = numel * 4 / (encode_s + decode_s) / 1e9
    fraction = gbps / bandwidth_gbps
    code = CODE_BYTES_PER_ELEMENT.get(method)
    out = {
        "codec": codec.kernels.mode(device) if method not in CAST_METHODS else "cast",
        "encode_s": encode_s,
        "decode_s": decode_s,
        "gbps": gbps,
        "fraction_of_bandwidth": fraction,
        "error": None,
    }
    if code is not None:
        # The fused bound (module docstring): the bytes a codec must move per element, 4 of them the fp32 input.
        out.update(bound_fraction=4 / (16 + 2 * code), share_of_bound=fraction * (16 + 2 * code) / 4)
    if plain is not None:
        plain_gbps = numel * 4 / sum(plain) / 1e9
        out.update(
            encode_s_without_error_feedback=plain[0],
            gbps_without_error_feedback=plain_gbps,
            fraction_without_error_feedback=plain_gbps / bandwidth_gbps,
        )
        if code is not None:
            out.update(
                bound_fraction_without_error_feedback=4 / (12 + 2 * code),
                share_of_bound_without_error_feedback=plain_gbps / bandwidth_gbps * (12 + 2 * code) / 4,
            )
    return out


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:ERROR_CHARS]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
