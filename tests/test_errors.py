"""Bad input: one clear line, reported once, a non-zero exit, within seconds (never a hang).

The "Bad input" table of docs/troubleshooting.md is checked here row by row: each row's input is run
as a user would run it, and the line it reports must be the row's message word for word (with DIR,
FILE and PORT in place of this run's temporary paths and port). A row without a case here fails, and
so does a case without a row.
"""

import re
import socket

import pytest
import torch
from data_dirs import tiny_cifar10
from jobs import SHORT_RUN_ARGS, SYNTHETIC_ARGS, processes_per_machine, run_job
from launch import BIN, ON_GPU, ROOT, deepspeed, python, torchrun
from outputs import check_one_error, printed_errors

from common import models, utils

TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()


def bad_input_table():
    """{bad input: message} from the "Bad input" table."""
    section = TROUBLESHOOTING.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| (.+?) \| `(.+?)` \|$", section, flags=re.M))


@pytest.fixture(scope="module")
def busy_port():
    """A port that another program listens on, as another job's rendezvous would."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def checkpoint(output_dir, **contents):
    utils.save_atomic(contents, output_dir / "checkpoint.pt")
    return output_dir


def truncated_checkpoint(output_dir):
    path = checkpoint(output_dir, model=models.ResNet9().state_dict()) / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[:5000])
    return output_dir


def cases(tmp, port):
    """{bad input: (command, environment, {text of this run: its placeholder in the table})}."""
    out = ["--output-dir", tmp / "out"]
    absent, a_file, bad_json, no_config = tmp / "absent", tmp / "file", tmp / "bad.json", tmp / "absent.json"
    a_file.touch()
    bad_json.write_text('{"zero_optimization": ')
    other_settings = checkpoint(tmp / "other", batch_size=24, epochs=1, seed=0)
    torchrun_at_port = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={port}"]
    return {
        "a global batch that the world size does not divide":
            (torchrun(3, "04_cifar10_ddp.py", *SYNTHETIC_ARGS, "--batch-size", 32, *out), {}, {}),
        # Every rank finds it in build_data, after init_process_group: all leave with the one line.
        "a global batch larger than the training set, found once the process group exists (04)":
            (torchrun(2, "04_cifar10_ddp.py", *SYNTHETIC_ARGS, "--batch-size", 4800, *out), {}, {}),
        "a global batch that the world size times 05's `--gradient_accumulation_steps` does not divide":
            (torchrun(2, "05_cifar10_deepspeed.py", *SYNTHETIC_ARGS, "--gradient_accumulation_steps", 5, *out), {}, {}),
        "`--stages` that does not divide the world size (08)":
            (torchrun(2, "08_cifar10_pipeline.py", *SYNTHETIC_ARGS, "--stages", 3, *out), {}, {}),
        "more `--stages` than ResNet-9's 5 blocks (08)":
            (torchrun(6, "08_cifar10_pipeline.py", *SYNTHETIC_ARGS, "--stages", 6, *out), {}, {}),
        "fewer `--microbatches` than `--stages` under 1F1B (08)":
            (torchrun(2, "08_cifar10_pipeline.py", *SYNTHETIC_ARGS, "--stages", 2, "--microbatches", 1, *out), {}, {}),
        "`--microbatches` that do not divide a replica's share of the batch (08)":
            (torchrun(2, "08_cifar10_pipeline.py", *SYNTHETIC_ARGS, "--microbatches", 5, *out), {}, {}),
        "`--amp fp16` in 08 (no loss scaling across pipeline stages)":
            (python("08_cifar10_pipeline.py", *SYNTHETIC_ARGS, "--amp", "fp16", *out), {}, {}),
        "`--amp fp16` in 09 (no loss scaling across tensor-parallel ranks)":
            (python("09_cifar10_tensor_parallel.py", *SYNTHETIC_ARGS, "--amp", "fp16", *out), {}, {}),
        "`--tp-size` that does not divide the world size (09)":
            (python("09_cifar10_tensor_parallel.py", *SYNTHETIC_ARGS, "--tp-size", 2, *out), {}, {}),
        "`--tp-size` that does not divide the 4 attention heads (09)":
            (torchrun(3, "09_cifar10_tensor_parallel.py", *SYNTHETIC_ARGS, "--tp-size", 3, *out), {}, {}),
        "a `--width` that the 4 attention heads do not divide (09)":
            (python("09_cifar10_tensor_parallel.py", *SYNTHETIC_ARGS, "--width", 30, *out), {}, {}),
        "`--amp fp16` in 10 (no loss scaler, as in 09)":
            (python("10_cifar10_context_parallel.py", *SYNTHETIC_ARGS, "--amp", "fp16", *out), {}, {}),
        "`--cp-size` that does not divide the world size (10)":
            (python("10_cifar10_context_parallel.py", *SYNTHETIC_ARGS, "--cp-size", 2, *out), {}, {}),
        "`--cp-size` that does not divide the 64 tokens (10)":
            (torchrun(3, "10_cifar10_context_parallel.py", *SYNTHETIC_ARGS, "--cp-size", 3, *out), {}, {}),
        "`--amp fp16` in 11 (no loss scaler, as in 09 and 10)":
            (python("11_cifar10_expert_parallel.py", *SYNTHETIC_ARGS, "--amp", "fp16", *out), {}, {}),
        "`--ep-size` that does not divide the world size (11)":
            (python("11_cifar10_expert_parallel.py", *SYNTHETIC_ARGS, "--ep-size", 2, *out), {}, {}),
        "`--ep-size` that does not divide the `--experts` (11)":
            (torchrun(2, "11_cifar10_expert_parallel.py", *SYNTHETIC_ARGS, "--experts", 3, *out), {}, {}),
        "a `--top-k` above `--experts` (11)":
            (python("11_cifar10_expert_parallel.py", *SYNTHETIC_ARGS, "--experts", 2, "--top-k", 3, *out), {}, {}),
        "a negative `--balance-weight` (11)":
            (python("11_cifar10_expert_parallel.py", *SYNTHETIC_ARGS, "--balance-weight", -0.01, *out), {}, {}),
        "`--batch-size` of 0 or less": (python("02_cifar10_gpu.py", *SYNTHETIC_ARGS, "--batch-size", 0, *out), {}, {}),
        "`--epochs` of 0 or less": (python("02_cifar10_gpu.py", *SYNTHETIC_ARGS, "--epochs", -1, *out), {}, {}),
        "an unknown `--amp`": (python("02_cifar10_gpu.py", *SYNTHETIC_ARGS, "--amp", "fp8", *out), {}, {}),
        "`--amp` given to step 01, which trains in fp32":
            (python("01_cifar10_cpu.py", *SYNTHETIC_ARGS, "--amp", "bf16", *out), {}, {}),
        "`--amp fp16` without a GPU, in 05 (05 runs DeepSpeed's fp16 on GPUs only)":
            (python("05_cifar10_deepspeed.py", *SYNTHETIC_ARGS, "--amp", "fp16", *out), {}, {}),
        "`--amp fp16` without a GPU, in 06 (Accelerate has no fp16 on the CPU)":
            (python("06_mnist_accelerate.py", *SYNTHETIC_ARGS, "--amp", "fp16", *out), {}, {}),
        "no data set in `--data-dir`, no network":
            (python("01_cifar10_cpu.py", "--data-dir", absent, *out), {}, {str(absent): "DIR"}),
        "a `--data-dir` that is a file":
            (python("02_cifar10_gpu.py", "--data-dir", a_file, *out), {}, {str(a_file): "FILE"}),
        "more replicas than test samples in 04, 05 or 07–11 (a replica: a process; in 08–10, a group)":
            (torchrun(3, "04_cifar10_ddp.py", *SHORT_RUN_ARGS, "--data-dir", tiny_cifar10(tmp / "tiny", 48, 2),
                      *out), {}, {}),
        "`--resume` with no checkpoint (01–04, 06)":
            (python("01_cifar10_cpu.py", *SYNTHETIC_ARGS, "--resume", *out), {}, {str(tmp / "out"): "DIR"}),
        "`--resume` with no checkpoint (05, 07–11: a folder of checkpoints)":
            (python("07_cifar10_fsdp.py", *SYNTHETIC_ARGS, "--resume", *out), {}, {str(tmp / "out"): "DIR"}),
        "`--resume` with other settings than the checkpoint's":
            (python("01_cifar10_cpu.py", *SYNTHETIC_ARGS, "--batch-size", 48, "--resume",
                    "--output-dir", other_settings), {}, {str(other_settings): "DIR"}),
        "a corrupt or truncated checkpoint":
            (python("03_cifar10_dataparallel.py", *SYNTHETIC_ARGS, "--resume", "--output-dir",
                    truncated_checkpoint(tmp)), {}, {str(tmp): "DIR"}),
        "a missing DeepSpeed config":
            (python("05_cifar10_deepspeed.py", *SYNTHETIC_ARGS, "--deepspeed-config", no_config, *out), {},
             {str(no_config): "FILE"}),
        "a malformed DeepSpeed config":
            (python("05_cifar10_deepspeed.py", *SYNTHETIC_ARGS, "--deepspeed-config", bad_json, *out), {},
             {str(bad_json): "FILE"}),
        # torchrun's agent opens the rendezvous before it starts any worker: the message is torchrun's.
        "the rendezvous port in use (torchrun)":
            ([*torchrun_at_port, "04_cifar10_ddp.py", *SYNTHETIC_ARGS, *out], {}, {str(port): "PORT"}),
        # The deepspeed launcher leaves it to the workers: rank 0 cannot listen, and says so.
        "the rendezvous port in use (deepspeed)":
            (deepspeed(2, "05_cifar10_deepspeed.py", *SYNTHETIC_ARGS, *out, port=port), {"OMP_NUM_THREADS": "1"},
             {str(port): "PORT"}),
    }


ROWS = bad_input_table()


# The full tier holds the rows run by a launcher of several processes (each process imports torch: 4 to 40 s a
# job on a 2-core CPU; torchrun's busy port stops it before its workers start); the quick tier the rows of one.
FULL_TIER_ROWS = {
    "a global batch that the world size does not divide",
    "a global batch larger than the training set, found once the process group exists (04)",
    "a global batch that the world size times 05's `--gradient_accumulation_steps` does not divide",
    "`--stages` that does not divide the world size (08)",
    "more `--stages` than ResNet-9's 5 blocks (08)",
    "fewer `--microbatches` than `--stages` under 1F1B (08)",
    "`--microbatches` that do not divide a replica's share of the batch (08)",
    "`--tp-size` that does not divide the 4 attention heads (09)",
    "`--cp-size` that does not divide the 64 tokens (10)",
    "`--ep-size` that does not divide the `--experts` (11)",
    "more replicas than test samples in 04, 05 or 07–11 (a replica: a process; in 08–10, a group)",
    "the rendezvous port in use (torchrun)",
    "the rendezvous port in use (deepspeed)",
}


def test_the_table_and_the_cases_match(tmp_path, busy_port):
    table = cases(tmp_path, busy_port)
    assert sorted(ROWS) == sorted(table)
    assert {row for row, (command, _, _) in table.items() if processes_per_machine(command) > 1} == FULL_TIER_ROWS


@pytest.mark.parametrize("bad_input", [pytest.param(row, marks=[pytest.mark.full] if row in FULL_TIER_ROWS else [])
                                       for row in sorted(ROWS)])
def test_bad_input_gets_the_tables_message(bad_input, busy_port, tmp_path):
    if bad_input.startswith("`--amp fp16` without a GPU") and ON_GPU:
        pytest.skip("a GPU machine accepts --amp fp16")
    command, env, placeholders = cases(tmp_path, busy_port)[bad_input]
    result = run_job(command, timeout=120, env=env)
    if bad_input == "the rendezvous port in use (torchrun)":
        assert result.returncode != 0 and not printed_errors(result)
        line = result.stderr.strip().splitlines()[-1]
    else:
        line = check_one_error(result)
    # No traceback from the script (a launcher may add its own failure report), no usage text.
    assert not re.search(r'File ".*\d\d_\w+\.py"', result.stderr) and "usage:" not in result.stderr
    for text, placeholder in placeholders.items():
        line = line.replace(text, placeholder)
    assert line == ROWS[bad_input]
    assert not (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.full
def test_offline_without_data_under_torchrun(tmp_path):
    """Local rank 0's download fails; every rank still leaves the barrier, and one error is reported."""
    data_dir = tmp_path / "no-data"
    result = run_job(torchrun(2, "04_cifar10_ddp.py", "--data-dir", data_dir, "--output-dir", tmp_path), timeout=120)
    check_one_error(result, str(data_dir), "--synthetic")


@pytest.mark.skipif(not ON_GPU, reason="a CPU-only machine runs any number of processes")
@pytest.mark.parametrize("launcher, script", [(torchrun, "04_cifar10_ddp.py"), (deepspeed, "05_cifar10_deepspeed.py")])
def test_more_processes_than_gpus(launcher, script, tmp_path):
    """One process per GPU: a launcher that starts one more gets one line, not a CUDA traceback per rank."""
    gpus = torch.cuda.device_count()
    result = run_job(launcher(gpus + 1, script, *SYNTHETIC_ARGS, "--output-dir", tmp_path), timeout=120,
                     more_processes_than_gpus=True)
    check_one_error(result, f"{gpus + 1} processes on this machine but {gpus} GPU(s)")


DIVERGED_RUNS = [
    ("01", lambda *args: python("01_cifar10_cpu.py", *args)),
    ("02", lambda *args: python("02_cifar10_gpu.py", *args)),
    ("03", lambda *args: python("03_cifar10_dataparallel.py", *args)),
    ("04", lambda *args: torchrun(2, "04_cifar10_ddp.py", *args)),
    # ZeRO-1, 2 and 3 skip a step whose gradients are not numbers, in fp32 too ("OVERFLOW! Skipping step"):
    # their weights stay numbers. Without ZeRO the loss becomes NaN, as in the other steps.
    ("05", lambda *args: torchrun(2, "05_cifar10_deepspeed.py", *args, "--zero-stage", 0)),
    ("06", lambda *args: torchrun(2, "06_mnist_accelerate.py", *args)),
    ("07", lambda *args: torchrun(2, "07_cifar10_fsdp.py", *args)),
    ("08", lambda *args: torchrun(2, "08_cifar10_pipeline.py", *args)),
    ("09", lambda *args: torchrun(2, "09_cifar10_tensor_parallel.py", *args)),
    ("10", lambda *args: torchrun(2, "10_cifar10_context_parallel.py", *args)),
    ("11", lambda *args: torchrun(2, "11_cifar10_expert_parallel.py", *args)),
]


@pytest.mark.full
@pytest.mark.parametrize("step, launch", DIVERGED_RUNS)
def test_a_diverged_run_is_an_error(step, launch, tmp_path):
    """A learning rate far too high: the loss is no longer a number by the first check (step 10). The run
    stops there on every rank with one line, exits non-zero, and writes neither a checkpoint of NaN weights
    nor outputs that look like a success."""
    data_set = ["--synthetic"] if step == "06" else ["--data-dir", tiny_cifar10(tmp_path / "data", 480, 10)]
    args = [*data_set, *SHORT_RUN_ARGS, "--lr", 1e6, "--save-every", 10, "--output-dir", tmp_path / "out"]
    line = check_one_error(run_job(launch(*args), timeout=120))
    assert re.fullmatch(r"error: the training loss is (nan|inf) at step 10: the run diverged; lower --lr, or raise "
                        r"--batch-size \(docs/troubleshooting.md\)", line), line
    assert not list((tmp_path / "out").glob("*"))
