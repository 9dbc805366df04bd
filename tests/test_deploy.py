"""The Kubernetes manifests under deploy/ (KubeRay RayJob and RayService, a batch/v1 CronJob) against the
fields KubeRay's v1 CRDs and Kubernetes document (no package ships their schemas), and the commands in
them against our own parsers and ServeConfig: what `kubectl apply` would run is a real invocation."""

from __future__ import annotations

import importlib
import json
import shlex
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"

# Field names from KubeRay's ray.io/v1 CRDs (ray-operator/apis/ray/v1: rayjob_types.go, rayservice_types.go,
# raycluster_types.go) and Kubernetes' batch/v1 CronJobSpec.
RAYJOB_SPEC = {"entrypoint", "rayClusterSpec", "clusterSelector", "submissionMode", "shutdownAfterJobFinishes",
               "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit", "runtimeEnvYAML", "jobId",
               "metadata", "entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "submitterPodTemplate",
               "submitterConfig", "suspend", "managedBy", "deletionStrategy"}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
RAYSERVICE_SPEC = {"serveConfigV2", "rayClusterConfig", "upgradeStrategy", "serviceUnhealthySecondThreshold",
                   "deploymentUnhealthySecondThreshold", "excludeHeadPodFromServeSvc"}
RAYCLUSTER_SPEC = {"rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling", "autoscalerOptions",
                   "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions"}
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template",
                "scaleStrategy", "numOfHosts", "idleTimeoutSeconds", "suspend"}
CRONJOB_SPEC = {"schedule", "timeZone", "concurrencyPolicy", "startingDeadlineSeconds", "successfulJobsHistoryLimit",
                "failedJobsHistoryLimit", "suspend", "jobTemplate"}


def manifest(name: str) -> dict:
    doc = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(doc, dict) and doc["metadata"]["name"], name
    return doc


def job_args(argv: list[str], job: str) -> "object":
    """``python -m jobs.<job> ARGS`` parsed by that job's own parser (argparse exits 2 on a bad flag)."""
    assert argv[:3] == ["python", "-m", f"jobs.{job}"], argv
    return importlib.import_module(f"jobs.{job}").build_parser().parse_args(argv[3:])


def check_cluster(spec: dict) -> list[dict]:
    """A RayClusterSpec's documented fields; returns its worker groups."""
    assert set(spec) <= RAYCLUSTER_SPEC, set(spec) - RAYCLUSTER_SPEC
    assert spec["rayVersion"] == importlib.import_module("ray").__version__   # the image's Ray is ours
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP and head["template"]["spec"]["containers"]
    groups = spec["workerGroupSpecs"]
    for g in [head, *groups]:
        # rayStartParams is map[string]string in the CRD: a bare number or bool is refused by the API server
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), g["rayStartParams"]
    for g in groups:
        assert set(g) <= WORKER_GROUP, set(g) - WORKER_GROUP
        assert g["groupName"] and g["template"]["spec"]["containers"]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    return groups


def gpus(group: dict) -> int:
    return sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in group["template"]["spec"]["containers"])


def custom_resources(group: dict) -> dict:
    """rayStartParams.resources: a JSON object inside a quoted string, as KubeRay passes it to ray start."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def test_rayjob_runs_the_distributed_quantize_job():
    doc = manifest("rayjob-quantize.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    spec = doc["spec"]
    assert set(spec) <= RAYJOB_SPEC, set(spec) - RAYJOB_SPEC
    assert spec["submissionMode"] in SUBMISSION_MODES
    args = job_args(shlex.split(spec["entrypoint"]), "quantize")
    assert args.stages >= 1 and args.ray_address is None     # joins the RayJob's cluster through RAY_ADDRESS
    groups = check_cluster(spec["rayClusterSpec"])
    assert sum(gpus(g) * g["replicas"] for g in groups) >= args.stages * args.replicas * args.gpus_per_actor


def test_rayservice_serves_prefill_and_decode_on_their_own_gpu_groups():
    from actors.serving.serve_config import ServeConfig

    doc = manifest("rayservice-serve.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    assert set(doc["spec"]) <= RAYSERVICE_SPEC
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    cfg = ServeConfig.from_dict(app["args"])               # our own validation: unknown keys are refused
    assert cfg.mode == "disaggregated" and cfg.model_path.startswith("s3://")
    groups = {g["groupName"]: g for g in check_cluster(doc["spec"]["rayClusterConfig"])}
    for role, dep in (("prefill", cfg.prefill), ("decode", cfg.llm)):
        need = dep.ray_actor_options["resources"]
        assert need == {role: 1}, need
        assert custom_resources(groups[role]) == {role: 1}     # only that group's pods offer it
        assert gpus(groups[role]) >= dep.ray_actor_options["num_gpus"] > 0


def test_cronjob_requantizes_nightly():
    doc = manifest("cronjob-requantize.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("batch/v1", "CronJob")
    spec = doc["spec"]
    assert set(spec) <= CRONJOB_SPEC, set(spec) - CRONJOB_SPEC
    minute, hour, *rest = spec["schedule"].split()
    assert len(rest) == 3 and rest == ["*", "*", "*"] and minute.isdigit() and hour.isdigit()   # once a day
    assert spec["concurrencyPolicy"] == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    (c,) = pod["containers"]
    args = job_args([*c["command"], *c["args"]], "requantize")
    assert args.stages >= 1 and args.model_path and args.save_path


@pytest.mark.parametrize("name", ["rayjob-quantize.yaml", "rayservice-serve.yaml", "cronjob-requantize.yaml"])
def test_each_manifest_says_how_to_apply_it(name):
    assert f"kubectl apply -f deploy/{name}" in (DEPLOY / name).read_text()
