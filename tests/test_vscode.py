""".vscode/launch.json: every step has a configuration, and each configuration, turned into the command
line that VS Code starts (docs/vscode.md), runs the step as configured."""

import json
import os
import re
import shlex

import pytest
from jobs import processes_per_machine, run_job
from launch import ROOT, SCRIPTS, free_port
from outputs import check_ok, read_metrics

from common import data

LAUNCH_JSON = ROOT / ".vscode" / "launch.json"


def configurations():
    # VS Code reads JSON with comments; the file keeps its comments on lines of their own.
    text = "\n".join(line for line in LAUNCH_JSON.read_text().splitlines() if not line.lstrip().startswith("//"))
    return json.loads(text)["configurations"]


LAUNCHES = [configuration for configuration in configurations() if configuration["request"] == "launch"]


def substituted(value):
    """`value` with VS Code's variables replaced as VS Code replaces them before it starts anything:
    ${env:NAME} from VS Code's own environment (here the test's), an empty string where unset."""
    def variable(match):
        name, _, argument = match.group(1).partition(":")
        if name == "workspaceFolder":
            return str(ROOT)
        if name == "env":
            return os.environ.get(argument, "")
        raise AssertionError(f"{match.group(0)}: a variable that this test does not substitute")

    return re.sub(r"\$\{(.*?)\}", variable, value)


def command_line(configuration):
    """What debugpy starts: `python program args` or `python -m module args`, no shell in between."""
    target = (["-m", configuration["module"]] if "module" in configuration
              else [substituted(configuration["program"])])
    return [substituted(configuration["python"]), *target, *map(substituted, configuration["args"])]


def with_value(command, option, value):
    """`command` with the value of `option` (`--option value` or `--option=value`) replaced."""
    for index, word in enumerate(command):
        if word == option:
            return [*command[:index + 1], str(value), *command[index + 2:]]
        if word.startswith(f"{option}="):
            return [*command[:index], f"{option}={value}", *command[index + 1:]]
    raise AssertionError(f"no {option} in {command}")


def script_of(command):
    return next(word for word in command if os.path.basename(word) in SCRIPTS.values())


def test_every_step_has_a_configuration():
    scripts = [os.path.basename(script_of(command_line(configuration))) for configuration in LAUNCHES]
    assert sorted(scripts) == sorted(SCRIPTS.values())


def test_the_docs_show_what_each_configuration_starts():
    page = re.sub(r"\s*\\\n\s*", " ", (ROOT / "docs" / "vscode.md").read_text())  # continuation lines joined
    for configuration in LAUNCHES:
        command = [word.removeprefix(f"{ROOT}/") for word in command_line(configuration)]
        assert shlex.join(command) in page, configuration["name"]


@pytest.mark.full
@pytest.mark.parametrize("configuration", LAUNCHES, ids=[configuration["name"] for configuration in LAUNCHES])
def test_configuration_runs_the_step(configuration, tmp_path):
    command = command_line(configuration)
    assert substituted(configuration["cwd"]) == str(ROOT)  # where run_job runs it
    # Outputs go to the test's directory, and the deepspeed launcher's fixed port becomes a free one,
    # or concurrent jobs would collide.
    command = with_value(command, "--output-dir", tmp_path)
    deepspeed = configuration.get("module") == "deepspeed.launcher.runner"
    if deepspeed:
        command = with_value(command, "--master_port", free_port())
    env = {name: substituted(value) for name, value in configuration.get("env", {}).items()}
    # A DeepSpeed run that finds its CPU op missing compiles it (about 45 s on 2 cores; install.sh does it).
    check_ok(run_job(command, env=env, timeout=600 if deepspeed else 180))
    metrics = read_metrics(tmp_path)
    assert metrics["script"] == os.path.basename(script_of(command))
    assert metrics["data"] == "synthetic"
    assert metrics["world_size"] == processes_per_machine(command)
    assert metrics["steps"] == int(command[command.index("--max-steps") + 1])
    assert metrics["test_samples"] == data.SYNTHETIC_TEST_SIZE
    assert (tmp_path / "model.pt").is_file()
