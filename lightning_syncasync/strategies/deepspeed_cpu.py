"""``DeepSpeedCPUStrategy``: Lightning's DeepSpeed strategy, also on CPU processes (gloo), with the same config.

Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA ("The DeepSpeed strategy is only supported on CUDA
GPUs"), yet DeepSpeed 0.19.8 itself runs on its CPU accelerator with gloo: ZeRO stages 0-3 in fp32, bf16, and fp16
with ZeRO 0/2 train with 2 processes (FINDINGS). Three things stand in the way, and only those are changed here:

* the CUDA-only check in ``setup_environment`` (CPU gets DDP's environment setup instead);
* the CUDA device-index validation in ``setup_distributed``;
* ``deepspeed.initialize(args.device_rank=root_device.index)``: a CPU device has no index, DeepSpeed needs the
  local rank.

On CUDA everything is Lightning's code path unchanged, so one Hydra config (``strategy=deepspeed_zero2_bf16``) runs on
a laptop and on GPUs. Also rejected at construction, with the reason: settings this DeepSpeed no longer has
(``OneBitAdam`` and the compression library were removed in 0.19; this project's ``compression=`` and
``OneBitAdam`` replace them), ZeRO stages out of range, and ``hier_sync``/``async_ssp`` options, which belong to other
strategies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

# Keys of other strategies of this project: passing them here is a mistake, not something to ignore silently.
_FOREIGN = {
    "inter_period": "hier_sync",
    "max_delay": "hier_sync",
    "node_size": "hier_sync",
    "virtual_nodes": "hier_sync",
    "outer": "hier_sync",
    "staleness": "async_ssp",
    "compensation": "async_ssp",
    "exchange_every": "async_ssp",
    "compression": "ddp_measured/hier_sync/async_ssp",
}
_REMOVED_OPTIMIZERS = {"onebitadam", "onebitlamb", "zerooneadam"}


class DeepSpeedCPUStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO on CUDA or CPU processes (see the module docstring).

    Args:
        stage: ZeRO stage: 0 (plain data parallel), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters).
        offload_optimizer: keep optimizer states (and the optimizer step) in CPU memory (ZeRO-Offload).
        offload_parameters: keep parameters in CPU memory (ZeRO-3 only).
        partition_activations: shard checkpointed activations across ranks (with activation checkpointing).
        cpu_checkpointing: keep checkpointed activations in CPU memory.
        config: a full DeepSpeed config (dict or JSON path) instead of the arguments above; gradient accumulation and
            precision still come from the Trainer (``accumulate_grad_batches``, ``precision``).
        start_method: ``"popen"`` like Lightning's, or ``"spawn"`` for notebooks, tests and Hydra multirun.
        kwargs: any other argument of Lightning's ``DeepSpeedStrategy``.

    Example::

        Trainer(accelerator="cpu", devices=2, precision="bf16-mixed",
                strategy=DeepSpeedCPUStrategy(stage=2, start_method="spawn"))
    """

    strategy_name = "deepspeed_cpu"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        config: dict[str, Any] | str | None = None,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        foreign = sorted(k for k in kwargs if k in _FOREIGN)
        if foreign:
            owners = ", ".join(f"{k} ({_FOREIGN[k]})" for k in foreign)
            raise ValueError(
                f"{owners}: settings of other strategies, not of DeepSpeed. Choose one strategy; DeepSpeed's own "
                "communication settings are its ZeRO options"
            )
        if stage not in (0, 1, 2, 3):
            raise ValueError(
                f"stage must be a ZeRO stage 0, 1, 2 or 3, got {stage!r}; HINT: 2 (or strategy=deepspeed_zero3_offload)"
            )
        if offload_parameters and stage != 3:
            raise ValueError(
                f"offload_parameters needs ZeRO stage 3 (parameters are only sharded there), got stage={stage}; "
                "set stage=3 or offload_parameters=False"
            )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be popen, spawn, fork or forkserver, got {start_method!r}; HINT: 'spawn' for "
                "notebooks and Hydra multirun"
            )
        if config is not None:
            config = _with_module_optimizer_offload(_load(config))
            check_config(config)
        super().__init__(
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            partition_activations=partition_activations,
            cpu_checkpointing=cpu_checkpointing,
            config=config,
            **kwargs,
        )
        self._start_method = start_method

    @override
    def _configure_launcher(self) -> None:
        # Runs in the launching process when the Trainer is built: a precision this machine cannot run fails there,
        # before any process is started.
        self._check_precision()
        super()._configure_launcher()

    def _check_precision(self) -> None:
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if self.config is not None:
            check_config_precision(self.config, precision)
        if isinstance(self.accelerator, CUDAAccelerator) or self.accelerator is None:
            return
        if precision.startswith("16"):
            from deepspeed.accelerator import get_accelerator

            if not get_accelerator().is_fp16_supported():
                raise ValueError(
                    f"precision={precision!r} (fp16) is not supported by DeepSpeed's {get_accelerator().device_name()} "
                    "accelerator on this machine; use precision='bf16-mixed' (strategy=deepspeed_zero2_bf16) or '32', "
                    "or run the fp16 preset on GPUs"
                )

    @override
    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_environment()
            return
        self._check_precision()
        # DeepSpeed's CPU accelerator: Lightning's DDP environment setup (launcher, cluster environment, seeds).
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        # DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce kernel (`deepspeed_shm_comm`: 20 s of
        # g++ on a fast core, on the first run of every machine) that only its inference all-reduce (AutoTP) uses;
        # ZeRO training reduces through torch.distributed. Marked incompatible, it is neither built nor loaded.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self._init_deepspeed_distributed()

    @override
    def setup(self, trainer: Any) -> None:
        if self.config is not None:
            check_config(self.config)
        with self._cpu_device_rank():
            super().setup(trainer)

    @contextlib.contextmanager
    def _cpu_device_rank(self) -> Iterator[None]:
        # Lightning passes `args.device_rank=self.root_device.index` to every `deepspeed.initialize`; a CPU device has
        # no index (None), while DeepSpeed's CPU accelerator expects the local rank there.
        if isinstance(self.accelerator, CUDAAccelerator):
            yield
            return
        import deepspeed

        original = deepspeed.initialize

        def initialize(*args: Any, **kwargs: Any) -> Any:
            ns = kwargs.get("args")
            if ns is None or getattr(ns, "device_rank", None) is None:
                kwargs["args"] = argparse.Namespace(device_rank=self.local_rank)
            return original(*args, **kwargs)

        deepspeed.initialize = initialize
        try:
            yield
        finally:
            deepspeed.initialize = original

    @override
    def _create_default_config(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        config = super()._create_default_config(*args, **kwargs)
        if kwargs.get("offload_optimizer"):
            # DeepSpeed refuses ZeRO-Offload with the LightningModule's own optimizer unless told it is deliberate;
            # its replacement (DeepSpeedCPUAdam) compiles a C++ op first (about a minute) and only speeds up Adam.
            config["zero_force_ds_cpu_optimizer"] = False
        return config

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Registered by lightning_syncasync.strategies._registry with our other names.
        return


def check_config(config: dict[str, Any]) -> None:
    """Reject DeepSpeed settings that DeepSpeed 0.19.8 removed, naming what replaces them here."""
    optimizer = str((config.get("optimizer") or {}).get("type", "")).replace("_", "").lower()
    if optimizer in _REMOVED_OPTIMIZERS:
        raise ValueError(
            f"DeepSpeed optimizer {config['optimizer']['type']!r} was removed from DeepSpeed (0.19 no longer has "
            "1-bit optimizers). Use lightning_syncasync.algorithms.compression.OneBitAdam with strategy "
            "ddp_measured, or compression='sign' on ddp_measured/hier_sync/async_ssp"
        )
    if "compression_training" in config:
        raise ValueError(
            "compression_training was removed from DeepSpeed (0.19 has no compression library). Use this project's "
            "compression= option (fp16, bf16, int8, int4, int2, sign, powersgd with error feedback) on ddp_measured, "
            "hier_sync or async_ssp"
        )
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(
            f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}; HINT: 2 shards optimizer states"
        )


def check_config_precision(config: dict[str, Any], precision: str) -> None:
    """Refuse a user config whose ``fp16``/``bf16`` section disagrees with the Trainer's ``precision``: Lightning adds
    the section of its precision beside the user's, and DeepSpeed then asserts at ``initialize`` (both enabled), in
    every process; or, with ``precision=32``, DeepSpeed trains in half precision on inputs Lightning leaves fp32."""
    enabled = [k for k in ("fp16", "bf16") if (config.get(k) or {}).get("enabled", False)]
    wants = "fp16" if precision.startswith("16") else "bf16" if precision.startswith("bf16") else None
    wrong = [k for k in enabled if k != wants]
    if wrong:
        fix = {"fp16": "'16-mixed'", "bf16": "'bf16-mixed'"}[wrong[0]]
        raise ValueError(
            f"the DeepSpeed config enables {wrong[0]} and the Trainer's precision is {precision!r}: DeepSpeed trains "
            f"in one or the other. HINT: set precision={fix}, or remove the config's {wrong[0]} section (Lightning "
            "writes the one its precision needs)"
        )


def _with_module_optimizer_offload(config: dict[str, Any]) -> dict[str, Any]:
    """A user config that offloads the optimizer and trains the LightningModule's own optimizer (no ``optimizer``
    section), as the presets do: DeepSpeed refuses that unless ``zero_force_ds_cpu_optimizer`` is false (its
    ``ZeRORuntimeException`` at ``initialize``, after the processes started), so it is set, and said, unless the
    config sets it."""
    zero = config.get("zero_optimization") or {}
    device = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
    if device in ("cpu", "nvme") and "optimizer" not in config and "zero_force_ds_cpu_optimizer" not in config:
        rank_zero_info(
            "DeepSpeed config: offload_optimizer with the LightningModule's own optimizer, so "
            "zero_force_ds_cpu_optimizer=False (DeepSpeed would refuse it otherwise; set it in the config to choose)"
        )
        config = {**config, "zero_force_ds_cpu_optimizer": False}
    return config


def _load(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {path} does not exist; pass a dict or an existing JSON file")
    rank_zero_info(f"DeepSpeed config from {path}")
    return json.loads(path.read_text())
