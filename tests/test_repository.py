"""The repository's own text: no merge left its conflict markers behind (a README once kept
both sides of a merge, markers and all, and every test still passed)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".venv", "build", ".git", ".pytest_cache", ".ruff_cache", ".hypothesis"}
MARKER = re.compile(r"^(<{7}|={7}|>{7})( |$)", re.MULTILINE)


def _text_files():
    for path in ROOT.rglob("*"):
        if SKIP.intersection(path.relative_to(ROOT).parts) or not path.is_file():
            continue
        if path.suffix in {".py", ".md", ".toml", ".txt", ".cfg", ".cpp", ".h", ".json"} or (
            path.name in {"Makefile", "CMakeLists.txt"}
        ):
            yield path


def test_no_file_keeps_merge_conflict_markers():
    found = [
        str(p.relative_to(ROOT))
        for p in _text_files()
        if MARKER.search(p.read_text("utf-8", "replace"))
    ]
    assert not found, f"merge conflict markers in: {found}"
