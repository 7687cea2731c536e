"""Describe a multi-node torchrun job to a cluster: a SLURM script, the image, Kubernetes manifests.

    from helpers.lessons.cluster import JobSize, slurm_script, check_slurm_script, pytorch_job, train_job
    from helpers.lessons.cluster import write_job_files
    size = JobSize(nodes=2, gpus_per_node=4)
    print(slurm_script("train.py", size, args=["--checkpoint", "/shared/ckpt.pt"]))
    validate(indexed_job(...)["job"], "V1Job")        # the Kubernetes schema, no cluster needed
    validate_pytorch_job(pytorch_job(...))             # Training Operator v1's own models (kubeflow-training)
    validate_train_job(train_job(...))                 # Kubeflow Trainer v2's own models (kubeflow-trainer-api)
    write_job_files("runs/cluster", "train.py", size)  # all of them and the Dockerfile, in one folder

Taught in lesson 06. Every generator returns plain text or plain dicts (YAML-ready). The Kubernetes jobs run
torchrun with a c10d rendezvous hosted by pod 0 and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pod_command: restarted
workers get a fresh store, pytorch/pytorch#135712), mount /dev/shm in memory and a ReadWriteMany claim
(checkpoint_claim); a worker given `--backend nccl` refuses to start without CUDA. The checks use real
parsers and the projects' own models: torchrun's argument parser and `bash -n` for SLURM (and, in the tests, a
real one-host Slurm 22.05 that runs the script with `sbatch`); the `kubernetes`
client's models (generated from the API's OpenAPI spec) for core resources; `kubeflow.training.models` for
PyTorchJob and `kubeflow_trainer_api.models` for TrainJob. A round trip through the model and back catches
misspelled fields, which the models would otherwise drop silently.

GPU sharing follows HAMi: `nvidia.com/gpu` (virtual GPUs), `nvidia.com/gpumem` (MiB of device memory each) or
`nvidia.com/gpumem-percentage`, `nvidia.com/gpucores` (percent of one GPU's cores each), `nvidia.com/priority`,
scheduler `hami-scheduler`: the defaults of HAMi's chart (charts/hami/values.yaml). HAMi's admission webhook
(pkg/scheduler/webhook.go) sets `schedulerName: hami-scheduler` on pods that ask for these names and name no
scheduler (or the default one); the generators set it anyway, so the files also work without the webhook.
With Volcano, HAMi's volcano-vgpu-device-plugin uses `volcano.sh/vgpu-number`, `volcano.sh/vgpu-memory` (or
`volcano.sh/vgpu-memory-percentage`) and `volcano.sh/vgpu-cores`, and Volcano's scheduler places the pods.
"""
from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.lessons.system import pinned

RENDEZVOUS_PORT = 29500
HAMI_SCHEDULER = "hami-scheduler"
VOLCANO_SCHEDULER = "volcano"
HAMI_NAMES = {"count": "nvidia.com/gpu", "memory": "nvidia.com/gpumem", "cores": "nvidia.com/gpucores",
              "memory_percent": "nvidia.com/gpumem-percentage", "priority": "nvidia.com/priority"}
VOLCANO_VGPU_NAMES = {"count": "volcano.sh/vgpu-number", "memory": "volcano.sh/vgpu-memory",
                      "cores": "volcano.sh/vgpu-cores", "memory_percent": "volcano.sh/vgpu-memory-percentage"}
_SHARES = ("memory", "memory_percent", "cores")
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PYTORCHJOB_CONTAINER = "pytorch"  # the container the training operator configures (kubeflow.training.constants)
PYTORCHJOB_PORT_NAME = "pytorchjob-port"  # the port it reads MASTER_PORT from (PytorchJobDefaultPortName)
# c10d's own default port (DEFAULT_PORT in torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py) is
# 29400; 29500 is torchrun's default --master-port (static backend). Any free port works when it is spelled out.
TRAINER_RUNTIME, TRAINER_JOB, TRAINER_CONTAINER = "torch-distributed", "node", "node"  # Trainer v2's torch runtime
TRAINER_PATCH_MANAGER = "lessons.example.com/job-files"  # who owns our runtime patch (any unique name)
# Kubeflow Trainer's TrainJob has spec.runtimePatches from v2.2.0 (kubeflow/trainer PR #3199/#3309; the
# kubeflow-trainer-api 2.2.0 models are the first with TrainerV1alpha1RuntimePatch, 2.1.0 has PodTemplateOverride):
# Trainer v2.0/v2.1 reject these TrainJobs. Trainer v2.3 changed how patches merge (strategic merge patch).
TRAINER_MIN_VERSION = "2.2.0"
WHEEL_CUDA = "13.0"  # torch.version.cuda of the pinned torch's PyPI wheel (tests/test_cluster.py checks it)
_BASE_RESOURCES = {"cpu", "memory", "ephemeral-storage"}
# torch's opt-out of the agent-shared TCPStore (use_agent_store in torch/distributed/elastic/rendezvous/
# dynamic_rendezvous.py): each round gets a fresh store, so restarted workers never read a dead group's keys
# (pytorch/pytorch#135712). It acts on the c10d rendezvous only: the static one always shares its store.
SHARE_STORE_OPT_OUT = {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}
CHECKPOINT_CLAIM, SHM_VOLUME = "checkpoints", "dshm"
# After SIGTERM torchrun forwards the signal to its workers and SIGKILLs those still running --shutdown-timeout
# seconds later (default 30, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT: torch/distributed/launcher/api.py:148-152;
# _shutdown in torch/distributed/elastic/agent/server/api.py:752-754; tests/test_fault_tolerance.py runs it).
# The scheduler's own deadline must come later:
# Slurm's warning comes STOP_MARGIN seconds more before the time limit, and a pod's grace period is STOP_MARGIN
# seconds longer than torchrun's timeout, so that torchrun itself can exit before the scheduler's SIGKILL.
STOP_MARGIN = 30
MIN_STOP_MARGIN = 10  # what the checks insist on between torchrun's deadline and the scheduler's
KUBERNETES_GRACE_DEFAULT = 30  # terminationGracePeriodSeconds when a pod does not set it


@dataclass(frozen=True)
class JobSize:
    """How big the job is: nodes x processes per node, and what each process gets."""

    nodes: int = 2
    gpus_per_node: int = 1
    cpus_per_process: int = 4
    gpu_memory_mib: int | None = None  # HAMi share of one GPU's memory; None = the whole GPU
    gpu_cores_percent: int | None = None  # HAMi share of one GPU's compute; None = the whole GPU
    memory_gib: int = 32  # host memory per node (pod): requested and limited, /dev/shm included
    shm_gib: int = 8  # the memory-backed /dev/shm per pod; it counts against memory_gib
    max_restarts: int = 1  # torchrun's --max-restarts: worker restarts inside one agent's life
    stop_seconds: int = 120  # after SIGTERM, what every worker gets to finish its step and save (--shutdown-timeout)
    backoff_limit: int | None = None  # the Kubernetes jobs' backoffLimit; None = nodes + 1 (job_backoff_limit)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def job_backoff_limit(self) -> int:
        """backoffLimit for the Kubernetes jobs: `backoff_limit`, or nodes + 1. A failure that takes the rendezvous
        host down (pod 0's agent) takes every other agent down with it, so one such failure costs `nodes`
        container restarts (PyTorchJob) or failed pods (Indexed Job). The PyTorchJob fails when the restarts
        *reach* backoffLimit (PastBackoffLimit: `>=`), a Job when its failed pods *exceed* it: with nodes + 1 both
        survive one whole-job failure."""
        return self.nodes + 1 if self.backoff_limit is None else self.backoff_limit

    @property
    def stop_window(self) -> int:
        """Seconds between the scheduler's SIGTERM and its SIGKILL (or the time limit): Slurm's --signal lead and a
        pod's terminationGracePeriodSeconds. torchrun's --shutdown-timeout (stop_seconds) ends STOP_MARGIN earlier."""
        return self.stop_seconds + STOP_MARGIN

    @property
    def shares_gpus(self) -> bool:
        return self.gpu_memory_mib is not None or self.gpu_cores_percent is not None


def torchrun_command(script: str, size: JobSize, endpoint: str, job_id: str,
                     args: tuple | list = ()) -> list[str]:
    """The torchrun command line every node runs (the same on all nodes: c10d assigns node ranks)."""
    return ["torchrun", f"--nnodes={size.nodes}", f"--nproc-per-node={size.gpus_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}",
            f"--max-restarts={size.max_restarts}", f"--shutdown-timeout={size.stop_seconds}", script,
            *map(str, args)]


# ---------------------------------------------------------------------------- SLURM

def slurm_script(script: str, size: JobSize, args: tuple | list = (), job_name: str = "ddp-train",
                 time_limit: str = "01:00:00", workdir: str | Path | None = None, setup: str | None = None,
                 output: str = "%x-%j.out", port: int | None = None) -> str:
    """A batch script for `sbatch`: one torchrun agent per node (srun), agents meet at the first node.

    The rendezvous port is the job's own, `20000 + SLURM_JOB_ID % 20000` (or `port`), and each node says whether
    it hosts the rendezvous store (`is_host`, node 0 only). A fixed port is not enough on a shared node: when
    another job's agent already holds it, an agent that only *guessed* it was the host retries as a client
    (c10d_rendezvous_backend.py, `for is_server in [is_host, False]`) and silently joins that job's store. With
    `is_host` given, a taken port is an error instead. The torchrun line runs under `bash -c` so that each node's
    task reads its own SLURM_NODEID. `#SBATCH --signal=TERM@<size.stop_window>` has Slurm send SIGTERM to the
    job's steps (the torchrun agents, which forward it to their workers) that long before the time limit: torchrun's
    --shutdown-timeout (size.stop_seconds) for the workers to save, and STOP_MARGIN more for torchrun to exit. And
    `--requeue` lets Slurm requeue the job after a node failure or a preemption: a worker that saves on SIGTERM
    (fault_tolerance_train.py does) then resumes with nothing lost.

    It runs as written from any folder: `#SBATCH --chdir` moves the job into `workdir` (default: this repository,
    which on a cluster lives on the shared filesystem that every node mounts), so the relative `script` and any
    relative path in `args` (a checkpoint) resolve there, on every node. `setup` is the shell line that puts
    torchrun and the `helpers` package on PATH on each node (default: activate the virtual environment this
    Python runs in; on a cluster, a `module load` or a container line goes here). `output` is relative to
    `workdir` unless absolute; its folder must exist when the job starts (Slurm opens it before the script runs).

    Since Slurm 22.05, srun no longer inherits --cpus-per-task from the allocation: without passing it on, each
    task counts as needing one CPU, and task/affinity binds it (the agent and all of its workers) to that one CPU.
    """
    import sys

    from helpers import REPO_ROOT

    workdir = Path(workdir or REPO_ROOT).resolve()
    if setup is None:
        setup = "# no virtual environment here: torchrun and helpers must already be on PATH on every node"
        if sys.prefix != sys.base_prefix:  # a virtual environment; inside the repository, it moves with workdir
            venv = Path(sys.prefix).resolve()
            if venv.is_relative_to(REPO_ROOT.resolve()):
                venv = workdir / venv.relative_to(REPO_ROOT.resolve())
            setup = f"source {shlex.quote(str(venv / 'bin' / 'activate'))}"
    command = torchrun_command(script, size, "$HEAD_NODE:$RDZV_PORT", "$SLURM_JOB_ID", args)
    words = [word if word.startswith("--rdzv") else shlex.quote(word) for word in command]
    at = words.index(shlex.quote(script))
    is_host = '--rdzv-conf=is_host=$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)'
    on_each_node = " ".join(["exec", *words[:at], is_host, *words[at:]])
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={size.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={size.gpus_per_node}",
        f"#SBATCH --cpus-per-task={size.cpus_per_process * size.gpus_per_node}",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={output}",
        f"#SBATCH --signal=TERM@{size.stop_window}",
        "#SBATCH --requeue",
        "set -euo pipefail",
        setup,
        # sed reads the whole list: `head -n 1` would exit early, and scontrol's SIGPIPE would end the script
        # under `set -o pipefail` once the host list is long enough
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"RDZV_PORT={port}" if port is not None else "RDZV_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        "export HEAD_NODE RDZV_PORT",
        f"export OMP_NUM_THREADS={size.cpus_per_process}",
        f"export {SHARE_STORE_OPT_OUT['name']}={SHARE_STORE_OPT_OUT['value']}",
        f"srun --cpus-per-task=$SLURM_CPUS_PER_TASK bash -c {shlex.quote(on_each_node)}",
        "",
    ])


def check_slurm_script(text: str) -> list[str]:
    """Parse the script with `bash -n` and torchrun's own parser; return the torchrun arguments it passes.

    The `#SBATCH` lines are only compared with the options `slurm_script` writes (no Slurm tool is needed here);
    tests/test_slurm.py submits the generated script to a real one-host Slurm with `sbatch`.

    Also checks the arithmetic: one torchrun process per allocated GPU; srun passes --cpus-per-task on to the
    agent, and the threads of all of a node's workers (OMP_NUM_THREADS x --nproc-per-node) fit in it.
    """
    from torch.distributed.run import get_args_parser

    known = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "chdir", "output",
             "signal", "requeue"}
    sbatch = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            option, _, value = line.split()[1].lstrip("-").partition("=")
            if option not in known:
                raise ValueError(f"unexpected #SBATCH option {option!r} in: {line}")
            sbatch[option] = value
    syntax = subprocess.run(["bash", "-n"], check=False, input=text, capture_output=True, text=True)
    if syntax.returncode != 0:
        raise ValueError(f"bash rejects the script: {syntax.stderr.strip()}")
    srun = next((line for line in text.splitlines() if line.startswith("srun ")), None)
    if srun is None or " torchrun " not in f" {srun} ":
        raise ValueError("the script has no `srun ... torchrun ...` line")
    words = shlex.split(srun)
    if "bash" in words and words[words.index("bash") + 1] == "-c":  # the line each node's task runs
        srun_options, inner = words[1:words.index("bash")], words[words.index("bash") + 2]
        arguments = slurm_node_arguments(inner, node_id=0)
        if "--rdzv-conf=is_host=1" not in arguments or "--rdzv-conf=is_host=0" not in slurm_node_arguments(inner, 1):
            raise ValueError("the nodes are not told whether they host the rendezvous store (--rdzv-conf=is_host=1 "
                             "on node 0 only): an agent that guesses can join another job's store on a shared node")
    else:
        srun_options, arguments = words[1:words.index("torchrun")], words[words.index("torchrun") + 1:]
    inherits = re.search(r"^export SRUN_CPUS_PER_TASK=\$SLURM_CPUS_PER_TASK$", text, re.MULTILINE)
    if "--cpus-per-task=$SLURM_CPUS_PER_TASK" not in srun_options and not inherits:
        raise ValueError("srun does not pass --cpus-per-task on (Slurm >= 22.05 does not inherit it): "
                         "every agent and its workers would get one CPU")
    try:
        parsed = get_args_parser().parse_args(arguments)  # torchrun's own parser
    except SystemExit:
        raise ValueError(f"torchrun rejects its arguments: {' '.join(arguments)}") from None
    gpus = sbatch.get("gpus-per-node")
    if gpus is not None and str(parsed.nproc_per_node) != gpus:
        raise ValueError(f"--nproc-per-node={parsed.nproc_per_node} but #SBATCH --gpus-per-node={gpus}: one process "
                         f"per GPU, or some GPUs idle (or two processes share one, which NCCL refuses)")
    lead = re.fullmatch(r"(?:B:)?TERM@(\d+)", sbatch.get("signal", ""))
    shutdown_timeout = 30 if parsed.shutdown_timeout is None else parsed.shutdown_timeout  # launcher/api.py:149-152
    if lead is None or int(lead[1]) < shutdown_timeout + MIN_STOP_MARGIN:
        raise ValueError(f"#SBATCH --signal={sbatch.get('signal')} but torchrun --shutdown-timeout="
                         f"{shutdown_timeout}: SIGTERM must come at least --shutdown-timeout + "
                         f"{MIN_STOP_MARGIN} s before the time limit, or the workers get less time to save than "
                         f"torchrun gives them")
    threads = re.search(r"^export OMP_NUM_THREADS=(\d+)$", text, re.MULTILINE)
    if threads and int(threads[1]) * int(parsed.nproc_per_node) > int(sbatch.get("cpus-per-task", 1)):
        raise ValueError(f"OMP_NUM_THREADS={threads[1]} x {parsed.nproc_per_node} processes oversubscribe "
                         f"--cpus-per-task={sbatch.get('cpus-per-task', 1)}")
    return arguments


def slurm_node_arguments(line: str, node_id: int) -> list[str]:
    """The torchrun arguments of the script's `bash -c 'exec torchrun ...'` line as the node with SLURM_NODEID =
    node_id expands them (torchrun swapped for printf; the batch shell's exports stand in as placeholders)."""
    if not line.startswith("exec torchrun "):
        raise ValueError(f"expected 'exec torchrun ...' under bash -c, got {line[:40]!r}")
    env = {"SLURM_NODEID": str(node_id), "HEAD_NODE": "head-node", "RDZV_PORT": "20007", "SLURM_JOB_ID": "7",
           "PATH": "/usr/bin:/bin"}
    shown = subprocess.run(["bash", "-c", "printf '%s\\n' " + line.removeprefix("exec torchrun ")], env=env,
                           check=True, capture_output=True, text=True)
    return shown.stdout.splitlines()


def second_job_on_a_taken_port(timeout: float = 60) -> dict[str, str]:
    """Two jobs, one node, one fixed rendezvous port. Another process ("job1") hosts a TCPStore on the port and
    writes owner=job1 into it; then this process starts "job2"'s c10d rendezvous backend at the same endpoint, twice:
    letting it guess whether it is the host (as a script without is_host does), and telling it (is_host=1).
    Returns what each attempt got: the owner key it could read, or the error it raised."""
    import select
    import sys

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    from helpers.launcher.api import free_port

    port = free_port()
    job1 = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                             f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, multi_tenant=True); "
                             "s.set('owner', 'job1'); print('ready', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    outcomes = {}
    try:
        ready, _, _ = select.select([job1.stdout], [], [], timeout)  # job1 says so once its store holds the key
        if not ready or job1.stdout.readline().strip() != "ready":
            raise RuntimeError(f"job1's store did not start within {timeout:g} s")
        for case, config in (("is_host guessed", {}), ("is_host=1", {"is_host": "1"})):
            parameters = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="job2",
                                              min_nodes=1, max_nodes=1, read_timeout="5", **config)
            try:
                _, store = create_backend(parameters)
                outcomes[case] = f"joined a store that says owner={store.get('owner').decode()}"
            except Exception as error:  # what it raised is the result
                outcomes[case] = f"refused: {type(error).__name__}: {str(error).splitlines()[0]}"
    finally:
        job1.kill()
        job1.wait()
    return outcomes


# ---------------------------------------------------------------------------- the image


def dockerfile() -> str:
    """A minimal image with this repository's code and the lessons' torch. Build it from the repository root:
    `docker build -f runs/cluster/Dockerfile -t REGISTRY/ddp-train:TAG .` and push it where the cluster pulls.
    PyPI's Linux torch wheels bring their CUDA libraries; the nodes need the NVIDIA driver, new enough for the
    wheel's CUDA (torch.version.cuda), and GPUs the wheel has kernels for (torch._C._cuda_getArchFlags())."""
    return "\n".join([
        "# The code must be in the image: the manifests run helpers/workers/... inside it.",
        "FROM python:3.11-slim",
        "WORKDIR /workspace",
        f"# PyPI's Linux wheel of torch {pinned('torch')} is its CUDA {WHEEL_CUDA} build: GPUs sm_75 (Turing) and",
        "# newer, and an NVIDIA driver of the R580 series or newer on the nodes.",
        "# For older drivers, add PyTorch's index of a CUDA 12 build that pytorch.org lists for this release:",
        "#   --index-url https://download.pytorch.org/whl/cu12X --extra-index-url https://pypi.org/simple",
        f"RUN pip install --no-cache-dir torch=={pinned('torch')} numpy=={pinned('numpy')}",
        "COPY pyproject.toml ./",
        "COPY helpers/ helpers/",
        "RUN pip install --no-cache-dir --no-deps .",
        "",
    ])


def image_name(registry: str = "registry.example.com/lessons") -> str:
    return f"{registry}/ddp-train:torch-{pinned('torch')}"


# ---------------------------------------------------------------------------- Kubernetes pods

def _gpu_names(gang: str | None) -> dict[str, str]:
    return VOLCANO_VGPU_NAMES if gang == "volcano" else HAMI_NAMES


def _resources(size: JobSize, gang: str | None = None) -> dict[str, dict[str, str]]:
    """GPU requests as HAMi reads them (limits), CPUs and host memory; quantities are strings, as the API wants.

    Memory is requested and limited: without a request the scheduler does not count the pod's host memory, and
    under memory pressure the node evicts it before pods that did ask; the limit bounds /dev/shm too."""
    names = _gpu_names(gang) if size.shares_gpus else HAMI_NAMES
    limits = {names["count"]: str(size.gpus_per_node)}
    if size.gpu_memory_mib is not None:
        limits[names["memory"]] = str(size.gpu_memory_mib)
    if size.gpu_cores_percent is not None:
        limits[names["cores"]] = str(size.gpu_cores_percent)
    cpus, memory = str(size.cpus_per_process * size.gpus_per_node), f"{size.memory_gib}Gi"
    return {"limits": {**limits, "cpu": cpus, "memory": memory}, "requests": {"cpu": cpus, "memory": memory}}


def _scheduler(size: JobSize, gang: str | None) -> str | None:
    if gang == "volcano":
        return VOLCANO_SCHEDULER  # gang scheduling, and (with HAMi's plugin) GPU shares too
    return HAMI_SCHEDULER if size.shares_gpus else None  # None: the default scheduler


def _container(name: str, command: list[str], image: str, size: JobSize, gang: str | None,
               port_name: str) -> dict:
    return {"name": name, "image": image, "command": list(command),
            "env": [dict(SHARE_STORE_OPT_OUT)],
            "ports": [{"name": port_name, "containerPort": RENDEZVOUS_PORT}],
            "resources": _resources(size, gang),
            "volumeMounts": _volume_mounts()}


def _volume_mounts() -> list[dict]:
    return [{"name": CHECKPOINT_CLAIM, "mountPath": "/checkpoints"}, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}]


def _volumes(size: JobSize) -> list[dict]:
    """The shared checkpoint claim, and /dev/shm in memory: a container's own /dev/shm is 64 MiB by default, too
    small for NCCL's shared-memory transport between the GPUs of a pod and for DataLoader workers. What is written
    there counts against the container's memory limit; sizeLimit bounds it (without it, a memory-backed emptyDir
    is a tmpfs bounded only by the node)."""
    return [{"name": CHECKPOINT_CLAIM, "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}},
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": f"{size.shm_gib}Gi"}}]


def _pod_spec(container: dict, size: JobSize, restart_policy: str | None, gang: str | None) -> dict:
    spec = {"restartPolicy": restart_policy} if restart_policy else {}
    spec.update({"containers": [container], "volumes": _volumes(size),
                 "terminationGracePeriodSeconds": size.stop_window})
    scheduler = _scheduler(size, gang)
    if scheduler:
        spec["schedulerName"] = scheduler
    return spec


def checkpoint_claim(storage: str = "100Gi", storage_class: str | None = None) -> dict:
    """The PersistentVolumeClaim `checkpoints` that every pod of the job mounts.

    ReadWriteMany, because the pods run on different nodes and all mount it at once: a ReadWriteOnce volume
    attaches to one node, and a second pod elsewhere stays in ContainerCreating ("Multi-Attach error"). It needs
    a storage class that offers ReadWriteMany (NFS, CephFS, a cloud file store); block storage does not.
    """
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": storage}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CHECKPOINT_CLAIM}, "spec": spec}


def check_shared_claim(claim: dict) -> Any:
    """The claim matches the Kubernetes schema and every node can mount it at once (ReadWriteMany)."""
    typed = validate(claim, "V1PersistentVolumeClaim")
    modes = claim.get("spec", {}).get("accessModes", [])
    if "ReadWriteMany" not in modes:
        raise ValueError(f"accessModes {modes}: pods on several nodes mount the checkpoints, which needs "
                         f"ReadWriteMany (ReadWriteOnce attaches to one node: the others wait with a "
                         f"Multi-Attach error)")
    return typed


def check_stop_window(pod: dict) -> None:
    """The pod's terminationGracePeriodSeconds (30 when unset) outlasts its torchrun's --shutdown-timeout (30 when
    not given) by MIN_STOP_MARGIN at least: else the kubelet SIGKILLs the workers before torchrun's own deadline,
    and a worker still saving its checkpoint dies mid-write."""
    grace = pod.get("terminationGracePeriodSeconds", KUBERNETES_GRACE_DEFAULT)
    for container in pod.get("containers", []):
        words = [word for part in container.get("command", []) + container.get("args", []) for word in part.split()]
        if not any(word.endswith("torchrun") for word in words):
            continue
        timeouts = [int(w.partition("=")[2]) for w in words if w.startswith("--shutdown-timeout=")]
        timeout = timeouts[0] if timeouts else 30
        if grace < timeout + MIN_STOP_MARGIN:
            raise ValueError(f"container {container.get('name')!r}: terminationGracePeriodSeconds={grace} but "
                             f"torchrun --shutdown-timeout={timeout}: the grace period must be at least "
                             f"--shutdown-timeout + {MIN_STOP_MARGIN} s, or the kubelet kills the workers while "
                             f"they save")


def check_shared_memory(pod: dict) -> None:
    """Every container mounts a memory-backed emptyDir at /dev/shm (NCCL's shared-memory transport, DataLoader
    workers: the default 64 MiB is too small)."""
    memory = {v["name"] for v in pod.get("volumes", []) if (v.get("emptyDir") or {}).get("medium") == "Memory"}
    for container in pod.get("containers", []):
        mounts = {(m.get("mountPath") or "").rstrip("/"): m.get("name") for m in container.get("volumeMounts", [])}
        if mounts.get("/dev/shm") not in memory:
            raise ValueError(f"container {container.get('name')!r}: no memory-backed emptyDir "
                             f"(emptyDir: {{medium: Memory}}) mounted at /dev/shm; the default is 64 MiB")


def _metadata(name: str, gang: str | None, queue: str) -> dict:
    if gang not in (None, "volcano", "kueue"):
        raise ValueError(f"gang must be None, 'volcano' or 'kueue', got {gang!r}")
    metadata = {"name": name}
    if gang == "kueue":  # Kueue admits the whole job at once, when its LocalQueue has quota for every pod
        metadata["labels"] = {KUEUE_QUEUE_LABEL: queue}
    return metadata


# ---------------------------------------------------------------------------- Kubernetes jobs

def pytorch_job(name: str, image: str, script: str, size: JobSize, args: tuple | list = (),
                gang: str | None = None, queue: str = "default") -> dict:
    """A Kubeflow Training Operator v1 PyTorchJob (kubeflow.org/v1; legacy since Kubeflow Trainer v2).

    The operator sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT
    (and MASTER_ADDR/MASTER_PORT) in every pod. MASTER_PORT comes from the port named `pytorchjob-port` on the
    container named `pytorch`. The command uses them for a c10d rendezvous at the Master, hosted by the Master's
    agent (is_host from PET_NODE_RANK), so that TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 applies (pod_command).
    Restarts: torchrun restarts its workers --max-restarts times; after that (or when the agent itself dies)
    restartPolicy OnFailure restarts the container in place, and the operator fails the job when the container
    restarts of its running pods add up to runPolicy.backoffLimit (PastBackoffLimit in the Training Operator's
    pkg/core/job.go: `>=`). backoffLimit is size.job_backoff_limit (nodes + 1 by default), not --max-restarts:
    a restart of the Master's container takes the rendezvous store down and every other agent with it.
    The replica spec carries restartPolicy; the pod template does not (the operator overwrites a template's
    restartPolicy with the replica's, with a Warning event: pod.go in controller.v1/common).
    gang="volcano": runPolicy.schedulingPolicy (a Volcano PodGroup with minAvailable = nodes);
    gang="kueue": the queue label on the job.
    """
    command = pod_command(script, size, "$PET_MASTER_ADDR:$PET_MASTER_PORT", name, "PET_NODE_RANK", args)

    def replica(count: int) -> dict:
        container = _container(PYTORCHJOB_CONTAINER, command, image, size, gang, PYTORCHJOB_PORT_NAME)
        pod = _pod_spec(container, size, None, gang)  # the replica's restartPolicy is the one that counts
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}

    replicas = {"Master": replica(1)}
    if size.nodes > 1:
        replicas["Worker"] = replica(size.nodes - 1)
    # runPolicy: optional in the CRD, but the SDK's model (kubeflow.training) requires it
    spec: dict[str, Any] = {"nprocPerNode": str(size.gpus_per_node), "pytorchReplicaSpecs": replicas,
                            "runPolicy": {"backoffLimit": size.job_backoff_limit}}
    if gang == "volcano":
        spec["runPolicy"]["schedulingPolicy"] = {"minAvailable": size.nodes, "queue": queue}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(name, gang, queue),
            "spec": spec}


def train_job(name: str, image: str, script: str, size: JobSize, args: tuple | list = (),
              gang: str | None = None, queue: str = "default") -> dict:
    """A Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) on the `torch-distributed` runtime.

    Needs Trainer >= TRAINER_MIN_VERSION (runtimePatches). The runtime (a ClusterTrainingRuntime the cluster
    admin installs) holds the JobSet template and sets the PET_* variables; the TrainJob says what differs: image,
    command (a c10d rendezvous at PET_MASTER_ADDR, see pod_command), nodes, resources, the store opt-out, and a
    runtime patch that mounts the checkpoint claim and /dev/shm. Gang scheduling with Volcano or the
    coscheduling plugin is the runtime's podGroupPolicy, not the TrainJob's; gang="kueue" adds the queue label.
    """
    if gang == "volcano":
        raise ValueError("a TrainJob gets Volcano gang scheduling from its runtime's podGroupPolicy; "
                         "use a runtime that sets it, or gang='kueue'")
    pod_patch = {"volumes": _volumes(size), "terminationGracePeriodSeconds": size.stop_window,
                 "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": _volume_mounts()}]}
    patch = {"manager": TRAINER_PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": TRAINER_JOB, "template": {"spec": {"template": {"spec": pod_patch}}}}]}}}}
    trainer = {"image": image,
               "command": pod_command(script, size, "$PET_MASTER_ADDR:$PET_MASTER_PORT", name, "PET_NODE_RANK",
                                      args),
               "env": [dict(SHARE_STORE_OPT_OUT)],
               "numNodes": size.nodes, "numProcPerNode": size.gpus_per_node,
               "resourcesPerNode": _resources(size, gang)}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": _metadata(name, gang, queue),
            "spec": {"runtimeRef": {"name": TRAINER_RUNTIME}, "trainer": trainer, "runtimePatches": [patch]}}


def pod_command(script: str, size: JobSize, endpoint: str, job_id: str, index_variable: str,
                args: tuple | list = ()) -> list[str]:
    """The container's command: torchrun under `sh -c`, with a c10d rendezvous at `endpoint` (shell variables
    allowed, e.g. "$PET_MASTER_ADDR:$PET_MASTER_PORT"), and the pod whose `index_variable` is 0 told to host the
    rendezvous store (is_host=1), every other pod not.

    Without is_host the agent guesses (_matches_machine_hostname in torch/distributed/elastic/rendezvous/
    utils.py): it resolves the endpoint's DNS name and compares it with its own addresses. If pod 0 starts
    before its DNS record exists, the guess is "not me": every agent is then a client of a store nobody hosts,
    and fails with RendezvousConnectionError after its read_timeout (60 s by default).
    c10d, not the static rendezvous, so that TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (in the container's env) gives
    every round a fresh store: a replaced pod or a restarted container comes back with
    TORCHELASTIC_RESTART_COUNT=0 while its peers count on, so no store prefix can be built from that count.
    """
    words = [word if word.startswith("--rdzv-endpoint=") else shlex.quote(word)
             for word in torchrun_command(script, size, endpoint, job_id, args)]
    at = words.index(shlex.quote(script))
    is_host = f'--rdzv-conf=is_host=$([ "${index_variable}" = 0 ] && echo 1 || echo 0)'
    return ["sh", "-c", " ".join(["exec", *words[:at], is_host, *words[at:]])]


def indexed_command(script: str, size: JobSize, endpoint: str, job_id: str, args: tuple | list = ()) -> list[str]:
    """The Indexed Job's command: pod_command with pod 0 being JOB_COMPLETION_INDEX=0 (set by the Job controller)."""
    return pod_command(script, size, endpoint, job_id, "JOB_COMPLETION_INDEX", args)


def check_pod_command(command: list[str], env: dict[str, str]) -> Any:
    """Run a pod's `sh -c` line with the environment `env`, with torchrun swapped for printf, and parse the words
    it would pass with torchrun's own parser; return the parsed arguments."""
    from torch.distributed.run import get_args_parser

    if command[:2] != ["sh", "-c"] or not command[2].startswith("exec torchrun "):
        raise ValueError(f"expected ['sh', '-c', 'exec torchrun ...'], got {command[:3]!r}")
    line = "printf '%s\\n' " + command[2].removeprefix("exec torchrun ")
    shown = subprocess.run(["sh", "-c", line], check=True, capture_output=True, text=True,
                           env={**env, "PATH": "/usr/bin:/bin"})
    try:
        return get_args_parser().parse_args(shown.stdout.splitlines())
    except SystemExit:
        raise ValueError(f"torchrun rejects: {shown.stdout!r}") from None


def check_indexed_command(command: list[str], index: int) -> Any:
    """check_pod_command as Indexed Job pod `index` runs it (JOB_COMPLETION_INDEX=index)."""
    return check_pod_command(command, {"JOB_COMPLETION_INDEX": str(index)})


def indexed_job(name: str, image: str, script: str, size: JobSize, args: tuple | list = (),
                gang: str | None = None, queue: str = "default") -> dict:
    """Plain Kubernetes: an Indexed Job (one pod per node) plus a headless Service that gives pod 0 a
    stable DNS name, `<name>-0.<name>`: the rendezvous endpoint, hosted by pod 0's torchrun agent
    (is_host=1 from JOB_COMPLETION_INDEX, see pod_command).

    Restarts: torchrun restarts its workers --max-restarts times inside the pod; after that the pod fails
    (restartPolicy Never) and the Job controller starts a replacement pod for that index, until more than
    backoffLimit pods have failed (size.job_backoff_limit: nodes + 1 by default). The replacement's agent
    joins the next rendezvous round with a restart count of 0.

    publishNotReadyAddresses: the Service publishes pod DNS records before the pods are Ready, so the
    agents can find pod 0 while they all start. gang="kueue": the queue label (Volcano would need a
    PodGroup of its own: use a PyTorchJob for that).
    """
    if gang == "volcano":
        raise ValueError("an Indexed Job needs a separate Volcano PodGroup; use gang='kueue' or a PyTorchJob")
    endpoint = f"{name}-0.{name}:{RENDEZVOUS_PORT}"
    command = indexed_command(script, size, endpoint, name, args)
    pod = _pod_spec(_container(PYTORCHJOB_CONTAINER, command, image, size, gang, "c10d"), size, "Never", gang)
    pod["subdomain"] = name  # pod DNS names live under the headless Service
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(name, gang, queue),
           "spec": {"completionMode": "Indexed", "completions": size.nodes, "parallelism": size.nodes,
                    "backoffLimit": size.job_backoff_limit,
                    "template": {"metadata": {"labels": {"job-name": name}}, "spec": pod}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": name},
                        "ports": [{"name": "c10d", "port": RENDEZVOUS_PORT}]}}
    return {"job": job, "service": service}


def write_job_files(folder: str | Path, script: str, size: JobSize, args: tuple | list = (),
                    name: str = "ddp-train", image: str | None = None,
                    slurm_args: tuple | list | None = None, workdir: str | Path | None = None,
                    setup: str | None = None) -> list[Path]:
    """Write the Dockerfile, the SLURM script, every manifest and the checkpoint claim into `folder`; return
    their paths. `slurm_args` replaces `args` in the SLURM script (a checkpoint path on the shared filesystem
    rather than the pods' mount). `workdir` and `setup` go to slurm_script: by default the script runs in this
    repository with this Python's virtual environment, which is right only on the cluster itself (a repository
    on the shared filesystem); given a `workdir`, the job's output goes to `workdir` (relative to --chdir),
    else beside the job files."""
    import yaml

    image = image or image_name()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plain = indexed_job(name, image, script, size, args)
    output = "%x-%j.out" if workdir is not None else str(folder.resolve() / "%x-%j.out")
    batch = slurm_script(script, size, args if slurm_args is None else slurm_args, job_name=name,
                         workdir=workdir, setup=setup, output=output)
    texts = {"Dockerfile": dockerfile(), "job.sbatch": batch,
             "pytorchjob.yaml": yaml.safe_dump(pytorch_job(name, image, script, size, args), sort_keys=False),
             "trainjob.yaml": yaml.safe_dump(train_job(name, image, script, size, args), sort_keys=False),
             "indexed-job.yaml": yaml.safe_dump_all([plain["service"], plain["job"]], sort_keys=False),
             "checkpoints-pvc.yaml": yaml.safe_dump(checkpoint_claim(), sort_keys=False)}
    for file_name, text in texts.items():
        (folder / file_name).write_text(text)
    return [folder / file_name for file_name in texts]


# ---------------------------------------------------------------------------- validation

def validate(manifest: dict, model: str) -> Any:
    """Check `manifest` against the Kubernetes API schema (e.g. model="V1Job"); return the model.

    The kubernetes client deserializes into typed models, which rejects missing required fields and wrong
    types; serializing back and comparing catches fields the schema does not know (a misspelled
    `restartPolcy` would otherwise vanish silently). Pod templates also get check_gpu_resources,
    check_shared_memory and check_stop_window.
    """
    from kubernetes.client import ApiClient

    typed = _round_trip(ApiClient(), manifest, model)
    for pod in _pod_specs(manifest):
        check_gpu_resources(pod)
        check_shared_memory(pod)
        check_stop_window(pod)
    return typed


def validate_pytorch_job(manifest: dict) -> int:
    """Check a PyTorchJob with the Training Operator's own models (kubeflow.training.models, generated from
    its API types), and what the operator relies on: one Master, the `pytorch` container in every replica,
    and the Master's `pytorchjob-port`, from which the operator sets MASTER_PORT / PET_MASTER_PORT for all
    pods (getPortFromPyTorchJob in pkg/controller.v1/pytorch/envvar.go reads the Master's template only).
    Returns the number of replica templates checked."""
    from kubeflow.training.api_client import ApiClient

    if manifest.get("apiVersion") != "kubeflow.org/v1" or manifest.get("kind") != "PyTorchJob":
        raise ValueError("not a kubeflow.org/v1 PyTorchJob")
    _round_trip(ApiClient(), manifest, "KubeflowOrgV1PyTorchJob")
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    if set(replicas) - {"Master", "Worker"} or replicas.get("Master", {}).get("replicas") != 1:
        raise ValueError(f"pytorchReplicaSpecs needs exactly one Master (and may have Worker), got {replicas!r}")
    for role, replica in replicas.items():
        pod = replica["template"]["spec"]
        container = next((c for c in pod["containers"] if c["name"] == PYTORCHJOB_CONTAINER), None)
        if container is None:
            raise ValueError(f"{role}: no container named {PYTORCHJOB_CONTAINER!r}; the operator configures "
                             f"only that one")
        ports = [port.get("name") for port in container.get("ports", [])]
        if role == "Master" and PYTORCHJOB_PORT_NAME not in ports:
            raise ValueError(f"Master: no port named {PYTORCHJOB_PORT_NAME!r}; the operator takes MASTER_PORT from "
                             f"it (and adds its default, 23456, when it is missing: a port under another name is "
                             f"never used)")
        check_gpu_resources(pod)
        check_shared_memory(pod)
        check_stop_window(pod)
    return len(replicas)


def validate_train_job(manifest: dict) -> Any:
    """Check a TrainJob with Kubeflow Trainer's own models (kubeflow_trainer_api, pydantic, from its CRDs), and
    that its runtime patches give the trainer container /dev/shm. runtimePatches need Trainer >= 2.2.0."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
    from pydantic import ValidationError

    if manifest.get("apiVersion") != "trainer.kubeflow.org/v1alpha1" or manifest.get("kind") != "TrainJob":
        raise ValueError("not a trainer.kubeflow.org/v1alpha1 TrainJob")
    try:
        typed = TrainerV1alpha1TrainJob.from_dict(manifest)
    except ValidationError as error:
        raise ValueError(f"TrainerV1alpha1TrainJob: {error}") from None
    problems = _differences(manifest, typed.to_dict(), "TrainJob")
    if problems:
        raise ValueError("TrainJob does not match Kubeflow Trainer's schema:\n  " + "\n  ".join(problems))
    # The runtime's pod template picks the scheduler; HAMi's admission webhook sets it for pods asking for shares.
    resources = manifest["spec"].get("trainer", {}).get("resourcesPerNode", {})
    check_gpu_resources({"containers": [{"resources": resources}]}, scheduler_set_elsewhere=True)
    pods = [job["template"]["spec"]["template"]["spec"] for patch in manifest["spec"].get("runtimePatches", [])
            for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"] if job["name"] == TRAINER_JOB]
    command = manifest["spec"].get("trainer", {}).get("command", [])
    for pod in pods:
        check_shared_memory(pod)
        check_stop_window({**pod, "containers": [{"name": TRAINER_CONTAINER, "command": command}]})
    if not pods:
        raise ValueError(f"no runtime patch for the {TRAINER_JOB!r} job: its pods get no /dev/shm volume")
    return typed


def check_gpu_resources(pod: dict, scheduler_set_elsewhere: bool = False) -> None:
    """The GPU resource names of a pod are ones HAMi (or Volcano's vGPU plugin) serves, in `limits`, with the
    count beside any share, a share within bounds, and a scheduler that understands them: for HAMi's names
    hami-scheduler, or none / the default one (HAMi's webhook then sets hami-scheduler); for Volcano's,
    volcano (no webhook sets it)."""
    for container in pod.get("containers", []):
        resources = container.get("resources", {})
        limits, requests = resources.get("limits", {}), resources.get("requests", {})
        for names, schedulers in ((HAMI_NAMES, (HAMI_SCHEDULER, None, "default-scheduler")),
                                  (VOLCANO_VGPU_NAMES, (VOLCANO_SCHEDULER,))):
            shares = [names[kind] for kind in _SHARES if names[kind] in limits]
            if shares and names["count"] not in limits:
                raise ValueError(f"{shares} without {names['count']}: a share is per GPU, the count is needed")
            for kind in ("cores", "memory_percent"):
                percent = limits.get(names[kind])
                if percent is not None and not 0 < int(percent) <= 100:
                    raise ValueError(f"{names[kind]}={percent}: a percent of one GPU, 1..100")
            if shares and pod.get("schedulerName") not in schedulers and not scheduler_set_elsewhere:
                raise ValueError(f"{shares} need schedulerName {schedulers[0]!r}, got {pod.get('schedulerName')!r}: "
                                 f"that scheduler does not know these names")
        known = _BASE_RESOURCES | set(HAMI_NAMES.values()) | set(VOLCANO_VGPU_NAMES.values())
        for key in [*limits, *requests]:
            if key not in known:
                raise ValueError(f"unknown resource name {key!r}; HAMi's NVIDIA names are "
                                 f"{sorted(HAMI_NAMES.values())}")
        gpu_requests = [key for key in requests if key not in _BASE_RESOURCES]
        if gpu_requests:
            raise ValueError(f"{gpu_requests} belong in limits: extended resources are set there")


def _pod_specs(manifest: dict) -> list[dict]:
    spec = manifest.get("spec", {})
    template = spec.get("template", manifest.get("template"))
    return [template["spec"]] if isinstance(template, dict) and "spec" in template else []


def _round_trip(client: Any, manifest: dict, model: str) -> Any:
    try:
        typed = client._ApiClient__deserialize(manifest, model)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{model}: {error}") from None
    problems = _differences(manifest, client.sanitize_for_serialization(typed), model)
    if problems:
        raise ValueError(f"{model} does not match the schema:\n  " + "\n  ".join(problems))
    return typed


def _differences(sent: Any, kept: Any, where: str) -> list[str]:
    if isinstance(sent, dict) and isinstance(kept, dict):
        problems = [f"{where}.{key}: unknown field" for key in sent if key not in kept]
        return problems + [p for key in sent if key in kept
                           for p in _differences(sent[key], kept[key], f"{where}.{key}")]
    if isinstance(sent, list) and isinstance(kept, list):
        pairs = enumerate(zip(sent, kept, strict=False))
        return [p for i, (a, b) in pairs for p in _differences(a, b, f"{where}[{i}]")]
    if sent != kept:
        return [f"{where}: {sent!r} is not a valid value (the schema reads it as {kept!r})"]
    return []


# ---------------------------------------------------------------------------- lesson 06's exercise

def pod_without_shared_memory() -> dict:
    """A training pod as the generators make it, minus /dev/shm: the exercise's starting point."""
    import copy

    job = indexed_job("ddp-train", image_name(), "train.py", JobSize())["job"]
    pod = copy.deepcopy(job["spec"]["template"]["spec"])
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != SHM_VOLUME]
    for container in pod["containers"]:
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != SHM_VOLUME]
    return pod


def check_shared_memory_exercise(add_shared_memory: Any) -> bool:
    """Lesson 06's exercise: does `add_shared_memory(pod)` give every container a memory-backed /dev/shm?"""
    import copy

    from kubernetes.client import ApiClient

    from helpers.lessons.checks import correct, not_yet

    pod = pod_without_shared_memory()
    pod["containers"].append({**copy.deepcopy(pod["containers"][0]), "name": "sidecar", "command": ["sleep", "1d"]})
    returned = add_shared_memory(pod)
    pod = returned if returned is not None else pod
    try:
        _round_trip(ApiClient(), pod, "V1PodSpec")
    except ValueError as error:
        return not_yet(f"the pod no longer matches the Kubernetes schema: {error}")
    if not any(v.get("persistentVolumeClaim") for v in pod.get("volumes", [])):
        return not_yet("the checkpoints volume is gone: add a volume, do not replace the list.")
    empty = [v for v in pod.get("volumes", []) if "emptyDir" in v]
    if not empty:
        return not_yet("there is no emptyDir volume yet.")
    if not any((v["emptyDir"] or {}).get("medium") == "Memory" for v in empty):
        return not_yet("the emptyDir has no `medium: Memory`: without it the volume lives on the node's disk.")
    try:
        check_shared_memory(pod)
    except ValueError as error:
        return not_yet(f"{error}. Mount the memory volume (by its name) at /dev/shm in every container.")
    if not any((v["emptyDir"] or {}).get("medium") == "Memory" and (v["emptyDir"] or {}).get("sizeLimit")
               for v in empty):
        return not_yet("the memory-backed emptyDir has no sizeLimit: without one the tmpfs is bounded only by the "
                       "node, and what is written there counts against the container's memory limit; give it a "
                       "bound (sizeLimit: 8Gi, say).")
    return correct("every container mounts a bounded, memory-backed emptyDir at /dev/shm, and the pod still matches "
                   "the Kubernetes schema.")
