"""block_buffer decides its buffers on the host: the float32 block progress and its comparisons with the thresholds
must be exactly those a float32 tensor gives (``1.0 - masked / size >= threshold``), at every boundary."""
import pytest
import torch

from dlm_engine.strategies.block_buffer import f32, host_progress

THRESHOLDS = [0.0, 1.0, 0.1, 0.2, 0.25, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95, 0.99, 1 / 3, 2 / 3, 0.123456789]


@pytest.mark.slow
def test_host_progress_and_threshold_tests_match_float32_tensors():
    for size in range(1, 257):
        masked = torch.arange(size + 1)
        prog = 1.0 - masked / torch.tensor([size] * (size + 1))
        host = [host_progress(m, size) for m in range(size + 1)]
        assert prog.tolist() == host, size
        assert torch.equal(torch.from_numpy(host_progress(masked.numpy(), size)), prog), size   # (arrays too)
        for t in THRESHOLDS + [k / size for k in range(size + 1)]:
            want = (prog >= t).tolist()
            assert want == [p >= f32(t) for p in host], (size, t)
            assert want == (host_progress(masked.numpy(), size) >= f32(t)).tolist(), (size, t)   # (as settle compares)
