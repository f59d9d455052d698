"""Byte-level language-modelling data module for the transformer demo.

The corpus is Python's own documentation topics (``pydoc_data.topics.topics``, ~466 kB of English prose and code
shipped with every CPython install), so a realistic next-token workload is available offline on every machine and is
byte-identical on every DDP rank.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lightning_syncasync.demo._split import _SplitDataModule


def load_corpus(max_chars: int | None = None) -> torch.Tensor:
    """Return the pydoc topics corpus as a 1-D ``int64`` tensor of UTF-8 byte values.

    Args:
        max_chars: If given, keep only the first ``max_chars`` characters (before UTF-8 encoding).

    Returns:
        The encoded corpus, values in ``[0, 256)``.
    """
    from pydoc_data.topics import topics

    # Sorted keys make the byte stream independent of dict ordering across Python builds.
    text = "".join(topics[key] for key in sorted(topics))
    if max_chars is not None:
        text = text[:max_chars]
    # bytearray gives frombuffer a writable buffer, avoiding its non-writable-buffer warning.
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


class TextDataModule(_SplitDataModule):
    """Next-byte prediction windows over the pydoc topics corpus.

    The byte stream is cut into non-overlapping windows: window ``i`` has input ``bytes[i*L : i*L+L]`` and target
    ``bytes[i*L+1 : i*L+L+1]`` (``L = seq_len``). The last ``val_fraction`` of the windows (a contiguous tail of the
    text) is the validation split, so validation text is never seen as training input; only the final target byte
    of the last training window equals the first input byte of the validation tail. Validation doubles as test.

    Attributes:
        vocab_size: Byte vocabulary size (256).
        seq_len: Window length.
        corpus: The encoded corpus (``None`` before ``setup()``).
        train_dataset: Training ``TensorDataset`` of ``(x, y)`` windows (``None`` before ``setup()``).
        val_dataset: Validation ``TensorDataset`` of ``(x, y)`` windows (``None`` before ``setup()``).

    Example::

        L.Trainer(max_steps=150).fit(TransformerLM(), datamodule=TextDataModule(seq_len=64, batch_size=16))
    """

    vocab_size: int = 256

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        max_chars: int | None = None,
        num_workers: int = 0,
    ) -> None:
        """Validate and store the configuration; the corpus is built in ``setup()``.

        Args:
            seq_len: Tokens (bytes) per training window; must not exceed the model's ``seq_len``.
            batch_size: Per-process batch size.
            val_fraction: Fraction of windows (taken from the end of the corpus) used for validation, in ``(0, 1)``.
            max_chars: Truncate the corpus to this many characters for quick runs; ``None`` uses all ~465k.
            num_workers: ``DataLoader`` worker processes; 0 loads in the main process.

        Raises:
            ValueError: If any argument is out of range.
        """
        super().__init__()
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}; set data.seq_len to e.g. 64")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size must be an integer >= 1, got {batch_size!r}; set data.batch_size to a positive integer"
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}; set data.val_fraction to e.g. 0.1")
        # Two windows (one train, one val) plus the shifted target byte is the smallest usable corpus.
        if max_chars is not None and (not isinstance(max_chars, int) or max_chars < 2 * seq_len + 1):
            raise ValueError(
                f"max_chars must be None or an integer >= 2 * seq_len + 1 = {2 * seq_len + 1}, got {max_chars!r}; "
                "set data.max_chars to null or a larger value"
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers must be an integer >= 0, got {num_workers!r}; set data.num_workers to 0 or more"
            )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_chars = max_chars
        self.num_workers = num_workers
        self.corpus: torch.Tensor | None = None
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Encode the corpus and cut it into train/validation windows (idempotent).

        Args:
            stage: Lightning stage; all stages share the data.

        Raises:
            ValueError: If the (truncated) corpus is too short for one train and one validation window.
        """
        if self.train_dataset is not None:
            return
        corpus = load_corpus(self.max_chars)
        num_windows = (len(corpus) - 1) // self.seq_len
        num_val = max(1, round(num_windows * self.val_fraction))
        num_train = num_windows - num_val
        if num_train < 1:
            raise ValueError(
                f"corpus of {len(corpus)} bytes gives {num_windows} windows of seq_len={self.seq_len}, too few for "
                f"val_fraction={self.val_fraction}; increase data.max_chars or decrease data.seq_len"
            )
        used = num_windows * self.seq_len
        x = corpus[:used].view(num_windows, self.seq_len)
        y = corpus[1 : used + 1].view(num_windows, self.seq_len)
        self.corpus = corpus
        # clone() so each split owns compact storage instead of a view into the whole corpus.
        self.train_dataset = TensorDataset(x[:num_train].clone(), y[:num_train].clone())
        self.val_dataset = TensorDataset(x[num_train:].clone(), y[num_train:].clone())
