"""grads_total: the value whose finiteness stands for the gradients' under manual optimization and accumulation.

It must flag a NaN or an infinity in any gradient, of any dtype, and must not flag a large but finite one: a false
alarm stops a healthy run."""

from __future__ import annotations

import pytest
import torch

from lightning_syncasync.algorithms.ssp.totals import grads_total

pytestmark = pytest.mark.timeout(30)


def _params(*grads: torch.Tensor) -> list[torch.Tensor]:
    params = []
    for g in grads:
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g
        params.append(p)
    return params


def test_none_without_gradients() -> None:
    assert grads_total([torch.zeros(3, requires_grad=True)]) is None


def test_the_sum_of_l1_norms_in_fp32_across_dtypes() -> None:
    grads = (torch.randn(40), torch.randn(7).to(torch.bfloat16), torch.randn(5).half())
    total = grads_total(_params(*grads) + [torch.zeros(2, requires_grad=True)])  # a parameter without a gradient
    assert total is not None and total.dtype == torch.float32 and total.dim() == 0
    expected = sum(g.float().abs().sum() for g in grads)
    torch.testing.assert_close(total, expected)


def test_a_large_finite_fp16_gradient_is_finite() -> None:
    # Its L1 norm (10^5) is past fp16's largest value (65504): a norm kept in the gradient's dtype would read inf.
    total = grads_total(_params(torch.ones(100_000, dtype=torch.float16)))
    assert total is not None and torch.isfinite(total) and total.item() == 100_000


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_non_finite_element_in_any_gradient_is_flagged(bad: float, dtype: torch.dtype) -> None:
    poisoned = torch.randn(9).to(dtype)
    poisoned[4] = bad
    total = grads_total(_params(torch.randn(30), poisoned))
    assert total is not None and not torch.isfinite(total)


def test_the_fallback_for_a_foreach_norm_without_dtype_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = (torch.randn(40), torch.ones(100_000, dtype=torch.float16))
    fused = grads_total(_params(*grads))

    def old_signature(tensors: list[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:  # noqa: A002
        return [t.norm(ord) for t in tensors]

    # An older torch's private op rejects the dtype keyword; the per-tensor path must give the same value.
    monkeypatch.setattr(torch, "_foreach_norm", old_signature)
    torch.testing.assert_close(grads_total(_params(*grads)), fused)
