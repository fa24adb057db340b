"""Every file the README, docs/ and docstrings point to exists in the project (no references to documents
that live outside it)."""
import re
from pathlib import Path

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
