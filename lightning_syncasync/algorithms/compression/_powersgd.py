"""PowerSGD for :class:`~lightning_syncasync.algorithms.compression.compressor.Compressor` (``_PowerSGD``): a rank-``r``
approximation ``P Q^T`` of each matrix, two all-reduces of the small factors, ``Q`` warm-started from the previous
exchange of the same key (Vogels et al., "PowerSGD", NeurIPS 2019). One-dimensional tensors (biases, norms) and
matrices whose factors would not be smaller travel uncompressed, in one all-reduce, as in torch's ``powerSGD_hook``."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import all_reduce_


class _PowerSGD:
    """The ``powersgd`` method of :class:`~lightning_syncasync.algorithms.compression.compressor.Compressor` (which
    sets the attributes below in its constructor)."""

    rank: int
    matrix_cols: int
    factor_seed: int
    factors: dict[str, torch.Tensor]

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
            all_reduce_(rest, group)
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
                    # Drawn on the CPU, then moved: the same first factors on every device type.
                    gen = torch.Generator().manual_seed(self.factor_seed * 1_000_003 + i)
                    self.factors[fkey] = torch.randn(c, self.rank, generator=gen, device="cpu").to(flat.device)
                qs.append(self.factors[fkey].to(flat.device))
            ps = [m @ q for m, q in zip(ms, qs, strict=True)]
            p_flat = torch.cat([p.reshape(-1) for p in ps])
            all_reduce_(p_flat, group)
            nbytes += p_flat.numel() * p_flat.element_size()
            pos = 0
            for j, p in enumerate(ps):
                ps[j] = _orthonormal(p_flat[pos : pos + p.numel()].view_as(p))
                pos += p.numel()
            qs = [m.t() @ p for m, p in zip(ms, ps, strict=True)]
            q_flat = torch.cat([q.reshape(-1) for q in qs])
            all_reduce_(q_flat, group)
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
