"""Every command in the code blocks of README.md and docs/results.md parses: the flags it shows are
accepted by the command's own parser, read in-process.

- ``gnmr-hf SUB ...``: the sub-command's parser (captured from ``gnmr_hf.cli.main``), every ``--flag``
  among its options, and the whole line parsed by it;
- ``python recipes/finetune.py ...`` and ``accelerate launch [...] recipes/finetune.py ...``: the recipe's own
  ``gnmr_hf.recipe.load_config`` (the config file exists, every key and dotted override such as
  ``--profile.budget`` or ``--gnmr.max_active`` is known, every value has its type); accelerate's flags by
  its ``launch`` parser;
- ``python PATH.py ...`` (the bench scripts): the script's argparse parser, captured by running it as
  ``__main__`` with parsing stopped before it does anything;
- ``python -m gnmr_hf...``: the module exists; ``make TARGET``: the Makefile has the target.

Python blocks must compile, and every ``gnmr_hf.NAME`` they use must exist. The checker is shown to catch a
bad flag, a bad dotted override, a missing config file and an unknown command first.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "results.md"]
SHELL = {"", "bash", "sh", "shell", "console", "zsh"}


# ------------------------------------------------------------------------------------ reading the pages


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced block."""
    out, lang, start, body = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*(```|~~~)\s*([\w+-]*)", line)
        if m and lang is None:
            lang, start, body = m.group(2).lower(), i + 1, []
        elif m:
            out.append((lang, start, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def shell_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv) of every command in the page's shell blocks: continuation lines joined, comments dropped,
    ``&&`` / ``;`` / ``|`` chains split, ``VAR=value`` prefixes and a ``$`` prompt removed."""
    out = []
    for lang, start, body in code_blocks(text):
        if lang not in SHELL:
            continue
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            line, first = lines[i], start + i
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            tokens = shlex.split(line.strip().removeprefix("$ "), comments=True)
            cmd: list[str] = []
            for tok in [*tokens, ";"]:
                if tok in ("&&", ";", "|", "||"):
                    while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
                        cmd.pop(0)
                    if cmd:
                        out.append((first, cmd))
                    cmd = []
                elif tok.startswith((">", "2>")):
                    break
                else:
                    cmd.append(tok)
            else:
                continue
            while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
                cmd.pop(0)
            if cmd:
                out.append((first, cmd))
    return out


def python_blocks(text: str) -> list[tuple[int, str]]:
    return [(start, body) for lang, start, body in code_blocks(text) if lang in ("python", "py")]


# ------------------------------------------------------------------------------------ the parsers


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, args):
        super().__init__(parser.prog)
        self.parser, self.args = parser, args


@contextlib.contextmanager
def _stop_at_parse():
    """Every ``ArgumentParser`` raises :class:`_Parsed` (itself and its arguments) instead of parsing."""
    real = argparse.ArgumentParser.parse_known_args

    def grab(self, args=None, namespace=None):
        raise _Parsed(self, list(sys.argv[1:] if args is None else args))

    argparse.ArgumentParser.parse_known_args = grab
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = real


def _parser_of(call) -> tuple[argparse.ArgumentParser, list[str]]:
    with _stop_at_parse():
        try:
            call()
        except _Parsed as p:
            return p.parser, p.args
    raise AssertionError("the command returned without parsing its arguments")


def _flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The option strings of ``parser`` and of the sub-command parsers ``argv`` selects."""
    flags = set(parser._option_string_actions)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    positionals = [t for t in argv if not t.startswith("-")]
    for sub in subs:
        chosen = next((t for t in positionals if t in sub.choices), None)
        if chosen is not None:
            flags |= _flags(sub.choices[chosen], argv[argv.index(chosen) + 1:])
    return flags


def _parse(parser: argparse.ArgumentParser, argv: list[str], own: list[str] | None = None) -> str | None:
    """None if ``parser`` accepts ``argv`` (values of the right type and choice, the required ones given;
    ``--help`` counts as accepted) and knows every flag shown, exactly as written (argparse would take
    ``--method`` for ``--methods``), else why not. ``own``: the part of ``argv`` whose flags are the parser's
    (default all of it)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    shown = [t.split("=", 1)[0] for t in (argv if own is None else own) if t.startswith("--")]
    unknown = [f for f in shown if f not in _flags(parser, argv)]
    return f"unknown flag(s) {', '.join(unknown)}" if unknown else None


def _recipe(argv: list[str]) -> str | None:
    from gnmr_hf.recipe import RecipeError, load_config

    if "--help" in argv or "-h" in argv:
        return None
    try:
        load_config(argv)
    except RecipeError as e:
        return str(e)
    return None


def _script(path: Path, argv: list[str]) -> str | None:
    if not path.is_file():
        return f"no such script {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
    if path.resolve() == (ROOT / "recipes" / "finetune.py").resolve():
        return _recipe(argv)
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(path), *argv], [str(path.parent)]
    try:
        parser, args = _parser_of(lambda: runpy.run_path(str(path), run_name="__main__"))
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return _parse(parser, args)


def _accelerate(argv: list[str]) -> str | None:
    if not argv or argv[0] != "launch":
        return f"accelerate {' '.join(argv[:1])}: only 'accelerate launch' is checked"
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    script = next((i for i, t in enumerate(argv) if t.endswith(".py")), len(argv))
    why = _parse(parser, argv[1:], own=argv[1:script])  # the flags after the script are the script's
    if why:
        return why
    args = parser.parse_args(argv[1:])
    if args.config_file and not (ROOT / args.config_file).is_file():
        return f"no such accelerate config {args.config_file}"
    return _script(ROOT / args.training_script, list(args.training_script_args))


def _gnmr_hf(argv: list[str]) -> str | None:
    from unittest import mock

    from gnmr_hf import cli, preflight

    if not argv or argv[0] in ("-h", "--help"):
        return None
    if argv[0] not in cli._COMMANDS:
        return f"gnmr-hf has no command {argv[0]!r}"
    # the parse only: gnmr_hf.preflight would refuse the pages' example folders (~/models/my-llama), absent here,
    # before the command's parser runs
    with mock.patch.object(preflight, "check_command", lambda command, argv: None):
        parser, args = _parser_of(lambda: cli.main(argv))
    return _parse(parser, args)


def _make(argv: list[str]) -> str | None:
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    missing = [t for t in argv if "=" not in t and not t.startswith("-") and t not in targets]
    return f"no make target {', '.join(missing)}" if missing else None


def check_command(argv: list[str]) -> str | None:
    """None if the command parses, else why not; commands this test does not know (pip, git, ...) pass."""
    while argv[0] in ("nice", "nohup", "time") and len(argv) > 1:  # a prefix that runs the rest as it is
        argv = argv[1:]
    prog, rest = argv[0], argv[1:]
    if prog == "gnmr-hf":
        return _gnmr_hf(rest)
    if prog == "make":
        return _make(rest)
    if prog == "accelerate":
        return _accelerate(rest)
    if prog in ("python", "python3") and rest:
        if rest[0] == "-m":
            mod = rest[1]
            if mod == "gnmr_hf.cli":
                return _gnmr_hf(rest[2:])
            if mod.startswith("gnmr_hf") and importlib.util.find_spec(mod) is None:
                return f"no module {mod}"
            return None
        if rest[0].endswith(".py"):
            return _script(ROOT / rest[0], rest[1:])
    return None


def page_faults(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    faults = [f"{page.name}:{line}: {shlex.join(argv)}: {why}" for line, argv in shell_commands(text)
              if (why := check_command(argv))]
    import gnmr_hf

    for start, body in python_blocks(text):
        try:
            compile(body, f"{page.name}:{start}", "exec")
        except SyntaxError as e:
            faults.append(f"{page.name}:{start}: python block does not compile: {e.msg} (line {e.lineno})")
        for name in sorted(set(re.findall(r"\bgnmr_hf((?:\.\w+)+)", body))):
            obj, path = gnmr_hf, "gnmr_hf"
            for part in name.strip(".").split("."):
                path += "." + part
                if hasattr(obj, part):
                    obj = getattr(obj, part)
                elif importlib.util.find_spec(path) is not None:
                    obj = importlib.import_module(path)
                else:
                    faults.append(f"{page.name}:{start}: {path} does not exist")
                    break
    return faults


# ------------------------------------------------------------------------------------ the checker


def test_commands_are_read_as_a_shell_would():
    text = ("```bash\nmake test    # installs as CI does\nGNMR_LATEST=1 make test\n"
            "accelerate launch --config_file recipes/accelerate/cpu.yaml recipes/finetune.py \\\n"
            "    --config recipes/gemma3-270m/nf4.yaml --max_steps 3\n"
            "cd out && gnmr-hf eval --model m | tee log\n```\n"
            "```python\nimport gnmr_hf  # not a command\n```\n")
    assert shell_commands(text) == [
        (2, ["make", "test"]), (3, ["make", "test"]),
        (4, ["accelerate", "launch", "--config_file", "recipes/accelerate/cpu.yaml", "recipes/finetune.py",
             "--config", "recipes/gemma3-270m/nf4.yaml", "--max_steps", "3"]),
        (6, ["cd", "out"]), (6, ["gnmr-hf", "eval", "--model", "m"]), (6, ["tee", "log"])]


@pytest.mark.parametrize("command, why", [
    ("gnmr-hf profile --model gemma3-270m --output prof --budgt 10%", "unrecognized arguments: --budgt"),
    ("gnmr-hf profile --model gemma3-270m --output prof --low nf8", "invalid choice: 'nf8'"),
    ("gnmr-hf export --model m --plan p", "the following arguments are required: --output"),
    ("gnmr-hf serve --model m", "gnmr-hf has no command 'serve'"),
    ("python recipes/finetune.py --config recipes/gemma3-270m/planned-ladder-nf4.yaml --profile.budgett +5%nf4",
     "unknown key(s) in the profile block: 'profile.budgett' (did you mean 'profile.budget'?)"),
    ("python recipes/finetune.py --config recipes/gemma3-270m/nf4.yaml --max_step 3", "'max_step'"),
    ("python recipes/finetune.py --config recipes/gemma9/nf4.yaml", "recipes/gemma9/nf4.yaml"),
    ("accelerate launch --config_file recipes/accelerate/cpu.yaml recipes/finetune.py --config "
     "recipes/smollm2-135m/gnmr.yaml --gnmr.max_activ 4", "'gnmr.max_activ' (did you mean 'gnmr.max_active'?)"),
    ("accelerate launch --config_file recipes/accelerate/tpu.yaml recipes/finetune.py", "no such accelerate config"),
    ("python bench/value/qlora_budget.py plan --out x --method bf16", "unknown flag(s) --method"),
    ("python bench/value/qlora_budget.py plot --out x", "invalid choice: 'plot'"),
    ("python bench/no_such_bench.py --out x", "no such script bench/no_such_bench.py"),
    ("make tests", "no make target tests"),
    ("nohup python bench/cost/overhead.py --round 2", "unknown flag(s) --round"),
    ("python -m gnmr_hf.offline.no_such_module x", "no module gnmr_hf.offline.no_such_module"),
])
def test_the_checker_catches_a_bad_command(command, why):
    fault = check_command(shlex.split(command))
    assert fault is not None and why in fault, fault


@pytest.mark.parametrize("command", [
    "gnmr-hf profile --model gemma3-270m --budget +10%nf4 --output prof",
    "gnmr-hf demo --help",
    "python recipes/finetune.py --config recipes/gemma3-270m/planned-ladder-nf4.yaml --profile.budget +5%nf4",
    "python bench/value/qlora_budget.py plan --out x --methods bf16,nf4 --seeds 0,1,2 --oracle-every 0",
    "make test", "make demo DEMO_ARGS='--low nf4'",
    "nice python bench/cost/overhead.py --rounds 2 --steps 3 --components",
])
def test_the_checker_accepts_a_good_command(command):
    assert check_command(shlex.split(command)) is None


def test_the_checker_catches_a_python_block_naming_what_does_not_exist(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```python\nimport gnmr_hf\nm = gnmr_hf.load_planned('m', 'p')\nx = gnmr_hf.load_planed(m)\n"
                    "gnmr_hf.planning.ladder.choose_rungs\n```\n```python\nif True\n```\n")
    assert page_faults(page) == ["p.md:2: gnmr_hf.load_planed does not exist",
                                 "p.md:8: python block does not compile: expected ':' (line 1)"]


# ------------------------------------------------------------------------------------ the pages


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_on_the_page_parses(page, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pages' paths are relative to the repository root
    text = page.read_text(encoding="utf-8")
    assert shell_commands(text), f"{page.name} shows no command"
    assert page_faults(page) == []
