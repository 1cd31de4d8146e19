"""MLflow for a run: params from the resolved config (secrets left out), one `log_batch` per learner step,
and the end-of-run plot. MLflow 3.x; the default store is a sqlite file in the run directory. Metrics are
given under their internal names and logged under their MLflow names (deploy/metric_names.py: `<section>/...`).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from deploy.metric_names import internal_name, metric_history, mlflow_name  # noqa: E402
from deploy.model_cache import cache_dir  # noqa: E402

SECRET_WORDS = ("password", "secret", "token", "credential")
PLOTTED = ("reward_mean", "rejection_rate", "mismatch_kl")


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists become their string form."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def public_params(resolved: dict) -> dict[str, str]:
    """Flattened config with every key naming a secret removed, and URLs stripped of their credentials."""
    params = {}
    for key, value in flatten(resolved).items():
        if any(word in key.lower() for word in SECRET_WORDS):
            continue
        text = str(value)
        if "://" in text and "@" in text:  # redis://user:pass@host -> redis://***@host
            scheme, rest = text.split("://", 1)
            text = f"{scheme}://***@{rest.split('@', 1)[1]}"
        params[key] = text[:6000]
    return params


class Tracker:
    """One MLflow run. `tracking_uri` empty -> `sqlite:///<run_dir>/mlflow.db`.

    resume_run_id: reopen this MLflow run (status back to RUNNING, its plotted history reloaded) instead of
        creating one: a resumed run continues the same metric history (step = weight version).
    tags: set on the run (e.g. a fork's parent)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, run_dir: Path, resume_run_id: str = "",
                 tags: dict[str, str] | None = None):
        local = Path(run_dir).resolve() / "mlflow.db"
        self.uri = tracking_uri or f"sqlite:///{local}"
        if not tracking_uri and experiment != "Default" and not local.exists():
            new_local_store(local)
        mlflow.set_tracking_uri(self.uri)
        exp = mlflow.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else mlflow.create_experiment(
            experiment, artifact_location=self._local_artifacts(tracking_uri, run_dir))
        self.client = MlflowClient(self.uri)
        self.history: dict[str, dict[int, float]] = {}  # internal name -> {step: last value} (for the plot)
        if resume_run_id:
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            for key in PLOTTED:
                self.history[key] = {m.step: m.value for m in metric_history(self.client, resume_run_id, key)}
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        for name, value in (tags or {}).items():
            self.client.set_tag(self.run_id, name, value)
        self.ended = False

    @staticmethod
    def _local_artifacts(tracking_uri: str, run_dir: Path) -> str | None:
        """Where a new experiment keeps artifacts: beside a local sqlite store (the run directory, or the folder
        of the given sqlite file); None lets a tracking server decide."""
        if not tracking_uri:
            return (Path(run_dir).resolve() / "artifacts").as_uri()
        if tracking_uri.startswith("sqlite:///"):
            return (Path(tracking_uri[len("sqlite:///"):]).resolve().parent / "artifacts").as_uri()
        return None

    def log_params(self, resolved: dict) -> dict[str, str]:
        """Log the config as params. A reopened run keeps its params (MLflow never changes one): new keys are
        added, and the changed ones are returned ({key: new value}) for the caller to record."""
        logged = self.client.get_run(self.run_id).data.params
        changed = {k: v for k, v in public_params(resolved).items() if k in logged and logged[k] != v}
        params = [Param(k, v) for k, v in public_params(resolved).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow caps one batch at 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        return changed

    def record_resume(self, version: int, changed: dict[str, str]) -> None:
        """Tags of a resumed run: `resumed_at_versions` (comma-separated, one per resume) and, for each param
        given a new value at this resume, `resume_v<version>.<param>` = the new value."""
        tags = self.client.get_run(self.run_id).data.tags
        earlier = tags.get("resumed_at_versions", "")
        self.client.set_tag(self.run_id, "resumed_at_versions", f"{earlier},{version}" if earlier else str(version))
        for name, value in changed.items():
            self.client.set_tag(self.run_id, f"resume_v{version}.{name}", value)

    def first_values(self, prefix: str) -> dict[str, float]:
        """{metric: its value at the lowest step} for the run's metrics whose internal name starts with
        `prefix` (e.g. "eval/": the evaluation before training of a resumed run), under internal names."""
        names = [k for k in self.client.get_run(self.run_id).data.metrics if internal_name(k).startswith(prefix)]
        return {internal_name(k): min(self.client.get_metric_history(self.run_id, k),
                                      key=lambda m: (m.step, m.timestamp)).value for k in names}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """All metrics of one step (internal names) in one `log_batch` call, each under its MLflow name
        (deploy.metric_names.mlflow_name); non-finite and non-numeric values are skipped."""
        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and value == value and abs(value) != float("inf"):
                batch.append(Metric(mlflow_name(key), float(value), now, step))
                self.history.setdefault(key, {})[step] = float(value)
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def plot(self, out: Path) -> Path:
        """PNG of reward, rejection rate and mismatch KL over learner steps (titled by their internal names)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
        for ax, key in zip(axes, PLOTTED):
            points = sorted(self.history.get(key, {}).items())
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o")
            ax.set_title(key)
            ax.set_xlabel("learner step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def end(self, status: str) -> None:
        """Mark the run FINISHED / FAILED / KILLED; only the first call counts."""
        if not self.ended:
            self.ended = True
            self.client.set_terminated(self.run_id, status)

    def where(self) -> str:
        """How to open this run in the MLflow UI."""
        mlflow_cli = Path(sys.executable).with_name("mlflow")  # the one installed beside this Python
        return f"{mlflow_cli} ui --backend-store-uri {self.uri} --host 127.0.0.1 --port 5000   (run id {self.run_id})"


def new_local_store(db: Path) -> None:
    """Start a new run's sqlite store `db` as a copy of an empty one already at this MLflow's schema,
    `<cache>/mlflow-<mlflow version>.db` (deploy/model_cache.cache_dir), which MLflow itself creates the first
    time: its creation runs every schema migration, 2-5 s of each run's start on 2 cores. Processes that make
    the template at once each make their own and rename it into place (the same bytes' worth). Not for the
    "Default" experiment: the template's Default experiment keeps the artifact location of where it was made.
    Where the cache cannot be written, nothing is copied and MLflow creates `db` as before."""
    template = cache_dir() / f"mlflow-{mlflow.__version__}.db"
    try:
        if not template.exists():
            template.parent.mkdir(parents=True, exist_ok=True)
            made = template.with_name(f"{template.name}.{os.getpid()}.tmp")
            made.unlink(missing_ok=True)
            MlflowClient(f"sqlite:///{made}").search_experiments()  # MLflow creates and migrates it
            os.replace(made, template)
    except OSError:
        return
    shutil.copyfile(template, db)
