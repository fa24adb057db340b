"""The documentation stays true: every file the README, docs/ and docstrings point to exists in the project (no
references to documents that live outside it), every relative link of the README and docs/ resolves (file and
#anchor), and every `dlm`, `dlm -m`, `dlm-sweep`, `dlm-trace` and `lm_eval` command they show still composes
(Hydra's compose, in process: no model is loaded and nothing runs)."""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w/.-])((?:docs|dlm_engine|strategies|cache|conf|experiments|tests)/[\w./-]+\.(?:md|py|yaml|sh|json|png))")
PLACEHOLDER = re.compile(r"(^|/)(name|NAME)\.")      # `conf/strategy/name.yaml` in instructions
OUTSIDE = re.compile(r"ARCHITECTURE\.md|(?<![\w/])specs/\w+\.md|\.\./shared")


def sources():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    for folder in ("dlm_engine", "strategies", "cache", "experiments", "conf"):
        for p in sorted((ROOT / folder).rglob("*")):
            if p.suffix in (".py", ".yaml", ".md") and "__pycache__" not in p.parts:
                yield p


def pages():
    """The user documentation: the README and every page under docs/ (specs and decision records included)."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def test_every_referenced_file_exists():
    missing = []
    for src in sources():
        text = src.read_text()
        for m in PATH.finditer(text):
            ref = m.group(1).rstrip(".")
            if not PLACEHOLDER.search(ref) and not (ROOT / ref).exists():
                missing.append(f"{src.relative_to(ROOT)}: {ref}")
        for m in OUTSIDE.finditer(text):
            missing.append(f"{src.relative_to(ROOT)}: points outside the project ({m.group(0)})")
    assert missing == []


def test_the_check_catches_a_missing_file():
    assert PATH.search("see `docs/no_such_page.md` for details").group(1) == "docs/no_such_page.md"
    assert OUTSIDE.search("as in ARCHITECTURE.md") and OUTSIDE.search("specs/dream.md §2")
    assert not OUTSIDE.search("docs/specs/dream.md")


# ------------------------------------------------------------------------------------------- links
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are examples, not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, every character that is not a letter, digit,
    space, hyphen or underscore removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # a link keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """Every anchor of a markdown page (repeated headings get -1, -2, ... as on GitHub)."""
    seen, out = {}, set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path):
    for m in LINK.finditer(prose(page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):           # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            yield f"{page.relative_to(ROOT)}: {target} (no such file)"
            continue
        try:
            dest.relative_to(ROOT)
        except ValueError:
            yield f"{page.relative_to(ROOT)}: {target} (outside the project)"
            continue
        if anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            yield f"{page.relative_to(ROOT)}: {target} (no heading with that anchor)"


def test_every_relative_link_resolves_to_a_file_and_heading():
    assert [b for page in pages() for b in broken_links(page)] == []


def test_the_link_check_catches_a_missing_file_or_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Run, and pick a `cache`\n\n```\n# not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#run-and-pick-a-cache) [ok](#top) [bad](docs/b.md) [bad](docs/a.md#not-a-heading)"
                    " [web](https://hydra.cc) `[code](docs/c.md)`\n\n# Top\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
        "docs/b.md (no such file)", "docs/a.md#not-a-heading (no heading with that anchor)"]
    assert slug("Sizes (`experiments/bench_trace.py`)") == "sizes-experimentsbench_tracepy"
    assert slug("Worked example: threshold × block length") == "worked-example-threshold--block-length"


# ------------------------------------------------------------------------------------------- commands
PROGRAMS = ("dlm", "dlm-sweep", "dlm-trace", "lm_eval", "dlm-lm-eval")
# flags of `dlm` that take no part in composing the run config (Hydra's own)
DLM_FLAGS = {"--cfg": 1, "-c": 1, "--help": 0, "--hydra-help": 0, "--info": 1, "--resolve": 0, "--version": 0}


def commands(page: Path):
    """``(program, argv, line)`` of every command line in the fenced code blocks of ``page``."""
    for block in FENCE.finditer(page.read_text()):
        text = re.sub(r"\\\n\s*", " ", block.group(0))       # continuation lines
        for line in text.splitlines()[1:-1]:
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):   # VAR=value before the command
                words.pop(0)
            if words and words[0].rsplit("/", 1)[-1] in PROGRAMS:
                yield words[0].rsplit("/", 1)[-1], words[1:], line.strip()


def documented_commands():
    return [(page, *c) for page in pages() for c in commands(page)]


def compose_dlm(argv, monkeypatch):
    """Compose ``dlm ARGV`` as the app does (a multirun: every job of its grid) and run every check ``dlm`` makes
    before loading a model, except those that read files the example only names (checkpoints, prompt files)."""
    from hydra.types import RunMode

    import dlm_engine.app.inputs
    import dlm_engine.models.checkpoint
    from dlm_engine.app.run import validate
    from dlm_engine.sweeps.grid import config_loader, expand

    monkeypatch.setattr(dlm_engine.models.checkpoint, "check_checkpoint", lambda model: None)
    monkeypatch.setattr(dlm_engine.app.inputs, "read_prompts_file", lambda path: ["1+1="])     # (a one-prompt file)
    overrides, multirun, i = [], False, 0
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "--multirun"):
            multirun = True
        elif a in DLM_FLAGS:
            i += DLM_FLAGS[a]
        elif a.startswith("-"):
            raise AssertionError(f"unknown flag {a}")
        else:
            overrides.append(a)
        i += 1
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()          # the packaged conf/, whatever another test initialised Hydra with
    loader = config_loader()
    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    config = loader.load_configuration("config", overrides, run_mode=mode)
    if not multirun:
        validate(config)
        return 1
    jobs = expand(config, loader)
    for job in jobs:
        validate(loader.load_sweep_config(master_config=config, sweep_overrides=job))
    return len(jobs)


def check_command(program, argv, monkeypatch):
    if program == "dlm":
        return compose_dlm(argv, monkeypatch)
    if program == "dlm-sweep":
        positional = [a for a in argv if not a.startswith("-")]
        assert set(argv) - set(positional) <= {"--no-plots"} and len(positional) == 1, argv
        return 1
    if program == "dlm-trace":
        from dlm_engine.trace.cli import build_parser

        build_parser().parse_args([a for a in argv if not re.fullmatch(r"\[.*\]", a)])   # [--json]: optional
        return 1
    # lm_eval / dlm-lm-eval: model_args are dlm overrides
    args = dict(zip(argv, argv[1:]))
    assert "--model_args" in args, argv
    return compose_dlm(args["--model_args"].split(","), monkeypatch)


@pytest.mark.slow      # (composes and validates 40+ documented command lines: ~20 s on 2 cores)
def test_every_documented_command_composes(monkeypatch):
    found = documented_commands()
    programs = {program for _, program, _, _ in found}
    assert {"dlm", "dlm-sweep", "dlm-trace", "lm_eval"} <= programs and len(found) >= 40, programs
    failed = []
    for page, program, argv, line in found:
        if "--config-dir" in argv:       # a user's plug-in strategy and its YAML, which the project does not hold
            continue
        with monkeypatch.context() as m:
            try:
                check_command(program, argv, m)
            except (Exception, SystemExit) as exc:
                failed.append(f"{page.relative_to(ROOT)}: {line}\n    {type(exc).__name__}: {str(exc).splitlines()[0]}")
    assert failed == [], "\n".join(failed)


@pytest.mark.parametrize("line, problem", [
    ("dlm strategy=treshold", "strategy/treshold"),
    ("dlm strategy=threshold strategy.treshold=0.7", "treshold"),
    ("dlm -m strategy=threshold strategy.threshold=0.5,1.5", "threshold"),
    ("dlm strategy=wino cache=dual", "aux_columns"),
    ("dlm-trace show", "required"),
])
def test_the_command_check_catches_a_broken_example(tmp_path, monkeypatch, capsys, line, problem):
    page = tmp_path / "page.md"
    page.write_text(f"```bash\n{line}   # a comment\n```\n")
    [(program, argv, _)] = list(commands(page))
    with pytest.raises((Exception, SystemExit)) as info:
        check_command(program, argv, monkeypatch)
    assert problem in str(info.value) + capsys.readouterr().err
