"""The user's docs: README.md and docs/ stay true to the code.

docs/plan.md is what tools/gen_plan_reference.py writes from fxstar/plan.py; the README's quick
start runs as written; every relative link and anchor resolves; measured figures live in
docs/results.md only; the docs say what is, not what was.
"""

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch

from fxstar import plan as plan_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _generator():
    path = ROOT / "tools" / "gen_plan_reference.py"
    spec = importlib.util.spec_from_file_location("gen_plan_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_reference_is_current():
    current = (DOCS / "plan.md").read_text(encoding="utf-8")
    assert current == _generator().render(), (
        "docs/plan.md is stale: run .venv/bin/python tools/gen_plan_reference.py"
    )


def test_plan_reference_documents_every_option():
    text = (DOCS / "plan.md").read_text(encoding="utf-8")
    for name in plan_module._all_option_names():
        assert f"### `{name}`" in text, name


def test_plan_reference_lists_exactly_the_refused_options():
    from fxstar.engine import implemented_options

    implemented = implemented_options()
    refused = [
        name for name in plan_module._all_option_names()
        if name not in implemented and name.split(".")[0] not in implemented
    ]  # fmt: skip
    text = " ".join((DOCS / "plan.md").read_text(encoding="utf-8").split())
    listed = re.search(r"`OptionNotImplementedError` when set: ([^.]*)\.", text)
    assert listed is not None, "docs/plan.md: the sentence listing the refused options moved"
    assert re.findall(r"`([\w.]+)`", listed[1]) == refused
    assert (listed[1] == "none") == (not refused)


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Quick start", 1)
    assert len(section) == 2, "README.md: no '## Quick start' section"
    block = re.search(r"```python\n(.*?)```", section[1], re.DOTALL)
    assert block is not None, "README.md: the quick start has no python block"
    return block[1]


def test_readme_quick_start_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_quick_start(), "README.md:quick start", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]).item()
    assert (tmp_path / "ckpt" / "manifest.json").is_file()
    printed = out.getvalue()
    assert "compute tier" in printed  # engine.report()
    assert "ops.fetch(chunk_runtime" in printed  # the diff chunk_schedule made


def test_makefile_commands_are_the_documented_ones():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), target
        assert f"make {target}" in readme, target


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.*)$", text, re.MULTILINE)}


def test_links_resolve():
    broken = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


# a measured figure of this machine: a duration, a rate, a ratio such as 0.93x, a range of
# percentages; only docs/results.md holds them
FIGURE = re.compile(
    r"\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?(ms|MB/s|GB/s|minutes|seconds)\b"
    r"|\b\d+\.\d+x\b|\b\d+(\.\d+)?-\d+(\.\d+)?x\b|\b\d+(\.\d+)?-\d+(\.\d+)?%"
    r"|tokens/s [+-]?\d"
)


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "results.md"], ids=str)
def test_measured_figures_only_in_results(page):
    found = [m[0] for m in FIGURE.finditer(page.read_text(encoding="utf-8"))]
    assert not found, f"{page.name}: measured figures belong in docs/results.md: {found}"


HISTORY = re.compile(
    r"\b(used to|until this|no longer|previously|this session|earlier run|used before|"
    r"not yet|(is|are|was) now|down from|up from|before this change|any ?more|round (one|"
    r"two|three|four|\d)|always did|in the past|formerly|these days)\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_docs_say_what_is_not_what_was(page):
    text = " ".join(page.read_text(encoding="utf-8").split())
    found = [m[0] for m in HISTORY.finditer(text)]
    assert not found, f"{page.name}: history in the docs: {found}"


def test_every_doc_page_is_reachable_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS.glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md links no docs/ page called {missing}"
