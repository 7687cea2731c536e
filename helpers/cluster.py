"""Describe a multi-node torchrun job to a cluster: a SLURM batch script and Kubernetes manifests.

    from helpers.cluster import JobSize, slurm_script, check_slurm_script, pytorch_job, validate
    size = JobSize(nodes=2, gpus_per_node=4)
    print(slurm_script("train.py", size, args=["--checkpoint", "/shared/ckpt.pt"]))
    validate(indexed_job(...)["job"], "V1Job")        # the Kubernetes schema, no cluster needed

Taught in lesson 06. Every generator returns plain text or plain dicts (YAML-ready); the checks
use real parsers: torchrun's own argument parser and `bash -n` for SLURM, and the `kubernetes`
client's models (the API's schema, generated from its OpenAPI spec) for manifests.
GPU sharing follows HAMi: `nvidia.com/gpu` (virtual GPUs), `nvidia.com/gpumem` (MiB of device
memory each), `nvidia.com/gpucores` (percent of the GPU's cores each), scheduler `hami-scheduler`.
"""
from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from typing import Any

RENDEZVOUS_PORT = 29500
HAMI_SCHEDULER = "hami-scheduler"


@dataclass(frozen=True)
class JobSize:
    """How big the job is: nodes x processes per node, and what each process gets."""

    nodes: int = 2
    gpus_per_node: int = 1
    cpus_per_process: int = 4
    gpu_memory_mib: int | None = None  # HAMi share of one GPU's memory; None = the whole GPU
    gpu_cores_percent: int | None = None  # HAMi share of one GPU's compute; None = the whole GPU
    max_restarts: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def torchrun_command(script: str, size: JobSize, endpoint: str, job_id: str,
                     args: tuple | list = ()) -> list[str]:
    """The torchrun command line every node runs (the same on all nodes: c10d assigns node ranks)."""
    return ["torchrun", f"--nnodes={size.nodes}", f"--nproc-per-node={size.gpus_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}",
            f"--max-restarts={size.max_restarts}", script, *map(str, args)]


# ---------------------------------------------------------------------------- SLURM

def slurm_script(script: str, size: JobSize, args: tuple | list = (), job_name: str = "ddp-train",
                 time_limit: str = "01:00:00") -> str:
    """A batch script for `sbatch`: one torchrun agent per node (srun), agents meet at the first node."""
    command = torchrun_command(script, size, f"$HEAD_NODE:{RENDEZVOUS_PORT}", "$SLURM_JOB_ID", args)
    quoted = " ".join(word if word.startswith("--rdzv") else shlex.quote(word) for word in command)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={size.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={size.gpus_per_node}",
        f"#SBATCH --cpus-per-task={size.cpus_per_process * size.gpus_per_node}",
        f"#SBATCH --time={time_limit}",
        "#SBATCH --output=%x-%j.out",
        "set -euo pipefail",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export OMP_NUM_THREADS={size.cpus_per_process}",
        f"srun {quoted}",
        "",
    ])


def check_slurm_script(text: str) -> list[str]:
    """Parse the script as SLURM and torchrun would; return the torchrun arguments it passes."""
    from torch.distributed.run import get_args_parser

    known = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output"}
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            option = line.split()[1].lstrip("-").split("=")[0]
            if option not in known:
                raise ValueError(f"unexpected #SBATCH option {option!r} in: {line}")
    syntax = subprocess.run(["bash", "-n"], check=False, input=text, capture_output=True, text=True)
    if syntax.returncode != 0:
        raise ValueError(f"bash rejects the script: {syntax.stderr.strip()}")
    srun = next((line for line in text.splitlines() if line.startswith("srun torchrun ")), None)
    if srun is None:
        raise ValueError("the script has no `srun torchrun ...` line")
    arguments = shlex.split(srun)[2:]
    try:
        get_args_parser().parse_args(arguments)  # torchrun's own parser
    except SystemExit:
        raise ValueError(f"torchrun rejects its arguments: {' '.join(arguments)}") from None
    return arguments


# ---------------------------------------------------------------------------- Kubernetes

def _resources(size: JobSize) -> dict[str, dict[str, str]]:
    """GPU requests as HAMi reads them; quantities are strings, as the API wants them."""
    limits = {"nvidia.com/gpu": str(size.gpus_per_node)}
    if size.gpu_memory_mib is not None:
        limits["nvidia.com/gpumem"] = str(size.gpu_memory_mib)
    if size.gpu_cores_percent is not None:
        limits["nvidia.com/gpucores"] = str(size.gpu_cores_percent)
    cpus = str(size.cpus_per_process * size.gpus_per_node)
    return {"limits": {**limits, "cpu": cpus}, "requests": {"cpu": cpus}}


def _pod_spec(container: dict, size: JobSize, restart_policy: str) -> dict:
    spec = {"restartPolicy": restart_policy, "containers": [container],
            "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}}]}
    if size.gpu_memory_mib is not None or size.gpu_cores_percent is not None:
        spec["schedulerName"] = HAMI_SCHEDULER  # the scheduler that knows GPU shares
    return spec


def _container(command: list[str], image: str, size: JobSize, env: list[dict] | None = None) -> dict:
    container = {"name": "pytorch", "image": image, "command": list(command),
                 "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
                 "resources": _resources(size),
                 "volumeMounts": [{"name": "checkpoints", "mountPath": "/checkpoints"}]}
    if env:
        container["env"] = env
    return container


def pytorch_job(name: str, image: str, script: str, size: JobSize, args: tuple | list = ()) -> dict:
    """A Kubeflow PyTorchJob (kubeflow.org/v1). The training operator sets PET_NNODES,
    PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in every pod, and
    torchrun reads any option it is not given from PET_<OPTION>: the command stays short."""
    command = ["torchrun", f"--max-restarts={size.max_restarts}", script, *map(str, args)]
    def replica(count: int) -> dict:
        pod = _pod_spec(_container(command, image, size), size, "OnFailure")
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}

    replicas = {"Master": replica(1)}
    if size.nodes > 1:
        replicas["Worker"] = replica(size.nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
            "spec": {"nprocPerNode": str(size.gpus_per_node), "pytorchReplicaSpecs": replicas}}


def indexed_job(name: str, image: str, script: str, size: JobSize, args: tuple | list = ()) -> dict:
    """Plain Kubernetes: an Indexed Job (one pod per node) plus a headless Service that gives
    pod 0 a stable DNS name, `<name>-0.<name>`, used as the rendezvous endpoint."""
    endpoint = f"{name}-0.{name}:{RENDEZVOUS_PORT}"
    command = torchrun_command(script, size, endpoint, name, args)
    pod = _pod_spec(_container(command, image, size), size, "Never")
    pod["subdomain"] = name  # pod DNS names live under the headless Service
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
           "spec": {"completionMode": "Indexed", "completions": size.nodes, "parallelism": size.nodes,
                    "backoffLimit": size.max_restarts,
                    "template": {"metadata": {"labels": {"job-name": name}}, "spec": pod}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
               "spec": {"clusterIP": "None", "selector": {"job-name": name},
                        "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}}
    return {"job": job, "service": service}


def validate(manifest: dict, model: str) -> Any:
    """Check `manifest` against the Kubernetes API schema (e.g. model="V1Job"); return the model.

    The kubernetes client deserializes into typed models, which rejects missing required fields
    and wrong types; serializing back and comparing catches fields the schema does not know
    (a misspelled `restartPolcy` would otherwise vanish silently).
    """
    from kubernetes.client import ApiClient

    client = ApiClient()
    try:
        typed = client._ApiClient__deserialize(manifest, model)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{model}: {error}") from None
    back = client.sanitize_for_serialization(typed)
    problems = _differences(manifest, back, model)
    if problems:
        raise ValueError(f"{model} does not match the Kubernetes schema:\n  " + "\n  ".join(problems))
    return typed


def validate_pytorch_job(manifest: dict) -> int:
    """A PyTorchJob is a custom resource (no model in the client): check its shape and every pod
    template against V1PodTemplateSpec. Returns the number of templates checked."""
    if manifest.get("apiVersion") != "kubeflow.org/v1" or manifest.get("kind") != "PyTorchJob":
        raise ValueError("not a kubeflow.org/v1 PyTorchJob")
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    unknown = set(replicas) - {"Master", "Worker"}
    if unknown or "Master" not in replicas:
        raise ValueError(f"pytorchReplicaSpecs needs Master (and may have Worker), got {sorted(replicas)}")
    for role, replica in replicas.items():
        extra = set(replica) - {"replicas", "restartPolicy", "template"}
        if extra:
            raise ValueError(f"{role}: unknown field(s) {sorted(extra)}")
        validate(replica["template"], "V1PodTemplateSpec")
    return len(replicas)


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
