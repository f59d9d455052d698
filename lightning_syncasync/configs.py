"""Structured configs: the Hydra schema of every configurable object, derived from its constructor.

The constructors are the schema (STYLE.md): :func:`builds` turns a class's typed ``__init__`` into a dataclass with a
``_target_``, so the YAML files in ``conf/`` are checked at composition time. A misspelt key (``strategy.stalenes=3``)
or a wrong type (``trainer.max_epochs=ten``) then fails with Hydra's own error before any process starts, instead of
deep inside training. :func:`register_configs` stores the schemas under ``schema/<group>/<name>`` in Hydra's
``ConfigStore``; the YAML files pull them in with ``defaults: [/schema/<group>/<name>@_here_]``.

Only the Hydra app (``lightning_syncasync.train``) and tests call :func:`register_configs`; importing the package does
not touch the ConfigStore.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from dataclasses import field, make_dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

_PRIMITIVES = (int, float, str, bool)


def _omegaconf_type(annotation: Any) -> Any:
    """Map a constructor annotation to a type OmegaConf can validate (``Any`` when it cannot)."""
    if annotation in _PRIMITIVES or annotation is Any:
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            inner = _omegaconf_type(rest[0])
            return Any if inner is Any else Optional[inner]  # noqa: UP045 (OmegaConf needs typing.Optional)
        return Any
    if origin in (list, typing.List, tuple, typing.Tuple) and args:  # noqa: UP006
        inner = _omegaconf_type(args[0])
        if inner in _PRIMITIVES and (origin in (list, typing.List) or args[-1] is Ellipsis or len(set(args)) == 1):  # noqa: UP006
            return typing.List[inner]  # noqa: UP006 (OmegaConf 2.3 does not take list[int])
        return Any
    if origin in (dict, typing.Dict) and len(args) == 2 and args[0] is str:  # noqa: UP006
        inner = _omegaconf_type(args[1])
        return typing.Dict[str, inner]  # noqa: UP006
    return Any


def _options_class(annotation: Any) -> type | None:
    """The dataclass in ``X | None`` (or ``X``), for a strategy's ``options`` parameter; else ``None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) and isinstance(args[0], type) else None


def _default_field(default: Any) -> Any:
    if default is inspect.Parameter.empty:
        return field(default=MISSING)
    if default is None or isinstance(default, (*_PRIMITIVES, enum.Enum)):
        return field(default=default)
    if isinstance(default, (list, tuple)) and all(isinstance(v, _PRIMITIVES) for v in default):
        return field(default_factory=lambda d=tuple(default): list(d))
    if isinstance(default, dict) and not default:
        return field(default_factory=dict)
    raise TypeError(f"default {default!r} cannot be represented in a config")


def builds(
    target: type | typing.Callable[..., Any],
    *,
    exclude: typing.Iterable[str] = (),
    extra: dict[str, tuple[Any, Any]] | None = None,
    overrides: dict[str, Any] | None = None,
) -> type:
    """A dataclass schema for ``target``'s constructor, with ``_target_`` set to its import path.

    Parameters whose default is not representable in YAML (objects such as ``timedelta``) are left out: the
    constructor's own default applies and the key is unknown to Hydra. ``*args``/``**kwargs`` are left out too;
    pass the keyword arguments that matter through ``extra`` as ``{name: (type, default)}``.

    Args:
        target: the class (or function) to build.
        exclude: parameter names to leave out of the schema.
        extra: additional fields ``{name: (type, default)}``, e.g. DDP kwargs that DDPStrategy forwards.
        overrides: new defaults for some parameters.
    """
    fn = target.__init__ if inspect.isclass(target) else target
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable forward references: fall back to Any per parameter
        hints = {}
    overrides = overrides or {}
    fields: list[tuple[str, Any, Any]] = [
        ("_target_", str, field(default=f"{target.__module__}.{target.__qualname__}"))
    ]
    excluded = set(exclude) | {"self"}
    is_dataclass = dataclasses.is_dataclass(target)
    factories = {f.name: f.default_factory for f in dataclasses.fields(target)} if is_dataclass else {}
    for name, param in signature.parameters.items():
        if name in excluded or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        nested = _options_class(hints.get(name))
        if nested is not None:
            # A strategy's options object (strategies/options.py): a nested node, so `strategy.options.outer=...`
            # is checked against its fields, and instantiating builds the object.
            schema = builds(nested)
            fields.append((name, schema, field(default_factory=schema)))
            continue
        default = overrides.get(name, param.default)
        factory = factories.get(name, dataclasses.MISSING)
        if factory is not dataclasses.MISSING:
            default = factory()  # a dataclass field's default_factory (a dict or list)
        try:
            default_field = _default_field(default)
        except TypeError:
            continue
        fields.append((name, _omegaconf_type(hints.get(name, Any)), default_field))
    for name, (tp, default) in (extra or {}).items():
        fields.append((name, _omegaconf_type(tp), _default_field(default)))
    return make_dataclass(f"{target.__qualname__.replace('.', '_')}Conf", fields)


def _trainer_conf() -> type:
    from lightning.pytorch import Trainer

    # callbacks and logger come from the `callbacks` and `logger` groups (dicts of named objects), assembled by
    # the train app; trainer.strategy points at the top-level `strategy` node that the `strategy` group fills.
    return builds(Trainer, exclude=("callbacks", "logger"))


@dataclasses.dataclass
class TrainConfig:
    """Schema of ``conf/train.yaml``.

    Attributes:
        task_name: name of the job (output folders, logger names).
        seed: global seed (``None``: do not seed).
        trainer: ``lightning.pytorch.Trainer`` arguments; ``trainer.strategy`` is ``${strategy}`` by default.
        strategy: the strategy: a ``strategy`` group config (``_target_`` + arguments, so ``strategy.max_delay=2``
            works) or a registered name (``~strategy trainer.strategy=hier_sync``).
        model: the LightningModule (``_target_`` + arguments).
        data: the LightningDataModule.
        callbacks: named callbacks; set one to ``null`` to drop it.
        logger: named Lightning loggers.
        ckpt_path: checkpoint to resume from.
        test: run ``trainer.test`` after fitting.
        optimized_metric: metric returned to Hydra sweepers (e.g. optuna), read from ``trainer.callback_metrics``.
        results_file: JSON file, written by rank 0 in the job's output folder, with the metrics and the summary.
        ft: run a fault-tolerant job (``strategy=hier_sync_ft`` or ``async_ssp_ft``) as this many emulated nodes on
            this machine: a torchft Lighthouse and one job per node (``0``: this process is the job).
        ft_faults: the node fault schedule of an ``ft`` job, e.g. ``kill:1@10,start:1@25``.
        data_order: another draw of everything random after the model's initialisation (the order of the training
            batches first), the model initialised by ``seed`` as before: ``seed + 1000 x data_order`` reseeds after
            it (``0``: nothing reseeded). How much a result moves with the data order alone: the benchmarks' noise
            floor, DDP against itself (``ddp_other_order``). A module that builds its layers in ``configure_model``
            draws them after the reseed, so its weights change too.
    """

    task_name: str = "train"
    seed: Optional[int] = 42  # noqa: UP045
    trainer: Any = MISSING
    strategy: Any = "auto"
    model: Any = MISSING
    data: Any = MISSING
    callbacks: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
    ckpt_path: Optional[str] = None  # noqa: UP045
    test: bool = False
    optimized_metric: str = "val_acc"
    results_file: str = "results.json"
    ft: int = 0
    ft_faults: str = ""
    data_order: int = 0


def _schemas() -> dict[str, type]:
    """``schema/<group>/<name>`` -> dataclass. Imported lazily: building them imports Lightning and the demos."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, RichProgressBar, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_syncasync.callbacks import (
        AdaptiveBatchSize,
        PeerWatchdog,
        StragglerEmulator,
        SyncMonitor,
        SyncSwitcher,
    )
    from lightning_syncasync.demo import (
        Classifier,
        DigitsDataModule,
        Mnist5kDataModule,
        SyntheticDataModule,
        TextDataModule,
        TransformerLM,
    )
    from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy
    from lightning_syncasync.strategies.async_ssp_sharded import ShardedAsyncSSPStrategy
    from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy
    from lightning_syncasync.strategies.deepspeed_cpu import DeepSpeedCPUStrategy
    from lightning_syncasync.strategies.fault_tolerant import FaultTolerantStrategy
    from lightning_syncasync.strategies.hier_sync import HierSyncStrategy
    from lightning_syncasync.strategies.hier_sync_sharded import ShardedHierSyncStrategy
    from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy

    # DDPStrategy forwards **kwargs to torch's DistributedDataParallel; these are the ones users tune.
    ddp_kwargs: dict[str, tuple[Any, Any]] = {
        "find_unused_parameters": (bool, False),
        "static_graph": (bool, False),
        "gradient_as_bucket_view": (bool, False),
        "bucket_cap_mb": (Optional[float], None),  # noqa: UP045
    }
    return {
        "trainer/trainer": _trainer_conf(),
        "strategy/ddp": builds(DDPStrategy, exclude=("accelerator", "parallel_devices"), extra=ddp_kwargs),
        # MeasuredDDPStrategy forwards **kwargs to DDPStrategy: expose the same DDP settings.
        "strategy/measured_ddp": builds(
            MeasuredDDPStrategy,
            extra={"start_method": (str, "popen"), "process_group_backend": (Optional[str], None), **ddp_kwargs},  # noqa: UP045
        ),
        "model/classifier": builds(Classifier),
        "model/transformer_lm": builds(TransformerLM),
        "data/digits": builds(DigitsDataModule),
        "data/mnist5k": builds(Mnist5kDataModule),
        "data/text": builds(TextDataModule),
        "data/synthetic": builds(SyntheticDataModule),
        "strategy/hier_sync": builds(
            HierSyncStrategy,
            extra={"start_method": (str, "popen"), "process_group_backend": (Optional[str], None), **ddp_kwargs},  # noqa: UP045
        ),
        "strategy/hier_sync_sharded": builds(ShardedHierSyncStrategy),
        "strategy/async_ssp_sharded": builds(ShardedAsyncSSPStrategy),
        "strategy/fsdp": builds(
            ModelParallelStrategy,
            exclude=("data_parallel_size", "tensor_parallel_size"),
            extra={"data_parallel_size": (Any, "auto"), "tensor_parallel_size": (Any, 1)},
        ),
        "strategy/async_ssp": builds(
            AsyncSSPStrategy,
            extra={"start_method": (str, "popen"), "process_group_backend": (Optional[str], None)},  # noqa: UP045
        ),
        "strategy/fault_tolerant": builds(
            FaultTolerantStrategy,
            extra={"start_method": (str, "popen"), "process_group_backend": (Optional[str], None), **ddp_kwargs},  # noqa: UP045
        ),
        "strategy/auto_sync": builds(
            AutoSyncStrategy,
            extra={"start_method": (str, "popen"), "process_group_backend": (Optional[str], None), **ddp_kwargs},  # noqa: UP045
        ),
        "strategy/deepspeed_cpu": builds(
            DeepSpeedCPUStrategy,
            extra={"process_group_backend": (Optional[str], None), "logging_batch_size_per_gpu": (int, 1)},  # noqa: UP045
        ),
        "callbacks/sync_monitor": builds(SyncMonitor),
        "callbacks/straggler_emulator": builds(StragglerEmulator),
        "callbacks/adaptive_batch": builds(AdaptiveBatchSize),
        "callbacks/switcher": builds(SyncSwitcher),
        "callbacks/watchdog": builds(PeerWatchdog),
        "callbacks/model_checkpoint": builds(ModelCheckpoint),
        "callbacks/early_stopping": builds(EarlyStopping),
        "callbacks/rich_progress_bar": builds(RichProgressBar),
        "callbacks/tqdm_progress_bar": builds(TQDMProgressBar),
        "logger/csv": builds(CSVLogger),
        "logger/tensorboard": builds(TensorBoardLogger),
    }


def _ranks(num_nodes: Any, devices: Any) -> int:
    if not isinstance(devices, int) or isinstance(devices, bool) or not isinstance(num_nodes, int):
        raise ValueError(
            f"strategy=fsdp needs trainer.devices and trainer.num_nodes as counts to size its mesh, got devices="
            f"{devices!r}, num_nodes={num_nodes!r}; HINT: set trainer.devices=4 (or strategy.data_parallel_size)"
        )
    return num_nodes * devices


def register_configs(cs: ConfigStore | None = None) -> None:
    """Store :class:`TrainConfig` as ``train_schema`` and every object schema under ``schema/<group>/<name>``."""
    cs = ConfigStore.instance() if cs is None else cs
    # ${syncasync_ranks:${trainer.num_nodes},${trainer.devices}}: the world size, for settings that need it
    # (strategy=fsdp's data_parallel_size: Lightning's ModelParallelStrategy shards over data_parallel_size ranks).
    OmegaConf.register_new_resolver("syncasync_ranks", _ranks, replace=True)
    cs.store(name="train_schema", node=TrainConfig)
    for path, schema in _schemas().items():
        group, name = path.split("/")
        cs.store(group=f"schema/{group}", name=name, node=schema)
