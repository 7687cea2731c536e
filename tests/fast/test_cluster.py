"""helpers.lessons.cluster: SLURM and Kubernetes generators checked by real parsers.

That two agents make one job of four ranks (rank = 2 x node rank + local rank, an all_reduce across them) is
asserted by lesson 06 on its own two-node run (notebooks/06_fault_tolerance_and_scaling_out.ipynb, nbval's
Cell 27); a real Slurm runs the batch script in tests/test_slurm.py."""
from __future__ import annotations

import copy
import shlex

import pytest

from helpers import REPO_ROOT
from helpers.lessons.cluster import (
    HAMI_SCHEDULER,
    KUEUE_QUEUE_LABEL,
    STOP_MARGIN,
    JobSize,
    check_indexed_command,
    check_pod_command,
    check_shared_claim,
    check_shared_memory_exercise,
    check_slurm_script,
    checkpoint_claim,
    dockerfile,
    indexed_job,
    pod_without_shared_memory,
    pytorch_job,
    slurm_node_arguments,
    slurm_script,
    train_job,
    validate,
    validate_pytorch_job,
    validate_train_job,
    write_job_files,
)
from helpers.lessons.system import pinned

SHARED = JobSize(nodes=3, gpus_per_node=2, gpu_memory_mib=4000, gpu_cores_percent=25)
IMAGE = "pytorch/pytorch:latest"


def test_slurm_script_passes_bash_and_torchrun_parsers():
    text = slurm_script("train.py", SHARED, args=["--checkpoint", "/shared/c.pt"])
    arguments = check_slurm_script(text)
    assert "--nnodes=3" in arguments and "--nproc-per-node=2" in arguments
    assert arguments[-3:] == ["train.py", "--checkpoint", "/shared/c.pt"]
    assert "#SBATCH --nodes=3" in text and "#SBATCH --ntasks-per-node=1" in text
    assert "srun --cpus-per-task=$SLURM_CPUS_PER_TASK bash -c 'exec torchrun " in text  # Slurm >= 22.05: not inherited
    # the job's own rendezvous port, and node 0 alone told to host the store (a guess can join a stranger's store)
    assert "RDZV_PORT=$((20000 + SLURM_JOB_ID % 20000))" in text and "--rdzv-endpoint=head-node:20007" in arguments
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    node_line = shlex.split(srun)[-1]
    assert "--rdzv-conf=is_host=1" in slurm_node_arguments(node_line, 0)
    assert "--rdzv-conf=is_host=0" in slurm_node_arguments(node_line, 1)
    # a polite stop before the time limit, and a requeue after a preemption or a node failure; torchrun gives its
    # workers stop_seconds after SIGTERM (its default, 30 s, is too short for a large checkpoint: review 06-1), and
    # Slurm's warning comes STOP_MARGIN seconds earlier still, for torchrun itself to exit
    assert "--shutdown-timeout=120" in arguments
    assert f"#SBATCH --signal=TERM@{120 + STOP_MARGIN}" in text and "#SBATCH --requeue" in text


@pytest.mark.parametrize("change, words", [
    (("--nnodes=3", "--nodes=3"), "torchrun rejects"),
    (("#SBATCH --time", "#SBATCH --tme"), "unexpected #SBATCH option"),
    (("sed -n 1p)", "sed -n 1p"), "bash rejects"),
    (("srun --cpus-per-task=$SLURM_CPUS_PER_TASK ", "srun "), "does not pass --cpus-per-task"),
    (("OMP_NUM_THREADS=4", "OMP_NUM_THREADS=8"), "oversubscribe"),
    (("--nproc-per-node=2", "--nproc-per-node=4"), "gpus-per-node=2"),
    ((' --rdzv-conf=is_host=$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)', ""), "not told whether they host"),
    ((f"--signal=TERM@{120 + STOP_MARGIN}", "--signal=TERM@120"), "at least --shutdown-timeout"),
    (("--shutdown-timeout=120 ", ""), None),  # torchrun's 30 s default: well inside Slurm's window, accepted
])
def test_slurm_check_catches_mistakes(change, words):
    text = slurm_script("train.py", SHARED).replace(*change)
    assert text != slurm_script("train.py", SHARED)
    if words is None:
        check_slurm_script(text)
        return
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
    assert limits == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "4000", "nvidia.com/gpucores": "25", "cpu": "8",
                      "memory": "32Gi"}
    assert pod.containers[0].resources.requests == {"cpu": "8", "memory": "32Gi"}  # memory counted by the scheduler
    assert next(v for v in pod.volumes if v.empty_dir).empty_dir.size_limit == "8Gi"  # /dev/shm bounded
    # pod 0 hosts the c10d store because it is told so (is_host from JOB_COMPLETION_INDEX), not by a DNS guess
    hosts = {index: check_indexed_command(pod.containers[0].command, index) for index in range(3)}
    assert {index: parsed.rdzv_conf for index, parsed in hosts.items()} == {0: "is_host=1", 1: "is_host=0",
                                                                              2: "is_host=0"}
    assert all(parsed.rdzv_endpoint == "ddp-0.ddp:29500" and parsed.nnodes == "3" for parsed in hosts.values())
    service = manifests["service"]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True


def test_whole_gpus_use_the_default_scheduler():
    job = indexed_job("ddp", IMAGE, "train.py", JobSize(nodes=2, gpus_per_node=1))["job"]
    pod = validate(job, "V1Job").spec.template.spec
    assert pod.scheduler_name is None and set(pod.containers[0].resources.limits) == {"nvidia.com/gpu", "cpu", "memory"}


def test_pytorch_job_has_master_and_workers_with_valid_pod_templates():
    job = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    assert validate_pytorch_job(job) == 2
    replicas = job["spec"]["pytorchReplicaSpecs"]
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["ports"][0]["name"] == "pytorchjob-port"
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
    with pytest.raises(ValueError, match=r"V1Job: .*'three'"):
        validate(wrong_type, "V1Job")
    unnamed = _job()
    del unnamed["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        validate(unnamed, "V1Job")
    bad_template = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    bad_template["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containerz"] = []
    with pytest.raises(ValueError, match="containerz"):
        validate_pytorch_job(bad_template)


def _worker_container(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def _master_container(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_pytorch_job_check_uses_the_operators_models_and_what_it_reads():
    misspelled = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    misspelled["spec"]["runPolicy"]["backofLimit"] = 2  # a CRD field: only the operator's model knows it
    with pytest.raises(ValueError, match="backofLimit: unknown field"):
        validate_pytorch_job(misspelled)
    dead_port = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    _master_container(dead_port)["ports"][0]["name"] = "rendezvous"  # MASTER_PORT comes from the Master's port
    with pytest.raises(ValueError, match="Master: no port named 'pytorchjob-port'"):
        validate_pytorch_job(dead_port)
    renamed = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    _worker_container(renamed)["name"] = "trainer"
    with pytest.raises(ValueError, match="no container named 'pytorch'"):
        validate_pytorch_job(renamed)


@pytest.mark.parametrize("key, value, words", [
    ("nvidia.com/gpu-mem", "4000", "unknown resource name"),
    ("nvidia.com/gpucores", "150", "1..100"),
    ("nvidia.com/gpumem-percentage", "150", "1..100"),
])
def test_hami_resource_names_and_bounds_are_checked(key, value, words):
    job = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    _worker_container(job)["resources"]["limits"][key] = value
    with pytest.raises(ValueError, match=words):
        validate_pytorch_job(job)


def test_all_of_hamis_nvidia_names_are_accepted():
    job = pytorch_job("ddp", IMAGE, "train.py", SHARED)
    limits = _worker_container(job)["resources"]["limits"]
    del limits["nvidia.com/gpumem"]
    limits.update({"nvidia.com/gpumem-percentage": "50", "nvidia.com/priority": "1"})
    assert validate_pytorch_job(job) == 2


def test_gpu_shares_need_a_scheduler_that_knows_them():
    job = indexed_job("ddp", IMAGE, "train.py", SHARED)["job"]
    del job["spec"]["template"]["spec"]["schedulerName"]
    validate(job, "V1Job")  # no scheduler named: HAMi's admission webhook sets hami-scheduler
    job["spec"]["template"]["spec"]["schedulerName"] = "volcano"
    with pytest.raises(ValueError, match="hami-scheduler"):
        validate(job, "V1Job")
    volcano = pytorch_job("ddp", IMAGE, "train.py", SHARED, gang="volcano")
    del volcano["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"]
    with pytest.raises(ValueError, match="'volcano'"):
        validate_pytorch_job(volcano)


def test_gang_scheduling_fields():
    volcano = pytorch_job("ddp", IMAGE, "train.py", SHARED, gang="volcano")
    assert validate_pytorch_job(volcano) == 2
    assert volcano["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == SHARED.nodes
    pod = volcano["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["schedulerName"] == "volcano" and "volcano.sh/vgpu-memory" in pod["containers"][0]["resources"]["limits"]
    for manifest in (pytorch_job("ddp", IMAGE, "t.py", SHARED, gang="kueue"),
                     train_job("ddp", IMAGE, "t.py", SHARED, gang="kueue"),
                     indexed_job("ddp", IMAGE, "t.py", SHARED, gang="kueue")["job"]):
        assert manifest["metadata"]["labels"] == {KUEUE_QUEUE_LABEL: "default"}
    with pytest.raises(ValueError, match="podGroupPolicy"):
        train_job("ddp", IMAGE, "t.py", SHARED, gang="volcano")


def test_train_job_matches_kubeflow_trainers_models():
    job = train_job("ddp", IMAGE, "train.py", SHARED, args=["--checkpoint", "/checkpoints/c.pt"])
    typed = validate_train_job(job)
    assert typed.spec.trainer.num_nodes == 3 and typed.spec.runtime_ref.name == "torch-distributed"
    misspelled = copy.deepcopy(job)
    misspelled["spec"]["trainer"]["numNodez"] = 3
    with pytest.raises(ValueError, match="numNodez: unknown field"):
        validate_train_job(misspelled)
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["trainer"]["numNodes"] = "3"
    with pytest.raises(ValueError, match="valid integer"):
        validate_train_job(wrong_type)


def test_dockerfile_pins_the_lessons_torch_and_copies_files_that_exist():
    import torch

    text = dockerfile()
    assert f"torch=={pinned('torch')}" in text and torch.__version__.split("+")[0] == pinned("torch")
    if torch.version.cuda:  # catches a comment about the GPU floor left behind by a new torch pin
        assert f"is its CUDA {torch.version.cuda} build" in text
        assert "sm_75" in text and torch.cuda.get_arch_list()[0] == "sm_75"
    root = REPO_ROOT
    for line in text.splitlines():
        if line.startswith("COPY "):
            assert (root / line.split()[1]).exists(), line


def test_write_job_files_writes_what_the_checks_accept(tmp_path):
    import yaml

    paths = write_job_files(tmp_path, "helpers/workers/fault_tolerance_train.py", SHARED)
    assert sorted(p.name for p in paths) == sorted(
        ["Dockerfile", "job.sbatch", "pytorchjob.yaml", "trainjob.yaml", "indexed-job.yaml", "checkpoints-pvc.yaml"])
    check_shared_claim(yaml.safe_load((tmp_path / "checkpoints-pvc.yaml").read_text()))
    check_slurm_script((tmp_path / "job.sbatch").read_text())
    validate_pytorch_job(yaml.safe_load((tmp_path / "pytorchjob.yaml").read_text()))
    validate_train_job(yaml.safe_load((tmp_path / "trainjob.yaml").read_text()))
    service, job = yaml.safe_load_all((tmp_path / "indexed-job.yaml").read_text())
    validate(service, "V1Service")
    validate(job, "V1Job")


OPT_OUT = {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}


def _operator_env(node: int) -> dict[str, str]:
    return {"PET_NODE_RANK": str(node), "PET_MASTER_ADDR": "ddp-master-0", "PET_MASTER_PORT": "29500"}


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob", "indexed"])
def test_kubernetes_jobs_use_c10d_with_torchs_store_opt_out_not_the_restart_count(kind):
    """A replaced pod or a restarted container starts torchrun again at TORCHELASTIC_RESTART_COUNT=0 while its peers
    count on, so no job may rely on a store prefix built from that count: every Kubernetes job uses the c10d
    rendezvous (the static one ignores the opt-out) with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and the worker then
    joins with a plain init_process_group (tests/test_fault_tolerance.py runs that with a replaced agent)."""
    if kind == "pytorchjob":
        job = pytorch_job("ddp", IMAGE, "train.py", SHARED)
        containers = [r["template"]["spec"]["containers"][0] for r in job["spec"]["pytorchReplicaSpecs"].values()]
        env = _operator_env
    elif kind == "trainjob":
        job = train_job("ddp", IMAGE, "train.py", SHARED)
        containers = [job["spec"]["trainer"]]
        env = _operator_env
    else:
        job = indexed_job("ddp", IMAGE, "train.py", SHARED)["job"]
        containers = [job["spec"]["template"]["spec"]["containers"][0]]
        env = lambda node: {"JOB_COMPLETION_INDEX": str(node)}  # noqa: E731
    for container in containers:
        assert OPT_OUT in container["env"]
        parsed = [check_pod_command(container["command"], env(node)) for node in range(SHARED.nodes)]
        assert all(p.rdzv_backend == "c10d" and p.nnodes == "3" for p in parsed)
        assert [p.rdzv_conf for p in parsed] == ["is_host=1", "is_host=0", "is_host=0"]  # node 0 hosts, only it
        if kind != "indexed":
            assert {p.rdzv_endpoint for p in parsed} == {"ddp-master-0:29500"}


@pytest.mark.parametrize("kind", ["indexed", "pytorchjob", "trainjob"])
def test_a_pod_grace_period_shorter_than_torchruns_shutdown_timeout_is_refused(kind):
    """Review 06-1: the kubelet's SIGKILL comes terminationGracePeriodSeconds (30 by default) after SIGTERM; torchrun's
    comes --shutdown-timeout after it. The generated pods outlast torchrun by STOP_MARGIN; the Kubernetes default does
    not, and the check says so."""
    if kind == "indexed":
        job = indexed_job("ddp", IMAGE, "train.py", SHARED)["job"]
        pod, check = job["spec"]["template"]["spec"], lambda: validate(job, "V1Job")
    elif kind == "pytorchjob":
        job = pytorch_job("ddp", IMAGE, "train.py", SHARED)
        pod, check = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], lambda: validate_pytorch_job(job)
    else:
        job = train_job("ddp", IMAGE, "train.py", SHARED)
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod, check = patch["template"]["spec"]["template"]["spec"], lambda: validate_train_job(job)
    assert pod["terminationGracePeriodSeconds"] == SHARED.stop_seconds + STOP_MARGIN
    check()
    del pod["terminationGracePeriodSeconds"]  # Kubernetes' default, 30 s, against torchrun's 120
    with pytest.raises(ValueError, match="terminationGracePeriodSeconds=30 but torchrun --shutdown-timeout=120"):
        check()


@pytest.mark.parametrize("kind", ["indexed", "pytorchjob", "trainjob"])
def test_a_pod_without_a_memory_backed_dev_shm_is_refused(kind):
    if kind == "indexed":
        job = indexed_job("ddp", IMAGE, "train.py", SHARED)["job"]
        pod, check = job["spec"]["template"]["spec"], lambda: validate(job, "V1Job")
    elif kind == "pytorchjob":
        job = pytorch_job("ddp", IMAGE, "train.py", SHARED)
        pod, check = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], lambda: validate_pytorch_job(job)
    else:
        job = train_job("ddp", IMAGE, "train.py", SHARED)
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod, check = patch["template"]["spec"]["template"]["spec"], lambda: validate_train_job(job)
    check()
    shm = next(v for v in pod["volumes"] if "emptyDir" in v)
    del shm["emptyDir"]["medium"]  # an emptyDir on the node's disk is not /dev/shm in memory
    with pytest.raises(ValueError, match="/dev/shm"):
        check()


def test_the_checkpoint_claim_must_be_read_write_many():
    claim = checkpoint_claim(storage_class="nfs")
    assert check_shared_claim(claim).spec.access_modes == ["ReadWriteMany"]
    claim["spec"]["accessModes"] = ["ReadWriteOnce"]
    with pytest.raises(ValueError, match="Multi-Attach"):
        check_shared_claim(claim)


def _shm_solution(pod):
    pod["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
    for container in pod["containers"]:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})


def _unbounded(pod):  # review 06-4: right in every other way, but the tmpfs is bounded only by the node
    pod["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    for container in pod["containers"]:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})


def _trailing_slash(pod):  # right but different: Kubernetes mounts /dev/shm/ at /dev/shm
    pod["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
    for container in pod["containers"]:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm/"})


def _on_disk(pod):
    pod["volumes"].append({"name": "dshm", "emptyDir": {}})
    for container in pod["containers"]:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})


def _first_container_only(pod):
    pod["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    pod["containers"][0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})


def _replaces_volumes(pod):
    pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    for container in pod["containers"]:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})


def _wrong_name(pod):
    pod["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    for container in pod["containers"]:
        container["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})


def _misspelled(pod):
    pod["volumes"].append({"name": "dshm", "emptydir": {"medium": "Memory"}})


@pytest.mark.parametrize("wrong, words", [
    (lambda pod: None, "no emptyDir volume yet"),
    (_on_disk, "medium: Memory"),
    (_first_container_only, "'sidecar'"),
    (_replaces_volumes, "checkpoints volume is gone"),
    (_wrong_name, "by its name"),
    (_misspelled, "schema"),
    (_unbounded, "no sizeLimit"),
])
def test_shared_memory_exercise_says_not_yet_to_wrong_answers(wrong, words, capsys):
    assert not check_shared_memory_exercise(wrong)
    assert words in capsys.readouterr().out


def test_shared_memory_exercise_accepts_the_solution_in_place_or_returned(capsys):
    assert check_shared_memory_exercise(_shm_solution)
    assert check_shared_memory_exercise(lambda pod: (_shm_solution(pod), pod)[1])
    assert check_shared_memory_exercise(_trailing_slash)
    assert "Correct" in capsys.readouterr().out
    assert "dshm" not in str(pod_without_shared_memory())


def _pytorch_job_fails(restarts: int, backoff_limit: int) -> bool:
    """Our transcription, not run here, of the Training Operator's PastBackoffLimit (kubeflow/training-operator,
    pkg/core/job.go): the job fails once the container restarts of its running pods add up to backoffLimit."""
    return restarts > 0 if backoff_limit == 0 else restarts >= backoff_limit


def _job_fails(failed_pods: int, backoff_limit: int) -> bool:
    """Our transcription, not run here, of Kubernetes' Job controller for pods that never restart
    (pkg/controller/job/job_controller.go: exceedsBackoffLimit := failed > backoffLimit)."""
    return failed_pods > backoff_limit


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_default_backoff_limit_is_nodes_plus_one_the_least_that_survives_one_failure_of_every_agent(nodes):
    """What this pins: our backoffLimit (nodes + 1 by default, or JobSize.backoff_limit), judged by the two
    controllers' rules as transcribed above (no controller runs here). A failure of pod 0 (the rendezvous host)
    takes every agent down: `nodes` container restarts or failed pods. A backoffLimit copied from --max-restarts
    (1) would fail a 2-node PyTorchJob at its first restart."""
    size = JobSize(nodes=nodes, max_restarts=1)
    limit = pytorch_job("t", IMAGE, "train.py", size)["spec"]["runPolicy"]["backoffLimit"]
    assert limit == nodes + 1
    assert not _pytorch_job_fails(nodes, limit) and _pytorch_job_fails(nodes + 1, limit)
    assert _pytorch_job_fails(nodes, limit - 1), "nodes + 1 is the least limit that survives such a failure"
    limit = indexed_job("t", IMAGE, "train.py", size)["job"]["spec"]["backoffLimit"]
    assert limit == nodes + 1 and not _job_fails(nodes, limit)
    assert pytorch_job("t", IMAGE, "train.py", JobSize(nodes=nodes, backoff_limit=7))[
        "spec"]["runPolicy"]["backoffLimit"] == 7


def test_pytorch_job_sets_restart_policy_on_the_replica_not_the_template():
    """The operator overwrites a template's restartPolicy with the replica's (with a Warning event)."""
    for replica in pytorch_job("t", IMAGE, "train.py", SHARED)["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "OnFailure" and "restartPolicy" not in replica["template"]["spec"]


def test_write_job_files_takes_the_clusters_workdir_and_setup(tmp_path):
    paths = write_job_files(tmp_path, "helpers/workers/fault_tolerance_train.py", SHARED, workdir="/shared/lessons",
                            setup="module load pytorch")
    text = next(path for path in paths if path.name == "job.sbatch").read_text()
    check_slurm_script(text)
    assert "#SBATCH --chdir=/shared/lessons" in text and "\nmodule load pytorch\n" in text
    assert "#SBATCH --output=%x-%j.out" in text  # relative to --chdir: no path of this machine
    assert str(REPO_ROOT) not in text and str(tmp_path) not in text
