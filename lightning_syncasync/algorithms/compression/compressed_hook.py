"""A DDP comm hook that all-reduces gradient buckets through a :class:`Compressor`, with per-parameter error
feedback, measured bytes and overlap with backward.

torch ships ``fp16_compress_hook`` and ``powerSGD_hook``, but Lightning's ``DDPStrategy`` registers hooks only on
CUDA (FINDINGS.md), none of torch's hooks quantise to int8 or 1 bit, and none reports the bytes it sends. This hook
runs every method of ``algorithms/compression/compressor.py`` on gloo and NCCL.

Why a thread: the compressed exchanges (all-gather of int8 payloads, PowerSGD's two dependent all-reduces) are
blocking collectives; running them on one daemon thread, on a process group that nothing else uses, keeps them
overlapped with the rest of backward as DDP's own async all-reduce is, and issues them in bucket order on every rank.

Why per-parameter residuals: DDP rebuilds its buckets after the first iteration (in gradient-ready order), so a
residual keyed by bucket would no longer line up with its elements; keyed by parameter it survives any bucketing
and checkpoints by parameter index.

Why hierarchical across nodes: a flat ring all-reduce of fp32 gradients puts ``2 (n-1)/n`` of the model on every
ring link, the slow inter-node ones included, and an all-gather of int8 payloads still puts ``(n-1)/4`` of it there,
so on 2 nodes x 2 ranks int8 cuts the inter-node traffic only 2x, not 4x. Given the node groups, the hook instead
sums the bucket inside the node in full precision (reduce-scatter: every local rank gets one shard of the node's
sum), compresses only that shard for the inter-node exchange with the same local rank of the other nodes, and
all-gathers the averaged shards inside the node: the shape NCCL and Horovod use for hierarchical all-reduce. The
inter-node link then carries one compressed copy of the model per node (``1/4`` of the model for int8 on 2 nodes,
``1/6`` of the flat fp32 ring's traffic) and the requantisation happens once, on the node's sum. Error feedback
still lands on the right elements when DDP rebuilds its buckets and a shard moves to another local rank: a residual
is added to its owner's *input* before the node sum, so whichever rank owns the shard now compresses it.

Why ``frozen_rms``: a chunk-scaled code (``sign``, ``int8``) gives every element of a chunk the chunk's scale, so an
element whose gradient is small next to its chunk's gets mostly noise. With SGD error feedback averages the noise
out; Adam-family optimizers normalise each coordinate by its own second moment, which becomes about the chunk's
scale squared, so small coordinates stop learning (measured: EF-sign under AdamW ended 3 points below DDP on the LM
demo). 1-bit Adam answers this by freezing Adam's variance after a full-precision warm-up and compressing the
momentum. ``frozen_rms`` keeps the user's optimizer and does the same at the gradient: during the warm-up it
measures each coordinate's RMS over the (exact, identical on every rank) averaged gradients, then divides by it
before compressing and multiplies back after, so the code carries ``g / rms`` whose elements are alike in size and the
optimizer sees each coordinate at its own scale. Measured, it narrows the gap rather than closing it (README: 3.0
points below DDP over the LM's full budget against 3.8 for plain sign; 0.7-2.5 against 2.7 in a simulation).

This module must not use ``from __future__ import annotations``: DDP inspects the hook's annotations at run time.
"""

import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import CommThread, all_gather_flat, reduce_scatter_flat
from lightning_syncasync.algorithms.compression.compressor import Compressor, add_server_residual_
from lightning_syncasync.algorithms.stats import Scope, StatsRecorder, timing_event

# Exchanges a warm-up may use (exact enough to measure the gradients' scale), and the chunk-scaled methods that
# frozen_rms rescales.
WARMUP_METHODS = ("none", "fp16", "bf16", "int8")
RESCALED_METHODS = ("int8", "int4", "int2", "sign")


class CompressedAllReduce:
    """DDP comm-hook state: compressed mean of each gradient bucket, error feedback per parameter.

    Args:
        compressor: the method (its own error feedback is bypassed: residuals are kept here, per parameter).
        recorder: where bytes (measured from the payload sent) and timing go.
        scope: ``"inter"`` when the group spans nodes, ``"intra"`` otherwise.
        process_group: a group used by nothing else (the hook runs its collectives on a background thread).
        node_group, cross_group: this rank's node and its inter-node group (the same local rank on every node),
            both used by nothing else. Given both, buckets are all-reduced hierarchically (module docstring):
            full precision inside the node, compressed across nodes. ``powersgd`` stays flat (its factors follow
            the parameters' shapes, which a shard cuts through).
        warmup_steps: optimizer steps whose gradients are all-reduced in full precision before compression starts
            (torch's ``start_powerSGD_iter``; see ``MeasuredDDPStrategy``'s ``compression_warmup_steps``).
        warmup_compressor: the warm-up's exchange (default ``Compressor("none")``: fp32). ``int8`` keeps the
            warm-up's bytes low; its residuals carry over into the compressed phase.
        frozen_rms: scale each coordinate by its RMS measured over the warm-up's averaged gradients before
            compressing (module docstring). Needs ``warmup_steps >= 1`` and a chunk-scaled method (``int8``,
            ``int4``, ``int2``, ``sign``).

    Example::

        ddp = DistributedDataParallel(model)
        CompressedAllReduce(Compressor("int8"), recorder, process_group=dist.new_group()).register(ddp)
    """

    def __init__(
        self,
        compressor: Compressor,
        recorder: StatsRecorder,
        scope: Scope = "intra",
        process_group: dist.ProcessGroup | None = None,
        node_group: dist.ProcessGroup | None = None,
        cross_group: dist.ProcessGroup | None = None,
        warmup_steps: int = 0,
        warmup_compressor: Compressor | None = None,
        frozen_rms: bool = False,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a Compressor, got {type(compressor).__name__}")
        if scope not in ("intra", "inter"):
            raise ValueError(f"scope must be 'intra' or 'inter', got {scope!r}")
        if (node_group is None) != (cross_group is None):
            raise ValueError("node_group and cross_group go together: give both for the hierarchical path, or neither")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"warmup_steps must be an integer >= 0, got {warmup_steps!r}; HINT: 0 compresses from the start"
            )
        if warmup_compressor is not None and warmup_compressor.method not in WARMUP_METHODS:
            raise ValueError(
                f"warmup_compressor must use one of {WARMUP_METHODS}, got {warmup_compressor.method!r}; HINT: 'none' "
                "(fp32) or 'int8'"
            )
        if frozen_rms and (warmup_steps < 1 or compressor.method not in RESCALED_METHODS):
            raise ValueError(
                f"frozen_rms needs a warm-up to measure the RMS and a chunk-scaled method, got warmup_steps="
                f"{warmup_steps} and {compressor.method!r}; HINT: compression='sign' with compression_warmup_steps=20"
            )
        self.compressor = compressor
        compressor.check_backend(cross_group if node_group is not None else process_group)
        self.warmup_steps = warmup_steps
        self.steps = 0  # optimizer steps whose buckets have all been handed to the thread (the warm-up's clock)
        self._warmup = warmup_compressor or Compressor("none")  # the warm-up's exchange
        self.frozen_rms = frozen_rms
        # frozen_rms: per parameter index, the sum of squared averaged gradients over the warm-up and how many
        # steps it holds; then, from the first compressed step, the frozen RMS.
        self._square_sums: dict[int, torch.Tensor] = {}
        self._square_counts: dict[int, int] = {}
        self._rms: dict[int, torch.Tensor] = {}
        self.recorder = recorder
        self.scope: Scope = scope
        self.process_group = process_group
        self.node_group = node_group
        self.cross_group = cross_group
        self.hierarchical = node_group is not None and compressor.method != "powersgd"
        self.residuals: dict[int, torch.Tensor] = {}  # parameter index -> what compression held back
        self._index: dict[int, int] = {}
        self._thread: CommThread | None = None
        # Two-phase exchanges keep a server residual per bucket key inside the compressor. Where each key's elements
        # are, to fold a residual whose key is no longer used (DDP rebuilt its buckets, the warm-up ended) into the
        # per-parameter residuals: ("main"|"warmup", key) -> [pieces (index, numel), numel exchanged, scaled by the
        # frozen RMS]. The same on every rank (a checkpoint gathers it); saved in checkpoints.
        self._layouts: dict[tuple[str, str], list[Any]] = {}
        self._used: set[tuple[str, str]] = set()

    def register(self, ddp_module: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register on a DDP module (one comm hook per module, before the first backward)."""
        self._index = {id(p): i for i, p in enumerate(ddp_module.module.parameters())}
        ddp_module.register_comm_hook(self, CompressedAllReduce.hook)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals by parameter index, and the compressor's state (PowerSGD factors, counter)."""
        comp = self.compressor.state_dict()
        residuals = {k: v.clone() for k, v in self.residuals.items()}
        state = {"residuals": residuals, "compressor": comp, "steps": self.steps, "warmup": self._warmup.state_dict()}
        state["layouts"] = [[which, key, layout] for (which, key), layout in self._layouts.items()]
        if self.frozen_rms:
            state["square_sums"] = {k: v.clone() for k, v in self._square_sums.items()}
            state["square_counts"] = dict(self._square_counts)
            state["rms"] = {k: v.clone() for k, v in self._rms.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
        self.steps = int(state.get("steps", 0))
        self._layouts = {(which, key): layout for which, key, layout in state.get("layouts", [])}
        if "warmup" in state:
            self._warmup.load_state_dict(state["warmup"])
        if self.frozen_rms:
            if "rms" not in state and self.steps > 0:
                raise ValueError(
                    "this checkpoint was saved without frozen_rms, so the RMS of its warm-up is unknown; HINT: resume "
                    "with compression_frozen_rms=false, or start the run again"
                )
            self._square_sums = {int(k): v.clone() for k, v in state.get("square_sums", {}).items()}
            self._square_counts = {int(k): int(v) for k, v in state.get("square_counts", {}).items()}
            self._rms = {int(k): v.clone() for k, v in state.get("rms", {}).items()}

    @staticmethod
    def resized_state(states: list[dict[str, Any]], node_size: int | None) -> dict[str, Any]:
        """The state for every rank of a run on another number of ranks, from each saved rank's :meth:`state_dict`
        (in rank order). ``node_size``: the saved run's node size when it exchanged hierarchically, else ``None``.

        Error feedback is a debt on the world's mean gradient: the saved ranks added ``1/W`` of the sum of their
        residuals to it. Each saved rank's residuals, with its two-phase server residuals folded in as
        :meth:`_fold_unused` does, are averaged over the saved ranks, and every rank of the new run takes that mean:
        its mean over any number of ranks is the same debt, so nothing compression held back is dropped. What is the
        same on every rank (the step counter, PowerSGD's factors, the warm-up's RMS) comes from rank 0.
        """
        if not states:
            raise ValueError("resized_state needs the state of at least one saved rank")
        world = len(states)
        k = node_size or 1
        if world % k:
            raise ValueError(f"node_size {node_size} does not divide the {world} saved ranks")
        # The exchange group whose server residuals were kept: every rank (flat), or the ranks with this local rank
        # on every node (hierarchical; node-major ranks: rank r is local rank r % k of node r // k).
        group_world = world // k
        total: dict[int, torch.Tensor] = {}
        for r, state in enumerate(states):
            if state["compressor"].get("residuals") or state.get("warmup", {}).get("residuals"):
                # Unreachable: the hook keeps error feedback per parameter and calls its compressors without any.
                raise ValueError(f"saved rank {r}'s compressor holds residuals of its own, which this hook never keeps")
            own = {int(i): v.detach().float().cpu() for i, v in state["residuals"].items()}
            layouts = {(which, key): layout for which, key, layout in state.get("layouts", [])}
            group_rank, local = (r // k, r % k) if node_size else (r, 0)
            saved_rms = state.get("rms", {})  # the warm-up's frozen RMS, the same on every rank

            def rms(i: int, n: int, device: torch.device, saved: Any = saved_rms) -> torch.Tensor:
                return saved[i].detach().float().to(device)

            for which in ("main", "warmup"):
                comp = state["compressor"] if which == "main" else state.get("warmup", {})
                for key, server in comp.get("server_residuals", {}).items():
                    if (which, key) not in layouts:
                        raise ValueError(
                            f"saved rank {r}'s server residual {key!r} has no layout to fold it with; HINT: resume on "
                            f"the same number of ranks ({world})"
                        )
                    layout = layouts[(which, key)]
                    # As Compressor.pop_residual: group_world times the server residual, at this rank's shard ...
                    held = torch.zeros(layout[1], device="cpu")
                    add_server_residual_(held, server.detach().float().cpu(), group_world, group_rank)
                    # ... and as _fold_unused: at this local rank's node shard, in units of one rank's input.
                    _fold_into(own, held, layout, local, k, rms)
            for i, v in own.items():
                total[i] = total[i] + v if i in total else v
        first = states[0]
        resized = dict(first)
        resized["residuals"] = {i: v / world for i, v in total.items()}
        resized["compressor"] = {**first["compressor"], "residuals": {}, "server_residuals": {}}
        if "warmup" in first:
            resized["warmup"] = {**first["warmup"], "residuals": {}, "server_residuals": {}}
        resized["layouts"] = []
        return resized

    def _observe(self, index: int, mean: torch.Tensor) -> None:
        """Add one warm-up step's averaged gradient of parameter ``index`` to its sum of squares."""
        square = mean.double().square()
        if index in self._square_sums:
            self._square_sums[index] = self._square_sums[index].to(square.device) + square  # maybe restored on the CPU
        else:
            self._square_sums[index] = square
        self._square_counts[index] = self._square_counts.get(index, 0) + 1

    def _frozen(self, index: int, numel: int, device: torch.device) -> torch.Tensor:
        """Parameter ``index``'s RMS over the warm-up, frozen at its first use. Every rank computes it from the
        same averaged gradients, so it is identical everywhere and never travels."""
        rms = self._rms.get(index)
        if rms is None:
            sums = self._square_sums.pop(index, None)
            count = self._square_counts.pop(index, 0)
            if sums is None or count == 0:
                rms = torch.ones(numel, device=device)  # never seen in the warm-up (e.g. unused): plain chunk scales
            else:
                rms = (sums / count).sqrt().float()
                # A coordinate that was (almost) zero through the warm-up must not blow up later gradients: floor
                # it at a thousandth of the parameter's mean RMS (all-zero parameters get 1).
                floor = 1e-3 * rms.mean()
                rms = rms.clamp_min(floor) if floor > 0 else torch.ones_like(rms)
            self._rms[index] = rms
        if rms.device != device:  # restored from a checkpoint loaded on the CPU
            rms = self._rms[index] = rms.to(device)
        return rms

    def _hierarchical(
        self,
        sent: torch.Tensor,
        compressor: Compressor | None = None,
        key: str = "",
        pieces: Any = (),
        scaled: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean of ``sent`` over the world: node sum by reduce-scatter, exchange of this rank's shard across nodes
        through ``compressor`` (default: this hook's; two-phase across nodes only), all-gather inside the node.
        Returns ``(mean, what to add to this rank's next input)``."""
        compressor = compressor or self.compressor
        k = dist.get_world_size(self.node_group)
        numel = sent.numel()
        padded = torch.nn.functional.pad(sent, (0, -numel % k))
        shard = torch.empty(padded.numel() // k, dtype=padded.dtype, device=padded.device)
        reduce_scatter_flat(shard, padded, self.node_group)
        shard /= k  # the node's mean: the cross-node mean of node means is the world's mean (equal node sizes)
        rank = dist.get_rank(self.node_group)
        self._track(compressor, key, pieces, shard.numel(), scaled)
        mean_shard, own, inter_bytes = compressor.exchange(shard, self.cross_group, key)
        mean = torch.empty_like(padded)
        all_gather_flat(mean, mean_shard, self.node_group)
        # Bytes of the tensors handed to each collective, by the link they cross.
        self.recorder.record_blocking((padded.numel() + shard.numel()) * 4, "intra", 0.0)
        self.recorder.record_blocking(inter_bytes, "inter", 0.0)
        if not compressor.error_feedback:
            return mean[:numel], None
        # What compression dropped from the node's mean, in units of one rank's input (the node sums k inputs and
        # divides by k), at this rank's shard; zero elsewhere (other local ranks hold theirs).
        dropped = torch.zeros_like(padded)
        dropped[rank * shard.numel() : (rank + 1) * shard.numel()] = (shard - own) * k
        return mean[:numel], dropped[:numel]

    def _track(self, compressor: Compressor, key: str, pieces: Any, numel: int, scaled: bool) -> None:
        """Note that ``key`` was exchanged this step, and where its elements lie in the bucket's layout."""
        group = self.cross_group if self.hierarchical else self.process_group
        if compressor.layout(dist.get_world_size(group)) != "two_phase":
            return  # no server residual to place
        which = "warmup" if compressor is self._warmup else "main"
        self._layouts[(which, key)] = [[(i, n) for i, _, n, _ in pieces], numel, scaled]
        self._used.add((which, key))

    def _fold_unused(self) -> None:
        """At the end of a step: a server residual whose key this step did not use (DDP rebuilt its buckets after
        the first step or after a resume; the warm-up's exchange ended) would never be sent again. Add it, in units
        of one rank's input, to the residuals of the parameters it belongs to, so it is delayed, never lost."""
        group = self.cross_group if self.hierarchical else self.process_group
        # Hierarchical: the exchanged part is this local rank's node shard, and a residual folded into an input
        # weighs the node size k (the node mean) times the cross-node group's size (which pop_residual applies).
        k = dist.get_world_size(self.node_group) if self.hierarchical else 1
        offset_of = dist.get_rank(self.node_group) if self.hierarchical else 0
        for which, compressor in (("main", self.compressor), ("warmup", self._warmup)):
            for key in [name for name in compressor.server_residuals if (which, name) not in self._used]:
                layout = self._layouts.pop((which, key), None)
                if layout is None:
                    continue  # unreachable: every residual's layout is tracked (and checkpointed) with it
                held = compressor.pop_residual(key, layout[1], group)  # layout: pieces, numel exchanged, scaled
                if held is not None:
                    _fold_into(self.residuals, held, layout, offset_of, k, self._frozen)
        self._used = set()

    @staticmethod
    def hook(state: "CompressedAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        # (parameter index, offset in the bucket, numel, shape), in parameter order: the payload's layout (and with
        # it int8/sign chunking and PowerSGD's factor keys) must not depend on the order DDP put the bucket in,
        # which changes when DDP rebuilds its buckets after the first iteration (also after a resume).
        pieces, offset = [], 0
        for p in bucket.parameters():
            pieces.append((state._index[id(p)], offset, p.numel(), p.shape))
            offset += p.numel()
        pieces.sort(key=lambda piece: piece[0])
        state.recorder.record_launch(0, state.scope, time.perf_counter(), timing_event(buffer.device))
        # Decided here, in bucket order on the training thread, so every bucket of a step (and every rank) agrees.
        warming = state.steps < state.warmup_steps
        compressor = state._warmup if warming else state.compressor
        scaled = state.frozen_rms and not warming
        last = bucket.is_last()
        if last:
            state.steps += 1
        if state._thread is None:
            state._thread = CommThread("syncasync-ddp-compression", buffer.device)
        # A CUDA-aware future (as the futures of torch's own hooks), so DDP orders its use of the result after it.
        devices: list[int | str | torch.device] = [buffer.device] if buffer.is_cuda else []
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)

        def exchange() -> torch.Tensor:
            flat = buffer.detach().float()
            parts = []
            for i, off, n, _ in pieces:
                residual = state.residuals.get(i)
                if residual is not None and residual.device != flat.device:  # restored on the CPU
                    residual = state.residuals[i] = residual.to(flat.device)
                piece = flat[off : off + n]
                parts.append(piece + residual if residual is not None else piece)
            sent = torch.cat(parts)
            rms = torch.cat([state._frozen(i, n, flat.device) for i, _, n, _ in pieces]) if scaled else None
            if rms is not None:
                sent = sent / rms  # every element near unit size, so the chunk scale suits them all
            key = ",".join(str(i) for i, *_ in pieces)
            if state.hierarchical:
                mean, dropped = state._hierarchical(sent, compressor, key, pieces, scaled)
            else:
                state._track(compressor, key, pieces, sent.numel(), scaled)
                mean, own, nbytes = compressor.exchange(sent, state.process_group, key, [sh for *_, sh in pieces])
                state.recorder.record_blocking(nbytes, state.scope, 0.0)
                dropped = sent - own if compressor.error_feedback else None
            if rms is not None:
                mean = mean * rms
                dropped = dropped * rms if dropped is not None else None  # residuals stay in gradient units
            out = torch.empty_like(flat)
            pos = 0
            for i, off, n, _ in pieces:
                out[off : off + n] = mean[pos : pos + n]
                if dropped is not None:
                    state.residuals[i] = dropped[pos : pos + n].clone()
                if warming and state.frozen_rms:
                    state._observe(i, mean[pos : pos + n])
                pos += n
            if last:
                state._fold_unused()
            out = out.to(buffer.dtype)
            # The end of this job's work on its stream (CUDA), or now (the CPU's collectives are done when they return).
            state.recorder.record_completion(time.perf_counter(), timing_event(out.device))
            return out

        def _done(f: "Future[torch.Tensor]") -> None:
            err = f.exception()
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(f.result())

        state._thread.submit(exchange).add_done_callback(_done)
        return fut


def _fold_into(
    residuals: dict[int, torch.Tensor],
    held: torch.Tensor,
    layout: Any,
    local: int,
    k: int,
    rms: Any,
) -> None:
    """Add a popped server residual ``held`` (``numel`` elements of the exchanged shard) to the per-parameter
    ``residuals``, in units of one rank's input: at local rank ``local``'s node shard, times the node size ``k``
    (1 when flat), split over the bucket's ``pieces`` and, where the exchange was ``scaled`` by the frozen RMS,
    multiplied back by ``rms(index, numel, device)`` (residuals stay in gradient units)."""
    pieces, numel, scaled = layout
    offset = local * numel
    bucket = torch.zeros(max(sum(n for _, n in pieces), offset + numel), device=held.device)
    bucket[offset : offset + numel] = held * k
    pos = 0
    for i, n in pieces:
        piece = bucket[pos : pos + n]
        if scaled:
            piece = piece * rms(i, n, piece.device)
        held_i = residuals.get(i)
        residuals[i] = held_i.to(piece.device) + piece if held_i is not None else piece.clone()
        pos += n
