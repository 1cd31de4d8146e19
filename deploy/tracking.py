"""MLflow for a run: params from the resolved config (secrets left out), one `log_batch` per learner step,
and the end-of-run plot. MLflow 3.x; the default store is a sqlite file in the run directory.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

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
    """One MLflow run. `tracking_uri` empty -> `sqlite:///<run_dir>/mlflow.db`."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, run_dir: Path):
        self.uri = tracking_uri or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
        mlflow.set_tracking_uri(self.uri)
        exp = mlflow.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else mlflow.create_experiment(
            experiment, artifact_location=self._local_artifacts(tracking_uri, run_dir))
        self.client = MlflowClient(self.uri)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.history: dict[str, list[tuple[int, float]]] = {}
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

    def log_params(self, resolved: dict) -> None:
        params = [Param(k, v) for k, v in public_params(resolved).items()]
        for i in range(0, len(params), 100):  # MLflow caps one batch at 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """All metrics of one step in one `log_batch` call; non-finite and non-numeric values are skipped."""
        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and value == value and abs(value) != float("inf"):
                batch.append(Metric(key, float(value), now, step))
                self.history.setdefault(key, []).append((step, float(value)))
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def plot(self, out: Path) -> Path:
        """PNG of reward, rejection rate and mismatch KL over learner steps."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
        for ax, key in zip(axes, PLOTTED):
            points = self.history.get(key, [])
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
