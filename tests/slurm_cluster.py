"""A real one-node Slurm cluster on 127.0.0.1 for the tests: munged, slurmctld and slurmd started by hand
(no systemd), their configuration, keys, state and logs in a temporary directory, and everything they
started stopped at the end."""

import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from launch import ROOT, environment, free_port

NODE = "localhost"  # the name `scontrol show hostnames` gives the jobs: it must resolve to 127.0.0.1
# No accounting database, no cgroups: processes are tracked through /proc, tasks are not bound to CPUs.
# cred_expire: a requeued job waits that long before it may start again (120 s by default); starting a step
# on the loopback takes well under a second of the credential's lifetime.
SLURM_CONF = """\
ClusterName=tests
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={directory}/munge.socket,cred_expire=15
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=tests Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
# What a job's state becomes once it has ended (`scontrol show job`).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
START_TIMEOUT, STOP_TIMEOUT = 30, 60


def processes_with(variable):
    """The pids of the processes whose environment holds `variable` ("NAME=value")."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if variable.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # it has just exited
                continue
    return found


def process_status(pid):
    """A process's state, parent, the kernel call it waits in and command line (words), from /proc; an empty
    command line for one that has exited."""
    proc = Path("/proc", str(pid))
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        return {"state": fields[0], "parent": int(fields[1]), "wchan": (proc / "wchan").read_text() or "-",
                "command": (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]}
    except OSError:  # it has just exited
        return {"state": "-", "parent": 0, "wchan": "-", "command": []}


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(0.1)


class SlurmCluster:
    def __init__(self, directory):
        self.directory = directory
        self.conf = directory / "slurm.conf"
        self.daemons = {}
        self.submitted = []

    def env(self, extra=None):
        """The environment of a Slurm command (and of its jobs: sbatch passes it on), without the tests' one
        thread per process (conftest.py): srun.sbatch sets OMP_NUM_THREADS itself where it is unset. A job's Python
        processes print their threads' stacks when they abort (`wait` aborts a job that hangs)."""
        return environment({"SLURM_CONF": str(self.conf), "OMP_NUM_THREADS": None, "PYTHONFAULTHANDLER": "1",
                            **(extra or {})})

    def run(self, *command, env=None):
        """A Slurm client command's output; a failure raises, with what it printed."""
        result = subprocess.run(command, env=self.env(env), cwd=ROOT, capture_output=True, text=True, timeout=30)
        if result.returncode:
            raise RuntimeError(f"{' '.join(command)}: exit {result.returncode}\n{result.stdout}{result.stderr}")
        return result.stdout

    def start(self, name, *command):
        log = (self.directory / f"{name}.out").open("w")
        self.daemons[name] = subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)
        log.close()

    def check_running(self):
        for name, daemon in self.daemons.items():
            if daemon.poll() is not None:
                raise RuntimeError(f"{name} exited with {daemon.returncode}:\n"
                                   f"{(self.directory / f'{name}.out').read_text()[-3000:]}")

    def node_state(self):
        self.check_running()
        return subprocess.run(["sinfo", "--noheader", "--format=%t"], env=self.env(), capture_output=True,
                              text=True, timeout=30).stdout.strip()

    def submit(self, script, *args, options=(), env=None):
        """Submit `script` (sbatch, not --wait: it returns long after the job ends); the job's id."""
        job_id = self.run("sbatch", "--parsable", *options, script, *map(str, args), env=env).strip()
        self.submitted.append(job_id)
        return job_id

    def job_state(self, job_id):
        return re.search(r"JobState=(\w+)", self.run("scontrol", "--oneliner", "show", "job", job_id)).group(1)

    def wait(self, job_id, timeout, output):
        """The state that the job ends in; a job that outlasts `timeout` is cancelled and fails the test, with
        what it was doing: its record, its processes and the end of its `output` file."""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) not in ENDED:
            if time.monotonic() > deadline:
                record = self.run("scontrol", "--oneliner", "show", "job", job_id)
                processes = self.processes_of(job_id)
                before = output.stat().st_size if output.exists() else 0
                self.dump_stacks(job_id)
                self.run("scancel", job_id)
                printed = output.read_bytes()[before:].decode(errors="replace") if output.exists() else "no output"
                pytest.fail(f"job {job_id} still {state} after {timeout}s: cancelled\n{record}\n{processes}\n"
                            f"--- the output before the stacks\n{output.read_text(errors='replace')[:before][-5000:]}"
                            f"\n--- the stacks\n{printed[:30000]}\n{self.logs()}")
            time.sleep(0.2)
        return state

    def job_processes(self, job_id):
        """The pids of the job's processes (this cluster's job: its ids start at 1 on every cluster)."""
        return sorted(set(processes_with(f"SLURM_JOB_ID={job_id}")) & set(processes_with(f"SLURM_CONF={self.conf}")))

    def dump_stacks(self, job_id):
        """Every thread's stack of each of the job's trainers (04), one after the other, into its output: each
        aborts, and faulthandler (PYTHONFAULTHANDLER, self.env) prints the stacks. Not the launcher nor the
        loader workers, whose stacks would bury the trainers'. No core file."""
        def trainer(pid):
            words = process_status(pid)["command"]
            return any(word.endswith("04_cifar10_ddp.py") for word in words) and not any(
                word.endswith("torchrun") for word in words)

        for pid in self.job_processes(job_id):
            if trainer(pid) and not trainer(process_status(pid)["parent"]):
                with contextlib.suppress(OSError):
                    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
                    os.kill(pid, signal.SIGABRT)
                time.sleep(1)

    def processes_of(self, job_id):
        """Each process of the job: pid, state, the kernel call it waits in, command line."""
        lines = [f"{pid} {status['state']} {status['wchan']} {' '.join(status['command'])}"
                 for pid in self.job_processes(job_id) if (status := process_status(pid))["command"]]
        return "\n".join(lines) or "no processes"

    def jobs(self):
        return self.run("squeue", "--noheader", "--format=%i").split()

    def logs(self):
        """The end of each daemon's log."""
        logs = sorted(self.directory.glob("*.log"))
        return "\n".join(f"--- {path.name}\n{path.read_text()[-2000:]}" for path in logs)

    def stop(self):
        """Cancel what still runs, let slurmd clean up after its jobs (stopped at once, it leaves a
        slurmstepd behind), stop the daemons, and check that nothing they started is left."""
        try:
            if self.submitted and self.jobs():
                self.run("scancel", *self.jobs())
                wait_until(lambda: not self.jobs(), STOP_TIMEOUT, "jobs still in squeue")
        finally:
            for daemon in reversed(self.daemons.values()):  # slurmd, slurmctld, then munged, which they need
                daemon.terminate()
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
            left = processes_with(f"SLURM_CONF={self.conf}")
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            assert not left, f"left running after the cluster stopped: {left}"


@contextlib.contextmanager
def one_node_cluster():
    """A running one-node cluster (a SlurmCluster) whose node is idle; stopped at the end, even after a failure."""
    # Not pytest's tmp_path: munged refuses a socket in a directory that others may not enter (a 0700
    # directory, such as tmp_path's parents), a key that others may read, and a directory they may write.
    directory = Path(tempfile.mkdtemp(prefix="slurm-"))
    directory.chmod(0o755)
    for subdirectory in ("state", "spool"):
        (directory / subdirectory).mkdir()
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cluster = SlurmCluster(directory)
    cluster.conf.write_text(SLURM_CONF.format(node=NODE, directory=directory, controller_port=free_port(),
                                              node_port=free_port(), cpus=os.cpu_count()))
    socket = directory / "munge.socket"

    def munged_ready():
        cluster.check_running()
        return socket.exists()

    try:
        try:
            cluster.start("munged", "munged", "--foreground", f"--socket={socket}", f"--key-file={key}",
                          f"--pid-file={directory}/munged.pid", f"--log-file={directory}/munged.log",
                          f"--seed-file={directory}/munged.seed")
            wait_until(munged_ready, START_TIMEOUT, "munged has no socket")
            cluster.start("slurmctld", "slurmctld", "-D")
            cluster.start("slurmd", "slurmd", "-D", "-N", NODE)
            wait_until(lambda: cluster.node_state() == "idle", START_TIMEOUT, "the node is not idle")
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            raise RuntimeError(f"the cluster did not start: {error}\n{cluster.logs()}") from error
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(directory)
