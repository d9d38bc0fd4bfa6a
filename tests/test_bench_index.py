"""bench/README.md, the index of bench/: it lists every script under bench/ (not results/), each row's command
parses and names its script, each row's page cites that script; every bench script path that the README, the
docs or the index names exists; and every python script with a command line still starts (``--help``), now
that the scripts sit in one sub-folder per question."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_doc_commands import check_command

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
INDEX = BENCH / "README.md"
SCRIPT_PATH = re.compile(r"\bbench/(?!results/)[\w./-]*?\w\.(?:py|sh)\b")


def scripts(bench: Path = BENCH) -> list[Path]:
    """Every script file under ``bench`` (``*.py``, ``*.sh``), bench/results/ left out."""
    return sorted(p for p in bench.rglob("*") if p.suffix in (".py", ".sh") and p.is_file()
                  and "results" not in p.relative_to(bench).parts and "__pycache__" not in p.parts)


def index_rows(text: str) -> list[dict]:
    """The index's table rows: the script (its link target, relative to bench/), the command (inline code of the
    third cell) and the pages of the fourth cell (link targets, relative to bench/)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| [") else []
        if len(cells) != 4:
            continue
        script = re.fullmatch(r"\[[^\]]+\]\(([^)]+)\)", cells[0])
        command = re.fullmatch(r"`([^`]+)`", cells[2])
        rows.append({"line": line, "script": script and script.group(1), "command": command and command.group(1),
                     "pages": re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", cells[3])})
    return rows


def unlisted(bench: Path) -> list[str]:
    """The scripts under ``bench`` that ``bench/README.md`` does not link (as ``sub/name.py`` or ``name.py``)."""
    linked = set(re.findall(r"\]\(([^)#\s]+)", (bench / "README.md").read_text(encoding="utf-8")))
    return [p.relative_to(bench).as_posix() for p in scripts(bench) if p.relative_to(bench).as_posix() not in linked]


def missing_paths(pages: list[Path], root: Path = ROOT) -> list[str]:
    """``page: path`` for every bench script path a page names (``bench/...py`` or ``.sh``, not under
    bench/results/) that is no file under ``root``."""
    out = []
    for page in pages:
        for path in sorted(set(SCRIPT_PATH.findall(page.read_text(encoding="utf-8")))):
            if not (root / path).is_file():
                out.append(f"{page.name}: {path}")
    return out


def test_the_index_lists_every_script():
    assert len(scripts()) >= 30 and (BENCH / "runner.py") in scripts()
    assert unlisted(BENCH) == []
    rows = index_rows(INDEX.read_text(encoding="utf-8"))
    listed = [r["script"] for r in rows]
    assert len(listed) == len(set(listed)), "a script listed twice"
    # every script but the shared run loop (a module, linked in the introduction) has its row
    assert sorted(listed) == sorted(p.relative_to(BENCH).as_posix() for p in scripts() if p.name != "runner.py")


def test_the_index_check_catches_an_unlisted_script(tmp_path):
    (tmp_path / "value").mkdir()
    (tmp_path / "results" / "run").mkdir(parents=True)
    for name in ("value/a.py", "value/b.sh", "runner.py", "results/run/c.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "README.md").write_text("[runner.py](runner.py)\n| [a.py](value/a.py) | q | `python a.py` | p |\n")
    assert unlisted(tmp_path) == ["value/b.sh"]
    (tmp_path / "README.md").write_text("[runner.py](runner.py) [a.py](value/a.py) [b](value/b.sh)\n")
    assert unlisted(tmp_path) == []


def test_every_row_names_its_script_a_command_and_a_page_that_cites_it():
    rows = index_rows(INDEX.read_text(encoding="utf-8"))
    assert rows
    for row in rows:
        assert row["script"] and row["command"] and row["pages"], row["line"]
        path = f"bench/{row['script']}"
        assert path in shlex.split(row["command"]), f"{row['command']!r} does not run {path}"
        for page in row["pages"]:
            target = (BENCH / page).resolve()
            assert target.is_file() and target.parent == ROOT / "docs", f"{row['script']}: {page}"
            assert path in target.read_text(encoding="utf-8"), f"{page} does not cite {path}"


def test_every_command_of_the_index_parses(monkeypatch):
    """Python commands through the doc-command checker (the script's own argparse parser, in-process); shell
    drivers through ``bash -n`` (they parse) and their existence."""
    monkeypatch.chdir(ROOT)
    faults = []
    for row in index_rows(INDEX.read_text(encoding="utf-8")):
        argv = shlex.split(row["command"])
        while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):
            argv.pop(0)
        if argv[0] == "bash":
            proc = subprocess.run(["bash", "-n", argv[1]], capture_output=True, text=True)
            why = (proc.stderr.strip() or f"exit {proc.returncode}") if proc.returncode else None
        else:
            why = check_command(argv)
        if why:
            faults.append(f"{row['command']}: {why}")
    assert faults == []


def test_the_doc_command_checker_sees_a_moved_script():
    """The old flat paths are gone; the checker says so rather than passing them."""
    assert check_command(["python", "bench/qlora_budget.py", "--help"]) == "no such script bench/qlora_budget.py"
    assert check_command(["python", "bench/value/qlora_budget.py", "plan", "--help"]) is None


def test_every_bench_path_the_pages_name_exists(tmp_path):
    pages = [INDEX, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(set(SCRIPT_PATH.findall("\n".join(p.read_text(encoding="utf-8") for p in pages)))) >= 30
    assert missing_paths(pages) == []
    # the check itself: an old flat path is reported, the moved one and a results path are not
    (tmp_path / "bench" / "cost").mkdir(parents=True)
    (tmp_path / "bench" / "cost" / "step_cost.py").write_text("")
    page = tmp_path / "p.md"
    page.write_text("run `python bench/step_cost.py run` or bench/cost/step_cost.py; bench/results/x/y.py\n")
    assert missing_paths([page], root=tmp_path) == ["p.md: bench/step_cost.py"]


def test_the_docs_index_links_the_bench_index():
    assert "(../bench/README.md)" in (ROOT / "docs" / "README.md").read_text(encoding="utf-8")


def _has_cli(path: Path) -> bool:
    text = path.read_text(encoding="utf-8")
    return "argparse" in text and '__name__ == "__main__"' in text


PY_SCRIPTS = [p for p in scripts() if p.suffix == ".py" and _has_cli(p)]


def test_the_python_scripts_with_a_command_line_are_found():
    assert len(PY_SCRIPTS) >= 24
    assert {p.parent.name for p in PY_SCRIPTS} == {"value", "cost", "stress", "gpu", "serve"}


_STARTER = r"""
import contextlib, io, json, os, runpy, sys
root, out = sys.argv[1], {}
base_path = list(sys.path)
for rel in sys.argv[2:]:
    path = os.path.join(root, rel)
    # as `python bench/SUB/NAME.py --help` would: the script's folder first on sys.path, argv[0] the script
    sys.path[:] = [os.path.dirname(path)] + base_path
    sys.argv = [path, "--help"]
    buf, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # an import that fails from the new folder
        code = f"{type(e).__name__}: {e}"
    out[rel] = [code, buf.getvalue()[:300]]
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def started():
    """Every python script's ``--help``, run as ``__main__`` from its own folder in one fresh interpreter (one
    start-up of torch for all of them rather than one per script)."""
    rels = [p.relative_to(ROOT).as_posix() for p in PY_SCRIPTS]
    proc = subprocess.run([sys.executable, "-c", _STARTER, str(ROOT), *rels], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.mark.parametrize("path", PY_SCRIPTS, ids=lambda p: p.relative_to(BENCH).as_posix())
def test_each_python_script_starts_from_its_new_folder(path, started):
    """``bench/SUB/NAME.py --help`` run as the main module with its folder first on ``sys.path``: its imports (the
    shared runner, a sibling script, recipes/) resolve from the new folder and argparse prints its usage."""
    code, stdout = started[path.relative_to(ROOT).as_posix()]
    assert code in (0, None), code
    assert stdout.startswith("usage: " + path.name), stdout
