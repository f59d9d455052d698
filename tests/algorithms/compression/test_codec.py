"""The fused (``torch.compile``) codec against the eager one, on the CPU: the same codes, through the compressor's
own paths (error feedback fused into the encode, blocks of several rows, the mean of decoded rows), from a
background thread as the strategies' exchange threads call it, and the settings that choose it.

Inductor compiles C++ here and Triton on CUDA from the same graphs; ``tests/gpu`` compares them there."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.compression import _codec
from lightning_syncasync.algorithms.compression._codec import CODEC_ENV, Kernels
from lightning_syncasync.algorithms.compression.compressor import Compressor

pytestmark = pytest.mark.timeout(240)

CASES = [
    ("int8", "nearest"),
    ("int8", "stochastic"),
    ("int4", "nearest"),
    ("int4", "stochastic"),
    ("int2", "nearest"),
    ("int2", "stochastic"),
    ("sign", "nearest"),
]
# Each case compiles graphs of its own: 4-6 s each on a cold cache on 2 cores, 17 s for the first (CI starts cold).
# The default run keeps each method and each rounding once (int8 nearest, int4 and int2 stochastic, sign); the other
# pairings run with `-m slow`. A user's first call of each size is also checked against eager by the codec itself.
_SLOW_CASES = {("int8", "stochastic"), ("int4", "nearest"), ("int2", "nearest")}
CASE_PARAMS = [pytest.param(m, r, marks=pytest.mark.slow) if (m, r) in _SLOW_CASES else (m, r) for m, r in CASES]


def _scales(method: str, payload: torch.Tensor, row_len: int) -> torch.Tensor:
    return payload[:, _codec.code_bytes(method, row_len) :].contiguous().view(torch.float32)


def _codes(method: str, payload: torch.Tensor, row_len: int) -> torch.Tensor:
    return payload[:, : _codec.code_bytes(method, row_len)]


def _same(method: str, a: torch.Tensor, b: torch.Tensor, row_len: int) -> None:
    """int8, int4 and int2 payloads are bitwise equal (their scale is a maximum); sign's codes are, and its scales (a
    chunk's mean, summed in another order by the fused loop) agree to the last bits."""
    assert torch.equal(_codes(method, a, row_len), _codes(method, b, row_len))
    if method == "sign":
        torch.testing.assert_close(_scales(method, a, row_len), _scales(method, b, row_len), rtol=1e-6, atol=0)
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize(("method", "rounding"), CASE_PARAMS, ids=[f"{m}-{r}" for m, r in CASES])
def test_the_compiled_codec_gives_the_eager_codes_with_error_feedback_and_several_rows(method, rounding):
    gen = torch.Generator().manual_seed(3)
    eager = Compressor(method, rounding=rounding, codec="eager", seed=5)
    fused = Compressor(method, rounding=rounding, codec="compiled", seed=5)
    rows, row_len = 3, 4 * 256
    for size in (3 * 1024 - 77, 2 * 1024 + 5):  # two sizes: the second call takes the dynamic-shape graph
        held_e = held_f = None
        flat = torch.randn(size, generator=gen) * torch.rand(size, generator=gen)
        for feedback in (True, False):
            pe, ke = eager._encode_rows(flat, held_e, feedback, rows, row_len)
            pf, kf = fused._encode_rows(flat, held_f, feedback, rows, row_len)
            assert pe.shape == pf.shape and ke.shape == kf.shape == flat.shape
            _same(method, pe, pf, row_len)
            tol = {"rtol": 1e-5, "atol": 1e-6} if method == "sign" else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(kf, ke, **tol)
            # The fused decode of the same bytes, and the mean of the rows in row order, are bitwise the eager ones.
            assert torch.equal(eager._decode_rows(pe, row_len), fused._decode_rows(pe, row_len))
            assert torch.equal(eager._decode_rows(pe, row_len, mean=True), fused._decode_rows(pe, row_len, mean=True))
            if feedback:
                held_e, held_f = ke, kf
        # The last encode (no feedback) kept this rank's decoded copy: what the payload decodes to.
        assert torch.equal(ke, eager._decode_rows(pe, row_len).reshape(-1)[:size])


@pytest.fixture
def fresh_kernels(monkeypatch):
    """The codec's process-wide state as a new process has it (no compiled graphs, checks or fallback), and no
    SYNCASYNC_CODEC; put back after the test."""
    monkeypatch.delenv(CODEC_ENV, raising=False)
    for attr, value in (("_compiled", {}), ("_checked", {}), ("_sizes", {}), ("_broken", None)):
        monkeypatch.setattr(Kernels, attr, value)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


@pytest.mark.parametrize("collective", ["two_phase", "allgather"])
def test_a_compiled_compressor_keeps_the_eager_sequence_of_means_and_residuals(one_rank_group, collective):
    eager = Compressor("int8", rounding="stochastic", collective=collective, codec="eager", seed=1)
    fused = Compressor("int8", rounding="stochastic", collective=collective, codec="compiled", seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        grad = torch.randn(5000, generator=gen)
        mean_e, bytes_e = eager.allreduce(grad, None, "g")
        mean_f, bytes_f = fused.allreduce(grad, None, "g")
        assert bytes_e == bytes_f and torch.equal(mean_e, mean_f)
        assert torch.equal(eager.residuals["g"], fused.residuals["g"])
        assert eager.server_residuals.keys() == fused.server_residuals.keys()
        for key in eager.server_residuals:
            assert torch.equal(eager.server_residuals[key], fused.server_residuals[key])


def test_the_compiled_codec_runs_from_background_threads():
    # The averager's, async rounds' and the DDP hook's exchanges run the codec on their own threads: compiling there,
    # from two threads at once, must give what the main thread gets.
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    expected = Compressor("int4", codec="eager")._encode(x)[0]
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(Compressor("int4", codec="compiled")._encode(x)[0])
        except BaseException as err:  # handed to the test's thread
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert not errors, errors
    assert len(results) == 2 and all(torch.equal(r, expected) for r in results)


def test_auto_fuses_on_cuda_only_and_the_environment_overrides_the_setting(monkeypatch, fresh_kernels):
    auto = Kernels("auto")
    assert auto.mode(torch.device("cpu")) == "eager"
    assert auto.mode(torch.device("cuda", 0)) == "compiled"
    monkeypatch.setenv(CODEC_ENV, "compiled")
    assert Kernels("eager").mode(torch.device("cpu")) == "compiled"
    monkeypatch.setenv(CODEC_ENV, "fast")
    with pytest.raises(ValueError, match=f"{CODEC_ENV} must be one of .*HINT"):
        auto.mode(torch.device("cpu"))
    with pytest.raises(ValueError, match=f"{CODEC_ENV} must be one of .*HINT"):
        Compressor("int8")  # refused where the compressor is made, before any exchange thread runs it


def _failing_compile(fn, **kwargs):
    def compiled(*args):
        raise RuntimeError("no compiler here")

    return compiled


def _under_auto_and_eager(monkeypatch, x: torch.Tensor) -> tuple[Compressor, tuple, tuple]:
    """``x`` encoded by a ``codec="auto"`` compressor that takes the compiled path (as on CUDA) until the process
    drops it, and by an eager one: ``(the auto compressor, its codes, the eager codes)``."""
    auto = Compressor("int8", codec="auto")
    monkeypatch.setattr(auto.kernels, "mode", lambda device: "eager" if Kernels._broken else "compiled")
    return auto, auto._encode(x), Compressor("int8", codec="eager")._encode(x)


def test_a_compiler_failure_raises_with_a_hint_under_compiled_and_falls_back_under_auto(monkeypatch, fresh_kernels):
    monkeypatch.setattr(_codec.torch, "compile", _failing_compile)
    x = torch.randn(600)
    with pytest.raises(RuntimeError, match="codec='compiled' could not compile encode.*no compiler here.*HINT"):
        Compressor("int8", codec="compiled")._encode(x)
    # Under "auto" a failing compiler costs speed, not the run: the eager codes, a warning, and no second try.
    auto, got, expected = _under_auto_and_eager(monkeypatch, x)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert "no compiler here" in (Kernels._broken or "")
    assert auto.kernels.mode(x.device) == "eager"


def test_a_bad_codec_is_refused():
    with pytest.raises(ValueError, match="codec must be one of .*HINT"):
        Compressor("int8", codec="fused")  # type: ignore[arg-type]


def _miscompiling(fn, **kwargs):
    # What a miscompiled graph does: right shapes, one chunk of garbage (as Inductor's CPU loops did in torch 2.13
    # for the residual of a padded last chunk, before encode took it from the padded tensor).
    def compiled(method, *args):
        payload, kept = fn(method, *args)
        kept = kept.clone()
        kept[-100:] = 1e30
        return payload, kept

    return compiled


def test_a_compiled_codec_that_disagrees_with_eager_is_refused_or_dropped(monkeypatch, fresh_kernels):
    monkeypatch.setattr(_codec.torch, "compile", _miscompiling)
    x = torch.randn(3000)
    with pytest.raises(RuntimeError, match="disagreed with the eager one: 100 of 3000 elements of output 1.*HINT"):
        Compressor("int8", codec="compiled")._encode(x)
    _, got, expected = _under_auto_and_eager(monkeypatch, x)
    assert torch.equal(got[1], expected[1]) and "disagreed" in (Kernels._broken or "")


def _miscompiling_at(numel):
    # A graph that is only wrong at one size (as a dynamic-shape graph, compiled at the first change of size, can be).
    def factory(fn, **kwargs):
        def compiled(method, flat, *args):
            payload, kept = fn(method, flat, *args)
            if flat.numel() == numel:
                kept = kept.clone()
                kept[:100] = -1e30
            return payload, kept

        return compiled

    return factory


def test_a_miscompile_at_a_later_size_is_caught_at_that_sizes_first_call(monkeypatch, fresh_kernels):
    monkeypatch.setattr(_codec.torch, "compile", _miscompiling_at(2000))
    comp = Compressor("int8", codec="compiled")
    for _ in range(2 * _codec.CHECKED_CALLS):  # past the first calls' checks, at one size
        comp._encode(torch.randn(3000))
    with pytest.raises(RuntimeError, match="disagreed with the eager one: 100 of 2000 elements"):
        comp._encode(torch.randn(2000))


def _int8_with_scales_off(x: torch.Tensor, ulps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 with error feedback (no residual held) as a GPU graph may compute it: each chunk scale ``ulps`` ulp above
    the correctly rounded one (Triton's approximate division), everything else as ``_codec.encode``."""
    n, row_len = x.numel(), -(-x.numel() // 256) * 256
    chunks = torch.nn.functional.pad(x, (0, row_len - n)).view(1, -1, 256)
    scale = chunks.abs().amax(dim=2, keepdim=True) / 127.0
    for _ in range(ulps):
        scale = torch.nextafter(scale, torch.full_like(scale, float("inf")))
    q = torch.round(chunks / scale).clamp(-127, 127)
    codes = q.to(torch.int8).reshape(1, -1).view(torch.uint8)
    payload = torch.cat([codes, scale.reshape(1, -1).view(torch.uint8)], dim=1)
    return payload, (chunks - q * scale).reshape(-1)[:n]


def test_scales_a_few_ulp_off_agree_and_scales_visibly_off_do_not():
    # The check must not drop the fused codec on a GPU for Triton's approximate division (AGREE_RTOL's comment), and
    # must still catch a graph that computes the scales wrong.
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(7)) * 3
    row_len = -(-x.numel() // 256) * 256
    eager = _codec.encode("int8", x, None, None, 1, row_len, 256, True)
    assert _codec._disagreement("int8", _int8_with_scales_off(x, 0), eager, row_len) is None
    assert _codec._disagreement("int8", _int8_with_scales_off(x, 2), eager, row_len) is None
    assert _codec._disagreement("int8", _int8_with_scales_off(x, 8), eager, row_len) is None  # margin over 2
    assert _codec._disagreement("int8", _int8_with_scales_off(x, 20), eager, row_len) is not None
    assert _codec._disagreement("int8", _int8_with_scales_off(x, 2000), eager, row_len) is not None


def test_non_finite_inputs_are_not_a_compiler_failure(monkeypatch, fresh_kernels):
    # An fp16 loss-scale overflow puts inf in a gradient bucket: the codes of such a chunk are undefined on both
    # sides (NaN cast to an integer), so the check skips that call instead of blaming the compiler.
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    x[5] = float("inf")
    payload, own = Compressor("int8", codec="compiled")._encode(x)
    assert payload.numel() == 4096 + 16 * 4 and own.shape == x.shape and Kernels._broken is None
    assert not Kernels._checked  # skipped, not used up
    # The same non-finite values on both sides agree; a finite value against a non-finite one does not.
    y = torch.tensor([1.0, float("inf"), float("nan"), -float("inf")] * 16)
    assert _codec._disagreement("int8", y.clone(), y, 256) is None
    z = y.clone()
    z[1::4] = 7.0  # finite where eager has inf: 16 elements
    assert _codec._disagreement("int8", z, y, 256) is not None


def test_a_few_codes_flipped_at_rounding_boundaries_are_allowed_in_small_tensors():
    # On a GPU about 1e-5 of int8's codes can flip at a rounding boundary (approximate division): a bucket of a few
    # thousand elements may show one or two, which must not drop the fused codec; a chunk's worth is a miscompile.
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    row_len = -(-x.numel() // 256) * 256
    payload, kept = _codec.encode("int8", x, None, None, 1, row_len, 256, False)
    for flips, agree in ((2, True), (_codec.AGREE_MIN, True), (8, False)):
        flipped = payload.clone()
        flipped[0, :flips] ^= 1
        assert (_codec._disagreement("int8", (flipped, kept), (payload, kept), row_len) is None) == agree, flips


@pytest.mark.parametrize("numel", [8, 24, 40, 72])
def test_sign_decodes_a_single_row_whose_codes_are_not_a_multiple_of_4_bytes(one_rank_group, numel):
    # chunk_size 8: a row of `numel` elements has numel / 8 bytes of codes before its scales. A single row's slice is
    # contiguous and kept its odd storage offset, which a view as fp32 refused ("storage_offset() must be divisible
    # by 4"): every size here but multiples of 32 failed.
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    mean, _ = Compressor("sign", chunk_size=8, codec="eager").allreduce(grad, None, "g")
    chunks = grad.view(-1, 8)
    want = torch.where(chunks >= 0, 1.0, -1.0) * chunks.abs().mean(dim=1, keepdim=True)
    torch.testing.assert_close(mean, want.reshape(-1))
