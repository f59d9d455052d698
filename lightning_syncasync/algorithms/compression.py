"""Communication compression with error feedback: one ``Compressor`` for every strategy's collectives.

The design brief names bandwidth as the bottleneck of large clusters and recommends gradient quantisation and 1-bit
methods. DeepSpeed 0.19.8 removed both its 1-bit optimizers and its compression library, and Lightning's
``DDPStrategy`` silently skips DDP comm hooks on CPU, so this module gives every strategy here (DDP's gradient
buckets, ``hier_sync``'s inter-node hop, ``async_ssp``'s update exchange) one implementation.

Methods (``bytes per fp32 element on the wire`` in brackets):

* ``none`` [4]: plain fp32 all-reduce.
* ``fp16`` / ``bf16`` [2]: cast, all-reduce in half precision (pre-divided by the group size so fp16 cannot
  overflow, as torch's ``fp16_compress_hook``), cast back.
* ``int8`` [~1.02]: per-chunk absmax scale, nearest or stochastic rounding. Quantised values with different scales
  cannot be summed by an all-reduce, so each rank's payload (values and scales packed in one byte tensor) is
  all-gathered and every rank decodes and averages them.
* ``sign`` [~0.13]: 1 bit per element (packed 8 to a byte) and a per-chunk scale, the chunk's mean absolute value
  (scaled sign of EF-SignSGD: Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019); exchanged by
  all-gather since signs cannot be summed.
* ``powersgd``: rank-``r`` approximation ``P Q^T`` of each matrix, two all-reduces of the small factors, warm-started
  ``Q`` (Vogels et al., "PowerSGD", NeurIPS 2019). One-dimensional tensors (biases, norms) go uncompressed, as in
  torch's ``powerSGD_hook``. A flat tensor without shapes is viewed as a matrix with ``matrix_cols`` columns.

Error feedback (Seide et al., 2014; Karimireddy et al., 2019): what compression drops from a tensor is kept as a
residual under the caller's key and added to the next tensor sent under that key, so nothing is lost, only delayed.
For ``powersgd`` the residual is taken against the averaged approximation, as in torch's hook.

Bytes are counted from the tensors actually handed to collectives (what this rank sends), never estimated.
Everything is plain torch and runs on gloo and NCCL.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import all_gather_flat

Method = Literal["none", "fp16", "bf16", "int8", "sign", "powersgd"]
METHODS: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "sign", "powersgd")
Rounding = Literal["nearest", "stochastic"]

# The bit weights of one packed byte, most significant first.
_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def check_method(method: str, setting: str = "compression") -> None:
    """Raise a ``ValueError`` naming ``setting`` when ``method`` is not a compression method."""
    if method not in METHODS:
        raise ValueError(f"{setting} must be one of {METHODS}, got {method!r}; HINT: 'int8' cuts bytes about 4x")


class Compressor:
    """Compressed mean over a process group, with error feedback and exact byte accounting.

    Args:
        method: one of ``none``, ``fp16``, ``bf16``, ``int8``, ``sign``, ``powersgd`` (see the module docstring).
        error_feedback: keep what compression drops and add it to the next tensor of the same key. Ignored for
            ``none``; on by default for the others (``sign`` without it does not converge in general).
        chunk_size: elements per scale for ``int8`` and ``sign``.
        rounding: ``int8`` rounding, ``"nearest"`` or ``"stochastic"`` (unbiased).
        rank: ``powersgd`` rank.
        matrix_cols: ``powersgd`` only: columns of the matrix a tensor without shapes is viewed as.
        seed: seeds stochastic rounding (give each rank its own) and, with ``factor_seed``, nothing else.
        factor_seed: seeds the initial ``powersgd`` factors, which must be identical on every rank of the group.

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
    ) -> None:
        check_method(method)
        if chunk_size < 8 or chunk_size % 8:
            raise ValueError(
                f"chunk_size must be a positive multiple of 8, got {chunk_size}; HINT: the default 256 adds about 2% "
                "of scales to the payload"
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
        self.residuals: dict[str, torch.Tensor] = {}
        self.factors: dict[str, torch.Tensor] = {}  # powersgd's warm-started Q per (key, tensor index)
        # Random draws come from (seed, calls): a counter that every rank advances in lockstep, so the state a
        # checkpoint needs is one integer, not a generator per rank. Give each rank its own seed for independent
        # stochastic rounding; powersgd's first factors use `seed` alone and must match across ranks.
        self.calls = 0

    def __repr__(self) -> str:
        return f"Compressor({self.method!r}, error_feedback={self.error_feedback})"

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
        if self.error_feedback and key in self.residuals:
            residual = self.residuals[key]
            if residual.numel() != flat.numel():
                raise ValueError(
                    f"key {key!r} was used for {residual.numel()} elements and now for {flat.numel()}: "
                    "error feedback needs one key per tensor"
                )
            flat = flat + residual
        mean, own, nbytes = self.exchange(flat, group, key, shapes)
        if self.error_feedback:
            self.residuals[key] = flat - own
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
        self.calls += 1
        world = dist.get_world_size(group)
        if self.method == "none":
            out = flat.clone()
            dist.all_reduce(out, group=group)
            return out / world, flat, out.numel() * out.element_size()
        if self.method in ("fp16", "bf16"):
            half = (flat / world).to(torch.float16 if self.method == "fp16" else torch.bfloat16)
            own = half.float() * world
            dist.all_reduce(half, group=group)
            return half.float(), own, half.numel() * half.element_size()
        if self.method in ("int8", "sign"):
            payload, own = self._encode(flat)
            gathered = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
            all_gather_flat(gathered, payload, group)
            mean = sum(self._decode(p, flat.numel()) for p in gathered.chunk(world)) / world
            return mean, own, payload.numel() * payload.element_size()  # type: ignore[return-value]
        mean, nbytes = self._powersgd(flat, group, str(key), world, shapes)
        return mean, mean, nbytes

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Residuals, PowerSGD factors and the call counter: what a resumed run needs to continue exactly."""
        return {
            "method": self.method,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "factors": {k: v.clone() for k, v in self.factors.items()},
            "calls": self.calls,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise ValueError(
                f"the checkpoint's compression state is for {state.get('method')!r}, this run uses {self.method!r}; "
                "HINT: resume with the same compression setting"
            )
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.factors = {k: v.clone() for k, v in state["factors"].items()}
        self.calls = int(state["calls"])

    # -- int8 and sign: one packed byte tensor per rank ---------------------------------------------------------

    def _chunks(self, flat: torch.Tensor) -> torch.Tensor:
        pad = -flat.numel() % self.chunk_size
        return torch.nn.functional.pad(flat, (0, pad)).view(-1, self.chunk_size)

    def _encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the byte payload and this rank's own decoded tensor (for the residual)."""
        chunks = self._chunks(flat)
        if self.method == "int8":
            scale = chunks.abs().amax(dim=1, keepdim=True) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            x = chunks / safe
            if self.rounding == "stochastic":
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
                x = torch.floor(x + torch.rand(x.shape, generator=gen))
            else:
                x = torch.round(x)
            q = x.clamp_(-127, 127).to(torch.int8)
            own = (q.float() * scale).reshape(-1)[: flat.numel()]
            payload = torch.cat([q.reshape(-1).view(torch.uint8), scale.reshape(-1).view(torch.uint8)])
        else:
            scale = chunks.abs().mean(dim=1, keepdim=True)
            positive = chunks >= 0
            bits = (positive.view(-1, 8).to(torch.uint8) * _BITS).sum(dim=1, dtype=torch.uint8)
            own = (torch.where(positive, 1.0, -1.0) * scale).reshape(-1)[: flat.numel()]
            payload = torch.cat([bits, scale.reshape(-1).view(torch.uint8)])
        return payload, own

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        n_chunks = -(-numel // self.chunk_size)
        n = n_chunks * self.chunk_size
        if self.method == "int8":
            q = payload[:n].view(torch.int8).float().view(n_chunks, self.chunk_size)
            scale = payload[n:].view(torch.float32).view(n_chunks, 1)
            return (q * scale).reshape(-1)[:numel]
        bits = payload[: n // 8]
        scale = payload[n // 8 :].view(torch.float32).view(n_chunks, 1)
        positive = (bits.view(-1, 1) & _BITS).ne(0).view(n_chunks, self.chunk_size)
        return (torch.where(positive, 1.0, -1.0) * scale).reshape(-1)[:numel]

    # -- powersgd -----------------------------------------------------------------------------------------------

    def _matrices(self, numel: int, shapes: list[torch.Size] | None) -> list[tuple[int, int, int]]:
        """``(offset, rows, cols)`` of each piece: matrices to compress (rows, cols > 1) and flat pieces (cols=0)."""
        if shapes is None:
            cols = min(self.matrix_cols, numel)
            rows = numel // cols
            out = [(0, rows, cols)] if self._pays(rows, cols) else [(0, rows * cols, 0)]
            done = rows * cols
            return out + ([(done, numel - done, 0)] if done < numel else [])
        out, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            rows = shape[0] if len(shape) else 1
            cols = n // rows if rows else 0
            out.append((offset, rows, cols) if len(shape) >= 2 and self._pays(rows, cols) else (offset, n, 0))
            offset += n
        if offset != numel:
            raise ValueError(f"shapes hold {offset} elements, the tensor {numel}")
        return out

    def _pays(self, rows: int, cols: int) -> bool:
        # Compress only where the factors are smaller than the matrix (torch's powerSGD_hook's rule).
        return rows > self.rank and cols > self.rank and (rows + cols) * self.rank < rows * cols

    def _powersgd(
        self, flat: torch.Tensor, group: dist.ProcessGroup | None, key: str, world: int, shapes: list[torch.Size] | None
    ) -> tuple[torch.Tensor, int]:
        pieces = self._matrices(flat.numel(), shapes)
        mats = [(i, o, r, c) for i, (o, r, c) in enumerate(pieces) if c]
        plain = [(o, r) for o, r, c in pieces if not c]
        out = torch.empty_like(flat)
        nbytes = 0
        if plain:
            # The uncompressed pieces travel together in one all-reduce.
            rest = torch.cat([flat[o : o + n] for o, n in plain])
            dist.all_reduce(rest, group=group)
            nbytes += rest.numel() * rest.element_size()
            rest /= world
            pos = 0
            for o, n in plain:
                out[o : o + n] = rest[pos : pos + n]
                pos += n
        if mats:
            ms = [flat[o : o + r * c].view(r, c) for _, o, r, c in mats]
            qs = []
            for i, _, _, c in mats:
                fkey = f"{key}/{i}"
                if fkey not in self.factors or self.factors[fkey].shape != (c, self.rank):
                    gen = torch.Generator().manual_seed(self.factor_seed * 1_000_003 + i)
                    self.factors[fkey] = torch.randn(c, self.rank, generator=gen)
                qs.append(self.factors[fkey])
            ps = [m @ q for m, q in zip(ms, qs, strict=True)]
            p_flat = torch.cat([p.reshape(-1) for p in ps])
            dist.all_reduce(p_flat, group=group)
            nbytes += p_flat.numel() * p_flat.element_size()
            pos = 0
            for j, p in enumerate(ps):
                ps[j] = _orthonormal(p_flat[pos : pos + p.numel()].view_as(p))
                pos += p.numel()
            qs = [m.t() @ p for m, p in zip(ms, ps, strict=True)]
            q_flat = torch.cat([q.reshape(-1) for q in qs])
            dist.all_reduce(q_flat, group=group)
            nbytes += q_flat.numel() * q_flat.element_size()
            q_flat /= world
            pos = 0
            for (i, o, r, c), p in zip(mats, ps, strict=True):
                q = q_flat[pos : pos + c * self.rank].view(c, self.rank)
                pos += q.numel()
                self.factors[f"{key}/{i}"] = q.clone()  # warm start: next step's power iteration begins here
                out[o : o + r * c] = (p @ q.t()).reshape(-1)
        return out, nbytes


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    # Reduced QR: the columns of P become an orthonormal basis (Gram-Schmidt in the paper; QR is the stable form).
    return torch.linalg.qr(p, mode="reduced").Q


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
