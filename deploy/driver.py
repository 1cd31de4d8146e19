"""The driver: the whole system on one screen (slime's train.py style).

    the run's record (new, resumed or forked: deploy/record.py) -> services (Ray, Redis, MLflow)
    -> learner + N rollout actors (Ray actors)
    for step: learner consumes groups and steps -> actors rescaled/replaced -> weights broadcast -> log
    (evaluation of the initial weights first, if eval.before) -> evaluation dense and sparse -> plot and artifacts
    -> everything shut down (also on Ctrl-C / error)
"""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from broker import faults  # noqa: E402
from broker import run_state as rs  # noqa: E402
from broker.redis_server import LocalRedis, RedisInUse  # noqa: E402
from broker.streams import connect, queue_depth, unreachable  # noqa: E402
from deploy.actor_pool import ActorPool, RunFailed  # noqa: E402
from deploy.config import RunConfig, derived_params, to_dict  # noqa: E402
from deploy.console import Console, training_target  # noqa: E402
from deploy.model_cache import resolve_model  # noqa: E402
from deploy.record import open_record  # noqa: E402
from deploy.scale import write_run_info  # noqa: E402
from deploy.tracking import Tracker  # noqa: E402

MAX_LOCAL_ACTORS = 16
"""A local Ray is given enough logical CPUs for the learner and this many actors (to scale up at run time)."""


class Interrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run: the MLflow run is KILLED and everything is shut down; str() is
    the one line to print (step reached, last checkpoint, how to go on); `exit_code`: 130 (SIGINT), 143 (SIGTERM)."""

    def __init__(self, line: str, exit_code: int = 130):
        super().__init__(line)
        self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm's time limit or scancel, pod deletion, docker stop, systemd): stops the run as Ctrl-C does,
    after a checkpoint of the last completed step (train.sigterm_checkpoint_s). Ray turns any KeyboardInterrupt
    raised inside ray.get / ray.wait into a plain one, so `received` says which signal came."""


received: dict[str, bool] = {"SIGTERM": False}
"""Set by the SIGTERM handler: whether the interrupt that stops the run is a SIGTERM."""


def train(cfg: RunConfig, command: tuple[str, ...] = ("sparse-rl", "train"), resume: str = "") -> dict:
    """Run one training job end to end; returns the last step's metrics and the evaluation scores.
    `command` is how the run was started (argv words), for the hint printed on Ctrl-C; `resume`: the directory
    of a run to continue as the same record (deploy/record.py; cfg is then that run's config, see resume_config).
    Raises Interrupted on Ctrl-C (SIGINT) or SIGTERM, after shutting everything down; ConfigError (nothing
    started) when the record cannot be opened; RunFailed when a part of the run failed."""
    progress = {"step": 0, "run_dir": None, "trained": False}
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    received["SIGTERM"], received["after_finish"] = False, False
    if main:
        catch_signals()
    report = None
    try:
        # KV capacity (docs/SPEC.md §5.1): a config that cannot fit fails here, nothing started yet
        if cfg.preflight.enabled:
            from deploy.preflight import preflight
            report = preflight(cfg)  # printed once the record opened: a refused --resume prints one line only
        return _train(cfg, progress, resume, report, command)
    except KeyboardInterrupt as e:
        term = isinstance(e, Terminated) or received["SIGTERM"]
        raise Interrupted(interrupted_line(cfg, progress, command, "terminated (SIGTERM)" if term else "interrupted"),
                          143 if term else 130) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def catch_signals() -> None:
    """SIGINT raises KeyboardInterrupt, SIGTERM Terminated (main thread only). Called again after ray.init,
    whose native failure handler takes SIGTERM otherwise (a crash dump instead of a clean stop)."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _terminate)


def ignore_stops_after_finish() -> None:
    """Once the run has finished (summary.json written, MLflow FINISHED), SIGTERM and Ctrl-C stop nothing: the
    shutdown goes on and the exit code stays 0; the first one prints one line saying so (docs/running.md,
    "Stopping"). Main thread only; `train` restores the caller's handlers on return and the CLI installs
    these again for the process's own exit (Ray's and Redis's shutdown at interpreter exit)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _after_finish)
        signal.signal(signal.SIGINT, _after_finish)


def _after_finish(signum, frame):
    if not received.get("after_finish"):
        received["after_finish"] = True
        print(f"sparse-rl: {signal.Signals(signum).name} after the run finished: ignored (its record is complete); "
              "finishing the shutdown, exit 0", file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    """The first Ctrl-C stops the run; further ones are ignored so that the shutdown is not cut short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _terminate(signum, frame):
    """The first SIGTERM stops the run cleanly; a second one ends the process at once (the embedded Redis and
    Ray's processes die with it)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    received["SIGTERM"] = True
    raise Terminated


def interrupted_line(cfg: RunConfig, progress: dict, command: tuple[str, ...], what: str = "interrupted") -> str:
    """One line: how far the run got, its last checkpoint, and the command that goes on: the resume (with the
    path of this environment's `sparse-rl`, so that it runs as printed), or, once training finished, the
    evaluation of the final weights."""
    head = f"{what} at step {progress['step']} of {cfg.train.steps}"
    if progress.get("trained"):
        final = Path(progress["run_dir"]) / "final"
        return (f"{head}, after training (the final weights are in {final}); evaluate them with: {cli_path()} eval "
                f"--model {final} --config {Path(progress['run_dir']) / 'config.yaml'}")
    return f"{head}; {go_on_hint(cfg, progress['run_dir'], command)}"


def cli_path() -> str:
    """This environment's `sparse-rl` (so that a printed command runs as printed), else the bare name."""
    cli = Path(sys.executable).with_name("sparse-rl")
    return str(cli) if cli.exists() else "sparse-rl"


def go_on_hint(cfg: RunConfig, run_dir: Path | None, command: tuple[str, ...]) -> str:
    """"last checkpoint: ...; resume with: <command>" when the run has a checkpoint, else "last checkpoint:
    none ...; start again with: <the command that started it>"."""
    ckpt_dir = Path(cfg.learner.checkpoint_dir)
    latest = ckpt_dir / "latest"
    if run_dir is None or not latest.is_file():
        again = [cli_path(), *command[1:]] if command and command[0] == "sparse-rl" else list(command)
        return (f"last checkpoint: none (one every learner.checkpoint_interval={cfg.learner.checkpoint_interval} "
                f"versions); start again with: {shlex.join(again)}")
    tag = latest.read_text().strip()
    resume = f"{cli_path()} train --resume {run_dir}"
    version = int(tag.rpartition("_")[2]) if tag.rpartition("_")[2].isdigit() else 0
    if version >= cfg.train.steps:  # the last step's checkpoint: a resume must ask for more steps
        resume += f" train.steps={version + 1}"
    return (f"last checkpoint: {ckpt_dir / tag} (the learner may be a step ahead of the console; a resume "
            f"continues from {tag.replace('_', ' ')}); resume with: {resume}")


def checkpoint_on_sigterm(cfg: RunConfig, learner) -> None:
    """Have the learner write a checkpoint of its last completed step, waiting at most train.sigterm_checkpoint_s
    (0: off); says in one line what happened."""
    if cfg.train.sigterm_checkpoint_s <= 0:
        return
    try:
        version = ray.get(learner.checkpoint_now.remote(), timeout=cfg.train.sigterm_checkpoint_s)
        print(f"SIGTERM: checkpoint of weight version {version} in {cfg.learner.checkpoint_dir}", flush=True)
    except ray.exceptions.GetTimeoutError:
        print(f"SIGTERM: no checkpoint: the learner did not write one within train.sigterm_checkpoint_s="
              f"{cfg.train.sigterm_checkpoint_s:g} s", flush=True)
    except ray.exceptions.RayError as e:
        print(f"SIGTERM: no checkpoint: {str(e).strip().splitlines()[0][:200]}", flush=True)


def _train(cfg: RunConfig, progress: dict, resume: str, report=None, command=("sparse-rl", "train")) -> dict:
    record = open_record(cfg, resume)  # new (directory created atomically), resumed, or forked from a checkpoint
    if report is not None:
        print(report.table(), flush=True)
    run_id, run_dir = record.run_id, record.run_dir
    progress["run_dir"] = run_dir
    cfg.model = resolve_model(cfg.model)  # build/convert preset model files once, before any worker starts
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # what --resume loads
    console = Console()
    with ExitStack() as stack:
        tracker = _open_services(cfg, stack, record, console, report)
        stack.push(_redis_lost(cfg, lambda: go_on_hint(cfg, run_dir, command)))  # (runs before Redis stops)
        redis = connect(cfg.broker)
        rs.set_actors_target(redis, run_id, cfg.actors.count)
        learner_group = start_learner(cfg, run_id, lambda: go_on_hint(cfg, run_dir, command))
        stack.callback(learner_group.shutdown)
        learner = learner_group.rank0
        # on any stop (after the SIGTERM checkpoint, before the learner stops): the versions the learner committed
        # that are not logged yet (the stop came between its commit and the console line) get logged
        stack.push(lambda kind, *_: kind is not None and log_committed(run_dir, tracker, learner, progress,
                                                                        record.start_version))
        # on SIGTERM (after the actors stopped, before the learner does): a checkpoint of the last completed step
        stack.push(lambda kind, *_: received["SIGTERM"] and checkpoint_on_sigterm(cfg, learner))
        before = cfg.eval.enabled and cfg.eval.before and not record.resumed  # a resumed run evaluated at its start
        pool = _start_actors(cfg, run_id, learner_group, stack, console, paused=before)
        console.learner(learner_group.get(learner.parameter_counts.remote(), "it counted its parameters"))
        if record.resumed:  # the log of trained prompts and the metrics of the checkpoint's step, as one record
            resume_logs(run_dir, tracker, record.start_version,
                        learner_group.get(learner.resume_state.remote(), "it loaded the checkpoint"))
        version = int(learner_group.get(learner.version.remote(), "it sent the weights"))
        scores_before = tracker.first_values("eval/") if record.resumed else {}
        if before:
            scores_before = pool.evaluate()
            tracker.log_metrics(scores_before, version)  # eval/* at the initial version, again at the last
            rs.set_paused(redis, run_id, False)

        def target() -> int:
            return rs.read_actors_target(redis, run_id) or cfg.actors.count

        actor_idle = []  # actor_idle_fraction of every step, for the run's figure
        logging = faults.wrap(lambda: None, "driver.log", "driver", when=lambda: step)  # a test's fault, or not
        for step in range(version + 1, cfg.train.steps + 1):  # step = the weight version it makes
            # returns once groups_per_step groups are trained; meanwhile actors are replaced and joined
            step_report = pool.wait_for(learner.train_step.remote(), step, target, console,
                                        lambda: queue_depth(redis, cfg.broker, run_id),
                                        lambda: go_on_hint(cfg, run_dir, command))  # a learner.step.StepReport
            logging()  # (a test's fault: the driver slow to log a step the learner committed)
            log_trained_prompts(run_dir, step_report.version, step_report.trained_prompt_ids)
            metrics = step_report.as_metrics()
            pool.scale(target())
            metrics.update(pool.sync_weights())
            metrics.update(pool.metrics())
            actor_idle.append(metrics.get("actor_idle_fraction", 0.0))
            version = int(metrics["version"])  # MLflow step = weight version: continues after a resume
            tracker.log_metrics(metrics, version)
            progress["step"] = step  # done and logged (before its console line, which a Ctrl-C may follow at once)
            console.step(step, cfg.train.steps, version, metrics)
        _save_budget_log(cfg, redis, run_id, run_dir, tracker)
        learner_group.get(learner.save_final.remote(str(run_dir / "final")), "it saved the final weights")
        progress["trained"] = True  # from here an interrupted run is evaluated, not resumed
        pool.stop_generation()  # the last batches are published; from here the counts are final
        accounting = _accounting(cfg, redis, run_id, pool, metrics, actor_idle)
        console.accounting(accounting)
        return _finish(cfg, record, tracker, console, pool, metrics, scores_before, accounting)


def _redis_lost(cfg: RunConfig, hint):
    """An exit callback of the run's stack, run after the learner and actors are shut down and before the embedded
    Redis stops: a run that failed because Redis stopped answering (the driver's own command gave up after
    broker.retry_s, or a part failed while Redis does not answer a PING) ends with one line naming Redis and its
    address (RunFailed; MLflow FAILED), whatever part noticed first."""
    import redis

    def check(kind, error, tb) -> bool:
        own = kind is not None and issubclass(kind, (redis.ConnectionError, redis.TimeoutError))
        if not own and not (kind is not None and issubclass(kind, RunFailed)):
            return False
        why = unreachable(cfg.broker)
        if why is None and not own:
            return False  # Redis answers: the part's own line stands
        cause = why or f"{kind.__name__}: {' '.join(str(error).split())}"
        raise RunFailed(f"Redis at {cfg.broker.url} did not answer for broker.retry_s={cfg.broker.retry_s:g} s "
                        f"({cause}); {hint()}") from None
    return check


def _open_services(cfg: RunConfig, stack: ExitStack, record, console: Console, report=None) -> Tracker:
    """Redis (the embedded one unless broker.url is given), Ray and the MLflow run of `record`, each closed by
    `stack`; the run info `scale` and `--resume` read; params (and the preflight's) logged. Returns the tracker.
    Raises RunFailed when the embedded Redis's data directory is in use."""
    run_id, run_dir = record.run_id, record.run_dir
    if not cfg.broker.url:  # embedded default: a private redis-server on 127.0.0.1, its data in the run directory
        try:  # (append-only file: a resume finds queue and counters)
            cfg.broker.url = stack.enter_context(LocalRedis(
                password=os.environ.get(cfg.broker.password_env) or None, data_dir=run_dir / "redis",
                appendonly=True, appendfsync="everysec")).url
        except RedisInUse as e:
            raise RunFailed(str(e)) from None
    start_ray(cfg)
    stack.callback(ray.shutdown)
    if threading.current_thread() is threading.main_thread():
        catch_signals()  # ray.init installed its own SIGTERM handler
    tracker = Tracker(cfg.mlflow.tracking_uri, cfg.mlflow.experiment, run_id, run_dir,
                      resume_run_id=record.mlflow_run_id, tags={f"parent_{k}": v for k, v in record.parent.items()})
    # KILLED on Ctrl-C, FAILED on an error; a no-op once the run ended FINISHED
    stack.push(lambda kind, *_: tracker.end("KILLED" if kind and issubclass(kind, KeyboardInterrupt) else "FAILED"))
    # how `sparse-rl scale --run <id>` finds the broker, and `--resume` the MLflow run and checkpoints
    write_run_info(run_dir, run_id, cfg.broker, mlflow_uri=tracker.uri, mlflow_run_id=tracker.run_id,
                   checkpoint_dir=cfg.learner.checkpoint_dir)
    changed = tracker.log_params({**to_dict(cfg), **derived_params(cfg)})
    if report is not None:
        tracker.log_params(report.params())
    if record.resumed:
        tracker.record_resume(record.start_version, changed)
    tracker.log_artifact(run_dir / "config.yaml")
    console.start(run_id, run_dir, cfg.broker.url, tracker.where(), record,
                  training_target(cfg.learner, cfg.actors.engine.compressor.method))
    return tracker


def _start_actors(cfg: RunConfig, run_id: str, learner_group, stack: ExitStack, console: Console,
                  paused: bool) -> ActorPool:
    """actors.count rollout actors, shut down by `stack`, started and given the initial weights (the learner
    group watched meanwhile). They start while the learner ranks start (both load their models at once); the
    learner's start is waited for first, so that a rank that fails to start is named as such. `paused`: they
    start, load the weights and wait (generation_paused) for the evaluation before training; else the key is
    cleared (a run interrupted while it evaluated may have left it)."""
    rs.set_paused(connect(cfg.broker), run_id, paused)
    pool = ActorPool(cfg, run_id, learner_group.rank0, learner_group)
    stack.callback(pool.shutdown)
    pool.scale(cfg.actors.count)
    learner_group.wait_started()
    pool.wait_ready(console)  # nothing to train or evaluate with before the first actors have started
    pool.sync_weights()  # initial weights to everyone: one code path for initial and later weights
    return pool


def _save_budget_log(cfg: RunConfig, redis, run_id: str, run_dir: Path, tracker: Tracker) -> None:
    """With a budget controller (compressor.budget_control): every decision, with its reason, as an artifact."""
    if cfg.actors.engine.compressor.budget_control != "off":
        log = [line + "\n" for line in rs.read_budget_log(redis, run_id)]
        (run_dir / "budget_log.jsonl").write_text("".join(log))
        tracker.log_artifact(run_dir / "budget_log.jsonl")


def _accounting(cfg: RunConfig, redis, run_id: str, pool: ActorPool, metrics: dict, actor_idle: list[float]) -> dict:
    """The run's final accounting (once the last batches are published): broker counts, what is left in the
    queue, learner and actor versions, the actors' counters (run_state.actor_counts: every actor process, the
    killed ones' included), rollout utilization and the idle shares over the whole run."""
    counts = rs.run_counts(redis, run_id)
    accounting = {**counts, "left_in_queue": queue_depth(redis, cfg.broker, run_id),
                  "learner_version": int(metrics["version"]), "actor_versions": pool.versions(),
                  **rs.actor_counts(redis, run_id)}
    accounting.update(  # groups trained or filtered / groups produced (none in flight now); idle shares
        rollout_utilization=rs.rollout_utilization(counts, in_flight=0),
        learner_idle_fraction=metrics.get("learner_idle_fraction_run", 0.0),
        actor_idle_fraction=sum(actor_idle) / max(1, len(actor_idle)))
    return accounting


def finite_or_null(value):
    """`value` with every NaN or infinite float (a metric no token measured this step, e.g. replay exactness on a
    step whose tokens are all stale) replaced by None, so that summary.json is strict JSON (null) for jq and
    JSON.parse alike."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _finish(cfg: RunConfig, record, tracker: Tracker, console: Console, pool: ActorPool, metrics: dict,
            scores_before: dict, accounting: dict) -> dict:
    """The evaluation of the final weights, the plot, summary.json and the MLflow run FINISHED; returns the
    summary (the last step's metrics, the scores before and after, the accounting)."""
    version, run_dir = int(metrics["version"]), record.run_dir
    scores = pool.evaluate() if cfg.eval.enabled else {}
    tracker.log_metrics(scores, version)
    console.eval(scores, scores_before)
    tracker.log_artifact(tracker.plot(run_dir / "training.png"))
    summary = {"run_id": record.run_id, "run_dir": str(run_dir), "mlflow_uri": tracker.uri,
               "mlflow_run_id": tracker.run_id, **metrics, **scores,
               **{k.replace("eval/", "eval_before/", 1): v for k, v in scores_before.items()},
               "accounting": accounting}
    (run_dir / "summary.json").write_text(json.dumps(finite_or_null(summary), indent=1, allow_nan=False))
    tracker.end("FINISHED")
    ignore_stops_after_finish()   # from here on a stop would only cut the shutdown short
    console.finish(run_dir, tracker.where())
    return summary


STOP_RECORD_S = 60.0
"""On a stop, how long the driver waits for the learner to close its step protocol (a step in the middle of its
checkpoint and commit finishes them first: LearnerStep.close), seconds."""


def log_committed(run_dir: Path, tracker: Tracker, learner, progress: dict, start_version: int) -> None:
    """On a stop (Ctrl-C, SIGTERM, a failure): close the learner's step protocol, so that no step saves or commits
    after this, and log every version it committed that the driver has not logged (the stop landed between the
    learner's commit and the driver's logging): its line in trained_prompts.jsonl and its learner metrics in
    MLflow, from the step's report. Every version a checkpoint holds is then in the record; progress["step"]
    (the interrupted line's step) follows. One console line for each version logged so, or when the learner did
    not answer within STOP_RECORD_S."""
    try:
        reports = ray.get(learner.close_record.options(concurrency_group="record").remote(), timeout=STOP_RECORD_S)
    except ray.exceptions.GetTimeoutError:
        print(f"stop: the learner did not close its step within {STOP_RECORD_S:g} s; a version it commits now has "
              "no line in trained_prompts.jsonl", flush=True)
        return
    except ray.exceptions.RayError:
        return  # the learner is gone: it committed nothing after its last answer
    log = run_dir / "trained_prompts.jsonl"
    logged = {json.loads(line)["version"] for line in log.read_text().splitlines()} if log.exists() else set()
    for report in reports:
        if report.version <= max(progress["step"], start_version):
            continue  # logged by the step loop (or, up to the start version, by the record's earlier life)
        try:
            if report.version not in logged:
                log_trained_prompts(run_dir, report.version, report.trained_prompt_ids)
            tracker.log_metrics(report.as_metrics(), report.version)
        except Exception as e:  # (the stop's own line follows; this one says what is missing)
            print(f"stop: version {report.version} not logged: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
                  flush=True)
            return
        progress["step"] = report.version
        print(f"stop: version {report.version}, committed by the learner before the stop, logged "
              "(trained_prompts.jsonl, MLflow)", flush=True)


def log_trained_prompts(run_dir: Path, version: int, prompt_ids: list[str]) -> None:
    """Append the step's trained prompt ids to run_dir/trained_prompts.jsonl ({"version", "prompt_ids"} per step)."""
    with open(run_dir / "trained_prompts.jsonl", "a") as fh:
        fh.write(json.dumps({"version": int(version), "prompt_ids": prompt_ids}) + "\n")


def resume_logs(run_dir: Path, tracker: Tracker, version: int, state: dict) -> None:
    """A resumed record at checkpoint `version`: trained_prompts.jsonl keeps the steps before it, then the
    checkpoint's own step from the checkpoint (the later ones are trained again), and the learner metrics of the
    checkpoint's own step are logged if the interrupted run had not logged them (it may stop between the
    learner's step and its logging)."""
    log = run_dir / "trained_prompts.jsonl"
    own = bool(state.get("step_metrics"))  # checkpoints written before this was kept have no record of their step
    lines = [line for line in log.read_text().splitlines() if json.loads(line)["version"] < version + (not own)] \
        if log.exists() else []
    if own:  # the checkpoint's own step, from the checkpoint (logged or not before)
        lines.append(json.dumps({"version": version, "prompt_ids": state.get("trained_prompt_ids", [])}))
    log.write_text("".join(line + "\n" for line in lines))
    if state.get("step_metrics") and version not in tracker.history.get("reward_mean", {}):
        tracker.log_metrics(state["step_metrics"], version)


LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
"""A local Ray starts no idle workers ahead of use: every process of a run (learner ranks, rollout actors) is an
actor with its own worker, so prestarted ones only idle, each an interpreter that imported Ray (about 0.4 s of CPU
apiece per run on a 2-core machine)."""


def start_ray(cfg: RunConfig) -> None:
    """Join cfg.ray.address or start a local Ray. The workers import the installed project code whatever the
    driver's working directory: Ray puts that directory first on every worker's sys.path (so a folder named
    `actors` or an older checkout there would shadow ours) unless the job has a runtime_env working_dir, so
    the job's working_dir is an empty directory (the workers start in their copy of it; the config's paths
    are absolute, deploy.config.absolute_paths)."""
    with tempfile.TemporaryDirectory(prefix="sparse-rl-workdir-") as empty:
        runtime_env = {"working_dir": empty}
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, log_to_driver=True, runtime_env=runtime_env)
        else:
            # Logical CPUs only: local processes share the machine's cores (torch threads are set per process).
            need = (cfg.train.learner_num_cpus * cfg.learner.ranks
                    + cfg.actors.num_cpus * max(cfg.actors.count, MAX_LOCAL_ACTORS))
            ray.init(num_cpus=cfg.ray.num_cpus or max(os.cpu_count() or 1, int(need + 0.999)),
                     include_dashboard=False, log_to_driver=True, runtime_env=runtime_env,
                     _system_config=LOCAL_RAY_SYSTEM_CONFIG)


def start_learner(cfg: RunConfig, run_id: str, hint=None):
    """The learner.ranks learner ranks in their placement group (deploy/learner_group.py); `hint`: how to go on
    after a rank died."""
    from deploy.learner_group import LearnerGroup

    return LearnerGroup(cfg, run_id, hint, wait=False)  # _start_actors waits for it, the actors starting meanwhile
