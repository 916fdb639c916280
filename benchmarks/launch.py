"""How the tests and the benchmarks start the steps: the tour's scripts, the command lines of their
launchers, and the environment they run in. The tests import it too (tests/conftest.py)."""

import itertools
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
# Real data for offline measurements (the official MNIST archives, real CIFAR-10 images as arrays):
# beside the checkout on the project's machines, absent from a reader's clone.
SHARED_DATA = ROOT.parent / "shared" / "data"
BIN = Path(sys.executable).parent
ON_GPU = torch.cuda.is_available()

# Each step's script, and the step it is written from: the diff between the two is the step's lesson.
SCRIPTS = {
    "01": "01_cifar10_cpu.py",
    "02": "02_cifar10_gpu.py",
    "03": "03_cifar10_dataparallel.py",
    "04": "04_cifar10_ddp.py",
    "05": "05_cifar10_deepspeed.py",
    "06": "06_mnist_accelerate.py",
    "07": "07_cifar10_fsdp.py",
    "08": "08_cifar10_pipeline.py",
    "09": "09_cifar10_tensor_parallel.py",
    "10": "10_cifar10_context_parallel.py",
    "11": "11_cifar10_expert_parallel.py",
}
BASES = {"02": "01", "03": "02", "04": "02", "05": "04", "06": "04", "07": "04", "08": "04", "09": "07", "10": "09",
         "11": "09"}


def environment(extra=None):
    """The environment a step runs in: the environment's bin first on PATH, as when it is activated
    (DeepSpeed builds and loads its op with the ninja installed beside it, and always the same ninja:
    two versions disagree about the cached build and rebuild it every time), gloo on the loopback
    interface (one machine), and output that is not held back. `extra`: more variables; None removes one."""
    variables = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                 "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "PYTHONUNBUFFERED": "1",
                 **(extra or {})}
    return {name: value for name, value in variables.items() if value is not None}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_in_group(rank, function, world_size, port, timeout, queue):
    # One thread: a child forked after its parent ran a parallel CPU kernel (a matrix product, in a test
    # before this one) hangs in its first parallel region, whose thread pool it inherited as a stale copy.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timeout)
    queue.put((rank, function(rank)))
    dist.destroy_process_group()


def in_local_processes(function, world_size, timeout):
    """{rank: function(rank)}, each call in a process of its own, in one gloo group on 127.0.0.1 (no GPU
    needed). Forked, not spawned: a spawned process imports torch again, which is most of a short run's
    time. A process that fails stops the others and raises here; a group still running after `timeout` (a
    `datetime.timedelta`, also the group's own) and 30 s for the start-up is killed, with an error."""
    queue = mp.get_context("fork").SimpleQueue()
    processes = mp.start_processes(_run_in_group, args=(function, world_size, free_port(), timeout, queue),
                                   nprocs=world_size, join=False, start_method="fork")
    limit = timeout.total_seconds() + 30
    deadline = time.monotonic() + limit
    results = {}
    # Read the results while waiting: a result larger than the pipe's buffer blocks its process until read.
    while not processes.join(timeout=1) or not queue.empty():
        while not queue.empty():
            rank, result = queue.get()
            results[rank] = result
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            sys.exit(f"error: the {world_size} processes did not finish in {limit:.0f} s")
    return results


def python(script, *args):
    return [sys.executable, str(script), *map(str, args)]


def forked(nproc, script, *args):
    """The command line of a job of `nproc` processes on this machine, given the variables that a step reads
    from torchrun (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; and, as torchrun
    does for several processes, one thread each unless OMP_NUM_THREADS says otherwise), but forked from one
    Python that has imported torch: torchrun and each of its workers import torch, most of a short run's time
    on a CPU. For the tests whose claim is what a run computes (parity, resume); the tests of what a launcher
    does use the launcher. On a GPU machine, torchrun itself: a process that has asked whether CUDA is there
    (`ON_GPU`) cannot pass CUDA on to a forked child."""
    if ON_GPU:
        return torchrun(nproc, script, *args)
    return [sys.executable, __file__, str(nproc), str(script), *map(str, args)]


def _run_forked(nproc, argv):
    """`forked`'s job: fork the ranks, wait for them; the first that fails (non-zero status, or killed by a
    signal) ends the others with SIGKILL and gives the job its status."""
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc)}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        shared["OMP_NUM_THREADS"] = "1"  # torchrun's default for several workers
    # What the step imports (DTensor, DCP, DeepSpeed...), imported once here, not once per rank: the top level of
    # each script that `argv` starts with (benchmarks/float64.py, then the step it runs; `main()` runs only as
    # "__main__").
    for script in itertools.takewhile(lambda arg: arg.endswith(".py"), argv):
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__imports_only__")
    sys.stdout.flush()  # what the imports printed, once: not again from each rank's copy of the buffer
    sys.stderr.flush()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.environ.update(shared, RANK=str(rank), LOCAL_RANK=str(rank))
                torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
                run_step_here(argv)
                status = 0
            except SystemExit as exit:
                status = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
                if isinstance(exit.code, str):
                    print(exit.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except OSError:  # a closed pipe: nothing more to say, and the status still counts
                        pass
                os._exit(status)
        ranks[pid] = rank
    status = 0
    while ranks:
        pid, wait_status = os.wait()
        del ranks[pid]
        code = os.waitstatus_to_exitcode(wait_status)
        if code and not status:
            status = code if code > 0 else 128 - code
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    sys.exit(status)


def torchrun(nproc, script, *args, options=()):
    """torchrun's command line; `options` are more of torchrun's own (for example --max-restarts=1).
    --standalone: a private rendezvous on a free port, so that concurrent jobs cannot collide."""
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *options, str(script),
            *map(str, args)]


def torchrun_nodes(nnodes, nproc, script, *args, master_addr="127.0.0.1", rdzv_id=None, node_addrs=None):
    """torchrun's command line on each of `nnodes` machines ("nodes") of one job, node 0's first
    (docs/multi-node.md): a static master, node 0 at `master_addr`; or, given `rdzv_id`, the c10d
    rendezvous, whose store node 0 hosts there and which hands out the node ranks itself.
    `node_addrs`: each node's own address, for machines whose host name does not resolve to it (network
    namespaces): with c10d, node 0 is then told that it hosts the store, and each node which address
    to give its workers."""
    port = free_port()
    commands = []
    for node in range(nnodes):
        if rdzv_id is None:
            options = [f"--node_rank={node}", f"--master_addr={master_addr}", f"--master_port={port}"]
        else:
            options = ["--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{port}", f"--rdzv-id={rdzv_id}"]
            if node_addrs:
                options += [*(["--rdzv-conf=is_host=1"] if node == 0 else []), f"--local-addr={node_addrs[node]}"]
        commands.append([str(BIN / "torchrun"), f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", *options,
                         str(script), *map(str, args)])
    return commands


def legacy_launch(nproc, script, *args):
    """The launcher before torchrun, `python -m torch.distributed.launch` (deprecated): it passes the local
    rank as an argument, --local-rank=N."""
    return [sys.executable, "-m", "torch.distributed.launch", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", str(script), *map(str, args)]


def deepspeed(nproc, script, *args, port=None):
    """The deepspeed launcher; without GPUs --num_gpus is the number of processes. A free port instead of
    the launcher's fixed default (29500), so that concurrent jobs cannot collide."""
    return [str(BIN / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={port or free_port()}", str(script),
            *map(str, args)]


def deepspeed_nodes(hostfile, script, *args, master_addr="127.0.0.1"):
    """The deepspeed launcher's command line on each machine of `hostfile`, started there by hand
    (docs/multi-node.md). Never one without --no_ssh and --master_addr: the launcher would reach the
    hosts, or ask the first one for its address, over ssh."""
    nnodes = sum(1 for line in Path(hostfile).read_text().splitlines() if line.split("#")[0].strip())
    port = free_port()
    return [[str(BIN / "deepspeed"), f"--hostfile={hostfile}", "--no_ssh", f"--node_rank={node}",
             f"--master_addr={master_addr}", f"--master_port={port}", str(script), *map(str, args)]
            for node in range(nnodes)]


def accelerate_launch(nproc, script, *args, config_precision=ON_GPU):
    """`accelerate launch` with the repository's config, as the README says. The config's fp16 needs a
    GPU: without one it is overridden, unless `config_precision`. Port 0: a free port."""
    return [str(BIN / "accelerate"), "launch", "--config_file", "accelerate_config.yaml", "--num_processes", str(nproc),
            "--main_process_port", "0", *([] if config_precision else ["--mixed_precision", "no"]),
            str(script), *map(str, args)]


LAUNCHERS = {"python": lambda nproc, script, *args: python(script, *args), "torchrun": torchrun,
             "deepspeed": deepspeed, "accelerate": accelerate_launch, "forked": forked}


def run_step_here(argv):
    """Run the step script that `argv` names first, with the rest as its command line, in this process
    (as `python STEP ARGS` would, but after the caller has changed something in PyTorch)."""
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # the step imports common/ from beside it
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":  # forked(): python benchmarks/launch.py NPROC SCRIPT ARGS
    _run_forked(int(sys.argv[1]), sys.argv[2:])
