"""The engine's counter-based noise: exact 32-bit arithmetic, normal statistics, independence across steps,
streams and seeds, and (CUDA) the same draws on both devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from cgforge.kernels import noise as rng
from cgforge.plugin.md.integrators import NoiseSource

N = 200_000


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def draw(seed: int = 0, step: int = 0, stream: int = 0, n: int = N, device: str = "cpu") -> torch.Tensor:
    return rng.normal_noise(seed, torch.tensor(step, device=device), stream, n, device)


def test_wrapping_products_equal_the_exact_split():
    x = torch.randint(0, 2**32, (100_000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    for c in (rng._C1, rng._C2, 0x27D4EB2F):
        assert torch.equal((x * c) & rng._M32, rng._mul32_exact(x, c))
    assert rng._mix(123456789) == int(rng._mix(torch.tensor(123456789)))  # host ints and tensors agree


def test_draws_are_standard_normal():
    z = draw().numpy()
    assert abs(z.mean()) < 5 / np.sqrt(N)
    assert abs(z.var() - 1) < 5 * np.sqrt(2 / N)
    assert abs(stats.kurtosis(z)) < 5 * np.sqrt(24 / N)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    bits = rng.uniform_bits(0, torch.tensor(3), 0, N, "cpu")
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    counts = np.bincount((bits >> 28).numpy(), minlength=16)  # the top 4 bits are uniform
    assert stats.chisquare(counts).pvalue > 1e-3


def test_draws_are_reproducible_and_independent():
    z = draw(step=5)
    assert torch.equal(z, draw(step=5)), "same (seed, step, stream): same numbers"
    bound = 5 / np.sqrt(N)
    for other in (draw(step=6), draw(step=5 + 2**32), draw(stream=1, step=5), draw(seed=1, step=5),
                  draw(seed=2**32, step=5)):
        assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < bound
    lag = float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])
    assert abs(lag) < bound, "neighbouring draws are uncorrelated"
    half = N // 2  # the two Box-Muller outputs of one pair are independent too
    assert abs(float(torch.corrcoef(torch.stack([z[:half], z[half:]]))[0, 1])) < 5 / np.sqrt(half)


def test_sizes_and_the_noise_source():
    step = torch.tensor(7)
    assert draw(n=7).shape == (7,) and draw(n=1).shape == (1,)
    source = NoiseSource(3, step)
    assert source(2, (4, 3)).shape == (4, 3)
    assert torch.equal(source(2, (4, 3)).reshape(-1), rng.normal_noise(3, step, 2, 12, "cpu"))
    step.add_(1)  # the source reads the engine's step counter as it is now
    assert not torch.equal(source(2, (4, 3)).reshape(-1), rng.normal_noise(3, step - 1, 2, 12, "cpu"))


@pytest.mark.cuda
def test_cuda_draws_equal_cpu_draws():
    for step in (0, 11, 2**33 + 5):
        bits_cpu = rng.uniform_bits(4, torch.tensor(step), 1, 5000, "cpu")
        bits_gpu = rng.uniform_bits(4, torch.tensor(step, device="cuda"), 1, 5000, "cuda")
        assert torch.equal(bits_cpu, bits_gpu.cpu())
        torch.testing.assert_close(draw(4, step, 1, 5000), draw(4, step, 1, 5000, "cuda").cpu(), rtol=1e-13,
                                   atol=1e-13)


def test_noise_kernel_compiles_without_spills() -> None:
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available

    if not nvrtc_available():
        pytest.skip("NVRTC is not installed")
    result = compile_cubin(rng.NORMAL_NOISE_SOURCE, arch="sm_90", name="normal_noise.cu")
    res = result.resources("normal_noise_f64")
    # a 40-byte frame is double cos/sin's large-argument reduction (never taken here: angles lie in [0, 2 pi))
    assert not res.spills and res.stack_frame <= 64, res


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 2, 7, 15553, 100001])
def test_cuda_noise_kernel_equals_the_torch_expression(n: int) -> None:
    """The one-kernel draws are the torch expression's (the engine's numbers did not change with the kernel)."""
    for step in (0, 11, 2**33 + 5):
        kernel = rng.normal_noise(9, torch.tensor(step, device="cuda"), 2, n, "cuda")
        reference = rng.normal_noise_reference(9, torch.tensor(step, device="cuda"), 2, n, "cuda")
        assert kernel.shape == (n,) and kernel.dtype == torch.float64
        torch.testing.assert_close(kernel, reference, rtol=1e-15, atol=1e-15)
        torch.testing.assert_close(kernel.cpu(), rng.normal_noise(9, torch.tensor(step), 2, n, "cpu"), rtol=1e-13,
                                   atol=1e-13)
