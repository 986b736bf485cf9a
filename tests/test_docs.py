"""The documentation keeps up with the code: Quick start, README size, API lists, license.

The checks live in tools/check_docs.py, which CI's docs stage also runs together
with every code block and example. These tests need a source checkout and skip
where the suite runs from a copy of tests/ alone (the sdist and wheel stages).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "check_docs.py"

pytestmark = pytest.mark.skipif(
    not (TOOL.exists() and (ROOT / "README.md").exists() and (ROOT / "docs").is_dir()),
    reason="needs a source checkout (README.md, docs/, tools/check_docs.py)",
)


@pytest.fixture(scope="module")
def check_docs():
    spec = importlib.util.spec_from_file_location("check_docs", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("check_docs", None)


def test_readme_quickstart_is_what_ci_runs(check_docs):
    if not (ROOT / ".ci" / "run").exists():
        pytest.skip("no .ci/run here")
    check_docs.check_quickstart()
    assert check_docs.readme_quickstart() == [
        'python -m pip install -e ".[test,plot]"',
        "python -m pytest",
    ]


def test_readme_stays_short(check_docs):
    check_docs.check_readme_length()


def test_readme_api_at_a_glance_names_every_public_name(check_docs):
    check_docs.check_api_at_a_glance()


def test_api_reference_documents_every_public_name(check_docs):
    check_docs.check_api_reference()


def test_undocumented_names_are_reported(check_docs):
    missing = check_docs.undocumented("LearnedPositionEmbedding lookup pe(0)")
    assert "cposembed.scatter_add" in missing
    assert "cposembed.lookup" not in missing
    assert "cposembed.LearnedPositionEmbedding.__call__" not in missing


def test_code_block_parsing(check_docs, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n- item\n\n  ```pycon\n  >>> 1 + 1\n  2\n  ```\n"
        "\n````text\n```python\nnot a block\n```\n````\n",
        encoding="utf-8",
    )
    blocks = check_docs.blocks_of(page)
    assert [(b.language, b.line, b.code) for b in blocks] == [
        ("python", 4, "x = 1\n"),
        ("pycon", 10, ">>> 1 + 1\n2\n"),
        ("text", 15, "```python\nnot a block\n```\n"),
    ]
    for block in blocks[:2]:
        check_docs.run_block(block)


def test_license_file_is_mit_and_declared():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License")
    assert "Copyright (c) 2026 The cposembed developers" in text
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
