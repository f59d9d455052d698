"""Small decoder-only transformer language model, the "real" workload for the sync/async strategy demos.

A few million parameters of dense, attention-heavy compute: large enough that gradient synchronisation costs are
visible, small enough to train on CPUs. Pairs with :class:`~lightning_syncasync.demo.text.TextDataModule`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_syncasync.demo._shard import shard_if_meshed


class LinearWarmup:
    """Learning-rate multiplier that ramps linearly from ``1 / warmup_steps`` to 1 over ``warmup_steps`` steps.

    A module-level class rather than a lambda so the scheduler can be pickled and its state checkpointed.

    Args:
        warmup_steps: Number of optimizer steps until the full learning rate, >= 1.
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        """Return the multiplier for ``step``.

        Args:
            step: Zero-based optimizer step.

        Returns:
            ``min(1, (step + 1) / warmup_steps)``.
        """
        return min(1.0, (step + 1) / self.warmup_steps)


class TransformerLM(LightningModule):
    """Pre-norm causal transformer over a byte (or any small) vocabulary with a tied output head.

    Token and learned position embeddings feed ``n_layers`` ``nn.TransformerEncoderLayer`` blocks (``batch_first``,
    ``norm_first``, GELU, 4x feed-forward) run with a causal mask, then a final ``LayerNorm`` and a linear head that
    shares its weight with the token embedding. Logged metrics: ``train_loss`` (per step, progress bar),
    ``val_loss``/``val_ppl`` (per epoch, synchronised across ranks), ``val_acc`` (next-token accuracy over all
    positions, a torchmetrics metric) and the matching ``test_*`` metrics.

    Attributes:
        tok_emb: Token embedding, also the output projection.
        pos_emb: Learned position embedding for up to ``seq_len`` positions.
        blocks: The transformer stack.
        norm: Final layer norm.
        head: Output projection (weight tied to ``tok_emb.weight``).
        val_acc: Validation next-token accuracy metric.
        test_acc: Test next-token accuracy metric.

    Example::

        L.Trainer(max_steps=150).fit(TransformerLM(lr=3e-3, warmup_steps=10), datamodule=TextDataModule(batch_size=16))
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 64,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        activation_checkpointing: bool = False,
        optimizer: str = "adamw",
        onebit_warmup_steps: int = 10,
    ) -> None:
        """Validate the configuration and build the network.

        Args:
            vocab_size: Vocabulary size (256 for bytes), >= 2.
            d_model: Model width, divisible by ``n_heads``.
            n_layers: Number of transformer blocks, >= 1.
            n_heads: Attention heads per block, >= 1.
            seq_len: Maximum sequence length (size of the position embedding); must be >= the data's ``seq_len``.
            dropout: Dropout probability in ``[0, 1)`` for embeddings, attention and feed-forward.
            lr: Peak AdamW learning rate, > 0.
            weight_decay: AdamW weight decay for matrices and embeddings (biases and norms are never decayed), >= 0.
            warmup_steps: Linear warmup length in optimizer steps; 0 disables the scheduler.
            activation_checkpointing: Recompute each block's activations in backward instead of keeping them
                (``torch.utils.checkpoint``): less activation memory for about one more forward pass. Works with
                every strategy, DeepSpeed's included.
            optimizer: ``"adamw"``, or ``"onebit_adam"``: 1-bit Adam (``algorithms/compression/onebit_adam.py``), plain
                Adam for ``onebit_warmup_steps`` and then sign-compressed momenta with a frozen variance; train it with
                ``strategy=ddp_measured`` so gradient traffic stops after the warm-up.
            onebit_warmup_steps: ``optimizer="onebit_adam"`` only: steps of plain Adam before the variance freezes.

        Raises:
            ValueError: If any argument is out of range.
        """
        super().__init__()
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(
                f"vocab_size must be an integer >= 2, got {vocab_size!r}; set model.vocab_size to e.g. 256"
            )
        if not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be an integer >= 1, got {d_model!r}; set model.d_model to e.g. 256")
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers must be an integer >= 1, got {n_layers!r}; set model.n_layers to e.g. 4")
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be an integer >= 1, got {n_heads!r}; set model.n_heads to e.g. 4")
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model must be divisible by n_heads, got d_model={d_model}, n_heads={n_heads}; "
                "set model.d_model to a multiple of model.n_heads"
            )
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}; set model.seq_len to e.g. 64")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}; set model.dropout to e.g. 0.0")
        if not 0.0 < lr < math.inf:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}; set model.lr to e.g. 1e-3")
        if not 0.0 <= weight_decay < math.inf:
            raise ValueError(
                f"weight_decay must be a finite number >= 0, got {weight_decay!r}; set model.weight_decay to e.g. 0.0"
            )
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"warmup_steps must be an integer >= 0, got {warmup_steps!r}; set model.warmup_steps to 0 to disable"
            )
        if optimizer not in ("adamw", "onebit_adam"):
            raise ValueError(
                f"optimizer must be 'adamw' or 'onebit_adam', got {optimizer!r}; set model.optimizer to 'adamw'"
            )
        if not isinstance(onebit_warmup_steps, int) or onebit_warmup_steps < 1:
            raise ValueError(
                f"onebit_warmup_steps must be an integer >= 1, got {onebit_warmup_steps!r}; set "
                "model.onebit_warmup_steps to e.g. 10 (1-bit Adam needs a warm-up to estimate the variance)"
            )
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model,
            n_heads,
            dim_feedforward=4 * d_model,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # Nested tensors only apply to padding masks and are unsupported with norm_first (they just emit a warning).
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # nn.Embedding's N(0, 1) init would make the tied head's initial logits huge; GPT-style small init avoids it.
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        self.head.weight = self.tok_emb.weight
        # Micro averaging over flattened positions is plain next-token accuracy.
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: Integer tensor of shape ``(B, T)`` with ``T <= seq_len``.

        Returns:
            Logits of shape ``(B, T, vocab_size)``.

        Raises:
            ValueError: If ``tokens`` is not 2-D or ``T`` exceeds ``seq_len``.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (batch, time), got shape {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.hparams.seq_len:
            raise ValueError(
                f"input sequence length {length} exceeds the model's seq_len={self.hparams.seq_len}; "
                "set model.seq_len >= data.seq_len"
            )
        positions = torch.arange(length, device=tokens.device)
        h = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        # Built per call rather than stored as a buffer so no extra state is broadcast or checkpointed.
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device, dtype=h.dtype)
        if self.hparams.get("activation_checkpointing") and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            for block in self.blocks.layers:
                h = checkpoint(block, h, src_mask=mask, is_causal=True, use_reentrant=False)
        else:
            h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x).reshape(-1, self.hparams.vocab_size)
        targets = y.reshape(-1)
        return F.cross_entropy(logits, targets), logits, targets

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean next-token cross-entropy on one batch.

        Args:
            batch: ``(inputs, targets)``, both ``(B, T)`` integer tensors.
            batch_idx: Index of the batch in the epoch.

        Returns:
            The loss, for automatic optimisation.
        """
        loss, _, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate validation loss, perplexity and next-token accuracy.

        Args:
            batch: ``(inputs, targets)``.
            batch_idx: Index of the batch.
        """
        loss, logits, targets = self._loss(batch)
        self.val_acc(logits, targets)
        self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        # Mean of per-batch perplexities (not exp of the mean loss); good enough for a demo curve.
        self.log("val_ppl", torch.exp(loss), on_step=False, on_epoch=True, sync_dist=True)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate test loss, perplexity and next-token accuracy.

        Args:
            batch: ``(inputs, targets)``.
            batch_idx: Index of the batch.
        """
        loss, logits, targets = self._loss(batch)
        self.test_acc(logits, targets)
        self.log("test_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("test_ppl", torch.exp(loss), on_step=False, on_epoch=True, sync_dist=True)
        self.log("test_acc", self.test_acc, on_step=False, on_epoch=True)

    def configure_model(self) -> None:
        """Shard with FSDP2 when the strategy gives a device mesh (``hier_sync_sharded``, ``ModelParallelStrategy``):
        each encoder layer is its own unit; the embeddings, norm and tied head go with the root."""
        shard_if_meshed(self, self.blocks.layers)

    def configure_optimizers(self) -> Any:
        """AdamW (or 1-bit Adam) with decay on matrices/embeddings only, plus optional per-step linear warmup.

        Returns:
            The optimizer, or a dict with the optimizer and a step-interval ``LambdaLR`` when ``warmup_steps > 0``.
        """
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if hp.get("optimizer", "adamw") == "onebit_adam":
            from lightning_syncasync.algorithms.compression.onebit_adam import OneBitAdam

            optimizer: torch.optim.Optimizer = OneBitAdam(groups, lr=hp.lr, warmup_steps=hp.onebit_warmup_steps)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.lr)
        if hp.warmup_steps == 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
