"""Communication compression: the ``Compressor`` every strategy's collectives share, its codecs, the DDP comm hook
that runs it on gradient buckets, and 1-bit Adam.

``from lightning_syncasync.algorithms.compression import Compressor`` keeps working from when this was one module.
"""

from lightning_syncasync.algorithms.compression.compressed_hook import CompressedAllReduce
from lightning_syncasync.algorithms.compression.compressor import (
    CHUNKED,
    COLLECTIVES,
    METHODS,
    Compressor,
    add_server_residual_,
    check_method,
)
from lightning_syncasync.algorithms.compression.onebit_adam import OneBitAdam

__all__ = [
    "CHUNKED",
    "COLLECTIVES",
    "METHODS",
    "CompressedAllReduce",
    "Compressor",
    "OneBitAdam",
    "add_server_residual_",
    "check_method",
]
