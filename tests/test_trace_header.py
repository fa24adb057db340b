"""The provenance header stays small: a CPU generator state that ``torch.manual_seed(seed)`` rebuilds is
recorded by its seed and SHA-256, not as 6.7 KB of base64; ``restore_rng`` rebuilds it and checks it."""
import base64
import hashlib

import pytest
import torch

from dlm_engine.errors import UserError
from dlm_engine.trace import records
from dlm_engine.app.recording import restore_rng, rng_state


def test_a_freshly_seeded_state_is_recorded_by_its_seed_and_restored_exactly():
    torch.manual_seed(11)
    want = torch.random.get_rng_state()
    st = rng_state(11)
    assert st["torch_cpu_seed"] == 11 and "torch_cpu_b64" not in st
    assert st["torch_cpu_sha256"] == hashlib.sha256(want.numpy().tobytes()).hexdigest()
    torch.rand(1000)
    restore_rng(st)
    assert torch.equal(torch.random.get_rng_state(), want)
    # the batch records compare their states with the header's fingerprint, which the reader takes as written
    assert records.batch_defaults({"rng": st})[1] == records.rng_fingerprint(want.numpy().tobytes())


def test_a_state_the_seed_does_not_rebuild_is_written_whole():
    torch.manual_seed(11)
    torch.rand(7)
    want = torch.random.get_rng_state()
    st = rng_state(11)
    assert "torch_cpu_seed" not in st and base64.b64decode(st["torch_cpu_b64"]) == want.numpy().tobytes()
    torch.manual_seed(3)
    restore_rng(st)
    assert torch.equal(torch.random.get_rng_state(), want)
    # a 2.0 header (no fingerprint): the fingerprint comes from the state it holds
    old = {k: v for k, v in st.items() if k != "fingerprint"}
    assert records.batch_defaults({"rng": old})[1] == records.batch_defaults({"rng": st})[1]


@pytest.mark.parametrize("bad", [{"torch_cpu_seed": 11, "torch_cpu_sha256": "0" * 64},
                                 {"torch_cpu_seed": "11"}, {"torch_cpu_seed": -1}, {"torch_cpu_seed": True}])
def test_a_seeded_state_that_does_not_check_out_is_one_line(bad):
    with pytest.raises(UserError, match="RNG state cannot be restored"):
        restore_rng(bad)


def test_a_malformed_fingerprint_is_no_default():
    assert records.batch_defaults({"rng": {"fingerprint": "xyz"}})[1] is None
    assert records.batch_defaults({"rng": {"fingerprint": 5}})[1] is None
