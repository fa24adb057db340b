"""The run option ``threads``: torch's intra-op CPU threads while decoding, put back afterwards; part of the
config (validated, recorded in the trace header, applied by the API, the command and a verified re-run)."""
import pytest
import torch

import dlm_engine
from conftest import run_dlm
from dlm_engine.app.api import run_prompts, torch_threads
from dlm_engine.core.registry import cache_class, strategy_class
from dlm_engine.errors import ConfigError


def other_count() -> int:
    """A thread count different from the current one (so that setting it is visible)."""
    return 1 if torch.get_num_threads() != 1 else 2


def test_run_prompts_decodes_with_the_given_threads_and_puts_them_back():
    lm = dlm_engine.Session(model="tiny", device="cpu").lm
    seen = []
    S, C = strategy_class("low_confidence"), cache_class("none")
    before, n = torch.get_num_threads(), other_count()

    def hook(canvas):
        seen.append(torch.get_num_threads())

    run_prompts(lm, ["12+34=", "7+8="], lambda: S(S.Config(steps=4), 8), lambda: C(C.Config()), 8, 1,
                canvas_hook=hook, threads=n)
    assert seen == [n, n] and torch.get_num_threads() == before
    seen.clear()
    run_prompts(lm, ["12+34="], lambda: S(S.Config(steps=4), 8), lambda: C(C.Config()), 8, 1, canvas_hook=hook)
    assert seen == [before]                        # None: left as they are


def test_threads_are_put_back_when_the_decode_fails():
    before, n = torch.get_num_threads(), other_count()
    with pytest.raises(RuntimeError, match="boom"):
        with torch_threads(n):
            assert torch.get_num_threads() == n
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads=0"):
        with torch_threads(0):
            pass


def test_the_session_api_applies_and_records_threads(tmp_path, thread_counts):
    s = dlm_engine.Session(model="tiny", device="cpu")
    before = torch.get_num_threads()
    out = s.generate(["12+34="], strategy="threshold", cache="none", threads=1, trace=tmp_path / "t.dlmt")
    assert thread_counts == [1, before] and out.config.threads == 1
    from dlm_engine.trace import open_trace

    tr = open_trace(out.trace)
    assert tr.header["config"]["threads"] == 1
    # a verified re-run decodes with the recorded count
    from dlm_engine.app.rerun import rerun

    thread_counts.clear()
    assert rerun(tr)["reproduced"]
    assert thread_counts and thread_counts[0] == 1
    with pytest.raises(ConfigError, match=r"^threads=0 must be a positive integer"):
        s.generate(["12+34="], threads=0)


@pytest.mark.slow
@pytest.mark.parametrize("value, needle", [("0", "threads=0 must be a positive integer"),
                                           ("-2", "threads=-2 must be a positive integer"),
                                           ("many", "threads: Value 'many'")])
def test_a_bad_thread_count_is_one_line(tmp_path, value, needle):
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'r'}", f"threads={value}", "trace.record=false"], cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "r" / "summary.json").exists()


def test_the_command_decodes_with_its_thread_count_and_records_it(tmp_path, thread_counts):
    from hydra import compose, initialize_config_module

    from dlm_engine.app.config import register_configs
    from dlm_engine.app.run import run
    from dlm_engine.core.registry import load_plugins
    from dlm_engine.trace import open_trace

    load_plugins()
    register_configs()
    with initialize_config_module(config_module="dlm_engine.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["threads=1", "task.n=2", "progress=false"])
    before = torch.get_num_threads()
    summary = run(cfg, tmp_path)
    assert thread_counts == [1, before] and summary["prompts"] == 2
    assert open_trace(str(tmp_path / cfg.trace.filename)).header["config"]["threads"] == 1


def test_a_sweep_job_made_before_the_option_existed_still_counts_as_done():
    from omegaconf import OmegaConf

    from dlm_engine.app.jobs import config_digest

    base = {"gen_length": 16, "seed": 0, "strategy": {"name": "threshold"}}
    old = config_digest(OmegaConf.create(base))                      # a result written before ``threads``
    assert config_digest(OmegaConf.create({**base, "threads": None})) == old
    assert config_digest(OmegaConf.create({**base, "threads": 1})) != old   # another count is another job
