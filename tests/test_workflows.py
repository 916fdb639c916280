"""The GitHub workflow that a fork of the repository runs: it runs the README's commands, it is valid
for GitHub, and zizmor's security audit finds nothing in it. Both linters work offline. And .ci/run's share
of the full tier."""

import os
import re
import subprocess

import pytest
import yaml
from conftest import SHARED_RUNS, shards
from launch import BIN, ROOT

WORKFLOWS = ROOT / ".github" / "workflows"


def run_tool(*command):
    return subprocess.run([str(BIN / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_workflow_runs_the_readme_commands():
    readme_commands = re.findall(r"^```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    assert len(readme_commands) == 3, "the quick start, the quick tier and the full tier"
    workflows = [yaml.safe_load(path.read_text()) for path in sorted(WORKFLOWS.glob("*.yml"))]
    runs = [step["run"] for workflow in workflows for job in workflow["jobs"].values() for step in job["steps"]
            if "run" in step]
    assert runs == readme_commands


def test_the_full_tier_runs_on_pull_requests_by_hand_and_weekly_and_the_quick_tier_on_every_push():
    [workflow] = [yaml.safe_load(path.read_text()) for path in sorted(WORKFLOWS.glob("*.yml"))]
    events = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert set(events) == {"push", "pull_request", "workflow_dispatch", "schedule"}
    quick, full = workflow["jobs"]["quick"], workflow["jobs"]["full"]
    assert quick["steps"][-1]["run"].endswith("pytest")
    assert full["steps"][-1]["run"].endswith('pytest -m "full or slow"')
    assert quick["if"] == "github.event_name == 'push' || github.event_name == 'pull_request'"
    assert full["if"] == "github.event_name != 'push'"


def test_ci_runs_a_shard_of_the_full_tier_in_turn_and_the_shards_hold_every_test_once():
    ci = (ROOT / ".ci" / "run").read_text()
    assert '.venv/bin/python -m pytest -m "full or slow" --shard "$SHARD"' in ci
    # The shard that .ci/run's own lines choose in this checkout: the next one with each commit on main.
    choice = ci[ci.index('if [ -z "${SHARD:-}" ]'):ci.index("\nfi\n") + 4]
    chosen = subprocess.run(["bash", "-euc", f'{choice}echo "$SHARD"'], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "SHARD": ""})
    git = [subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
           for args in (["rev-parse", "--is-shallow-repository"], ["rev-list", "--first-parent", "--count", "HEAD"],
                        ["rev-parse", "--short=8", "HEAD"])]
    commits = int(git[2], 16) if git[0].strip() == "true" else int(git[1])
    assert chosen.stdout == f"{commits % 8 + 1}/8\n", chosen.stderr
    tests = [("tests/test_a.py::test_one[04]", ["tmp_path"]), ("tests/test_a.py::test_one[05]", ["tmp_path"]),
             ("tests/test_a.py::test_one[07]", []), ("tests/test_b.py::test_table", ["measured"]),
             ("tests/test_b.py::test_rows[1]", ["measured", "tmp_path"]), ("tests/test_b.py::test_alone", [])]
    parts = shards(tests, 3)
    assert sorted(sum(parts, [])) == sorted(test_id for test_id, _ in tests)
    assert [shard for shard in parts if "tests/test_b.py::test_table" in shard] == [
        shard for shard in parts if "tests/test_b.py::test_rows[1]" in shard]  # one run of `measured`
    assert {len([test for test in shard if "test_one" in test]) for shard in parts} == {1}  # a family spread out
    # Each name is a module-scoped fixture that tests take as an argument: one they fetched by name, or a renamed
    # one, would not keep its tests together.
    sources = "".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
    for name in SHARED_RUNS:
        assert f'@pytest.fixture(scope="module")\ndef {name}(' in sources, name
        assert re.search(rf"^def test_\w+\([^)]*\b{name}\b", sources, flags=re.M), name


# GitHub's schema (vendored in check-jsonschema: no download), and a timeout on every job: without
# one, a hung job holds its runner for 6 hours.
@pytest.mark.parametrize("schema", ["vendor.github-workflows", "custom.github-workflows-require-timeout"])
def test_workflows_match_the_schema(schema):
    result = run_tool("check-jsonschema", "--builtin-schema", schema, *map(str, WORKFLOWS.glob("*.yml")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_finds_nothing():
    """Pinned actions, read-only permissions, no persisted credentials, no template injection, and the
    code smells of the pedantic persona. --offline: the audits that ask GitHub's API are left out."""
    result = run_tool("zizmor", "--offline", "--persona=pedantic", "--no-progress", str(WORKFLOWS))
    assert result.returncode == 0, result.stdout + result.stderr
