"""Checkpointing of a strategy's algorithm state (pending rounds, clocks, outer momentum, residuals) and of the
optimizer state of nodes that train apart."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities import rank_zero_warn


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


NODE_OPTIMIZERS_KEY = "hier_sync_node_optimizer_states"


class SavesNodeOptimizers:
    """Mixin (before the Lightning base) for a strategy whose nodes train apart between averagings, each with its own
    optimizer state (Adam's moments differ from node to node; a node's ranks agree, DDP keeps them identical).

    Lightning writes rank 0's optimizer state only, and a resume then restarted every node from node 0's moments
    (measured on ``hier_sync``, Adam, 2 nodes of 2: 0.013 off the uninterrupted run at the first resumed step). So rank
    0's file also holds every node's, gathered from the first rank of each node while :meth:`_nodes_apart`, and each
    node loads its own. An optimizer without state (plain SGD) sends nothing. The file holds ``num_nodes`` copies of
    the optimizer state.
    """

    topology: Any
    global_rank: int
    optimizers: list[Any]

    def _nodes_apart(self) -> bool:
        """Whether the nodes' optimizer states may differ now (hierarchical averaging is on)."""
        raise NotImplementedError

    def _node_cross_group(self) -> Any:
        """A cross-node group (the same local rank of every node) that nothing uses while a checkpoint is saved."""
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        from lightning_syncasync.algorithms._comm import all_gather_state

        states = checkpoint.get("optimizer_states")
        topo = self.topology
        spans = topo is not None and topo.num_nodes > 1
        if spans and states and self._nodes_apart() and any(bool(s.get("state")) for s in states):
            if topo.local_rank_of(self.global_rank) == 0:  # rank 0's group: the first rank of every node
                checkpoint[NODE_OPTIMIZERS_KEY] = all_gather_state(states, group=self._node_cross_group())
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        per_node = checkpoint.get(NODE_OPTIMIZERS_KEY)
        if per_node is None:
            return
        topo = self.topology
        nodes = topo.num_nodes if topo is not None else 1
        if len(per_node) == nodes:
            states = per_node[topo.node_of(self.global_rank) if topo is not None else 0]
        else:
            # Another number of nodes (a lost node, a fine-tune on one machine). The saved model is the merged one
            # (checkpoints are taken at a consistent cut), so every node starts from the merged optimizer state too.
            states = [mean_optimizer_state([node[i] for node in per_node]) for i in range(len(per_node[0]))]
            rank_zero_warn(
                f"the checkpoint holds the optimizer states of {len(per_node)} nodes and this run has {nodes}: every "
                "node starts from their mean (the saved model is their merged one too), so the run goes on, but not "
                "step for step as an uninterrupted one would. HINT: resume on as many nodes (node_size or virtual "
                "nodes as before) to continue the same trajectory"
            )
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)


def mean_state(states: list[Any]) -> Any:
    """The element-wise mean of several replicas' states of one structure (nested dicts and lists of tensors and
    numbers): floating-point tensors are averaged where the replicas differ; everything else (step counters, which
    agree, and what only the first holds) is the first one's."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        if not first.is_floating_point():
            return first
        others = [s for s in states[1:] if isinstance(s, torch.Tensor) and s.shape == first.shape]
        if len(others) != len(states) - 1:
            raise ValueError(f"the replicas' states differ in structure: a tensor of shape {tuple(first.shape)} here")
        if all(torch.equal(first, o) for o in others):
            return first
        return torch.stack([first, *[o.to(first.device) for o in others]]).mean(dim=0)
    if isinstance(first, dict):
        return {k: mean_state([v, *[s[k] for s in states[1:] if k in s]]) for k, v in first.items()}
    if isinstance(first, (list, tuple)):
        if any(len(s) != len(first) for s in states[1:]):
            raise ValueError(f"the replicas' states differ in structure: lists of {[len(s) for s in states]} items")
        return type(first)(mean_state([s[i] for s in states]) for i in range(len(first)))
    return first


def mean_optimizer_state(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The element-wise mean of several replicas' ``optimizer.state_dict()`` (the same optimizer and parameters):
    each floating-point tensor of a parameter's state is averaged where the replicas differ; everything else (step
    counters, which agree, and ``param_groups``) is the first one's.

    For the first moment (momentum, Adam's ``exp_avg``), linear in the gradients, the mean is what one optimizer
    fed the mean of the replicas' gradients would hold; for Adam's ``exp_avg_sq`` it is at least the square of that
    mean, so the first steps are, if anything, smaller than that optimizer's. A replica that holds no state for a
    parameter (it never stepped it) has nothing to add to that parameter's mean (:func:`mean_state` skips it)."""
    return {**states[0], "state": mean_state([s["state"] for s in states])}


def drop_added_callback_states(
    checkpoint: dict[str, Any], callbacks: list[Any], keys: tuple[str, ...], who: str, log: Any
) -> None:
    """Drop from ``checkpoint`` the states of callbacks a strategy adds by itself at more than one rank.

    Why: a checkpoint of more ranks holds the state of a callback the strategy added there (``SyncSwitcher``,
    ``AdaptiveBatchSize``). At one rank the strategy adds none, and Lightning would tell the user to pass it
    ("callbacks used to create the checkpoint need to be provided"). Unless the user passed such a callback (it then
    gets its state), the state is dropped, and the log says so.
    """
    have = {c.state_key for c in callbacks}
    states = checkpoint.get("callbacks", {})
    dropped = [k for k in keys if k in states and k not in have]
    for key in dropped:
        del states[key]
    if dropped:
        log.info("%s: one rank, so the checkpoint's %s state is not used", who, " and ".join(dropped))
