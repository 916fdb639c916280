"""The README and the docstrings are checked against the code, so they cannot drift.

Every launch command in them names a script that exists and passes arguments that the script's
own parser accepts; every file name in the README exists; the tour table's diff sizes are current.
"""

import ast
import importlib.util
import re
import shlex
import subprocess
import sys

import pytest
from helpers import README, ROOT

STEP_SCRIPTS = sorted(path.name for path in ROOT.glob("0[1-9]_*.py"))
LAUNCHERS = ("python", "torchrun", "deepspeed", "accelerate", "bash", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def shell_commands(text):
    """Command lines in `text`'s code blocks and inline code (or a docstring's lines), continuations joined."""
    blocks = re.findall(r"```(?:bash|sh|shell)?\n(.*?)```", text, flags=re.S) or [text]
    blocks += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" # ")[0].strip()
            if line.startswith(LAUNCHERS):
                commands.extend(part.strip() for part in re.split(r"&&|;", line) if part.strip())
    return commands


# Scripts that run a step given after them: the step's arguments are what to check.
WRAPPERS = ("benchmarks/float64.py", "benchmarks/nondeterministic.py")


def script_and_arguments(command):
    """The repository file a command runs (the step, behind a wrapper) and the arguments it passes to it."""
    words = shlex.split(command)
    for index, word in enumerate(words):
        if word.endswith((".py", ".sh")) and not (word in WRAPPERS and index + 1 < len(words)):
            return word, words[index + 1:]
    return None, []


def parse_with_script(script, arguments, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"step_{script[:2]}", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [script, *arguments])
    module.parse_args()


def docstring(script):
    return ast.get_docstring(ast.parse((ROOT / script).read_text()))


def all_launch_commands():
    sources = {"README.md": README, **{script: docstring(script) for script in STEP_SCRIPTS}}
    return [(source, command) for source, text in sources.items() for command in shell_commands(text)]


@pytest.mark.parametrize("source, command", all_launch_commands())
def test_launch_command_runs_an_existing_script_with_valid_arguments(source, command, monkeypatch):
    script, arguments = script_and_arguments(command)
    if script is None:  # e.g. `python -m pytest`, a launcher's own command
        return
    assert (ROOT / script).is_file(), f"{source}: {command}: no {script}"
    if script in STEP_SCRIPTS:
        # Placeholders such as N or HOST sit in the launcher's options, never in the script's.
        parse_with_script(script, arguments, monkeypatch)


def test_every_step_and_the_launchers_are_in_the_readme():
    commands = " ".join(command for _, command in all_launch_commands())
    for script in STEP_SCRIPTS:
        assert script in README
        assert script in commands, f"no launch command for {script}"
    assert "bash install.sh && bash tour.sh" in README
    assert "bash install.sh --dev && .venv/bin/python -m pytest" in README


def test_ci_runs_the_readme_test_command():
    assert "bash install.sh --dev && .venv/bin/python -m pytest" in (ROOT / ".ci" / "run").read_text()


def test_file_names_in_the_readme_exist():
    outputs = {"metrics.json", "model.pt", "checkpoint.pt"}  # written by the runs, not in the repository
    names = set(re.findall(r"`([\w./-]+\.(?:py|json|yaml|sh|txt|toml|md))`", README)) - outputs
    missing = [name for name in names if not name.startswith("../") and not (ROOT / name).exists()]
    assert not missing


def test_tour_table_diff_sizes_are_current():
    rows = re.findall(r"\| `(0\d_\w+\.py)` \|.*\| (\d+) lines vs `(0\d_\w+\.py)` \|", README)
    assert len(rows) == len(STEP_SCRIPTS) - 1, "one diff size per step after the first"
    for script, size, base in rows:
        diff = subprocess.run(["diff", ROOT / base, ROOT / script], capture_output=True, text=True).stdout
        changed = sum(line.startswith(("<", ">")) for line in diff.splitlines())
        assert int(size) == changed, f"README says {size} lines for {base} -> {script}, the diff has {changed}"
