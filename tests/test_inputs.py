"""Inputs: prompts_file as plain text or JSONL (prompts and chats), the checks that need the model (context
length, vocabulary, token ids in constraints), and one warning for characters the tokenizer cannot represent."""
import json
import shutil

import pytest

from conftest import run_dlm
from dlm_engine.app.inputs import read_prompts_file
from dlm_engine.errors import ConfigError, UserError


def test_plain_text_is_one_prompt_per_line(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('12+34=\n\n{"prompt": "kept as text"}\n')
    assert [p.text for p in read_prompts_file(f)] == ["12+34=", '{"prompt": "kept as text"}']


def test_jsonl_prompts_keep_newlines_and_extra_keys(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a\nb", "id": 7}) + "\n\n"
                 + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    a, b = read_prompts_file(f)
    assert (a.text, a.meta) == ("a\nb", {"id": 7})
    assert b.messages == [{"role": "user", "content": "hi"}] and b.shown == "hi"


@pytest.mark.parametrize("content, message", [
    ('{"prompt": 3}\n', "line 1 of '{f}': \"prompt\" must be a string"),
    ('{"prompt": "a"}\n{"prompt": \n', "line 2 of '{f}' is not valid JSON"),
    ('{"text": "a"}\n', 'line 1 of \'{f}\': expected an object with either "prompt"'),
    ('{"messages": [{"role": "user"}]}\n', '"messages" must be a non-empty list'),
    ("\n\n", "'{f}' holds no prompts (it is empty or has only blank lines)"),
])
def test_bad_jsonl_lines_are_named(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(ConfigError) as err:
        read_prompts_file(f)
    assert message.format(f=f) in str(err.value) and str(err.value).startswith("prompts_file: ")


@pytest.mark.slow
@pytest.mark.parametrize("path, message", [
    ("{tmp}", "prompts_file: '{tmp}' is a directory, not a file"),
    ("/dev/null", "prompts_file: '/dev/null' holds no prompts (it is empty or has only blank lines)"),
    ("{tmp}/missing.txt", "prompts_file: '{tmp}/missing.txt' does not exist"),
])
def test_prompts_file_that_is_not_a_prompt_file_is_one_line(tmp_path, path, message):
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'r'}", f"prompts_file={path.format(tmp=tmp_path)}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["dlm: error: " + message.format(tmp=tmp_path)]


@pytest.fixture(scope="module")
def lm():
    from dlm_engine.app.api import load_directory

    return load_directory()


def _cfg(*overrides):
    from dlm_engine.app.compose import compose
    from dlm_engine.app.run import validate

    cfg = compose(["device=cpu", *overrides])
    validate(cfg)
    return cfg


def test_prompts_longer_than_the_context_fail_before_decoding(lm, tmp_path):
    from dlm_engine.app.run import load_inputs

    f = tmp_path / "p.txt"
    f.write_text("12+34=\n" + "1" * 50 + "\n")
    with pytest.raises(UserError, match=r"^prompt 1 has 50 tokens: with gen_length=16 it needs 66 positions, more "
                                        r"than model 'tiny' supports \(max_sequence_length=64; "
                                        r"model.max_length=N runs a RoPE model past it\)$"):
        load_inputs(_cfg(f"prompts_file={f}"), lm)
    # gen_length alone is checked against config.json before the model is loaded
    with pytest.raises(ConfigError, match=r"^gen_length=128 is more than model 'tiny' supports "
                                          r"\(max_sequence_length=64; model.max_length=N runs a RoPE model past it\)$"):
        _cfg("gen_length=128")


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_model_max_length_replaces_the_declared_context(tmp_path):
    """``model.max_length`` lets a RoPE model run past the context its config declares (the embedded model's
    64 positions), and is then the limit every check names."""
    from dlm_engine.app.api import load_model
    from dlm_engine.app.run import load_inputs

    cfg = _cfg("gen_length=128", "model.max_length=144", "task.n=2")
    lm = load_model(cfg.model, "cpu", "float32")
    assert lm.max_length == 144 and lm.config["max_sequence_length"] == 64
    assert [len(x) for x in load_inputs(cfg, lm)["ids"]] == [8, 13]     # + 128 fits in 144
    f = tmp_path / "p.txt"
    f.write_text("12345678901234567890\n")
    with pytest.raises(UserError, match=r"^prompt 0 has 20 tokens: with gen_length=128 it needs 148 positions, "
                                        r"more than model 'tiny' supports \(model.max_length=144\)$"):
        load_inputs(_cfg("gen_length=128", "model.max_length=144", f"prompts_file={f}"), lm)
    with pytest.raises(ConfigError, match=r"^gen_length=128 is more than model 'tiny' supports "
                                          r"\(model.max_length=100\)$"):
        _cfg("gen_length=128", "model.max_length=100")
    # a smaller limit than the declared one is honoured too
    with pytest.raises(ConfigError, match=r"\(model.max_length=8\)$"):
        _cfg("gen_length=16", "model.max_length=8")


@pytest.mark.parametrize("value", ["0", "-4"])
def test_model_max_length_must_be_positive(value):
    from dlm_engine.app.api import load_model

    with pytest.raises(ConfigError, match=rf"^model.max_length must be a positive integer or null \(got {value}\)$"):
        _cfg(f"model.max_length={value}")
    cfg = _cfg()
    cfg.model.max_length = int(value)
    with pytest.raises(ConfigError, match=r"^model.max_length must be a positive integer"):
        load_model(cfg.model, "cpu", "float32")


def test_out_of_vocabulary_constraint_ids_fail_before_decoding(lm):
    from dlm_engine.app.run import load_inputs

    cfg = _cfg("strategy=early_exit", "strategy.answer_start=0", "strategy.constraints=[[2,40],[6,99999]]")
    with pytest.raises(ConfigError, match=r"^strategy.constraints\[1\]: token id 99999 is outside the vocabulary "
                                          r"of model 'tiny' \(0\.\.127\)$"):
        load_inputs(cfg, lm)


@pytest.mark.slow
def test_unrepresentable_characters_warn_once(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["café", "name a\ncolor:", "12+34=", "thé"]))
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'r'}", f"prompts_file={f}", "trace.record=false"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "cannot represent" in line]
    assert warnings == ["dlm: warning: the prompts contain characters model 'tiny' cannot represent ('\\n', 'é'); "
                        "its tokenizer encodes them as its unknown token"]
    rows = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["café", "name a\ncolor:", "12+34=", "thé"]


def test_chat_messages_use_the_tokenizer_template(lm, tmp_path):
    """A copy of the embedded model whose tokenizer has a chat template: {"messages"} prompts are rendered with
    it, and a model without one says so."""
    from dlm_engine.app.api import load_directory
    from dlm_engine.app.session import Session
    from dlm_engine.checkpoints import embedded_path

    ck = tmp_path / "ck"
    shutil.copytree(embedded_path("tiny"), ck)
    conf = json.loads((ck / "tokenizer_config.json").read_text())
    conf["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (ck / "tokenizer_config.json").write_text(json.dumps(conf))
    chat = [{"role": "system", "content": "12+"}, {"role": "user", "content": "34="}]
    s = Session(model="local", device="cpu", **{"model.path": str(ck)})
    out = s.generate([{"messages": chat}, "12+34="], strategy="low_confidence", cache="none")
    assert out[0].tokens == out[1].tokens and out[0].prompt == "34=" and out[0].extra["messages"] == chat
    assert load_directory(str(ck)).tokenizer.chat_template
    with pytest.raises(UserError, match=r"prompt 0: chat messages need a tokenizer with a chat template; "
                                        r"model 'tiny' has none"):
        Session(model="tiny", device="cpu").generate([{"messages": chat}])


def test_length_errors_name_the_key_the_config_declares():
    from dlm_engine.app.inputs import check_gen_length

    with pytest.raises(ConfigError, match=r"^gen_length=64 is more than model 'd' supports \(max_position_embeddings=32; "
                                          r"model.max_length=N runs a RoPE model past it\)$"):
        check_gen_length(64, {"max_position_embeddings": 32}, "d")
    check_gen_length(64, {"max_position_embeddings": 32}, "d", 64)    # the override replaces it
