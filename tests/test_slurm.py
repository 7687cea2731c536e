"""Lesson 06's batch script, submitted with `sbatch` to a real one-host Slurm (22.05 from the distribution).

The fixture starts munged, slurmctld and slurmd with a private configuration in a temporary folder (own ports,
own munge socket and key), so it touches nothing of a Slurm the machine may already run. The node declares two
GPUs as GRES backed by /dev/null and /dev/zero: the script is the one generated for a GPU cluster
(`#SBATCH --gpus-per-node=2`) and Slurm must accept that request; the job's workers then run on the CPU with
gloo (torch finds no CUDA device). Skipped, with the reason, where the Slurm daemons or root are missing:
`apt-get install slurmctld slurmd slurm-client munge` (Debian 12) provides them. In the slow set (README, "More
checks"): `pytest -m slow tests/test_slurm.py`; .ci/run runs it after `pytest --nbval`.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO_ROOT, free_port
from helpers.lessons.cluster import JobSize, check_slurm_script, second_job_on_a_taken_port, write_job_files

pytestmark = pytest.mark.slow
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


def _config(folder: Path, host: str) -> str:
    ctld_port, d_port = free_port(), free_port()
    return "\n".join([
        "ClusterName=lessons", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={folder}/munge.socket", "CredType=cred/munge",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldPort={ctld_port}", f"SlurmdPort={d_port}",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "GresTypes=gpu",
        "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none", "ReturnToService=2",
        f"NodeName={host} CPUs={os.cpu_count()} RealMemory=2000 Gres=gpu:2 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""])


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [name for name in DAEMONS if shutil.which(name) is None
               and not Path("/usr/sbin", name).exists()]
    if missing:
        pytest.skip(f"no Slurm here ({', '.join(missing)} missing): "
                    "apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("a private one-host Slurm needs root (slurmd runs jobs as their user)")
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (folder / "slurm.conf").write_text(_config(folder, host))
    (folder / "gres.conf").write_text(f"AutoDetect=off\nNodeName={host} Name=gpu File=/dev/null\n"
                                      f"NodeName={host} Name=gpu File=/dev/zero\n")
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    sbin = lambda name: shutil.which(name) or f"/usr/sbin/{name}"  # noqa: E731
    subprocess.run([sbin("munged"), f"--key-file={key}", f"--socket={folder}/munge.socket", "--force",
                    f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                    f"--seed-file={folder}/munge.seed"], check=True, env=env)
    subprocess.run([sbin("slurmctld")], check=True, env=env)
    subprocess.run([sbin("slurmd")], check=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                log = (folder / "slurmctld.log").read_text()[-1500:]
                pytest.fail(f"the one-host Slurm did not come up (node state {state!r}); slurmctld.log ends:\n{log}")
            time.sleep(0.3)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], capture_output=True, env=env)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = folder / f"{name}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().split()[0]), 15)
                except (ProcessLookupError, ValueError):
                    pass


def _run_job(batch: Path, env: dict, limit: float = 180) -> tuple[str, str]:
    """Submit `batch` from its folder; return (job id, final state) once Slurm says the job ended. Polled every
    0.2 s: `sbatch --wait` polls at growing intervals (up to 10 s), which cost a job that fails at once 10 s."""
    job_id = subprocess.run(["sbatch", "--parsable", batch.name], cwd=batch.parent, env=env, capture_output=True,
                            text=True, check=True).stdout.strip().split(";")[0]
    deadline = time.monotonic() + limit
    while True:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True)
        state = next((field.split("=", 1)[1] for field in shown.stdout.split() if field.startswith("JobState=")), "")
        if state in ENDED:
            return job_id, state
        assert time.monotonic() < deadline, f"job {job_id} still {state or shown.stderr.strip()} after {limit} s"
        time.sleep(0.2)


@pytest.mark.parametrize("chdir", [True, False], ids=["as-written", "without---chdir"])
def test_the_generated_batch_script_runs_under_a_real_slurm(slurm, tmp_path, chdir):
    """sbatch from the job-files folder (not the repository): --chdir, the environment line and the relative
    script and checkpoint paths must all work as written. The job trains 4 steps on 2 ranks and checkpoints to a
    path relative to the repository (the job's folder) that leads out of it, into this test's own folder: tests
    never write into the repository. Without --chdir the job starts in the job-files folder and cannot find
    the script."""
    # relative: resolved in the job's folder, the repository; it lands in tmp_path only if the job ran there
    checkpoint = Path(os.path.relpath(tmp_path / "checkpoint.pt", REPO_ROOT))
    size = JobSize(nodes=1, gpus_per_node=2, cpus_per_process=1, max_restarts=0)
    files = write_job_files(tmp_path / "job-files", "helpers/workers/fault_tolerance_train.py", size,
                            args=["--steps", "4", "--checkpoint", str(checkpoint), "--checkpoint-every", "2"])
    batch = next(path for path in files if path.name == "job.sbatch")
    # a free rendezvous port for this test: the job-derived one (20000 + job id) may be taken by another test's job
    text = batch.read_text().replace("RDZV_PORT=$((20000 + SLURM_JOB_ID % 20000))", f"RDZV_PORT={free_port()}")
    assert "RDZV_PORT=$((" not in text  # the replacement found its line
    if not chdir:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("#SBATCH --chdir")) + "\n"
    batch.write_text(text)
    check_slurm_script(text)
    job_id, state = _run_job(batch, slurm)
    outputs = list(batch.parent.glob(f"*-{job_id}.out"))
    log = outputs[0].read_text() if outputs else "(no output file)"
    assert outputs == [batch.parent / f"ddp-train-{job_id}.out"], "the output did not land beside the job files"
    if not chdir:  # catches a test that would pass whether or not the script moves into the repository
        assert state == "FAILED" and "can't open file" in log, log[-600:]
        return
    # catches a script that only runs from the repository root, misses its environment, or whose job fails
    assert state == "COMPLETED", f"the job ended {state}; job output:\n{log}"
    # catches a job that trained on one rank (a wrong --nproc-per-node) or not at all
    assert "attempt 0: world size 2, starting at step 0" in log, log[-600:]
    assert (REPO_ROOT / checkpoint).resolve() == (tmp_path / "checkpoint.pt").resolve()
    assert (tmp_path / "checkpoint.pt").exists(), f"no checkpoint at <repository>/{checkpoint}; job output:\n{log}"
    print(f"Slurm job {job_id} ran; its output ends:\n{log[-600:]}")


def test_a_second_job_on_a_taken_port_joins_its_store_unless_told_it_hosts():
    """The reviewer's reproduction of the fixed-port hazard: a c10d backend that guesses it is the host falls back
    to being a client of whatever store holds the port; told is_host=1 it refuses instead."""
    outcomes = second_job_on_a_taken_port()
    assert outcomes["is_host guessed"] == "joined a store that says owner=job1", outcomes
    assert outcomes["is_host=1"].startswith("refused: RendezvousConnectionError"), outcomes
