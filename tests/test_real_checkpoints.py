"""Model presets for the official checkpoints (LLaDA-8B family, Dream-7B), exercised with tiny random
checkpoints written in the official directory formats (tests/official_ckpt.py): loading through the
presets, path errors, chat templates, and decoding with every registered strategy."""
import json

import pytest

from conftest import run_dlm
from official_ckpt import build_dream_instruct, build_llada_instruct
from dlm_engine.errors import ConfigError, UserError

PRESETS = ["llada_8b_instruct", "llada_8b_base", "llada_1_5", "dream_7b_instruct", "dream_7b_base"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("official")
    return {"llada": (root / "llada", build_llada_instruct(root / "llada")),
            "dream": (root / "dream", build_dream_instruct(root / "dream"))}


def compose(*overrides):
    from hydra import compose as hcompose, initialize_config_module

    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    register_configs()
    with initialize_config_module("dlm_engine.conf", version_base="1.3"):
        return hcompose("config", overrides=list(overrides))


def load(preset, path, **extra):
    from dlm_engine.app.api import load_model

    cfg = compose(f"model={preset}", f"model.path={path}", *[f"model.{k}={v}" for k, v in extra.items()])
    return load_model(cfg.model, "cpu", "auto")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_exists_and_needs_a_path(preset, tmp_path, monkeypatch):
    from dlm_engine.app.run import validate

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty Hugging Face cache
    cfg = compose(f"model={preset}")
    assert cfg.model.name == preset and cfg.model.hub_id and cfg.model.model_type in ("llada", "Dream")
    with pytest.raises(UserError) as err:
        validate(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "model.path=DIR" in msg and cfg.model.hub_id in msg
    assert str(tmp_path / "hub" / ("models--" + cfg.model.hub_id.replace("/", "--"))) in msg  # the folder looked in
    missing = tmp_path / "not-downloaded"
    with pytest.raises(UserError) as err:
        validate(compose(f"model={preset}", f"model.path={missing}"))
    assert str(missing) in str(err.value) and "model.path=DIR" in str(err.value)


def _hub_cache(root, hub_id, checkpoint, revision="0123abcd"):
    """Lay ``checkpoint`` out as the Hugging Face hub cache does: blobs, a snapshot of symlinks, refs/main."""
    import os
    import shutil

    repo = root / ("models--" + hub_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(checkpoint.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo, snap


@pytest.mark.slow
def test_presets_find_the_local_hugging_face_cache(ckpts, tmp_path, monkeypatch):
    """No model.path: the preset's hub id is looked up in the local cache (HF_HUB_CACHE), snapshot by refs/main;
    model.path may also name the cache folder itself. dlm records the snapshot it loaded."""
    from dlm_engine.app.run import validate

    path, _ = ckpts["llada"]
    repo, snap = _hub_cache(tmp_path / "hub", "GSAI-ML/LLaDA-8B-Instruct", path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose("model=llada_8b_instruct")
    validate(cfg)
    assert cfg.model.path == str(snap)
    from dlm_engine.app.api import load_model

    lm = load_model(cfg.model, "cpu", "auto")
    assert lm.chat_template and lm.eos_id is not None
    assert load("llada_8b_instruct", repo).digest == lm.digest
    proc = run_dlm(["model=llada_8b_instruct", "gen_length=8", "task.n=2", "device=cpu", f"hydra.run.dir={tmp_path}/run"],
                   cwd=tmp_path, env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model_path"] == str(snap)


@pytest.mark.slow
def test_cli_missing_directory_is_one_line_naming_the_path_tried(tmp_path):
    missing = tmp_path / "not-downloaded"
    proc = run_dlm(["model=dream_7b_instruct", f"model.path={missing}", f"hydra.run.dir={tmp_path}/run"],
                   cwd=tmp_path)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert str(missing) in err[0] and "model.path=DIR" in err[0] and "Dream-org/Dream-v0-Instruct-7B" in err[0]


def test_bad_chat_template_value_names_the_key():
    from dlm_engine.app.run import validate

    with pytest.raises(ConfigError, match="model.chat_template"):
        validate(compose("model=tiny_random", "model.chat_template=maybe"))


def test_preset_rejects_the_wrong_architecture(ckpts):
    with pytest.raises(UserError, match="expects model_type 'Dream'"):
        load("dream_7b_instruct", ckpts["llada"][0])


@pytest.mark.parametrize("family, preset", [("llada", "llada_8b_instruct"), ("dream", "dream_7b_instruct")])
def test_instruct_preset_loads_official_format_with_chat_template(ckpts, family, preset):
    path, ids = ckpts[family]
    lm = load(preset, path)
    assert lm.chat_template and lm.mask_id == ids["<|mdm_mask|>" if family == "llada" else "<|mask|>"]
    assert lm.eos_id == ids["<|endoftext|>"]
    enc = lm.encode("hi")
    text = lm.tokenizer.decode(enc)
    if family == "llada":
        assert enc[0] == ids["<|startoftext|>"] and enc.count(ids["<|startoftext|>"]) == 1
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "user<|end_header_id|>\n\nhi<|eot_id|>" in text
    else:
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # the preset's end-of-turn id is the tokenizer's EoT token in the real checkpoints; here the ids are scaled
    plain = load(preset, path, chat_template="off")
    assert not plain.chat_template and plain.encode("hi") == [ord("h") - 32, ord("i") - 32]


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_chat_template_auto_is_off_for_base_presets_and_on_requires_a_template(ckpts, tmp_path):
    path, _ = ckpts["llada"]
    assert not load("llada_8b_base", path).chat_template
    assert load("llada_8b_base", path, chat_template="on").chat_template
    # a tokenizer without a template: `on` is an error naming the key, `auto` quietly stays off
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    assert not load("llada_8b_instruct", bare).chat_template
    with pytest.raises(UserError, match="model.chat_template=on"):
        load("llada_8b_instruct", bare, chat_template="on")


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_end_of_turn_id_comes_from_the_checkpoints_tokenizer(ckpts):
    """Presets hard-code no EoT id: the checkpoint's tokenizer gives it (151645 / 126348 in the official ones,
    other ids in these tiny tokenizers); model.eot_token_id overrides it and is range-checked."""
    path, ids = ckpts["dream"]
    assert load("dream_7b_instruct", path).eot_id == ids["<|im_end|>"]
    assert load("local", path).eot_id == ids["<|im_end|>"]
    assert load("dream_7b_instruct", path, eot_token_id=ids["<|endoftext|>"]).eot_id == ids["<|endoftext|>"]
    with pytest.raises(UserError, match="model.eot_token_id=151645 is outside"):
        load("dream_7b_instruct", path, eot_token_id=151645)
    lpath, lids = ckpts["llada"]
    assert load("llada_8b_instruct", lpath).eot_id == lids["<|eot_id|>"]


def _strategy_configs():
    from dlm_engine.core.registry import STRATEGIES, load_plugins

    load_plugins()
    return sorted(STRATEGIES)


@pytest.mark.slow
@pytest.mark.parametrize("family, preset", [("llada", "llada_8b_instruct"), ("dream", "dream_7b_instruct")])
def test_every_registered_strategy_decodes_through_the_preset(ckpts, family, preset):
    """Every strategy in the registry (including ones added later) decodes both families; none is skipped."""
    from omegaconf import OmegaConf

    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class

    path, _ = ckpts[family]
    lm = load(preset, path)
    prompts = [lm.encode("2+2?"), lm.encode("hello there")]
    done = []
    for name in _strategy_configs():
        cfg = compose(f"model={preset}", f"model.path={path}", f"strategy={name}", "gen_length=16")
        cls = strategy_class(name)
        conf = OmegaConf.to_object(cfg.strategy)
        if hasattr(conf, "block_length") and conf.block_length is None and name != "dream":
            conf.block_length = 8
        stats = run_prompts(lm, prompts, lambda: cls(conf, 16), lambda: cache_class("none")(cache_class("none").Config()),
                            16, 2, warmup=False)
        assert len(stats.rows) == 2 and stats.nfe > 0, name
        for row in stats.rows:
            assert len(row.tokens) == 16 and lm.mask_id not in row.tokens[:row.generated_tokens], name
        done.append(name)
    assert set(done) >= {"low_confidence", "threshold", "dream"}


@pytest.mark.slow
def test_cli_decodes_dream_through_its_preset(ckpts, tmp_path):
    path, _ = ckpts["dream"]
    run = tmp_path / "dream"
    proc = run_dlm(["model=dream_7b_instruct", f"model.path={path}", "prompts=[hi,what is 2+2]", "gen_length=16",
                    "device=cpu", "trace.record=false", "strategy=dream", "strategy.steps=8", f"hydra.run.dir={run}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "dream_7b_instruct" and summary["chat_template"] is True
    assert summary["dtype"] == "float32" and summary["device"] == "cpu"
    assert summary["model_calls"] == 8 and summary["nfe"] == 16  # two sequences of 8 forwards, one batch


def test_dream_tokenizer_from_vocab_and_merges_without_remote_code(ckpts, tmp_path):
    """Dream's hub files have a remote-code DreamTokenizer over vocab.json + merges.txt (Qwen2 BPE):
    loaded with the built-in Qwen2 tokenizer, chat template and special tokens from tokenizer_config.json."""
    import shutil

    from tokenizers import ByteLevelBPETokenizer

    from official_ckpt import DREAM_SPECIALS
    from dlm_engine.models.chat import encode_chat, end_of_turn_id, load_tokenizer

    d = tmp_path / "dream_bpe"
    shutil.copytree(ckpts["dream"][0], d)
    (d / "tokenizer.json").unlink()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world what is two plus two", "system you are a helpful assistant user"],
                            vocab_size=300, min_frequency=1)
    bpe.save_model(str(d))
    n = len(json.loads((d / "vocab.json").read_text()))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["added_tokens_decoder"] = {str(n + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True}
                                  for i, s in enumerate(DREAM_SPECIALS)}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    tok, digest = load_tokenizer(d)
    assert digest.startswith("sha256:")
    ids = encode_chat(tok, "hello world")
    assert tok.decode(ids).endswith("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    assert end_of_turn_id({}, tok) == n + DREAM_SPECIALS.index("<|im_end|>")
