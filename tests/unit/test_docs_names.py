"""The README and docs/ name only what exists: every ``src/...`` (and ``tests/``, ``scripts/``,
``conf/``, ``docs/``) path, every dotted ``ddpexp.x.y`` / ``hydra_plugins.x`` name, every
relative link and its anchor. The README stays a front door: at most 400 lines of at most 100
characters, with a code map that names every package and top-level module of ``src/ddpexp/``
and every Hydra plugin package of ``src/hydra_plugins/``.

Names are resolved by importing (no process is started): a module, or a module and the
attributes after it (``ddpexp.checkpoint.io.save_atomic``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

# A repository path in backticks, in a link, or in prose: it begins at a word boundary that
# is not part of a longer path (``my_conf/``, ``/tmp/x/conf/`` are not repository paths).
PATH = re.compile(r"(?<![\w./-])((?:src|tests|scripts|conf|docs)/(?:[\w./-]*[\w/])?)")
# A dotted Python name rooted in the project's packages.
NAME = re.compile(r"(?<![\w./-])((?:ddpexp|hydra_plugins)(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def _not_names() -> set[str]:
    """Dotted words that are not Python names: the run's log file (Hydra's ``<job>.log``) and
    the tags the MLflow logger sets (``ddpexp.status``, ...)."""
    from ddpexp.loggers import mlflow

    return {"ddpexp.log", *(getattr(mlflow, n) for n in dir(mlflow) if n.endswith("_TAG"))}


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _strip_locator(path: str) -> str:
    """``src/x.py:12``, ``src/x.py#L12`` and ``docs/x.md#a-heading`` name ``src/x.py`` etc."""
    return re.sub(r"(:\d+(-\d+)?|#.*)$", "", path)


def _resolves(name: str) -> bool:
    """Whether ``name`` is an importable module, or a module followed by attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                # A submodule not imported by its package is still a module.
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")
                except (ImportError, AttributeError):
                    return False
            else:
                obj = getattr(obj, attr)
        return True
    return False


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in _text(page).splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            slug = _slug(match.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_every_repository_path_exists() -> None:
    missing = []
    for page in PAGES:
        for raw in PATH.findall(_text(page)):
            path = _strip_locator(raw)
            if not (ROOT / path).exists():
                missing.append(f"{_rel(page)}: {raw}")
    assert not missing, "paths that do not exist in the repository:\n  " + "\n  ".join(missing)


def test_every_dotted_name_imports() -> None:
    missing = []
    for page in PAGES:
        for name in sorted(set(NAME.findall(_text(page))) - _not_names()):
            if not _resolves(name):
                missing.append(f"{_rel(page)}: {name}")
    assert not missing, "names that are no module or attribute:\n  " + "\n  ".join(missing)


def test_every_relative_link_and_anchor_exists() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(_text(page)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{_rel(page)}: ({target}) has no file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(page)}: ({target}) has no such heading")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_the_readme_is_a_front_door() -> None:
    lines = _text(README).splitlines()
    # The suite's command block under "## Tests" keeps its lines: its timings are updated there.
    tests = lines.index("## Tests")
    wide = [f"line {n}: {len(line)} characters" for n, line in enumerate(lines, 1)
            if len(line) > 100 and not (n > tests and line.startswith("    pytest"))]
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move detail to docs/"
    assert not wide, "README.md lines over 100 characters:\n  " + "\n  ".join(wide)


def _code_map() -> str:
    text = _text(README)
    match = re.search(r"^## Code map\n(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE)
    assert match, "README.md has no '## Code map' section"
    return match.group(1)


@pytest.mark.parametrize("kind", ["packages", "modules"])
def test_the_code_map_names_every_package_and_module(kind: str) -> None:
    src = ROOT / "src"
    if kind == "packages":
        names = [f"{p.parent.name}/" for top in ("ddpexp", "hydra_plugins")
                 for p in (src / top).glob("*/__init__.py")]
    else:
        names = [p.name for p in (src / "ddpexp").glob("*.py")]
    code_map = _code_map()
    absent = sorted(n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}", code_map))
    assert not absent, f"the README's code map does not name these {kind}: {', '.join(absent)}"
