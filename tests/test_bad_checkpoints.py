"""Malformed checkpoints and inputs: config.json types and ranges, index files and tokenizer configs that
name files outside the checkpoint directory, binary prompt files. One line naming the file and the key."""
import json
import shutil
from types import SimpleNamespace

import pytest

from conftest import REFPARITY, run_dlm
from dlm_engine.errors import ConfigError, UserError
from dlm_engine.models.checkpoint import check_checkpoint
from dlm_engine.models.loader import build_random


def tiny_checkpoint(d):
    """A copy of the refparity tiny LLaDA checkpoint (config.json + model.safetensors)."""
    shutil.copytree(REFPARITY / "tiny_llada", d)
    return d


def _check(ck):
    return check_checkpoint(SimpleNamespace(name="local", path=str(ck), random=None, hub_id=None, model_type=None))


@pytest.mark.parametrize("change, needle", [
    ({"d_model": "64"}, 'd_model="64" is not an integer'),
    ({"n_heads": 0}, "n_heads=0 is outside 1..131072"),
    ({"n_layers": 2.5}, "n_layers=2.5 is not an integer"),
    ({"mask_token_id": 1024}, "mask_token_id=1024 is outside the vocabulary (0..1023)"),
    ({"eos_token_id": -1}, "eos_token_id=-1 is outside 0.."),
    ({"vocab_size": None, "embedding_size": None}, "has no vocab_size"),
    ({"d_model": 66}, "d_model=66 is not divisible by n_heads=4"),
    ({"rope_theta": "inf"}, "rope_theta=\"inf\" is not a finite number > 0"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0 is not a finite number > 0"),
    ({"weight_tying": "no"}, 'weight_tying="no" is not true or false'),
    ({"d_model": 1 << 40}, "d_model=1099511627776 is outside 1..131072"),
])
def test_config_json_types_and_ranges(tmp_path, change, needle):
    ck = tiny_checkpoint(tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(change)
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as exc:
        _check(ck)
    assert needle in str(exc.value) and str(ck / "config.json") in str(exc.value)


def test_dream_config_and_random_model_configs_are_checked():
    with pytest.raises(UserError, match="hidden_size=\"64\" is not an integer"):
        build_random({"model_type": "Dream", "hidden_size": "64", "num_attention_heads": 4, "num_hidden_layers": 1,
                      "intermediate_size": 8, "vocab_size": 32, "mask_token_id": 3})
    with pytest.raises(UserError, match="model.random: mask_token_id=99 is outside the vocabulary"):
        build_random({"model_type": "llada", "d_model": 8, "n_heads": 2, "n_layers": 1, "mlp_hidden_size": 8,
                      "vocab_size": 32, "mask_token_id": 99})


@pytest.mark.parametrize("weight_map, needle", [
    (5, "weight_map is int"),
    ({}, "not a non-empty object"),
    ({"w": "../outside.safetensors"}, '"../outside.safetensors" outside the checkpoint directory'),
    ({"w": "/etc/model.safetensors"}, '"/etc/model.safetensors" outside the checkpoint directory'),
    ({"w": "sub/model.safetensors"}, '"sub/model.safetensors" outside the checkpoint directory'),
    ({"w": "model.bin"}, '"model.bin", not a *.safetensors file'),
    ({"w": 7}, "names weight file 7"),
])
def test_index_entries_stay_inside_the_checkpoint(tmp_path, weight_map, needle):
    ck = tiny_checkpoint(tmp_path / "ck")
    (tmp_path / "outside.safetensors").write_bytes((ck / "model.safetensors").read_bytes())   # would load if followed
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError) as exc:
        _check(ck)
    assert needle in str(exc.value) and "model.safetensors.index.json" in str(exc.value)


def test_a_symlinked_weight_file_with_a_plain_name_is_fine(tmp_path):
    """Hugging Face cache snapshots are symlinks into ../../blobs: the name is what is checked."""
    ck = tiny_checkpoint(tmp_path / "ck")
    (tmp_path / "blob").write_bytes((ck / "model.safetensors").read_bytes())
    (ck / "model.safetensors").unlink()
    (ck / "model.safetensors").symlink_to(tmp_path / "blob")
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    assert _check(ck) == ck


@pytest.mark.parametrize("value", ["/etc/passwd", "../tokenizer.json", ["vocab.json", "../merges.txt"]])
def test_tokenizer_config_files_stay_inside_the_checkpoint(tmp_path, value):
    ck = tiny_checkpoint(tmp_path / "ck")
    (ck / "tokenizer_config.json").write_text(json.dumps({"tokenizer_file": value}))
    with pytest.raises(UserError, match="tokenizer_config.json' names tokenizer_file .* outside the checkpoint"):
        _check(ck)


def test_binary_or_non_utf8_prompts_file(tmp_path):
    from dlm_engine.app.inputs import check_text_file

    (tmp_path / "bin.txt").write_bytes(b"abc\x00\x01\x02")
    (tmp_path / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="prompts_file: '.*bin.txt' is a binary file \\(a NUL byte at offset 3\\)"):
        check_text_file(str(tmp_path / "bin.txt"), "prompts_file")
    with pytest.raises(ConfigError, match="prompts_file: '.*latin.txt' is not UTF-8 text \\(byte 3"):
        check_text_file(str(tmp_path / "latin.txt"), "prompts_file")
    (tmp_path / "ok.txt").write_text("héllo\n")
    check_text_file(str(tmp_path / "ok.txt"), "prompts_file")


@pytest.mark.slow
def test_a_malformed_checkpoint_on_the_command_line_is_one_line(tmp_path):
    ck = tiny_checkpoint(tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["n_heads"] = 0
    (ck / "config.json").write_text(json.dumps(cfg))
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'r'}", "model=local", f"model.path={ck}", "prompts=[hi]"], cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "n_heads=0 is outside 1..131072" in lines[0], proc.stderr
