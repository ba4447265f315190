"""The documentation site (issue 47): the Findings page gives every code of the catalogue its
entry under the anchor `#<code>`, the API reference covers `torchscope.__all__`, every page
is in the navigation, and `mkdocs build --strict` passes (where the `docs` extra is
installed: `make docs` installs it, and `.ci/run` builds the site after the tests)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import torchscope
import torchscope.catalogue as catalogue
import torchscope.lint  # declares the lint rules in the catalogue

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_code_has_its_entry_under_its_own_anchor() -> None:
    hooks = _hooks()
    text = hooks.findings_markdown()
    entries = catalogue.entries()
    assert entries
    for e in entries:
        block = text.split(f"### {e.code} {{#{e.code}}}\n", 1)
        assert len(block) == 2, f"{e.code} has no entry"
        body = block[1].split("\n### ", 1)[0]
        assert " ".join(e.meaning.split()) in body
        assert " ".join(e.criterion.split()) in body
        assert "**Fix:**" in body
        if e.literature:
            assert " ".join(e.literature.split()) in body
        if e.example:
            assert " ".join(e.example.split()) in body
    assert text.count("\n### ") + text.startswith("### ") == len(entries)
    # The lint rules are in the catalogue too, as lint.TS0xx.
    assert "{#lint.TS001}" in text


def test_the_page_keeps_the_marker_the_hook_fills() -> None:
    hooks = _hooks()
    assert hooks.FINDINGS_MARK in (DOCS / "findings.md").read_text()
    assert hooks.API_MARK in (DOCS / "api.md").read_text()


def test_the_api_reference_covers_every_public_name() -> None:
    text = _hooks().api_markdown()
    for name in torchscope.__all__:
        assert f"::: {torchscope._API[name]}.{name}" in text


def test_every_page_is_in_the_navigation() -> None:
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(),
                         flags=re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav, (pages - nav, nav - pages)


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    html = (site / "findings.html").read_text()
    for e in catalogue.entries():
        assert f'id="{e.code}"' in html, e.code
