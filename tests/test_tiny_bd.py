"""The embedded block-diffusion model ``tiny_bd`` (SDAR format): ships in the package, loads offline with the
SDAR code, decodes real answers with its family's default strategy (``sdar`` + ``block_kv``), which
``model=tiny_bd`` selects on its own in ``dlm``, the Python API, lm-eval and ``dlm-serve``."""
import json
import os

import pytest
import torch

from conftest import need, run_dlm
from dlm_engine.app import tasks
from dlm_engine.checkpoints import embedded_path

N_HELD_OUT = 200        # held-out prompts of the accuracy guard (50 per task)


@pytest.fixture(scope="module")
def lm():
    from dlm_engine.app.api import load_directory

    return load_directory(name="tiny_bd")


def _decode(lm, examples, cache: str, **strategy_options):
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class

    scls, ccls = strategy_class("sdar"), cache_class(cache)
    torch.manual_seed(0)
    return run_prompts(lm, [e.prompt for e in examples], lambda: scls(scls.Config(**strategy_options), 16),
                       lambda: ccls(ccls.Config()), gen_length=16, batch_size=64, warmup=False)


def _accuracy(examples, rows) -> float:
    return sum(tasks.check(e.task, e.prompt, r.text) for e, r in zip(examples, rows)) / len(examples)


def test_embedded_block_diffusion_checkpoint_is_small_official_sdar_and_documented():
    path = embedded_path("tiny_bd")
    assert path is not None, "dlm_engine/checkpoints/tiny_bd is missing"
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "training.json"} <= files
    assert sum(os.path.getsize(os.path.join(path, f)) for f in files) <= 10 * 1024 * 1024
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["model_type"] == "sdar" and cfg["architectures"] == ["SDARForCausalLM"]
    assert cfg["block_size"] == 4 and cfg["mask_token_id"] == 3 and cfg["vocab_size"] == 100
    card = open(os.path.join(path, "README.md")).read()
    assert "accuracy" in card.lower() and "train_tiny.py" in card and "--family sdar" in card
    log = json.load(open(os.path.join(path, "training.json")))
    assert log["family"] == "sdar" and log["evals"] and log["log"]


def test_loads_as_a_block_causal_sdar_model(lm):
    from dlm_engine.models.qwen_bd import SDARModel

    assert isinstance(lm.model, SDARModel) and lm.model.block_diffusion and lm.model.block_size == 4
    assert lm.mask_id == 3 and lm.eos_id == 2 and lm.encode("12+34=")


@pytest.mark.slow   # 200 decodes, ~8 s: in-process but seconds long: kept out of the quick tier (CI runs it)
def test_default_strategy_decodes_held_out_prompts_with_at_least_90_percent_accuracy(lm):
    examples = tasks.held_out(N_HELD_OUT)
    stats = _decode(lm, examples, "block_kv")
    acc = _accuracy(examples, stats.rows)
    assert acc >= 0.9, acc
    by_task = {}
    for e, r in zip(examples, stats.rows):
        by_task.setdefault(e.task, []).append(tasks.check(e.task, e.prompt, r.text))
    assert all(sum(v) / len(v) >= 0.75 for v in by_task.values()), {k: sum(v) / len(v) for k, v in by_task.items()}


@pytest.mark.slow   # ~3 s a case: in-process but seconds long: kept out of the quick tier (CI runs it)
@pytest.mark.parametrize("options", [{}, {"top_k": 1}], ids=["default", "greedy"])
def test_block_kv_cache_decodes_the_same_tokens_as_no_cache(lm, options):
    examples = tasks.held_out(40)
    cached, plain = _decode(lm, examples, "block_kv", **options), _decode(lm, examples, "none", **options)
    assert [r.tokens for r in cached.rows] == [r.tokens for r in plain.rows]
    # the store keeps finished blocks: fewer positions computed per forward, same forward count
    assert [r.nfe for r in cached.rows] == [r.nfe for r in plain.rows]


def test_model_preset_selects_the_family_decoding_and_the_command_line_still_wins():
    from dlm_engine.app.compose import compose

    cfg = compose(["model=tiny_bd"])
    assert (cfg.model.name, cfg.strategy.name, cfg.cache.name) == ("tiny_bd", "sdar", "block_kv")
    assert cfg.model.path == embedded_path("tiny_bd")
    cfg = compose(["model=tiny_bd", "strategy=threshold", "strategy.block_length=4", "cache=none"])
    assert (cfg.strategy.name, cfg.cache.name) == ("threshold", "none")
    cfg = compose([])                                         # the LLaDA default is untouched
    assert (cfg.model.name, cfg.strategy.name, cfg.cache.name) == ("tiny", "low_confidence", "none")


def test_python_api_session_runs_the_preset():
    import dlm_engine

    res = dlm_engine.Session(model="tiny_bd", device="cpu").generate(["347+085=", "901-256="])
    assert res.config.strategy.name == "sdar" and res.config.cache.name == "block_kv"
    assert [r.text for r in res.rows] == ["0432", "645"]


def test_lm_eval_adapter_takes_the_preset():
    need("lm_eval", "eval")
    import dlm_engine.integrations.lm_eval as adapter

    lm = adapter.DLMEngineLM(model="tiny_bd", device="cpu", **{"trace.record": "false"})
    assert (lm.cfg.strategy.name, lm.cfg.cache.name) == ("sdar", "block_kv")
    assert lm.generate_until([_Request("347+085=", {"until": ["\n"]})]) == ["0432"]


class _Request:
    """The part of an lm-eval ``Instance`` that ``generate_until`` reads."""

    def __init__(self, context, kwargs):
        self.args = (context, kwargs)


def test_serve_request_configs_default_to_the_preset_decoding():
    from dlm_engine.app.compose import compose
    from dlm_engine.serve.config import RequestConfigs

    configs = RequestConfigs(["model=tiny_bd"], compose(["model=tiny_bd"]))
    cfg = configs.get({})
    assert (cfg.model.name, cfg.strategy.name, cfg.cache.name) == ("tiny_bd", "sdar", "block_kv")
    # another strategy names its cache too (the server's default cache, block_kv, serves the block-diffusion decoders)
    cfg = configs.get({"strategy": "threshold", "block_length": 4, "cache": "none"})
    assert (cfg.strategy.name, cfg.strategy.block_length, cfg.cache.name) == ("threshold", 4, "none")


@pytest.mark.slow
def test_dlm_model_tiny_bd_cli_decodes_the_task_end_to_end(tmp_path):
    res = run_dlm([f"hydra.run.dir={tmp_path / 'run'}", "model=tiny_bd", "task.n=100", "trace.record=false"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "tiny_bd" and summary["prompts"] == 100
    assert summary["accuracy"] >= 0.9, summary["accuracy"]
    assert "strategy sdar, cache block_kv" in res.stdout and "accuracy" in res.stdout and "NFE/seq" in res.stdout


def test_two_stream_training_layout_gives_each_noisy_block_the_logits_of_its_decode_call():
    """The objective tiny_bd was trained with: the noisy copy of block k (auxiliary columns behind the clean
    sequence) gets exactly the logits a block-causal forward over [clean blocks < k, noisy block k] gives."""
    import random

    from conftest import load_experiment
    from dlm_engine.core.protocol import AuxColumns, CallRequest
    from dlm_engine.models.layers import cumsum_positions
    from dlm_engine.models.qwen_bd import SDARConfig, SDARModel

    tt = load_experiment("train_tiny")
    torch.manual_seed(0)
    model = SDARModel(SDARConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 mask_token_id=3, block_size=4, eos_token_id=2, pad_token_id=0)).eval()
    ids, km, width = tt.make_batch(random.Random(3), 6, set(), tasks.DEFAULT_MIX, 2)   # mixed prompt lengths
    B, L0 = ids.shape
    L = -(-L0 // 4) * 4
    ids = torch.cat([ids, torch.full((B, L - L0), 2)], 1)
    km = torch.cat([km, torch.ones(B, L - L0, dtype=torch.bool)], 1)
    ws = (width // 4) * 4
    noisy = ids[:, ws:].clone()
    masked = torch.rand(noisy.shape) < 0.5
    masked[:, : width - ws] = False
    noisy[masked] = 3
    pos = cumsum_positions(km, B, L, "cpu")
    with torch.no_grad():
        aux = AuxColumns(noisy, pos[:, ws:], tt.two_stream_mask(km, L, ws, 4))
        out = model(ids, attention_mask=km, position_ids=pos, logits_range=(0, 0), request=CallRequest(aux=aux)).aux_logits
        for b0 in range(ws, L, 4):
            x = ids[:, : b0 + 4].clone()
            x[:, b0:] = noisy[:, b0 - ws: b0 - ws + 4]
            ref = model(x, attention_mask=km[:, : b0 + 4], logits_range=(b0, b0 + 4)).logits
            torch.testing.assert_close(out[:, b0 - ws: b0 - ws + 4], ref, rtol=1e-5, atol=1e-5)
    # a noisy block never sees a later block or the clean copy of itself
    m = tt.two_stream_mask(torch.ones(1, 8, dtype=torch.bool), 8, 0, 4)[0]
    assert not m[8:12, 4:8].any() and not m[8:12, 0:4].any() and m[12:16, 0:4].all() and not m[12:16, 4:8].any()


@pytest.mark.slow
def test_sdar_training_recipe_runs_end_to_end_from_the_llada_warm_start(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT
    from safetensors.torch import load_file

    out = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_tiny.py"), "--family", "sdar",
                           "--init-from", embedded_path("tiny"), "--out", str(out), "--steps", "2", "--batch", "8",
                           "--log-every", "1", "--eval-every", "2", "--eval-n", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "training.json").read_text())
    assert len(meta["log"]) == 2 and meta["evals"][0]["step"] == 2 and 0 <= meta["evals"][0]["acc"] <= 1
    assert "two-stream" in meta["objective"] and "warm start" in meta["objective"]
    # the warm start copied the LLaDA weights (one step of a small lr moves them little) and fitted the QK-norm
    src, got = load_file(os.path.join(embedded_path("tiny"), "model.safetensors")), load_file(out / "model.safetensors")
    assert (got["model.layers.0.mlp.up_proj.weight"] - src["model.transformer.blocks.0.up_proj.weight"]).abs().max() < 0.05
    assert not torch.allclose(got["model.layers.0.self_attn.q_norm.weight"], torch.ones(32))


@pytest.mark.slow
def test_dlm_serve_model_tiny_bd_answers_with_the_family_decoding(tmp_path):
    need("uvicorn", "serve")
    need("sse_starlette", "serve")
    httpx = need("httpx", "dev")
    from dlm_engine.serve.cli import ServerThread

    with ServerThread(["device=cpu", "model=tiny_bd", "trace.record=false"], tmp_path) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": ["347+085=", "901-256="], "max_tokens": 16,
                                                "dlm": {"top_k": 1}})
            assert c.get("/v1/models").json()["data"][0]["id"] == "tiny_bd"
    assert r.status_code == 200, r.text
    assert [ch["text"] for ch in r.json()["choices"]] == ["0432", "645"]


def test_a_refused_cache_chosen_by_the_model_preset_names_the_caches_that_pair():
    """``model=tiny_bd`` selects cache=block_kv; a strategy picked on the command line that cannot use it gets
    one line naming the caches it pairs with (the user never typed block_kv)."""
    from dlm_engine.app.compose import compose
    from dlm_engine.app.run import prepare
    from dlm_engine.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        prepare(compose(["model=tiny_bd", "strategy=threshold", "strategy.block_length=4"]))
    msg = str(err.value)
    assert "\n" not in msg and "cache=block_kv" in msg
    paired = msg.split("caches that pair with it: ")[1].rstrip(")").split(", ")
    assert "none" in paired and "block_kv" not in paired
    prepare(compose(["model=tiny_bd", "strategy=threshold", "strategy.block_length=4", f"cache={paired[-1]}"]))
