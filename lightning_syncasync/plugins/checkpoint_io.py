"""``AtomicCheckpointIO``: checkpoints that are either complete or absent, loaded without unpickling code.

Writing: Lightning's ``TorchCheckpointIO`` already writes through an fsspec transaction (a temporary file renamed
into place), so a killed process leaves no half-written checkpoint under the real name; but nothing is flushed to
the disk before the rename, so after a power cut or kernel crash the renamed file may be empty. Here local files are
written to a temporary file in the same folder, ``fsync``-ed, renamed with ``os.replace`` (atomic on POSIX), and the
folder is ``fsync``-ed so the rename itself is durable. Remote paths (``s3://``, ...) go through Lightning's path.

Loading: ``weights_only=True`` unless the caller asks otherwise: torch then refuses to unpickle anything but
tensors and plain containers, so a checkpoint from an untrusted source cannot run code. Every strategy of this
package keeps its state in such plain types for that reason. A truncated, corrupt or foreign file raises
:class:`CheckpointLoadError` naming the file, what is wrong and what to do, instead of a zip-reader error.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be used: truncated, corrupt, not a Lightning checkpoint, or unsafe to unpickle."""


def _is_local(path: _PATH) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Durable, atomic local checkpoint writes and safe, explained loads (see the module docstring).

    Example::

        trainer = L.Trainer(strategy="ddp", devices=2, plugins=[AtomicCheckpointIO()])  # ours use it already
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO does not take storage_options, got {storage_options!r}; HINT: drop them"
            )
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path)
            return
        target = Path(str(path).removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)  # serialise first: a pickling error leaves nothing on disk
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(buffer.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        safe = True if weights_only is None else weights_only
        fs = get_filesystem(path)
        if not fs.exists(str(path)):
            raise FileNotFoundError(f"checkpoint {path} does not exist; HINT: check ckpt_path (or use 'last')")
        try:
            checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=safe)
        except pickle.UnpicklingError as err:
            if not safe:
                raise CheckpointLoadError(f"checkpoint {path} is corrupt: {err}") from err
            why = next((line.strip() for line in str(err).splitlines() if "Unsupported global" in line), "")
            raise CheckpointLoadError(
                f"checkpoint {path} holds objects that weights_only=True refuses to unpickle ({why[:200]}); HINT: if "
                "you trust its source, load it with weights_only=False (Trainer.fit(..., weights_only=False))"
            ) from err
        except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
            size = fs.size(str(path))
            raise CheckpointLoadError(
                f"checkpoint {path} ({size} bytes) is truncated, corrupt or not a torch checkpoint: "
                f"{str(err).splitlines()[0][:200]}; HINT: resume from an earlier checkpoint in the same folder or "
                "start without ckpt_path"
            ) from err
        return checkpoint


def check_lightning_checkpoint(checkpoint: Any, path: _PATH) -> None:
    """A checkpoint to resume from must be Lightning's (the plugin also loads other files for Lightning itself, e.g.
    the spawn launcher's bare weights, so this check belongs to the strategy's ``load_checkpoint``)."""
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        keys = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointLoadError(
            f"checkpoint {path} is not a Lightning checkpoint (it has {keys}, no 'state_dict'); HINT: for bare "
            "weights use model.load_state_dict(torch.load(path)) before fit, without ckpt_path"
        )
