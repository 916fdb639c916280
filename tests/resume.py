"""The exact-resume check: a run stopped mid-epoch and resumed ends as a run that never stopped."""

from data_dirs import tiny_cifar10
from jobs import SHORT_RUN_ARGS, run_job
from outputs import assert_same_weights, check_ok, check_one_error, read_metrics, resumed_steps

# A small data set, 10 steps of 24 samples per epoch, for two epochs: the first run stops in the
# middle of epoch 1, between two checkpoints; the resumed run crosses into epoch 2.
TRAIN_SIZE, TEST_SIZE, STEPS_PER_EPOCH = 240, 10, 10
STOP_STEP, END_STEP, SAVE_EVERY = 6, 14, 4
assert STOP_STEP < STEPS_PER_EPOCH < END_STEP < 2 * STEPS_PER_EPOCH and STOP_STEP % SAVE_EVERY


def check_exact_resume(launch, tmp_path, make_data=tiny_cifar10, env=None, again=False):
    """A run stopped at STOP_STEP and resumed to END_STEP ends with the weights and metrics of a run
    straight to END_STEP. `launch(*args)` gives the command line; `make_data` writes the data set. With
    `again`, the finished run is started once more and must stand (check_a_finished_run_stands).
    Returns the stopped run's output directory and its arguments, without --max-steps."""
    data_dir = make_data(tmp_path / "data", TRAIN_SIZE, TEST_SIZE)
    args = ["--data-dir", data_dir, *SHORT_RUN_ARGS, "--epochs", 2, "--save-every", SAVE_EVERY]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(run_job(launch(*args, "--max-steps", END_STEP, "--output-dir", straight), env=env))
    check_ok(run_job(launch(*args, "--max-steps", STOP_STEP, "--output-dir", stopped), env=env))
    resumed = check_ok(run_job(launch(*args, "--max-steps", END_STEP, "--resume", "--output-dir", stopped), env=env))
    assert resumed_steps(resumed.stdout) == [STOP_STEP], resumed.stdout[-2000:]
    assert_same_weights(straight / "model.pt", stopped / "model.pt")
    a, b = read_metrics(straight), read_metrics(stopped)
    assert (b["steps"], b["epochs_completed"]) == (END_STEP, END_STEP // STEPS_PER_EPOCH)
    assert (a["test_loss"], a["test_accuracy"]) == (b["test_loss"], b["test_accuracy"])
    if again:
        check_a_finished_run_stands(launch, args, stopped, env)
    return stopped, args


def check_only_the_last_checkpoint_kept(output_dir):
    """A resumed run of a step with checkpoint directories (07-10) ends with one, END_STEP's, and the `latest`
    pointer naming it: the older ones are removed once a newer one is complete."""
    checkpoints = output_dir / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"step{END_STEP}"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", f"step{END_STEP}"]


def check_a_finished_run_stands(launch, args, output_dir, env=None):
    """Started again with --resume once it has ended, a run trains nothing, says so, and leaves its outputs as
    they were, byte for byte (evaluating again would rewrite them with an empty epoch's figures)."""
    before = {name: (output_dir / name).read_bytes() for name in ("model.pt", "metrics.json")}
    again = check_ok(run_job(launch(*args, "--max-steps", END_STEP, "--resume", "--output-dir", output_dir), env=env))
    said = f"nothing to train: {output_dir} holds step {END_STEP} of {END_STEP}\n"
    assert again.stdout.count(said) == 1, again.stdout  # rank 0 alone says it
    assert resumed_steps(again.stdout) == [END_STEP]
    assert {name: (output_dir / name).read_bytes() for name in before} == before


def check_another_norm_is_refused(launch, args, output_dir):
    """A checkpoint of BatchNorm resumed with GroupNorm stops in one line, before any weight loads (DCP would
    load BatchNorm's affine weights into GroupNorm without a word, DeepSpeed's strict load with a traceback)."""
    refused = run_job(launch(*args, "--norm", "group", "--resume", "--output-dir", output_dir))
    check_one_error(refused, "was written with norm=batch, this run has group; resume with the same --norm")
