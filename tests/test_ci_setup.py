"""The install and test entry points agree: `.ci/run` is `make test`, which is `.ci/test.sh`, which installs
with constraints.txt and runs the README's test command."""

from __future__ import annotations

import os
import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_ci_run_is_make_test_is_the_test_script():
    run = (ROOT / ".ci" / "run").read_text()
    assert [ln for ln in run.splitlines() if ln and not ln.startswith(("#", "set ", "cd "))] == ["make test"]
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:\n\t(.+)$", makefile, re.M)
    assert recipe and recipe.group(1).startswith("bash .ci/test.sh")
    script = (ROOT / ".ci" / "test.sh").read_text()
    assert "-c constraints.txt" in script and "torch==2.13.0" in script
    # the CPU torch goes in before anything that could pull a CUDA build
    assert script.index("torch==2.13.0") < script.index("-e '.[dev]'")


def test_readme_gives_the_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [ln.split("#")[0].strip() for ln in first_block.splitlines()]
    assert "make test" in commands and "make demo" in commands
    script = (ROOT / ".ci" / "test.sh").read_text()
    pytest_line = [ln for ln in script.splitlines() if ln.startswith("python -m pytest")]
    # two workers, the slowest 15 printed, extra arguments passed through: the README's command, verbatim
    assert pytest_line == ['python -m pytest -q -n 2 --dist loadfile --durations=15 "$@"']
    assert "python -m pytest -q -n 2 --dist loadfile --durations=15" in readme


def test_constraints_pin_what_the_dev_extra_needs():
    pins = _pins()
    for name in ("transformers", "peft", "bitsandbytes", "accelerate", "datasets", "lm-eval", "torchao", "trl",
                 "pytest", "pytest-xdist", "ruff", "hypothesis"):
        assert name in pins, name
    assert "torch" not in pins  # installed on its own first (the CPU build on disk)


@pytest.mark.skipif(os.environ.get("GNMR_LATEST") == "1", reason="GNMR_LATEST=1 installs the newest releases")
def test_installed_versions_are_the_pinned_ones():
    pins = _pins()
    differ = {}
    for name in ("transformers", "peft", "bitsandbytes", "accelerate", "datasets", "lm-eval", "torchao"):
        got = metadata.version(name)
        if got != pins[name]:
            differ[name] = (got, pins[name])
    assert not differ, f"installed vs constraints.txt: {differ} (install with {shlex.quote('make test')})"


@pytest.mark.parametrize("venv", [None, "/some/env"])
def test_make_demo_uses_the_environment_make_test_installs_into(venv, tmp_path):
    # `make test` then `make demo` on a fresh clone: both in ./.venv unless a virtual environment is active
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON", "MAKEFLAGS")}
    if venv:
        env["VIRTUAL_ENV"] = venv
    dry = subprocess.run(["make", "-n", "-B", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    demo_line = [ln for ln in dry.stdout.splitlines() if "gnmr_hf.cli demo" in ln]
    assert demo_line and demo_line[0].split()[0] == ("python" if venv else ".venv/bin/python")
    install = [ln for ln in dry.stdout.splitlines() if "-e '.[all]'" in ln]
    assert install and install[0].split()[0] == demo_line[0].split()[0]
    assert any("python3 -m venv .venv" in ln for ln in dry.stdout.splitlines())
