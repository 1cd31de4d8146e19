"""deploy/slurm submitted to a real single-node Slurm (opt-in: `pytest -m slurm tests/deploy/test_slurm.py`).

Needs root and Debian's slurm-wlm and munge (`apt-get install -y slurm-wlm munge`). The fixture starts a
private cluster: its own munge key and socket, slurm.conf in a temporary directory (SLURM_CONF), free ports;
/etc is not touched. The jobs keep Ray and Redis on the loopback address 127.0.0.2 (Ray rewrites 127.0.0.1
to the machine's routable address); Ray's GCS and raylet still listen on every interface, as on any
multi-node Ray cluster, behind the job's Ray token.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from broker.redis_server import free_port

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "deploy" / "slurm"
HEAD_IP = "127.0.0.2"

# The "driver" of the first test: checks what the job built and writes it out (argv: output path, then the
# dotted keys the sbatch script appends).
PROBE = r'''
import json, os, sys, time
import ray, redis
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

keys = dict(arg.split("=", 1) for arg in sys.argv[2:])
ray.init(address=keys["ray.address"])
deadline = time.time() + 240  # the test submits add-actors.sbatch right after this job
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
    time.sleep(1)
nodes = [n for n in ray.nodes() if n["Alive"]]
added = [n for n in nodes if "learner" not in n["Resources"]]

@ray.remote(num_cpus=0, resources={"rollout": 1})
def password_seen():
    return os.environ.get("SPARSE_RL_REDIS_PASSWORD") == password

password = os.environ["SPARSE_RL_REDIS_PASSWORD"]
seen = ray.get(password_seen.options(
    scheduling_strategy=NodeAffinitySchedulingStrategy(added[0]["NodeID"], soft=False)).remote()) if added else None
client = redis.Redis.from_url(keys["broker.url"], password=password)
client.set("probe", "ok")
try:
    redis.Redis.from_url(keys["broker.url"]).get("probe")
    without_password = "answered"
except redis.AuthenticationError:
    without_password = "refused"
except redis.ResponseError as e:
    without_password = "refused" if "NOAUTH" in str(e) else str(e)
json.dump({"keys": keys, "resources": ray.cluster_resources(), "nodes": len(nodes),
           "added_node_sees_password": seen, "redis": client.get("probe").decode(),
           "redis_without_password": without_password}, open(sys.argv[1], "w"))
'''


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A private single-node Slurm cluster; yields the environment that reaches it."""
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install -y slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("the private Slurm cluster runs its daemons as root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=sparserl",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d}/munge.sock",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "MpiDefault=none", "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n")
    env = {**os.environ, "SLURM_CONF": str(conf),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    daemons = [subprocess.Popen(
        ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={d}/munge.sock",
         f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    time.sleep(1)
    for command in (["slurmctld", "-D", "-c"], ["slurmd", "-D"]):
        daemons.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "--noheader", "--format=%t"], env=env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                break
            time.sleep(1)
        else:
            pytest.fail(f"the private Slurm node did not come up; logs in {d}/log")
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        time.sleep(2)
        for p in reversed(daemons):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def submit(env: dict, *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait_job(env: dict, job_id: str, timeout: float) -> dict:
    """Poll until the job has finished; returns scontrol's fields (JobState, ExitCode, ...)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], env=env, capture_output=True, text=True)
        fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        time.sleep(2)
    subprocess.run(["scancel", job_id], env=env)
    pytest.fail(f"job {job_id} still running after {timeout} s")


def processes_mentioning(text: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if text in cmdline and p.pid != os.getpid():
            found.append(cmdline[:200])
    return found


def test_job_starts_redis_and_ray_runs_the_driver_and_takes_added_actor_nodes(slurm, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    state = tmp_path / "state"
    env = {**slurm, "SPARSE_RL_HEAD_IP": HEAD_IP, "SPARSE_RL_STATE_DIR": str(state)}
    main = submit(env, "--nodes=1", f"--output={tmp_path}/main-%j.out", str(SCRIPTS / "sparse-rl.sbatch"),
                  sys.executable, str(tmp_path / "probe.py"), str(tmp_path / "probe.json"))
    extra = submit(env, "--nodes=1", f"--output={tmp_path}/actors-%j.out", str(SCRIPTS / "add-actors.sbatch"), main)

    job = wait_job(env, main, timeout=480)
    log = (tmp_path / f"main-{main}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["keys"]["ray.address"].startswith(f"{HEAD_IP}:")
    assert probe["keys"]["broker.url"].startswith(f"redis://{HEAD_IP}:")
    assert (probe["keys"]["ray.actor_resource"], probe["keys"]["ray.learner_resource"]) == ("rollout", "learner")
    # the head: learner + 8 rollout slots (one-node job); the added node: 1 rollout slot
    assert probe["nodes"] == 2 and probe["resources"]["learner"] == 1 and probe["resources"]["rollout"] == 9
    assert probe["added_node_sees_password"] is True
    assert (probe["redis"], probe["redis_without_password"]) == ("ok", "refused")
    assert "driver exited with status 0" in log

    # the added nodes end with the main job; nothing of either job is left running
    added = wait_job(env, extra, timeout=120)
    assert added["JobState"] == "COMPLETED", (tmp_path / f"actors-{extra}.out").read_text()
    assert stat.S_IMODE((state / "cluster.env").stat().st_mode) == 0o600
    assert any((state / "redis").iterdir())  # append-only file written
    time.sleep(5)
    assert processes_mentioning(f"/tmp/ray-{main}") == [] and processes_mentioning(f"/tmp/ray-{extra}") == []
    assert processes_mentioning(str(state / "redis.conf")) == []


def test_job_runs_the_tiny_training_run(slurm, tmp_path):
    env = {**slurm, "SPARSE_RL_HEAD_IP": HEAD_IP, "SPARSE_RL_STATE_DIR": str(tmp_path / "state")}
    job_id = submit(env, "--nodes=1", f"--cpus-per-task={os.cpu_count()}", f"--output={tmp_path}/train-%j.out",
                    str(SCRIPTS / "sparse-rl.sbatch"), "sparse-rl", "train", "--config", "tiny",
                    f"run_dir={tmp_path}/runs", "actors.num_cpus=0.5", "train.learner_num_cpus=0.5")
    job = wait_job(env, job_id, timeout=900)
    log = (tmp_path / f"train-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    assert json.loads(summary.read_text())["run_id"] == summary.parent.name
