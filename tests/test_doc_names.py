"""Every name, path and section the docs cite exists: `functrain.*` names resolve, repository paths are
files or directories, and `README "Section"` / `docs/x.md "Section"` name a heading of that file.

Read: README.md, docs/*.md, and the docstrings and comments of functrain/, configs/, bench/ and examples/.
"""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(p for d in ("functrain", "configs", "bench", "examples") for p in (ROOT / d).rglob("*.py")),
]
NAME = re.compile(r"`(functrain(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
TOP = "functrain|tests|bench|configs|docs|examples|third_party_licenses"
PATH = re.compile(rf"(?<![\w./-])((?:{TOP})/[\w/-]*(?:\.[a-z]+\b|/))")
SECTION = re.compile(r'(README|docs/\w+\.md),? "([^"]+)"')


def _cited(pattern: re.Pattern) -> dict[tuple, list[str]]:
    """{match groups: ["file:line", ...]} of `pattern` over every source."""
    out: dict[tuple, list[str]] = {}
    for path in SOURCES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                out.setdefault(m.groups(), []).append(f"{path.relative_to(ROOT)}:{i}")
    return out


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or an attribute path under the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _headings(doc: str) -> list[str]:
    """The markdown headings of README.md or docs/<name>.md."""
    path = ROOT / ("README.md" if doc == "README" else doc)
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]


def test_the_cited_names_resolve():
    missing = {name: where for (name,), where in _cited(NAME).items() if not _resolves(name)}
    assert not missing, f"cited names that do not exist: {missing}"


def test_the_cited_paths_exist():
    missing = {path: where for (path,), where in _cited(PATH).items() if not (ROOT / path.rstrip(".")).exists()}
    assert not missing, f"cited paths that do not exist: {missing}"


def test_the_cited_sections_exist():
    missing = {}
    for (doc, title), where in _cited(SECTION).items():
        if not any(title in heading for heading in _headings(doc)):
            missing[f'{doc} "{title}"'] = where
    assert not missing, f"cited sections with no such heading: {missing}"


@pytest.mark.parametrize("bad", ["functrain.no_such_module", "functrain.step.no_such_name"])
def test_a_missing_name_is_found(bad):
    """The checks themselves can fail: a name, a path and a section that do not exist are seen."""
    assert not _resolves(bad)
    assert _resolves("functrain.step.staged.StagedLoss")
    line = 'see `functrain/no_such.py` and README "No such section"'
    assert PATH.search(line).group(1) == "functrain/no_such.py" and not (ROOT / "functrain/no_such.py").exists()
    doc, title = SECTION.search(line).groups()
    assert not any(title in heading for heading in _headings(doc))
