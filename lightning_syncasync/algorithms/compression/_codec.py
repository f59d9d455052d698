"""The chunked codecs' arithmetic (``int8``, ``int4``, ``int2``, ``sign``) as plain tensor functions, eager or
fused.

``Compressor`` calls :func:`encode`, :func:`decode` and :func:`decode_mean` for its byte payloads. Each is written
once and runs either as it is (eager: one kernel per operation, every intermediate a full tensor in memory) or
through ``torch.compile`` (fused: Inductor turns each function into a few loops, Triton kernels on CUDA and C++ on
the CPU). Both run the same source, so they compute the same codes.

Why fuse. An eager int8 encode with error feedback reads and writes about 88 bytes per fp32 element (the add of the
residual, the pad, abs, the chunk maxima, the division, round, clamp, the cast, the decoded copy, the subtraction,
the concatenation of codes and scales). A fused encode + decode moves what it must: read the input and the residual,
write the codes and the new residual, then read the codes and write the fp32 result, 18 bytes (``docs/gpu.md``). On
a GPU the codec is bound by memory traffic, so fusing is what brings it near the bandwidth; on this project's 2-core
CPU machines it is bound by arithmetic and fusing still removes most passes (the benchmark's ``codec`` figures).

Error feedback is fused too: :func:`encode` adds the held residual and returns the new one (``feedback=True``)
instead of this rank's decoded copy, so the residual never takes a pass of its own.

Layout of one block (a row of the payload): the codes, then each chunk's fp32 scale as 4 bytes, so a row can be
sent to one rank and decoded alone. ``int8``: one signed byte per element. ``int4``: values -7..7 offset to 1..15,
two per byte, low nibble first. ``int2``: ternary, values -1..1 offset to 1..3 (code 0 unused, as int4's nibble 0),
four per byte, lowest bits first; the scale is the chunk's largest magnitude. ``sign``: 1 bit per element (most
significant first, 1 for >= 0) and the chunk's mean absolute value as its scale (EF-SignSGD, Karimireddy et al., 2019).

Why ``int2`` is ternary rather than 4 levels: zero is exact (small and sparse coordinates cost nothing), it is
TernGrad's scheme (Wen et al., NeurIPS 2017: no loss on AlexNet at about 1.58 bits), and the integer codes of ``n``
ranks sum without bias into ``[-n, n]``, which a summable shared-scale form can add. Stochastic rounding
(``floor(q + u)``, ``u`` uniform in [0, 1), then the clamp) is unbiased: every ``q`` of a chunk divided by its
largest magnitude lies in [-1, 1], where the clamp changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Codec = Literal["auto", "eager", "compiled"]
CODECS: tuple[str, ...] = ("auto", "eager", "compiled")
# Overrides every Compressor's `codec` setting (for a whole job, e.g. to rule the compiler out when chasing a bug).
CODEC_ENV = "SYNCASYNC_CODEC"
# Levels each side of zero of the absmax codecs (int2 is ternary: -1, 0, 1 times the chunk's largest magnitude).
LEVELS = {"int8": 127.0, "int4": 7.0, "int2": 1.0}
# Compiled calls per case that also run eagerly and are compared, to catch a miscompiled graph: the first calls of
# each case, and the first call at each new size up to CHECKED_SIZES sizes (Dynamo compiles a static graph for the
# first size and a dynamic one at the first change of size: both are among them).
CHECKED_CALLS = 3
CHECKED_SIZES = 4
# What "the same" allows between fused and eager results: values may differ in the last bits, and a code where a
# value sits on a rounding boundary, in a tiny share of the elements; a miscompiled graph gets whole chunks wrong.
# The last bits: a sum in another order (sign's chunk mean), and on CUDA a division rounded otherwise (Inductor lowers
# fp32 `/` to Triton's approximate div.full, up to 2 ulp off, unless TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1). A
# chunk scale 2 ulp off moves int8's decoded values by up to 2.4e-7 of the chunk's largest input, while the residual
# they are subtracted from is only about 1/254 of it: up to 6.1e-5 of the largest residual, and a fused multiply-add
# in `x - q * scale` adds up to 1.5e-5 more. 3e-4 leaves room for both (a scale 16 ulp off passes, 20 does not:
# tests/algorithms/compression/test_codec.py); a miscompiled graph is off by far more.
AGREE_RTOL = 3e-4
AGREE_SHARE = 1e-4
# ... and at least this many elements, whatever the size: a code flipped at a rounding boundary happens in about 1e-5
# of int8's elements on a GPU, so a tensor of a few thousand elements can show one or two; a miscompile gets at least a
# chunk (8 elements or more) wrong.
AGREE_MIN = 4


def code_bytes(method: str, s: int) -> int:
    """Bytes of codes for ``s`` elements (a multiple of the chunk size, itself a multiple of 8)."""
    return {"int8": s, "int4": s // 2, "int2": s // 4, "sign": s // 8}[method]


def encode(
    method: str,
    flat: torch.Tensor,
    residual: torch.Tensor | None,
    noise: torch.Tensor | None,
    rows: int,
    row_len: int,
    chunk: int,
    feedback: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``flat + residual`` (``residual`` may be ``None``), zero-padded to ``rows * row_len`` elements, as
    ``rows`` blocks: ``(payload [rows, bytes per block] uint8, kept [numel])``. ``kept`` is the new residual
    ``flat + residual - decoded`` with ``feedback``, else the decoded copy (what the other ranks will read).
    ``noise`` (``int8``/``int4``/``int2`` stochastic rounding): uniform [0, 1) draws shaped
    ``[rows, chunks, chunk]``."""
    n = flat.numel()
    x = flat if residual is None else flat + residual
    chunks = F.pad(x, (0, rows * row_len - n)).view(rows, -1, chunk)
    if method == "sign":
        scale = chunks.abs().mean(dim=2, keepdim=True)
        positive = chunks >= 0
        bits = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=flat.device)
        codes = (positive.reshape(rows, -1, 8).to(torch.uint8) * bits).sum(dim=2, dtype=torch.uint8)
        own = torch.where(positive, 1.0, -1.0) * scale
    else:
        levels = LEVELS[method]
        scale = chunks.abs().amax(dim=2, keepdim=True) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = chunks / safe
        q = torch.round(q) if noise is None else torch.floor(q + noise)
        q = q.clamp(-levels, levels)
        own = q * scale
        if method == "int8":
            codes = q.to(torch.int8).reshape(rows, -1).view(torch.uint8)
        elif method == "int4":
            nibbles = (q + 8).to(torch.uint8).reshape(rows, -1, 2)
            codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
        else:
            crumbs = (q + 2).to(torch.uint8).reshape(rows, -1, 4)
            codes = crumbs[..., 0] | (crumbs[..., 1] << 2) | (crumbs[..., 2] << 4) | (crumbs[..., 3] << 6)
    scales = scale.reshape(rows, -1).view(torch.uint8)
    payload = torch.cat([codes.reshape(rows, -1), scales], dim=1)
    # Sliced after the subtraction, from the padded input: the same numbers as ``x - decoded`` (the first ``n``
    # elements of ``chunks`` are ``x``), in one shape with ``own``.
    kept = chunks - own if feedback else own
    return payload, kept.reshape(-1)[:n]


def decode(method: str, payload: torch.Tensor, row_len: int, chunk: int) -> torch.Tensor:
    """The inverse of :func:`encode`'s payload: ``[rows, bytes per block]`` -> ``[rows, row_len]`` fp32."""
    rows = payload.shape[0]
    nbytes = code_bytes(method, row_len)
    codes = payload[:, :nbytes]
    scale = _scales(payload, nbytes).view(rows, -1, 1)
    if method == "int8":
        q = codes.contiguous().view(torch.int8).float()
    elif method == "int4":
        q = torch.stack([codes & 0x0F, codes >> 4], dim=2).reshape(rows, row_len).float() - 8.0
    elif method == "int2":
        crumbs = [codes & 0x03, (codes >> 2) & 0x03, (codes >> 4) & 0x03, codes >> 6]
        q = torch.stack(crumbs, dim=2).reshape(rows, row_len).float() - 2.0
    else:
        bits = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=payload.device)
        q = torch.where((codes.reshape(rows, -1, 1) & bits).ne(0), 1.0, -1.0).reshape(rows, row_len)
    return (q.view(rows, -1, chunk) * scale).reshape(rows, row_len)


def _scales(payload: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The fp32 scales after each row's ``nbytes`` of codes. Copied, not ``.contiguous()``: the slice of a single row
    is contiguous already and keeps its storage offset, which a view as fp32 needs to be a multiple of 4 (``sign`` with
    a ``chunk_size`` not a multiple of 32 has ``row_len / 8`` bytes of codes)."""
    return payload[:, nbytes:].clone(memory_format=torch.contiguous_format).view(torch.float32)


def decode_mean(method: str, payload: torch.Tensor, row_len: int, chunk: int) -> torch.Tensor:
    """The mean of the decoded rows of ``payload`` (``[row_len]``), summed in row order: every rank that decodes
    the same bytes gets the same bits."""
    return decode(method, payload, row_len, chunk).sum(dim=0) / payload.shape[0]


class Kernels:
    """Picks eager or compiled codec functions per device; one per ``Compressor``.

    ``codec="auto"`` compiles on CUDA (where the codec is bound by memory traffic and fusing pays most) and stays
    eager elsewhere (compiling costs seconds per process and shape, which short CPU jobs and tests do not win back).
    ``"compiled"`` compiles on every device and raises if the compiler fails; under ``"auto"`` a compiler failure
    (no Triton, no C++ compiler) is logged once and the codec stays eager, since the results are the same.
    """

    # Compiled functions are shared by every Compressor of the process (Dynamo caches per function anyway).
    _compiled: dict[str, Callable[..., object]] = {}
    _lock = threading.Lock()
    _broken: str | None = None  # why compiling failed under "auto" (then every Compressor stays eager)
    _checked: dict[tuple[str, str, str, bool, bool, str], int] = {}  # compiled calls per case compared with eager
    _sizes: dict[tuple[str, str, str, bool, bool, str], set[int]] = {}  # the sizes compared per case

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._setting()  # a bad SYNCASYNC_CODEC is refused where the compressor is made, not in an exchange thread

    def _setting(self) -> str:
        codec = os.environ.get(CODEC_ENV, self.codec)
        if codec not in CODECS:
            raise ValueError(
                f"{CODEC_ENV} must be one of {CODECS}, got {codec!r}; HINT: unset it to use each Compressor's codec"
            )
        return codec

    def mode(self, device: torch.device) -> str:
        """``"compiled"`` or ``"eager"`` for tensors on ``device``, after the environment override."""
        codec = self._setting()
        if codec == "auto":
            return "compiled" if device.type == "cuda" and Kernels._broken is None else "eager"
        return codec

    def run(self, name: str, method: str, variant: str, *args: object) -> object:
        """Call :func:`encode`, :func:`decode` or :func:`decode_mean` (``name``) as ``name(method, *args)``, fused or
        not. ``variant`` names the case (rounding, feedback) that gets a compiled graph of its own.

        The first ``CHECKED_CALLS`` calls of each compiled case (one row or several), and its first call at each of
        its first ``CHECKED_SIZES`` sizes, also run eagerly and are compared: a compiler that miscompiles (Inductor
        in torch 2.13 did, on the CPU, for the residual of a padded last chunk: ``docs/gpu.md``) must cost speed,
        not the model. A disagreement is handled as a compiler failure."""
        fn = _FUNCTIONS[name]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device
        if self.mode(device) == "eager":
            return fn(method, *args)
        # Dynamo compiles one row apart from several, and a missing residual apart from one: each its own graph (and
        # each device type its own kernels).
        rows = args[3] if name == "encode" else tensors[0].shape[0]
        case = (name, method, variant, rows != 1, name == "encode" and args[1] is None, device.type)
        try:
            out = self._get(name, f"{method}_{variant}")(method, *args)
        except Exception as err:
            # A data error fails eagerly too and is raised as it is; otherwise the compiler (Inductor, Triton, the
            # C++ toolchain) failed.
            expected = fn(method, *args)
            return self._give_up(name, device, f"{type(err).__name__}: {err}", err, lambda: expected)
        size = tensors[0].numel()
        with Kernels._lock:
            seen = Kernels._sizes.setdefault(case, set())
            check = Kernels._checked.get(case, 0) < CHECKED_CALLS or (size not in seen and len(seen) < CHECKED_SIZES)
        # An input that is not finite (an fp16 loss-scale overflow in a gradient bucket) makes codes that neither
        # side defines (NaN cast to an integer): nothing to compare, and no check used up.
        if check and all(bool(t.isfinite().all()) for t in tensors if t.is_floating_point()):
            with Kernels._lock:
                Kernels._checked[case] = Kernels._checked.get(case, 0) + 1
                seen.add(size)
            expected = fn(method, *args)
            why = _disagreement(method, out, expected, int(args[4] if name == "encode" else args[1]))  # type: ignore[call-overload]
            if why is not None:
                return self._give_up(
                    name, device, f"the compiled {name} disagreed with the eager one: {why}", None, lambda: expected
                )
        return out

    def _give_up(
        self, name: str, device: torch.device, why: str, err: BaseException | None, eager: Callable[[], object]
    ) -> object:
        if self._setting() == "compiled":
            raise RuntimeError(
                f"codec='compiled' could not compile {name} on {device}: {why}; HINT: codec='eager' (or "
                f"{CODEC_ENV}=eager) runs the same arithmetic unfused"
            ) from err
        Kernels._broken = why
        log.warning("the fused compression codec failed, every codec of this process stays eager: %s", why)
        return eager()

    @classmethod
    def _get(cls, name: str, variant: str) -> Callable[..., object]:
        with cls._lock:
            key = f"{name}_{variant}"
            if key not in cls._compiled:
                # Dynamo keeps its compiled graphs on the function's code object, at most 8 per object. A copy of
                # the code object per variant (method, rounding, feedback) gives each its own cache, which then only
                # holds the shape cases (the first call's missing residual, one row or many). Sizes: Dynamo's
                # default, a static graph first and one dynamic graph from the first change of size on. Not
                # dynamic=True: it also makes the chunk size symbolic, and Inductor's CPU loops over a symbolic
                # chunk ran 2-4x slower than eager (measured here); the chunk size never changes in a run.
                fn = _FUNCTIONS[name]
                code = fn.__code__.replace(co_name=key)
                fresh = types.FunctionType(code, fn.__globals__, key, fn.__defaults__, fn.__closure__)
                cls._compiled[key] = torch.compile(fresh)
            return cls._compiled[key]


def _disagreement(method: str, got: object, expected: object, row_len: int) -> str | None:
    """Why ``got`` (compiled) is not ``expected`` (eager), or ``None`` when they agree (``AGREE_RTOL``,
    ``AGREE_SHARE``). Payloads compare their codes byte by byte and their scales as numbers."""
    outs = list(got) if isinstance(got, tuple) else [got]
    wants = list(expected) if isinstance(expected, tuple) else [expected]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(outs, wants, strict=True))  # type: ignore[arg-type]
    for i, (a, b) in enumerate(pairs):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} is {a.dtype}{list(a.shape)}, eager gives {b.dtype}{list(b.shape)}"
        if a.dtype == torch.uint8:
            nbytes = code_bytes(method, row_len)
            parts = [(a[:, :nbytes], b[:, :nbytes])]
            parts.append((_scales(a, nbytes), _scales(b, nbytes)))
        else:
            parts = [(a, b)]
        wrong, total = 0, 0
        for x, y in parts:
            if x.dtype == torch.uint8:
                wrong += int((x != y).sum())
            else:
                # Non-finite values agree when both sides hold the same one (inf - inf is NaN, so compared apart).
                finite = y.isfinite() & x.isfinite()
                largest = y[finite].abs().amax() if bool(finite.any()) else y.new_zeros(())
                close = finite & ((x - y).abs() <= AGREE_RTOL * (largest + y.abs()))
                same = ~finite & ((x == y) | (x.isnan() & y.isnan()))
                wrong += int((~close & ~same).sum())
            total += y.numel()
        if wrong > max(AGREE_SHARE * total, AGREE_MIN):
            return f"{wrong} of {total} elements of output {i} differ ({method})"
    return None


_FUNCTIONS: dict[str, Callable[..., object]] = {"encode": encode, "decode": decode, "decode_mean": decode_mean}
