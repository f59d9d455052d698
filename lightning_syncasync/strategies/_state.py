"""Checkpointing of a strategy's algorithm state (pending rounds, clocks, outer momentum, residuals)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH


class CheckpointedAlgorithm:
    """Mixin for a strategy whose algorithm object (``state_dict``/``load_state_dict``) must travel in checkpoints.

    The state goes under ``checkpoint[self._ckpt_key]``. Lightning loads a checkpoint before ``setup`` builds the
    algorithm, so a state read early is kept in ``self._restored`` until :meth:`_algorithm` exists; the subclass
    applies it when it builds the algorithm.
    """

    _ckpt_key: str
    _restored: dict[str, Any] | None

    def _algorithm(self) -> Any | None:
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        algorithm = self._algorithm()
        if algorithm is not None:
            checkpoint[self._ckpt_key] = algorithm.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        state = checkpoint.get(self._ckpt_key)
        if state is not None:
            algorithm = self._algorithm()
            if algorithm is not None:
                algorithm.load_state_dict(state)
            else:
                self._restored = state  # applied when the algorithm is built in setup()
        return checkpoint
