"""helpers.cluster: SLURM and Kubernetes generators checked by real parsers; a real two-node launch."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from helpers import free_port, start, wait
from helpers.cluster import (
    HAMI_SCHEDULER,
    JobSize,
    check_slurm_script,
    indexed_job,
    pytorch_job,
    slurm_script,
    validate,
    validate_pytorch_job,
)

WHOAMI = Path(__file__).resolve().parent.parent / "helpers" / "workers" / "whoami.py"
SHARED = JobSize(nodes=3, gpus_per_node=2, gpu_memory_mib=4000, gpu_cores_percent=25)
IMAGE = "pytorch/pytorch:latest"


def test_slurm_script_passes_bash_and_torchrun_parsers():
    text = slurm_script("train.py", SHARED, args=["--checkpoint", "/shared/c.pt"])
    arguments = check_slurm_script(text)
    assert "--nnodes=3" in arguments and "--nproc-per-node=2" in arguments
    assert arguments[-3:] == ["train.py", "--checkpoint", "/shared/c.pt"]
    assert "#SBATCH --nodes=3" in text and "#SBATCH --ntasks-per-node=1" in text


@pytest.mark.parametrize("change, words", [
    (("--nnodes=3", "--nodes=3"), "torchrun rejects"),
    (("#SBATCH --time", "#SBATCH --tme"), "unexpected #SBATCH option"),
    (("head -n 1)", "head -n 1"), "bash rejects"),
])
def test_slurm_check_catches_mistakes(change, words):
    text = slurm_script("train.py", SHARED).replace(*change)
    with pytest.raises(ValueError, match=words):
        check_slurm_script(text)


def test_indexed_job_and_service_match_the_schema_with_hami_requests():
    manifests = indexed_job("ddp", IMAGE, "train.py", SHARED)
    job = validate(manifests["job"], "V1Job")
    validate(manifests["service"], "V1Service")
    pod = job.spec.template.spec
    assert job.spec.completions == job.spec.parallelism == 3 and job.spec.completion_mode == "Indexed"
    assert pod.scheduler_name == HAMI_SCHEDULER and pod.subdomain == "ddp"
    limits = pod.containers[0].resources.limits
    assert limits == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "4000", "nvidia.com/gpucores": "25", "cpu": "8"}
    assert "--rdzv-endpoint=ddp-0.ddp:29500" in pod.containers[0].command


def test_whole_gpus_use_the_default_scheduler():
    job = indexed_job("ddp", IMAGE, "train.py", JobSize(nodes=2, gpus_per_node=1))["job"]
    pod = validate(job, "V1Job").spec.template.spec
    assert pod.scheduler_name is None and set(pod.containers[0].resources.limits) == {"nvidia.com/gpu", "cpu"}


def test_pytorch_job_has_master_and_workers_with_valid_pod_templates():
    job = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    assert validate_pytorch_job(job) == 2
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    assert replicas["Master"]["template"] is not replicas["Worker"]["template"]  # no YAML anchors
    single = pytorch_job("ddp", IMAGE, "train.py", JobSize(nodes=1))
    assert set(single["spec"]["pytorchReplicaSpecs"]) == {"Master"}


def _job() -> dict:
    return copy.deepcopy(indexed_job("ddp", IMAGE, "train.py", SHARED)["job"])


def test_validation_catches_unknown_fields_wrong_types_and_missing_fields():
    misspelled = _job()
    misspelled["spec"]["template"]["spec"]["restartPolcy"] = "Never"
    with pytest.raises(ValueError, match="restartPolcy: unknown field"):
        validate(misspelled, "V1Job")
    wrong_type = _job()
    wrong_type["spec"]["completions"] = "three"
    with pytest.raises(ValueError, match="completions"):
        validate(wrong_type, "V1Job")
    unnamed = _job()
    del unnamed["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        validate(unnamed, "V1Job")
    bad_template = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    bad_template["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containerz"] = []
    with pytest.raises(ValueError, match="containerz"):
        validate_pytorch_job(bad_template)


def test_two_agents_make_one_job_of_four_ranks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    port = free_port()
    jobs = [start(WHOAMI, nproc=2, nnodes=2, node_rank=node, rdzv_endpoint=f"127.0.0.1:{port}",
                  rdzv_id="test", echo=False) for node in (0, 1)]
    results = {rank: info for run in wait(jobs, timeout=120) for rank, info in run.results.items()}
    assert sorted(results) == [0, 1, 2, 3]
    assert all(info["rank"] == 2 * info["node_rank"] + info["local_rank"] for info in results.values())
    assert {info["rank_sum"] for info in results.values()} == {6.0}
