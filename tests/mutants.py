"""The mutation check: edits that break a claim of the tour while the code still runs. The quick tier must
catch every one, through a test that runs the code, not through the static checks (quoted code, tags, lint,
diff sizes).

    .venv/bin/python tests/mutants.py                 # every edit: caught or missed, and by which test
    .venv/bin/python tests/mutants.py set_epoch rank  # the edits whose name contains one of these words

Each edit is made in a copy of the repository (its files as git lists them), never in the checkout. The copy
first runs, unchanged, every test named below: they must pass (otherwise a failure would prove nothing). Then,
for each edit, a fresh copy with that edit runs the quick-tier tests that hold its claim (`pytest -x`, with the
quick tier's marker expression from pyproject.toml): a failure is a catch. Exit status 1 if an edit is missed.
docs/testing.md says how long the whole check takes."""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 900  # seconds per pytest run; a mutant that hangs a job is caught by that job's own timeout first

PARITY = "tests/test_parity.py::test_same_weights_as_the_reference_run"
PREEMPTION = ("tests/test_faults.py::"
              "test_a_signal_to_one_workers_process_group_stops_every_rank_at_one_step_and_resumes_exactly")
README_RUN = "tests/test_steps.py::test_the_readme_command_with_its_defaults_writes_the_contracts_outputs"
# What the failing check prints: the weights' difference from the reference run, the test samples counted.
PARITY_DIFFERS = r" vs (01|09 x1): \d"
WEIGHTS_DIFFER = r"tensors differ"
MISCOUNTED = r"assert \d+ == 1001"


@dataclass(frozen=True)
class Mutant:
    name: str
    claim: str  # what the edit breaks
    path: str
    old: str  # must occur exactly once in `path`
    new: str
    tests: tuple  # quick-tier test ids that must fail
    expect: str  # a regular expression that the failure's output must match: the claim's check, not a crash


MUTANTS = [
    Mutant("set_epoch", "04: each epoch shuffles anew (DistributedSampler.set_epoch)", "04_cifar10_ddp.py",
           "        sampler.set_epoch(epoch)  #", "        pass  #", (f"{PARITY}[04 x2]",), PARITY_DIFFERS),
    Mutant("rank0_share", "04: each rank trains on its own share of the global batch", "04_cifar10_ddp.py",
           "num_replicas=replicas, rank=replica,", "num_replicas=replicas, rank=0,",
           (f"{PARITY}[04 x2]",), PARITY_DIFFERS),
    Mutant("eval_all_reduce", "04: the ranks' test totals are summed: every test sample counted once",
           "04_cifar10_ddp.py", "    dist.all_reduce(totals)  # [04]", "    pass  # [04]",
           (f"{README_RUN}[04_cifar10_ddp.py]",), MISCOUNTED),
    Mutant("resume_position", "04: a resumed epoch skips the batches trained before the stop", "04_cifar10_ddp.py",
           "    done = state.step - state.epoch * len(loader)", "    done = 0", (PREEMPTION,), WEIGHTS_DIFFER),
    Mutant("scratch_mean", "ddp_from_scratch.py: the summed gradients are divided by the world size (a mean)",
           "ddp_from_scratch.py", "            flat /= self.world_size", "            pass",
           ("tests/test_ddp_from_scratch.py::test_the_wrapper_takes_the_steps_of_torchs_ddp[2]",), r"2 processes: \d"),
    Mutant("stop_flag_shared", "04-10: the stop flag is shared (all-reduced) so that every rank stops at one step",
           "common/distributed.py",
           "        self._sent = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag",
           "        self._sent = dist.barrier(group=self._group, async_op=True), flag",
           (PREEMPTION,), "hung: killed after"),
    Mutant("loader_workers_signals", "04-10: the loader's workers do not die of the stop signals",
           "common/distributed.py", "        signal.pthread_sigmask(signal.SIG_BLOCK, self.STOP_SIGNALS)", "",
           (PREEMPTION,), r"does not block SIGTERM|DataLoader worker \(pid"),
    Mutant("zero_stage", "05: --zero-stage sets the engine's ZeRO stage", "05_cifar10_deepspeed.py",
           '        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage  # [05]',
           "        pass  # [05]", ("tests/test_deepspeed.py::test_resume_with_zero3_matches_uninterrupted_run",),
           "assert 2 == 3"),
    Mutant("gather_for_metrics", "06: gather_for_metrics drops the padding of the last batch", "06_mnist_accelerate.py",
           "accelerator.gather_for_metrics((logits, labels))", "accelerator.gather((logits, labels))",
           (f"{README_RUN}[06_mnist_accelerate.py]",), MISCOUNTED),
    Mutant("dcp_optimizer_state", "07: the sharded checkpoint restores the optimizer's state (momentum)",
           "07_cifar10_fsdp.py", 'dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)',
           'dcp.load({"model": model_state}, checkpoint_id=path)',
           ("tests/test_fsdp.py::test_resume_mid_epoch_matches_uninterrupted_run",), WEIGHTS_DIFFER),
    Mutant("pipeline_scale_grads", "08: the micro-batches' summed gradients are divided by their number",
           "08_cifar10_pipeline.py", "loss_fn=loss_fn)  # [08]", "loss_fn=loss_fn, scale_grads=False)  # [08]",
           (f"{PARITY}[08 2x1]",), PARITY_DIFFERS),
    Mutant("tp_norm_partial_sums", "09: the norm weights' gradients, partial sums over a rank's tokens, are reduced "
           "over the tensor-parallel group (SequenceParallel)", "09_cifar10_tensor_parallel.py",
           '        "attention_norm": SequenceParallel(),', "", (f"{PARITY}[09 x2]",), PARITY_DIFFERS),
    Mutant("template_set_epoch", "templates/train_ddp.py: each epoch shuffles anew", "templates/train_ddp.py",
           "        sampler.set_epoch(epoch)", "        pass",
           ("tests/test_templates.py::test_ddp_template_with_a_users_data_reads_disjoint_shares_in_a_new_order_"
            "each_epoch",), r"assert \[.*\] != \["),
    Mutant("template_test_totals", "templates/train_ddp.py: the ranks' test totals are summed",
           "templates/train_ddp.py", "    dist.all_reduce(totals)", "    pass",
           ("tests/test_templates.py::test_template_learns_and_counts_every_test_sample_once[ddp-2]",), MISCOUNTED),
    Mutant("template_resume_views", "templates/train_ddp.py: the ranks decide to resume from what every rank sees",
           "templates/train_ddp.py", "    dist.all_gather_object(views, latest)", "    views = [latest] * len(views)",
           ("tests/test_templates.py::test_every_rank_takes_the_same_decision_to_resume",), "see other files than"),
]


def copy_of_repository(destination):
    """The repository's files (tracked, and new ones that git does not ignore) copied into `destination`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def apply(mutant, root):
    path = root / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        sys.exit(f"error: {mutant.name}: {mutant.old!r} occurs {text.count(mutant.old)} times in {mutant.path}")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(root, tests):
    """(pytest's exit status, the ids of the tests that failed, the output's tail) of `tests` run in `root`, in a
    process group of their own that is killed, whole, after TIMEOUT."""
    # One process (-n 0): under pytest-xdist, -x ends a failed run as interrupted (exit 2), not failed (1).
    command = [sys.executable, "-m", "pytest", "-x", "-n", "0", "-q", "-p", "no:cacheprovider", "--durations=0", *tests]
    process = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, [], output
    return process.returncode, re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M), output


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="run only the edits whose name contains one of these")
    args = parser.parse_args()
    mutants = [mutant for mutant in MUTANTS if not args.names or any(word in mutant.name for word in args.names)]
    if not mutants:
        sys.exit(f"error: no edit is named like {' or '.join(args.names)}")

    with tempfile.TemporaryDirectory() as scratch:
        tests = sorted({test for mutant in mutants for test in mutant.tests})
        start = time.monotonic()
        status, failed, output = run_tests(copy_of_repository(Path(scratch) / "unchanged"), tests)
        if status != 0:
            sys.exit(f"error: the unchanged repository fails its own tests (exit {status}, {failed}):\n{output}")
        print(f"unchanged: {len(tests)} tests pass ({time.monotonic() - start:.0f} s)", flush=True)
        missed = []
        for mutant in mutants:
            root = copy_of_repository(Path(scratch) / mutant.name)
            apply(mutant, root)
            start = time.monotonic()
            status, failed, output = run_tests(root, mutant.tests)
            # Caught: the tests failed by the claim's own check (not a crash of the edited code), or hung.
            caught = status in (1, None) and re.search(mutant.expect, output) is not None
            verdict = "caught" if caught else ("MISSED" if status == 0 else f"OTHER (pytest exit {status})")
            reason = next(iter(re.findall(r"^E +(.+)$", output, re.M)), "")[:150]  # pytest's first error line
            print(f"{verdict:<8} {mutant.name:<24} {time.monotonic() - start:5.0f} s  {mutant.path}: {mutant.claim}"
                  + (f"\n         by {', '.join(failed) or 'the time limit'}: {reason}" if caught else
                     f"\n{output[-3000:]}"),
                  flush=True)
            if not caught:
                missed.append(mutant.name)
            shutil.rmtree(root)
    print(f"{len(mutants) - len(missed)} of {len(mutants)} edits caught" + (f"; missed: {missed}" if missed else ""))
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
