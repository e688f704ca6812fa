"""The docs a newcomer reads are current and short: the README under 200 lines with its Python example running as
printed, the settings reference generated from the config (``make docs`` rewrites it; the suite only checks),
module docstrings short, and no code pointing at a SPEC file the project does not have."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ROOT / "docs" / "settings.md"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_settings_reference_is_generated_from_the_config():
    from sao.cli import settings_reference

    text = settings_reference()
    if os.environ.get("SAO_WRITE_DOCS") == "1":
        SETTINGS.write_text(text)
    assert SETTINGS.read_text() == text, "docs/settings.md is not the config's: run `make docs` and commit it"


def test_no_module_points_at_a_spec_file():
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py") if re.search(r"SPEC §", p.read_text())]
    assert found == []


def test_module_docstrings_are_short():
    long = []
    for path in (ROOT / "src" / "sao").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if len(doc.splitlines()) > 20:
            long.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert long == [], "module docstrings over 20 lines (the essay belongs in docs/design/):\n" + "\n".join(long)


def _readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if marker in b)


def test_the_readme_python_example_trains_on_user_rows_with_a_user_reward(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(_readme_block("sao.train("), "README.md", "exec"), namespace)
    run = namespace["run"]
    assert len(run.records) == 10 + 4 and (tmp_path / "runs" / "mine" / "adapter").is_dir()
    import json

    record = json.loads((tmp_path / "runs" / "mine" / "config.json").read_text())
    assert record["replayable"] is False and any("reward_fn" in r for r in record["not_replayable"])
    assert record["passed"]["dataset"].startswith("64 rows passed in")


def test_the_readme_algorithm_example_runs():
    exec(compile(_readme_block("SAO("), "README.md", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_link_to_files_that_exist(doc):
    text = (ROOT / "docs" / doc).read_text()
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / "docs" / target).exists(), f"docs/{doc} links to {target}, which does not exist"


@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md", "docs/agents.md", "docs/traces-and-serving.md",
                                 "docs/experiments.md", "docs/scale-out.md"])  # fmt: skip
def test_every_sao_command_in_the_docs_parses_as_printed(doc):
    """Each ``sao ...`` line of a bash block is a command the CLI accepts: its command and every flag exist and
    take the values shown (running them is the recipe's and the tests' business)."""
    import shlex

    from sao.cli import build_parser

    text = (ROOT / doc).read_text()
    blocks = [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", text, re.S)]  # continuations
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    lines = [line for line in lines if line.startswith("sao ") and "<" not in line and "..." not in line]
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as refused:
            raise AssertionError(f"{doc}: `{line}` is refused by the CLI") from refused
