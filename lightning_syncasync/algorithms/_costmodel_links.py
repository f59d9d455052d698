"""The cost of the collectives in :class:`~lightning_syncasync.algorithms.costmodel.ScalingModel` (``_Collectives``),
in the alpha-beta model with ring algorithms (Hockney 1994; Thakur, Rabenseifner & Gropp 2005): the bytes each
compression method puts on the wire and the collective its payload travels by (``COMPRESSION``), the ring all-reduce
and all-gather, the two-phase compressed all-reduce, the bytes a rank sends and the codec's CPU cost."""

from __future__ import annotations

import math

from lightning_syncasync.algorithms.compression.summable import packing

# Bytes on the wire relative to fp32, and the collective the payload travels by (README's compression table;
# powersgd depends on the shapes: 2.6% on the transformer LM at rank 4).
COMPRESSION: dict[str, tuple[float, str]] = {
    "none": (1.0, "all_reduce"),
    "fp16": (0.5, "all_reduce"),
    "bf16": (0.5, "all_reduce"),
    "int8": (0.254, "two_phase"),
    "int4": (0.129, "two_phase"),
    "int2": (0.066, "two_phase"),
    "sign": (0.035, "two_phase"),
    "powersgd": (0.03, "all_reduce"),
}
# The codes ``Compressor(collective="summable")`` adds in one all-reduce: (levels each side of zero, payload bits).
SUMMABLE_CODES: dict[str, tuple[int, int]] = {"int8": (127, 8), "int4": (7, 4), "int2": (1, 2)}
# DDP's default bucket size (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25): one collective per bucket.
# (Compressed DDP uses 2 MB buckets; their collectives overlap with backward, which `overlap` stands for.)
_BUCKET_BYTES = 25 * 2**20


def summable_ratio(method: str, k: int, chunk: int = 256) -> float:
    """Bytes the summable collective hands its two all-reduces over ``k`` ranks, relative to fp32: one fp32 scale a
    chunk, and the codes as digits of radix ``2 k levels + 1``, as many to a 64-bit word as
    :func:`~lightning_syncasync.algorithms.compression.summable.packing` puts there."""
    per = packing(SUMMABLE_CODES[method][0], k)[1]
    return (64 / per + 32 / chunk) / 32


def summable_headroom(method: str, k: int) -> float:
    """The summable collective's bytes over the payload's (``COMPRESSION``'s ratio): the sum's headroom."""
    return summable_ratio(method, k) / COMPRESSION[method][0]


class _Collectives:
    """The collectives' costs, for :class:`~lightning_syncasync.algorithms.costmodel.ScalingModel` (which sets the
    attributes below in its constructor)."""

    intra_link: tuple[float, float]
    inter_link: tuple[float, float]
    codec_s_per_byte: float

    def _link(self, nodes: int) -> tuple[float, float]:
        """The slowest link of a flat ring: inter-node when the world spans nodes."""
        if nodes > 1:
            return (max(self.intra_link[0], self.inter_link[0]), min(self.intra_link[1], self.inter_link[1]))
        return self.intra_link

    @staticmethod
    def ring_all_reduce_s(k: int, nbytes: float, link: tuple[float, float]) -> float:
        """2 (k-1)/k * bytes / beta + 2 (k-1) alpha; 0 for a group of one."""
        if k <= 1:
            return 0.0
        alpha, beta = link
        return 2 * (k - 1) / k * nbytes / beta + 2 * (k - 1) * alpha

    @staticmethod
    def ring_all_gather_s(k: int, payload_bytes: float, link: tuple[float, float]) -> float:
        """(k-1) * payload / beta + (k-1) alpha: every rank receives the other k-1 payloads."""
        if k <= 1:
            return 0.0
        alpha, beta = link
        return (k - 1) * payload_bytes / beta + (k - 1) * alpha

    @staticmethod
    def _kind(compression: str, k: int) -> str:
        """How the payload travels over ``k`` ranks: ``all_reduce``, ``two_phase``, ``all_gather`` or ``summable``
        (``int8@allgather``: the chunked code in the all-gather layout; predict() names it so from the ``collective``
        setting; ``int4@summable``: the summable collective). As ``Compressor``'s ``collective="auto"``, two ranks
        all-gather (the same bytes, one encoding)."""
        method, _, layout = compression.partition("@")
        kind = COMPRESSION[method][1]
        if layout == "summable" and method in SUMMABLE_CODES:
            return "summable"
        return "all_gather" if kind == "two_phase" and (layout == "allgather" or k <= 2) else kind

    def _collective(self, k: int, nbytes: float, link: tuple[float, float], compression: str, ratio: float) -> float:
        kind = self._kind(compression, k)
        if kind == "all_gather":
            return self.ring_all_gather_s(k, ratio * nbytes, link)
        if kind == "summable":  # the scales' all-reduce (its bytes in the ratio), then the packed codes'
            headroom = summable_headroom(compression.partition("@")[0], k)
            return self.ring_all_reduce_s(k, headroom * ratio * nbytes, link) + 2 * (k - 1) * link[0]
        # Two-phase: an all-to-all of shards ((k-1)/k of the payload) then an all-gather of the averaged shards
        # (k-1 shards of 1/k), with k-1 latencies each: exactly a ring all-reduce of the payload.
        return self.ring_all_reduce_s(k, ratio * nbytes, link)

    def _sent(self, k: int, payload: float, compression: str) -> float:
        """Bytes a rank sends for one exchange of a ``payload``-byte compressed tensor (the CPU cost's basis)."""
        kind = self._kind(compression, k)
        if kind == "two_phase":
            return 2 * (k - 1) / k * payload
        if kind == "summable":
            return 2 * (k - 1) / k * payload * summable_headroom(compression.partition("@")[0], k)
        return (2 if kind == "all_reduce" else 1) * payload * (k - 1)

    def _codec_s(self, k: int, nbytes: float, compression: str) -> float:
        if compression == "none" or k <= 1:
            return 0.0
        # Bytes encoded or decoded besides the first encode: all-gather decodes k-1 payloads; two-phase decodes k
        # shards of 1/k, re-encodes one and decodes k again (about 2); an all-reduce decodes one.
        decoded = {"all_gather": k - 1, "two_phase": 2}.get(self._kind(compression, k), 1)
        return self.codec_s_per_byte * nbytes * (1 + decoded)

    def _collectives_per_step(self, nbytes: float) -> int:
        return max(1, math.ceil(nbytes / _BUCKET_BYTES))
