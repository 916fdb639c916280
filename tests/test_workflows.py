"""The GitHub workflow that a fork of the repository runs: it runs the README's commands, it is valid
for GitHub, and zizmor's security audit finds nothing in it. Both linters work offline."""

import re
import subprocess

import pytest
import yaml
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
