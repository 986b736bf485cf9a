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


def test_autodoc_entries_are_read_with_their_module_and_class(check_docs):
    text = (
        ".. currentmodule:: cposembed\n\n"
        ".. autoclass:: LearnedPositionEmbedding\n\n"
        "   .. automethod:: __call__(positions, *, out=None)\n"
        "   .. autoproperty:: embeddings\n\n"
        ".. autofunction:: lookup\n\n"
        ".. currentmodule:: cposembed.torch\n\n"
        ".. autoclass:: TokenPositionEmbedding\n"
    )
    assert check_docs.autodoc_entries(text) == {
        "cposembed.LearnedPositionEmbedding",
        "cposembed.LearnedPositionEmbedding.__call__",
        "cposembed.LearnedPositionEmbedding.embeddings",
        "cposembed.lookup",
        "cposembed.torch.TokenPositionEmbedding",
    }


def test_a_name_missing_from_the_api_reference_is_reported(check_docs):
    text = (ROOT / "docs" / "api.rst").read_text(encoding="utf-8")
    names = {**check_docs.public_api(), **check_docs.torch_api()}
    assert check_docs.missing_from_reference(text, names) == []
    # Drop an entry, or add a public name that has none: the check names it.
    without = text.replace(".. autofunction:: scatter_add\n", "")
    assert check_docs.missing_from_reference(without, names) == ["cposembed.scatter_add"]
    new = {**names, "cposembed.torch.not_documented": object()}
    assert check_docs.missing_from_reference(text, new) == ["cposembed.torch.not_documented"]
    # The NumPy class's entry does not count for the torch class of the same name.
    torch_class = {"cposembed.torch.TokenPositionEmbedding": object()}
    rst = ".. currentmodule:: cposembed\n\n.. autoclass:: TokenPositionEmbedding\n"
    assert check_docs.missing_from_reference(rst, torch_class) == list(torch_class)


def test_the_api_reference_covers_cposembed_torch_when_torch_is_there(check_docs):
    pytest.importorskip("torch")
    import cposembed.torch as ct

    names = check_docs.torch_api()
    assert set(names) == {f"cposembed.torch.{n}" for n in ct.__all__}
    documented = check_docs.autodoc_entries((ROOT / "docs" / "api.rst").read_text("utf-8"))
    assert set(names) <= documented


def test_code_lines_of_the_docs_fit_the_column(check_docs, tmp_path):
    check_docs.check_code_line_length()
    page = tmp_path / "page.md"
    page.write_text("```text\n" + "x" * 89 + "\nshort\n```\n", encoding="utf-8")
    assert check_docs.long_code_lines([page]) == ["page.md:2: 89 characters"]
    page.write_text("```text\n" + "x" * 88 + "\n```\n", encoding="utf-8")
    assert check_docs.long_code_lines([page]) == []


def test_readme_performance_table_is_made_from_the_bench_runs(check_docs):
    check_docs.check_performance_table()


def test_performance_table_takes_the_median_ours_over_this_of_the_runs():
    spec = importlib.util.spec_from_file_location("perf_table", ROOT / "tools" / "perf_table.py")
    assert spec is not None and spec.loader is not None
    perf_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf_table)
    machine = {
        "cpu": "CPU", "cpus_available": 2, "threads": 2, "table": [2048, 768],
        "batch": [32, 1024], "dtype": "float32", "torch": None, "load_average_1min": 0.5,
    }  # fmt: skip

    def run(ratio, torch=None):
        rows = [{"op": "pe(pos)", "contender": "numpy P[pos]", "ratio_ours_to_this": ratio,
                 "target": 0.65}]  # fmt: skip
        if torch is not None:
            rows.append({"op": "torch layer fwd+bwd", "ratio_ours_to_this": torch,
                         "contender": "torch 2 x nn.Embedding fwd+bwd", "target": 0.2})  # fmt: skip
        return {"machine": {**machine, "torch": "2.13" if torch else None}, "results": rows}

    table = perf_table.render([run(0.3, torch=0.1), run(0.9), run(0.5)])
    assert "| `pe(positions)` | NumPy `P[positions]` | 0.500 | 2.00 x faster | <= 0.65: met |" in (
        table
    )
    assert "| two `nn.Embedding` | 0.100 | 10.0 x faster | <= 0.2: met |" in table  # one run
    words = " ".join(table.split())
    assert "median of 3 runs" in words and "(PyTorch rows: one run)" in words
    assert "below 1, cposembed is faster" in words
    no_torch = perf_table.render([run(0.3)])
    assert "nn.Embedding" not in no_torch  # a row without data is left out
    # A miss is marked in the ratio and the target; a ratio above 1 reads as slower.
    missed = perf_table.render([run(1.06)])
    assert "| **1.060** | 1.06 x slower | <= 0.65: **missed** |" in missed


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


def test_readme_links_the_handbook_and_installs_before_the_rest():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](https://mbrenndoerfer.com/writing/learned-position-embeddings)" in text
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads[:2] == ["## Installation", "## Quick start"], heads


def test_the_quick_starts_test_extra_leaves_the_torch_clients_out():
    """The Quick start installs ``test``: no transformers or ONNX, which only matter
    with torch; those are the ``torch-test`` extra, which CI's torch stage installs."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    clients = ("transformers", "onnx", "onnxscript", "onnxruntime")
    assert not [r for r in extras["test"] if r.split("=")[0].rstrip("<>!~") in clients]
    assert sorted(r.split("==")[0] for r in extras["torch-test"]) == sorted(clients)
    run = (ROOT / ".ci" / "run").read_text() if (ROOT / ".ci" / "run").exists() else ""
    assert not run or '".[test,torch,torch-test]"' in run


def test_the_readme_counts_the_examples_there_are():
    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    n = len(list((ROOT / "examples").glob("*.py")))
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"has {words.get(n, n)} longer programs" in text
