"""Communication compression with error feedback: one ``Compressor`` for every strategy's collectives.

The design brief names bandwidth as the bottleneck of large clusters and recommends gradient quantisation and 1-bit
methods. DeepSpeed 0.19.8 removed both its 1-bit optimizers and its compression library, and Lightning's
``DDPStrategy`` silently skips DDP comm hooks on CPU, so this module gives every strategy here (DDP's gradient
buckets, ``hier_sync``'s inter-node hop, ``async_ssp``'s update exchange) one implementation.

Methods (``bytes per fp32 element on the wire`` in brackets):

* ``none`` [4]: plain fp32 all-reduce.
* ``fp16`` / ``bf16`` [2]: cast, all-reduce in half precision (pre-divided by the group size so fp16 cannot
  overflow, as torch's ``fp16_compress_hook``), cast back.
* ``int8`` [~1.02]: per-chunk absmax scale, nearest or stochastic rounding.
* ``int4`` [~0.52]: the same with 4 bits (values -7..7, two to a byte): the brief's "4-bit quantisation".
* ``int2`` [~0.27]: ternary codes (-1, 0, 1 times the chunk's largest magnitude, four to a byte), TernGrad's scheme
  (Wen et al., NeurIPS 2017); zero stays exact (``_codec.py``). At the default chunk of 256 the payload is 6.6% of
  fp32's bytes; measured on the wire, two-phase, 0.067 of fp32 per rank on 2 ranks and 0.100 on 4
  (``scripts/collective_bytes.py``). With error feedback keep ``rounding="nearest"`` (the default): stochastic
  rounding is unbiased, but its variance (``max|x| * |x|`` per element) exceeds a Gaussian chunk's energy, so the
  residual settles at about 6x the input's norm instead of 1.2x (``tests/algorithms/compression/test_int2.py``).
* ``sign`` [~0.14]: 1 bit per element (packed 8 to a byte) and a per-chunk scale, the chunk's mean absolute value
  (scaled sign of EF-SignSGD: Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019).

Quantised values with different scales cannot be summed by an all-reduce. The chunked methods (``int8``, ``int4``,
``int2``, ``sign``) therefore travel by one of two ``collective`` layouts:

* ``"two_phase"``: a compressed all-reduce in two phases, the shape of DeepSpeed's 1-bit Adam
  all-reduce and Bagua's ByteGrad. The tensor is cut into one shard per rank; every rank encodes each shard and an
  ``all_to_all`` sends shard ``j`` to rank ``j``, which decodes the ``world`` copies, averages them, re-encodes the
  average with a second error-feedback residual of its own (the "server" residual) and an all-gather hands the
  averaged shards to everyone. A rank sends and receives about twice the compressed size of the tensor, whatever
  the number of ranks, and every rank decodes the same bytes, so all ranks hold a bitwise-identical mean.
* ``"allgather"``: every rank's whole compressed tensor is all-gathered and every rank decodes and averages all of
  them. A rank receives ``world - 1`` compressed copies, so its traffic grows linearly with the ranks: past a
  handful of nodes compression then costs more than it saves (the cost model's simulation). Kept as the reference
  and for comparisons.

* ``"summable"`` (``int8``, ``int4``, ``int2``): codes that share one scale per chunk, summed by the all-reduce
  itself (THC, Li et al. 2023; ``summable.py``): a small ``MAX`` all-reduce agrees the chunks' scales, a ``SUM``
  all-reduce adds the codes, packed with headroom for the sum of ``world`` codes; bitwise the same mean everywhere,
  one residual per rank. The headroom grows with log2 of the ranks: ``int2`` hands the all-reduce 2.4 bits an
  element on 2 ranks, 3.4 on 4, 4.3 on 8, against its payload's 2.1 (``summable.py``).
* ``"auto"`` (the default): ``allgather`` on a group of 2 ranks, where both layouts move the same bytes (each rank
  sends one compressed tensor) and all-gather quantises once instead of twice; ``two_phase`` from 3 ranks up.

Padding to ``world * chunk_size`` elements lets the two-phase layout split any tensor over any number of ranks.
The bytes returned are those handed to the collectives (as for every method): the whole payload plus one shard
for two-phase; what crosses the wire is about twice the payload for two-phase and ``world - 1`` payloads for
all-gather (``last_wire``).
* ``powersgd``: rank-``r`` approximation ``P Q^T`` of each matrix, two all-reduces of the small factors, warm-started
  ``Q`` (Vogels et al., "PowerSGD", NeurIPS 2019). One-dimensional tensors (biases, norms) go uncompressed, as in
  torch's ``powerSGD_hook``. A flat tensor without shapes is viewed as a matrix with ``matrix_cols`` columns. Its
  arithmetic lives in ``_powersgd.py``.

Error feedback (Seide et al., 2014; Karimireddy et al., 2019): what compression drops from a tensor is kept as a
residual under the caller's key and added to the next tensor sent under that key, so nothing is lost, only delayed.
For ``powersgd`` the residual is taken against the averaged approximation, as in torch's hook.

The chunked methods' arithmetic (encode with the residual fused in, decode, mean of decoded rows) lives in
``_codec.py`` as plain tensor functions that run eagerly or fused by ``torch.compile`` (``codec``; fused on CUDA by
default, where the codec is bound by memory traffic).

Bytes are counted from the tensors actually handed to collectives (what this rank sends), never estimated.
Everything is plain torch and runs on gloo and NCCL.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import all_gather_flat, all_reduce_, all_to_all_flat
from lightning_syncasync.algorithms.compression._codec import CHECKED_CALLS, CODECS, LEVELS, Codec, Kernels
from lightning_syncasync.algorithms.compression._powersgd import _PowerSGD
from lightning_syncasync.algorithms.compression.summable import check_groups, summed_over
from lightning_syncasync.algorithms.streams import wait_for_device

Method = Literal["none", "fp16", "bf16", "int8", "int4", "int2", "sign", "powersgd"]
METHODS: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4", "int2", "sign", "powersgd")
# Methods whose payloads are chunk-scaled codes (not summable by an all-reduce): they use `collective`.
CHUNKED: tuple[str, ...] = ("int8", "int4", "int2", "sign")
Rounding = Literal["nearest", "stochastic"]
Collective = Literal["auto", "two_phase", "allgather", "summable"]
COLLECTIVES: tuple[str, ...] = ("auto", "two_phase", "allgather", "summable")
# The chunked codecs whose integer codes an all-reduce can add (collective="summable").
SUMMABLE_METHODS: tuple[str, ...] = ("int8", "int4", "int2")
# Backends known to implement all_to_all_single (the two-phase layout's first phase).
ALL_TO_ALL_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi")


def check_method(method: str, setting: str = "compression") -> None:
    """Raise a ``ValueError`` naming ``setting`` when ``method`` is not a compression method."""
    if method not in METHODS:
        raise ValueError(f"{setting} must be one of {METHODS}, got {method!r}; HINT: 'int8' cuts bytes about 4x")


def add_server_residual_(total: torch.Tensor, server: torch.Tensor, world: int, rank: int) -> None:
    """Add a two-phase server residual, in units of one rank's input, to ``total`` (a rank's input-sized residual):
    ``world`` times the residual (the mean divides the sum by ``world``) at the shard that ``rank`` owns."""
    numel = total.numel()
    lo = min(rank * server.numel(), numel)
    hi = min(lo + server.numel(), numel)
    total[lo:hi] += world * server[: hi - lo].to(total.device)


class Compressor(_PowerSGD):
    """Compressed mean over a process group, with error feedback and exact byte accounting.

    Args:
        method: one of ``none``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``int2``, ``sign``, ``powersgd`` (module
            docstring).
        error_feedback: keep what compression drops and add it to the next tensor of the same key (and, in the
            two-phase layout, what the re-encoding of each averaged shard drops, on the rank that owns the shard).
            Ignored for ``none``; on by default for the others (``sign`` without it does not converge in general).
        chunk_size: elements per scale for the chunked methods (a positive multiple of 8: ``sign`` packs 8
            elements to a byte, ``int2`` 4).
        rounding: ``int8``/``int4``/``int2`` rounding, ``"nearest"`` or ``"stochastic"`` (unbiased).
        collective: how the chunked methods (``int8``, ``int4``, ``int2``, ``sign``) travel: ``"two_phase"``
            (per-rank traffic independent of the number of ranks), ``"allgather"`` (every rank receives every other
            rank's payload), ``"summable"`` (``int8``/``int4``/``int2`` only: shared-scale codes summed by one
            all-reduce, bitwise the same on every rank) or ``"auto"`` (all-gather on 2 ranks, two-phase from 3);
            module docstring.
        rank: ``powersgd`` rank.
        matrix_cols: ``powersgd`` only: columns of the matrix a tensor without shapes is viewed as.
        seed: seeds stochastic rounding (give each rank its own) and, with ``factor_seed``, nothing else.
        factor_seed: seeds the initial ``powersgd`` factors, which must be identical on every rank of the group.
        codec: how the chunked methods encode and decode: ``"eager"`` (one torch operation at a time),
            ``"compiled"`` (fused by ``torch.compile``: Triton on CUDA, C++ on the CPU; the same codes, a few seconds
            of compiling per process), or ``"auto"`` (the default: compiled on CUDA, eager elsewhere). The
            environment variable ``SYNCASYNC_CODEC`` overrides it for a whole job.

    Example::

        comp = Compressor("int8")
        mean, nbytes = comp.allreduce(grad, group=None, key="grad")  # every rank calls it, in the same order
    """

    def __init__(
        self,
        method: Method = "none",
        error_feedback: bool = True,
        chunk_size: int = 256,
        rounding: Rounding = "nearest",
        rank: int = 4,
        matrix_cols: int = 256,
        seed: int = 0,
        factor_seed: int = 0,
        collective: Collective = "auto",
        codec: Codec = "auto",
    ) -> None:
        check_method(method)
        if codec not in CODECS:
            raise ValueError(
                f"codec must be one of {CODECS}, got {codec!r}; HINT: 'auto' (the default) fuses the codec on GPUs "
                "and runs it eagerly elsewhere"
            )
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 8 or chunk_size % 8:
            raise ValueError(
                f"chunk_size must be a positive multiple of 8 (sign packs 8 elements to a byte, int2 4, int4 2), got "
                f"{chunk_size!r}; HINT: the default 256 adds about 2% of scales to the payload"
            )
        if collective not in COLLECTIVES:
            raise ValueError(
                f"collective must be one of {COLLECTIVES}, got {collective!r}; HINT: 'auto' (the default) keeps each "
                "rank's traffic independent of the number of ranks"
            )
        if collective == "summable" and method not in SUMMABLE_METHODS:
            raise ValueError(
                f"collective='summable' needs integer codes an all-reduce can add ({', '.join(SUMMABLE_METHODS)}), "
                f"got compression={method!r}; HINT: compression='int4' or 'int2' with collective='summable', or "
                "collective='auto' for the other methods"
            )
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(
                f"rounding must be 'nearest' or 'stochastic', got {rounding!r}; HINT: 'stochastic' is unbiased, "
                "'nearest' (the default) adds less noise"
            )
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}; HINT: PowerSGD uses 1-4")
        if matrix_cols < 1:
            raise ValueError(f"matrix_cols must be >= 1, got {matrix_cols}; HINT: the default 256 suits flat tensors")
        self.method = method
        self.error_feedback = error_feedback and method != "none"
        self.chunk_size = chunk_size
        self.rounding = rounding
        self.rank = rank
        self.matrix_cols = matrix_cols
        self.seed = seed
        self.factor_seed = factor_seed
        self.collective = collective
        self.codec = codec
        self.kernels = Kernels(codec)
        self.residuals: dict[str, torch.Tensor] = {}
        # Two-phase layout: per key, what re-encoding this rank's averaged shard dropped (in units of the mean).
        self.server_residuals: dict[str, torch.Tensor] = {}
        # Bytes of the last exchange on the wire, under a ring implementation of each collective: (sent, received).
        self.last_wire: tuple[int, int] = (0, 0)
        self.factors: dict[str, torch.Tensor] = {}  # powersgd's warm-started Q per (key, tensor index)
        # Random draws come from (seed, calls): a counter that every rank advances in lockstep, so the state a
        # checkpoint needs is one integer, not a generator per rank. Give each rank its own seed for independent
        # stochastic rounding; powersgd's first factors use `seed` alone and must match across ranks.
        self.calls = 0

    def __repr__(self) -> str:
        collective = f", collective={self.collective!r}" if self.method in CHUNKED else ""
        return f"Compressor({self.method!r}, error_feedback={self.error_feedback}{collective})"

    def check_backend(self, group: dist.ProcessGroup | None = None) -> None:
        """Raise a ``ValueError`` with the fix when ``group``'s backend lacks a collective this method needs (the
        two-phase layout's ``all_to_all``), or when the summable layout's sums would overflow a word on ``group``'s
        ranks. Strategies call it at setup, before the first exchange."""
        if not dist.is_available() or not dist.is_initialized():
            return
        layout = self.layout(dist.get_world_size(group))
        if layout == "summable":
            check_groups(int(LEVELS[self.method]), dist.get_world_size(group))
        if layout != "two_phase":
            return
        backend = str(dist.get_backend(group))
        names = [part.rpartition(":")[2] for part in backend.split(",")]
        if not any(name in ALL_TO_ALL_BACKENDS for name in names):
            raise ValueError(
                f"compression={self.method!r} with collective='two_phase' needs all_to_all, which the {backend!r} "
                f"backend does not provide (known to: {', '.join(ALL_TO_ALL_BACKENDS)}); HINT: "
                "compression_options={'collective': 'allgather'} uses all-gather only"
            )

    def time_codec(
        self, numel: int, reps: int = 3, device: torch.device | str = "cpu", error_feedback: bool = True
    ) -> tuple[float, float]:
        """Wall seconds of one encode (error feedback included, unless ``error_feedback=False``) and one decode of a
        ``numel``-element tensor with this method's codec, on this process and ``device``, each the mean of ``reps``
        calls made back to back after untimed warm-up calls: what the cost
        model charges per byte (``codec_s_per_byte``), measured where it runs, so a rank with a small CPU share shows
        its real cost. No collective; the state of this compressor is left untouched. ``fp16``/``bf16`` time their
        cast down and back up the same way. The codec is this compressor's (``codec``: eager or fused)."""
        casts = {"fp16": torch.float16, "bf16": torch.bfloat16}
        if self.method not in CHUNKED and self.method not in casts:
            raise ValueError(
                f"time_codec times the chunked codecs {CHUNKED} and the casts ('fp16', 'bf16'), not {self.method!r}"
            )
        if numel < 1 or reps < 1:
            raise ValueError(f"numel and reps must be >= 1, got {numel} and {reps}")
        device = torch.device(device)
        flat = torch.randn(numel, device=device)
        residual = torch.zeros_like(flat)
        cast = casts.get(self.method)
        row_len = -(-numel // self.chunk_size) * self.chunk_size

        def encode(x: torch.Tensor, held: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            # Error feedback as the exchanges run it: add what was held, keep what this encode drops.
            if cast is None:
                return self._encode_rows(x, held, held is not None, 1, row_len)
            y = x if held is None else x + held
            half = y.to(cast)
            return half, y - half.float()

        def decode(payload: torch.Tensor) -> torch.Tensor:
            return self._decode_rows(payload, row_len) if cast is None else payload.float()

        def sync() -> None:
            wait_for_device(device)

        # Untimed first calls: allocations, and for a fused codec its compiling and the calls it checks against the
        # eager codec (``_codec.CHECKED_CALLS``).
        warmup = 1 if cast is not None or self.kernels.mode(device) == "eager" else 1 + CHECKED_CALLS
        for _ in range(warmup):
            payload, kept = encode(flat, residual if error_feedback else None)
            if error_feedback:
                residual = kept
            decode(payload)
        # Back to back, one sync around all the calls of each kind: on an accelerator the host queues the next call
        # while the device runs this one, so the time is the device's. A sync around each call would add its launch
        # and the sync's round trip (tens of microseconds) to calls that take well under a millisecond on a GPU.
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            payload, kept = encode(flat, residual if error_feedback else None)
            if error_feedback:
                residual = kept
        sync()
        t1 = time.perf_counter()
        for _ in range(reps):
            decode(payload)
        sync()
        return (t1 - t0) / reps, (time.perf_counter() - t1) / reps

    def layout(self, world: int) -> str | None:
        """The layout an exchange over ``world`` ranks uses: ``"two_phase"``, ``"allgather"`` or ``"summable"`` for
        the chunked methods, ``None`` for the others (they all-reduce)."""
        if self.method not in CHUNKED:
            return None
        if self.collective == "auto":
            return "allgather" if world <= 2 else "two_phase"
        return self.collective

    # -- the collective ---------------------------------------------------------------------------------------

    def allreduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: str | int,
        shapes: list[torch.Size] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Blocking compressed mean of ``tensor`` over ``group``; returns ``(mean, bytes this rank sent)``.

        ``tensor`` is not modified. Every rank of ``group`` calls this with the same ``key``, the same numel and the
        same ``shapes`` in the same order. ``shapes`` (``powersgd`` only) splits the flat tensor into matrices.
        """
        key = str(key)
        _check_tensor(tensor)
        flat = tensor.detach().reshape(-1).float()
        residual = None
        if self.error_feedback and key in self.residuals:
            residual = self.residuals[key].to(flat.device)  # loaded from a checkpoint: maybe on the CPU
            if residual.numel() != flat.numel():
                raise ValueError(
                    f"key {key!r} was used for {residual.numel()} elements and now for {flat.numel()}: "
                    "error feedback needs one key per tensor"
                )
        mean, kept, nbytes = self._exchange(flat, residual, self.error_feedback, group, key, shapes)
        if self.error_feedback:
            self.residuals[key] = kept
        return mean.view_as(tensor).to(tensor.dtype), nbytes

    def exchange(
        self,
        flat: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: str = "",
        shapes: list[torch.Size] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The compressed mean of a flat fp32 tensor without error feedback: ``(mean, own, bytes sent)``, where
        ``own`` is what the other ranks received from this one (``flat - own`` is what compression dropped; for
        ``powersgd``, the averaged approximation, as in torch's hook). For callers that keep residuals their own
        way (the DDP hook keeps them per parameter, since DDP may rebuild its buckets). ``key`` names the
        ``powersgd`` factors."""
        return self._exchange(flat, None, False, group, key, shapes)

    def _exchange(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None,
        feedback: bool,
        group: dist.ProcessGroup | None,
        key: str,
        shapes: list[torch.Size] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The mean of ``flat + residual`` (``residual`` may be ``None``): ``(mean, kept, bytes sent)``, where
        ``kept`` is the new residual ``flat + residual - own`` with ``feedback``, else ``own``. The chunked codecs
        fuse the residual into their encode; the others add and subtract it here."""
        self.calls += 1
        world = dist.get_world_size(group)
        if self.method in CHUNKED:
            if self.layout(world) == "two_phase":
                return self._two_phase(flat, residual, feedback, group, str(key), world)
            if self.layout(world) == "summable":
                return self._summable(flat if residual is None else flat + residual, feedback, group, world)
            numel = flat.numel()
            row_len = -(-numel // self.chunk_size) * self.chunk_size
            payload, kept = self._encode_rows(flat, residual, feedback, 1, row_len)
            gathered = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
            all_gather_flat(gathered, payload.view(-1), group)
            mean = self._decode_rows(gathered.view(world, -1), row_len, mean=True)[:numel]
            self.last_wire = _wire("all_gather", payload.numel(), world)
            return mean, kept, payload.numel() * payload.element_size()
        if residual is not None:
            flat = flat + residual
        mean, own, nbytes = self._exchange_summable(flat, group, key, shapes, world)
        return mean, (flat - own if feedback else own), nbytes

    def _summable(
        self, x: torch.Tensor, feedback: bool, group: dist.ProcessGroup | None, world: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Shared-scale codes summed by two all-reduces (``summable.py``), decoded to the mean."""
        noise = None
        if self.rounding == "stochastic":  # each rank its own draws: the sum is of integers
            noise = self._rand(torch.Size([-(-x.numel() // self.chunk_size), self.chunk_size]), 0, x.device)
        total, own, handed = summed_over(x, int(LEVELS[self.method]), self.chunk_size, group, noise)
        self.last_wire = (sent := sum(_wire("all_reduce", b, world)[0] for b in handed), sent)
        return total / world, (x - own if feedback else own), sum(handed)

    def _exchange_summable(
        self, flat: torch.Tensor, group: dist.ProcessGroup | None, key: str, shapes: list[torch.Size] | None, world: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``none``, ``fp16``, ``bf16`` and ``powersgd``: payloads an all-reduce can sum."""
        if self.method == "none":
            out = flat.clone()
            all_reduce_(out, group)
            self.last_wire = _wire("all_reduce", out.numel() * out.element_size(), world)
            return out / world, flat, out.numel() * out.element_size()
        if self.method in ("fp16", "bf16"):
            half = (flat / world).to(torch.float16 if self.method == "fp16" else torch.bfloat16)
            own = half.float() * world
            all_reduce_(half, group)
            self.last_wire = _wire("all_reduce", half.numel() * half.element_size(), world)
            return half.float(), own, half.numel() * half.element_size()
        mean, nbytes = self._powersgd(flat, group, str(key), world, shapes)
        self.last_wire = _wire("all_reduce", nbytes, world)  # its all-reduces, summed
        return mean, mean, nbytes

    def pop_residual(self, key: str | int, numel: int, group: dist.ProcessGroup | None) -> torch.Tensor | None:
        """Take everything held back under ``key`` out of the compressor, as one tensor to add to this rank's next
        input of ``numel`` elements when that input is all-reduced exactly (a checkpoint's consistent cut, which
        flushes every residual): this rank's own residual, plus ``world`` times the server residual of the shard
        it owns, at that shard (the mean divides the sum by ``world``). ``None`` when nothing is held."""
        key = str(key)
        own = self.residuals.pop(key, None)
        server = self.server_residuals.pop(key, None)
        if own is None and server is None:
            return None
        like = own if own is not None else server
        assert like is not None
        total = own.clone() if own is not None else torch.zeros(numel, device=like.device)
        if server is not None:
            add_server_residual_(total, server, dist.get_world_size(group), dist.get_rank(group))
        return total

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Residuals, PowerSGD factors and the call counter: what a resumed run needs to continue exactly."""
        return {
            "method": self.method,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "server_residuals": {k: v.clone() for k, v in self.server_residuals.items()},
            "factors": {k: v.clone() for k, v in self.factors.items()},
            "calls": self.calls,
        }

    @staticmethod
    def resized_state(states: list[dict[str, Any]]) -> dict[str, Any]:
        """The state for every rank of a run on another number of ranks, from each saved rank's :meth:`state_dict`
        (in rank order; their exchanges ran over all of them). Per key, every saved rank's residual with its server
        residual folded in (as :meth:`pop_residual` does) is averaged over the saved ranks: the mean over any number
        of ranks of that same residual is the debt the saved ranks held on the mean, so nothing is dropped. The
        PowerSGD factors and the call counter (the same on every rank) come from rank 0."""
        if not states:
            raise ValueError("resized_state needs the state of at least one saved rank")
        world = len(states)
        # A key's size: its own residuals' (every rank with error feedback has one), else the servers' shards.
        sizes: dict[str, int] = {}
        for state in states:
            for key, server in state.get("server_residuals", {}).items():
                sizes.setdefault(key, server.numel() * world)
        for state in states:
            sizes.update({key: own.numel() for key, own in state["residuals"].items()})
        total: dict[str, torch.Tensor] = {}
        for r, state in enumerate(states):
            keys = set(state["residuals"]) | set(state.get("server_residuals", {}))
            for key in keys:
                own = state["residuals"].get(key)
                server = state.get("server_residuals", {}).get(key)
                numel = sizes[key]
                held = own.detach().float().cpu().clone() if own is not None else torch.zeros(numel, device="cpu")
                if server is not None:
                    add_server_residual_(held, server.detach().float().cpu(), world, r)
                if key in total and total[key].numel() != held.numel():
                    raise ValueError(f"saved ranks disagree on the size of residual {key!r}")
                total[key] = total[key] + held if key in total else held
        first = states[0]
        return {**first, "residuals": {k: v / world for k, v in total.items()}, "server_residuals": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise ValueError(
                f"the checkpoint's compression state is for {state.get('method')!r}, this run uses {self.method!r}; "
                "HINT: resume with the same compression setting"
            )
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.server_residuals = {k: v.clone() for k, v in state.get("server_residuals", {}).items()}
        self.factors = {k: v.clone() for k, v in state["factors"].items()}
        self.calls = int(state["calls"])

    # -- int8, int4, int2 and sign: packed byte blocks -----------------------------------------------------------

    def _encode_rows(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None,
        feedback: bool,
        rows: int,
        row_len: int,
        stream: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``flat + residual``, zero-padded to ``rows * row_len``, encoded as ``rows`` blocks that each decode alone:
        ``(payload [rows, bytes per block], kept [numel])``, ``kept`` the new residual with ``feedback``, else this
        rank's decoded copy (``_codec.encode``)."""
        noise = None
        if self.rounding == "stochastic" and self.method != "sign":
            noise = self._rand(torch.Size([rows, row_len // self.chunk_size, self.chunk_size]), stream, flat.device)
        variant = f"{self.rounding}_{'feedback' if feedback else 'own'}"
        out = self.kernels.run(
            "encode", self.method, variant, flat, residual, noise, rows, row_len, self.chunk_size, feedback
        )
        return out  # type: ignore[return-value]

    def _decode_rows(self, payload: torch.Tensor, row_len: int, mean: bool = False) -> torch.Tensor:
        """The inverse of :meth:`_encode_rows`: ``[rows, bytes per block]`` -> ``[rows, row_len]`` fp32, or with
        ``mean`` the mean of the rows (``[row_len]``, summed in row order)."""
        name = "decode_mean" if mean else "decode"
        return self.kernels.run(name, self.method, "", payload, row_len, self.chunk_size)  # type: ignore[return-value]

    def _encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The byte payload of ``flat`` (one block, padded to whole chunks) and this rank's own decoded tensor."""
        row_len = -(-flat.numel() // self.chunk_size) * self.chunk_size
        payload, own = self._encode_rows(flat, None, False, 1, row_len)
        return payload.reshape(-1), own

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        row_len = -(-numel // self.chunk_size) * self.chunk_size
        return self._decode_rows(payload.view(1, -1), row_len).reshape(-1)[:numel]

    def _rand(self, shape: torch.Size, stream: int, device: torch.device) -> torch.Tensor:
        # (seed, calls, stream): the two phases of one exchange draw from different streams. Drawn on the tensor's
        # device (a CUDA generator draws other numbers than a CPU one: stochastic rounding is reproducible per
        # device type, not across them).
        gen = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + self.calls + stream * 7_919_000_003)
        return torch.rand(shape, generator=gen, device=device)

    def _two_phase(
        self,
        flat: torch.Tensor,
        residual: torch.Tensor | None,
        feedback: bool,
        group: dist.ProcessGroup | None,
        key: str,
        world: int,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Compressed all-to-all of shards, average, re-encode (server error feedback), compressed all-gather."""
        numel = flat.numel()
        shard = -(-numel // (world * self.chunk_size)) * self.chunk_size  # whole chunks per rank's shard
        payload, kept = self._encode_rows(flat, residual, feedback, world, shard)
        received = torch.empty_like(payload)
        all_to_all_flat(received.view(-1), payload.reshape(-1), group)
        # This rank's shard from every rank, decoded and averaged in rank order: the same sum on any machine.
        averaged = self._decode_rows(received, shard, mean=True)
        held = None
        if self.error_feedback:
            held = self.server_residuals.get(key)
            if held is not None:
                held = held.to(averaged.device)
                if held.numel() != shard:
                    raise ValueError(
                        f"key {key!r} was exchanged in shards of {held.numel()} elements and now of {shard}: the "
                        "tensor or the number of ranks changed; HINT: one key per tensor, and resume on as many ranks"
                    )
        mine, server_kept = self._encode_rows(averaged, held, self.error_feedback, 1, shard, stream=1)
        if self.error_feedback:
            self.server_residuals[key] = server_kept
        gathered = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_flat(gathered, mine.view(-1), group)
        mean = self._decode_rows(gathered.view(world, -1), shard).reshape(-1)[:numel]
        sent_a2a, recv_a2a = _wire("all_to_all", payload.numel(), world)
        sent_ag, recv_ag = _wire("all_gather", mine.numel(), world)
        self.last_wire = (sent_a2a + sent_ag, recv_a2a + recv_ag)
        return mean, kept, payload.numel() + mine.numel()


def _check_tensor(tensor: torch.Tensor) -> None:
    # Integer tensors cannot carry gradients or averages, and a sparse layout has no flat view: refuse both clearly
    # (callers pass non-float parameters and buffers around the compressor, as the strategies do).
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(
            f"compression needs a dense tensor, got layout {tensor.layout}; HINT: densify it (tensor.to_dense()) "
            "or leave it out of the compressed exchange"
        )
    if not tensor.is_floating_point():
        raise ValueError(
            f"compression needs a floating-point tensor, got {tensor.dtype}; HINT: non-float parameters and buffers "
            "are exchanged uncompressed by the strategies, do not pass them to a Compressor"
        )


def _wire(kind: str, nbytes: int, world: int) -> tuple[int, int]:
    """Bytes one rank sends and receives in a collective over ``world`` ranks, as ring (and pairwise all-to-all)
    implementations move them: NCCL's and gloo's. ``nbytes`` is what the rank hands to the collective (its whole
    input for an all-reduce or an all-to-all, its own part for an all-gather)."""
    if world <= 1:
        return 0, 0
    if kind == "all_reduce":
        moved = 2 * (world - 1) * nbytes // world
    elif kind == "all_gather":
        moved = (world - 1) * nbytes
    elif kind in ("all_to_all", "reduce_scatter"):
        moved = (world - 1) * nbytes // world
    else:
        raise ValueError(f"unknown collective {kind!r}")
    return moved, moved
