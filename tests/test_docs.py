"""The docs site builds in strict mode, and every code block of the README and the site is run or checked.

The site is MkDocs (``mkdocs.yml``, pages in ``docs/``): a strict build fails on a broken link, a bad anchor or a
page left out of the navigation, and a test proves it does by breaking a copy.  Each Python example names the
test that runs it (``<!-- tested by: ... -->`` before its fence), and that test must read it from the page; each
``resilient`` command line is parsed by the command's own parser; each file a command names exists; each fault
plan parses.  A block of a kind nobody checks fails here until a rule for it is added.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.cli import run_config
from resilient.cli.main import _subcommand, build_parser
from resilient.core.errors import ConfigError
from resilient.faults.plan import FaultPlan

from .docs_text import DOCS, REPO, Block, blocks_of, pages

BUILD_TIMEOUT_S = 120
REPO_PATH = re.compile(r"^(examples|deploy|agents|chaos|scripts|benchmarks|dashboards|docs)/")
"""Arguments that name a file of this repository: they must exist."""
INSTALLABLE = re.compile(r"^(torch==[\d.]+|resilient-train(\[[a-z0-9,]+\])?|-e|\.)$")
"""What the docs tell a user to ``pip install``."""


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=config_dir, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = build(REPO, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_site_builds_in_strict_mode_with_every_page(site: Path) -> None:
    for page in sorted(DOCS.glob("*.md")):
        html = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert html.is_file(), f"{page.name} was not built"
    assert "What recovers how" in (site / "index.html").read_text()


@pytest.mark.parametrize("damage", ["a link to a missing page", "an anchor nobody has", "a page left out of the nav"])
def test_a_broken_site_fails_the_strict_build(tmp_path: Path, damage: str) -> None:
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    if damage == "a link to a missing page":
        index.write_text(index.read_text() + "\n[gone](no-such-page.md)\n")
        named = "no-such-page.md"
    elif damage == "an anchor nobody has":
        index.write_text(index.read_text() + "\n[gone](install.md#no-such-heading)\n")
        named = "no-such-heading"
    else:
        (tmp_path / "docs" / "stray.md").write_text("# A page the navigation does not list\n")
        named = "stray.md"
    proc = build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0, f"{damage} did not fail the build:\n{proc.stderr[-2000:]}"
    assert "in strict mode" in proc.stdout and named in proc.stderr, proc.stdout[-500:] + proc.stderr[-2000:]


def test_the_readme_s_links_to_the_site_lead_to_pages_and_headings_that_exist(site: Path) -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+\.md)(?:#([^)]+))?\)", readme)
    assert len(links) >= 10, links
    for target, anchor in links:
        assert (REPO / target).is_file(), f"README links to {target}, which does not exist"
        if anchor:
            stem = Path(target).stem
            html = (site / ("index.html" if stem == "index" else f"{stem}/index.html")).read_text()
            assert f'id="{anchor}"' in html, f"README links to {target}#{anchor}, a heading that does not exist"


def _tests_reading(block: Block) -> list[str]:
    """Problems with a Python block's ``tested by`` names: each must be a test function that reads the page."""
    if not block.tested_by:
        return [(f"{block.where()}: a Python example that no test runs (put <!-- tested by: tests/FILE.py::TEST --> "
                 f"before its fence, and run it in that test)")]
    problems = []
    for name in block.tested_by:
        file, _, function = name.partition("::")
        path = REPO / file
        if not path.is_file():
            problems.append(f"{block.where()}: {file} does not exist")
            continue
        source = path.read_text()
        found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function]
        if not found:
            problems.append(f"{block.where()}: {file} has no test {function}")
        elif block.page not in (ast.get_source_segment(source, found[0]) or ""):
            problems.append(f"{block.where()}: {name} does not read {block.page}")
    return problems


def _command_problems(block: Block, parser) -> list[str]:
    problems = []
    for line in block.body.replace("\\\n", " ").splitlines():
        try:
            argv = shlex.split(line, comments=True)
        except ValueError as e:
            problems.append(f"{block.where()}: `{line}` is not a shell command: {e}")
            continue
        if not argv:
            continue
        where = f"{block.where()}: `{line.strip()}`"
        command = argv[0]
        if re.fullmatch(r"[A-Z_]+=\S*", command) and len(argv) == 1:
            continue  # a variable the next lines use
        if command == "resilient":
            try:
                parser.parse_args(argv[1:])
            except SystemExit:
                problems.append(f"{where}: the command does not parse")
        elif command == "pip":
            if argv[1:2] != ["install"] or not all(INSTALLABLE.match(a) for a in argv[2:]):
                problems.append(f"{where}: installs something the docs do not vouch for")
        elif command == "echo":
            if ">" in argv and argv[1].lstrip().startswith("{"):
                FaultPlan.loads(argv[1])
        elif command in ("bash", "torchrun", ".venv/bin/mkdocs"):
            pass  # their files are checked below; the site's build is the test above
        else:
            problems.append(f"{where}: no rule checks `{command}` (add one in tests/test_docs.py)")
            continue
        for arg in argv[1:]:
            if REPO_PATH.match(arg) and not (REPO / arg).exists():
                problems.append(f"{where}: {arg} does not exist")
    return problems


def load_run_config(block: Block, problems: list[str]) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(block.body)
        f.flush()
        try:
            flags = run_config.load(Path(f.name), _subcommand(build_parser(), "run"))
        except ConfigError as e:
            problems.append(f"{block.where()}: {e}")
            return
    tokens = [token for given in flags.values() for token in given]
    try:
        build_parser().parse_args(["run", *tokens, "train.py"])
    except SystemExit:
        problems.append(f"{block.where()}: its flags do not parse: {' '.join(tokens)}")


def test_every_code_block_of_the_readme_and_the_site_is_run_or_checked() -> None:
    parser = build_parser()
    problems: list[str] = []
    seen: dict[str, int] = {}
    for page in pages():
        for block in blocks_of(page):
            seen[block.lang] = seen.get(block.lang, 0) + 1
            if block.lang in ("python", "py"):
                problems += _tests_reading(block)
            elif block.lang == "bash":
                problems += _command_problems(block, parser)
            elif block.lang == "json":
                data = json.loads(block.body)
                if "faults" in data:
                    FaultPlan.loads(block.body)
            elif block.lang == "toml":  # the pages' TOML is resilient run --config files: every key a flag
                load_run_config(block, problems)
            elif block.lang in ("text", "mermaid"):
                pass  # output as printed, trees and diagrams (the state diagram is tests/test_machine.py's)
            else:
                problems.append(f"{block.where()}: a block in {block.lang or 'no language'}: name one "
                                f"(python, bash, json, toml, text, mermaid) so that it is checked")
    assert not problems, "\n".join(problems)
    assert seen.get("python", 0) + seen.get("py", 0) >= 5 and seen.get("bash", 0) >= 15, seen


def test_the_checks_catch_an_untested_example_and_a_command_that_does_not_parse(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nprint('hi')\n```\n\n```bash\nresilient run --no-such-flag train.py\n"
                    "bash scripts/no-such.sh\n```\n")
    python, bash = blocks_of(page)
    assert "no test runs" in _tests_reading(python)[0]
    problems = _command_problems(bash, build_parser())
    assert len(problems) == 2 and "does not parse" in problems[0] and "does not exist" in problems[1], problems
