"""Run config: presets load, overrides apply, bad values fail at start naming the field (also via the CLI)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from deploy.config import CONFIG_DIR, ConfigError, load_config


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_preset_loads(preset):
    cfg = load_config(preset, check_files=False)  # the qwen presets name /models/..., a cluster's volume
    assert cfg.model and cfg.actors.count >= 1


DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""A value naming a callable, "package.module:function" (user code: reward, task generator, environment)."""


def dotted_paths(node) -> list[str]:
    """Every string value of a config (as a container) that names a callable."""
    if isinstance(node, dict):
        return [p for v in node.values() for p in dotted_paths(v)]
    if isinstance(node, list):
        return [p for v in node for p in dotted_paths(v)]
    return [node] if isinstance(node, str) and DOTTED.match(node) else []


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_dotted_path_a_preset_names_resolves(preset):
    """The presets' user code (actors.tasks:count_numbers, actors.envs.lookup:LookupEnv, ...) imports as the run's
    config check imports it, and every other value of the form module:function resolves to a callable."""
    from actors.config import load_callable
    from deploy.config import check_user_code

    cfg = load_config(preset, check_files=False)
    check_user_code(cfg)
    for spec in dotted_paths(OmegaConf.to_container(OmegaConf.structured(cfg))):
        assert callable(load_callable(spec, preset))


def test_the_presets_name_their_user_code_by_dotted_path():
    """Control for the test above: the dotted paths it resolves are found (9 presets name some)."""
    named = {p.stem: dotted_paths(OmegaConf.to_container(OmegaConf.structured(load_config(p.stem, check_files=False))))
             for p in CONFIG_DIR.glob("*.yaml")}
    assert len([name for name, paths in named.items() if paths]) == 9, named
    assert set(named["tiny-lookup"]) == {"actors.envs.lookup:lookup_items", "actors.envs.lookup:LookupEnv"}


def test_a_run_config_saved_with_the_lookup_envs_old_module_resumes(tmp_path):
    """A run's config.yaml written before the lookup environment moved to actors/envs/lookup.py names
    actors.lookup_env:lookup_items and actors.lookup_env:LookupEnv: `--resume` still loads it (actors/lookup_env.py
    re-exports both), with the same callables."""
    from actors.config import load_callable
    from actors.envs.lookup import LookupEnv, lookup_items
    from deploy.record import resume_config

    saved = OmegaConf.structured(load_config("tiny-lookup"))
    saved.actors.data.function = "actors.lookup_env:lookup_items"
    saved.actors.env.factory = "actors.lookup_env:LookupEnv"
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    cfg = resume_config(tmp_path)
    assert (cfg.actors.data.function, cfg.actors.env.factory) == ("actors.lookup_env:lookup_items",
                                                                  "actors.lookup_env:LookupEnv")
    assert load_callable(cfg.actors.data.function, "data.function") is lookup_items
    assert load_callable(cfg.actors.env.factory, "env.factory") is LookupEnv


def test_presets_ship_in_the_package():
    import deploy

    assert CONFIG_DIR == Path(deploy.__file__).parent / "configs"
    assert {"tiny", "smollm2-gsm8k", "qwen2.5-math"} <= {p.stem for p in CONFIG_DIR.glob("*.yaml")}


def test_overrides_apply():
    cfg = load_config("tiny", ["actors.count=3", "actors.engine.compressor.method=snapkv", "learner.lr=2e-6"])
    assert (cfg.actors.count, cfg.actors.engine.compressor.method, cfg.learner.lr) == (3, "snapkv", 2e-6)


def test_the_learner_seed_follows_the_run_seed_unless_set():
    """learner.seed unset -> the run's `seed` (one seed for the whole run); set explicitly, it is kept (as
    bench/replication.py sets both). Every preset leaves both unset: seed 0 and learner seed 0."""
    presets = [load_config(p.stem, check_files=False) for p in sorted(CONFIG_DIR.glob("*.yaml"))]
    assert {(cfg.seed, cfg.learner.seed) for cfg in presets} == {(0, 0)}
    assert load_config("tiny", ["seed=3"]).learner.seed == 3
    assert load_config("tiny", ["seed=3", "learner.seed=0"]).learner.seed == 0
    explicit = load_config("tiny", ["learner.seed=5"])
    assert (explicit.seed, explicit.learner.seed) == (0, 5)


def test_main_job_defaults():
    import inspect

    from deploy import cli
    assert "default=MAIN_JOB" in inspect.getsource(cli) and cli.MAIN_JOB == "smollm2-count-warm"
    cfg = load_config(cli.MAIN_JOB)   # `sparse-rl train` without --config: the decode regime (docs/results.md 6)
    assert cfg.model == "smollm2-135m-count-warm"
    assert cfg.actors.engine.compressor.method == "rkv" and cfg.actors.count == 2
    assert cfg.actors.reward.function == "actors.tasks:count_reward"
    assert load_config("smollm2-copy").actors.reward.function == "actors.tasks:copy_reward"  # the prefill regime
    assert cfg.eval.data == "train_task" and cfg.eval.before and list(cfg.eval.modes) == ["dense", "sparse"]
    assert load_config("smollm2-count").actors.reward.function == "actors.tasks:count_reward"  # the decode regime
    gsm8k = load_config("smollm2-gsm8k")   # GSM8K evaluation stays available as a preset
    assert gsm8k.eval.data == "gsm8k_test" and gsm8k.eval.limit == 100 and gsm8k.actors.reward.function == ""


@pytest.mark.parametrize("override, field", [
    ("actors.engine.compressor.method=lru", "compressor.method"),
    ("actors.engine.compressor.kv_budget=8", "kv_budget"),
    ("actors.sampling.top_p=0.9", "top_p"),
    ("actors.sampling.top_k=20", "top_k"),
    ("learner.lr=fast", "learner.lr"),
    ("learner.rejection=maybe", "rejection"),
    ("actors.cont=2", "actors.cont"),
    ("actors.count=0", "actors.count"),
    ("eval.modes=[dense,fuzzy]", "eval.modes"),
])
def test_bad_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("tiny", [override])


@pytest.mark.parametrize("override, message", [
    ("learner.eps=-1", "learner.eps=-1.0: expected 0 < eps < 1"),
    ("learner.lr=-1e-6", "learner.lr=-1e-06: expected a finite value >= 0"),
    ("learner.loss_agg_mode=token-sum", "learner.loss_agg_mode='token-sum': expected one of"),
    ("actors.sampling.temperature=-1", "actors.sampling.temperature=-1.0: expected >= 0"),
    ("actors.sampling.temperature=0", "actors.sampling.temperature=0.0: training rollouts require temperature > 0"),
    ("actors.sampling.top_p=0.9", "actors.sampling.top_p=0.9: training rollouts require top_p = 1.0"),
    ("actors.engine.dtype=fp16", "actors.engine.dtype='fp16': expected fp32 | bf16"),
    ("actors.data.source=hf", "actors.data.source='hf': expected reasoning_gym | gsm8k_jsonl"),
    ("actors.data.source=gsm8k_jsonl", "actors.data.path is required when actors.data.source is gsm8k_jsonl"),
    ("broker.high_watermark=0", "broker.high_watermark=0: expected >= 1"),
    ("broker.max_staleness=-1", "broker.max_staleness=-1: expected >= 0"),
    ("broker.claim_ttl_s=0", "broker.claim_ttl_s=0.0: expected > 0"),
    ("broker.retry_s=-1", "broker.retry_s=-1.0: expected 0 <= retry_s <= 600 (seconds, 0 = no retry)"),
    ("learner.filter_groups=std", "learner.filter_groups='std': expected one of ('none', 'zero_variance')"),
    ("learner.max_extra_reads=-1", "learner.max_extra_reads=-1: expected >= 0"),
    ("actors.engine.compressor.kv_budget=8",
     "actors.engine.compressor.kv_budget=8 must be > actors.engine.compressor.window=8"),
    ("eval.sparse_compressor.kv_budget=8",
     "eval.sparse_compressor.kv_budget=8 must be > eval.sparse_compressor.window=8"),
    ("actors.engine.compressor.phase=shared",
     "actors.engine.compressor.phase='shared' is unknown: expected one of ('request', 'aligned')"),
    ("train.wait_report_s=0", "train.wait_report_s=0.0: expected > 0"),
    ("train.group_wait_s=0", "train.group_wait_s=0.0: expected > 0"),
    ("learner.checkpoint_interval=0", "learner.checkpoint_interval=0: expected >= 1"),
    ("train.learner_num_cpus=-1", "train.learner_num_cpus=-1.0: expected >= 0"),
    ("actors.num_gpus=-1", "actors.num_gpus=-1.0: expected >= 0"),
    ("actors.sampling.samples_per_prompt=1", "actors.sampling.samples_per_prompt=1: expected >= 2"),
    ("learner=5", "learner=5: learner is a section (set its fields: learner.<field>=<value>)"),
    ("actors.sampling=3", "actors.sampling=3: actors.sampling is a section"),
    ("learner.ranks=0", "learner.ranks=0: expected >= 1"),
    ("actors.engine.compressor.kv_dtype=fp8", "actors.engine.compressor.kv_dtype='fp8' is unknown: expected one of "
     "('model', 'bf16', 'fp8_e4m3', 'int8', 'int4')"),
    ("actors.engine.compressor.kv_scale=channel", "actors.engine.compressor.kv_scale='channel' is unknown"),
    ("actors.engine.compressor.kv_scale=layer", "actors.engine.compressor.kv_scale='layer' with "
     "actors.engine.compressor.kv_dtype='model': a static per-layer scale"),
    ("eval.sparse_compressor.kv_scale=layer", "eval.sparse_compressor.kv_scale='layer' with "
     "eval.sparse_compressor.kv_dtype='model'"),
    ("learner.replay_quant_gap=true", "learner.replay_quant_gap=True: it measures the replayed forward: needs "
     "learner.policy_target=sparse"),
])
def test_component_errors_name_the_dotted_field(override, message):
    """Components name their own fields (LearnerConfig.eps, compressor.kv_budget); the run config reports
    the dotted name the user typed, and no class name."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    assert str(err.value).startswith(message)
    assert "Config" not in str(err.value) and "SamplingParams" not in str(err.value)
    assert ";" not in str(err.value), str(err.value)  # one fault, one clause (ranks=0 is not also a zero_stage error)


def test_filter_groups_values_load():
    assert load_config("tiny", ["learner.filter_groups=zero_variance"]).learner.filter_groups == "zero_variance"
    assert load_config("tiny", ["learner.filter_groups=none"]).learner.filter_groups == "none"
    assert load_config("tiny", ["broker.admission=false"]).broker.admission is False


def test_lr_zero_is_allowed():
    assert load_config("tiny", ["learner.lr=0"]).learner.lr == 0  # a control run: the weights stay fixed


@pytest.mark.parametrize("model, reason", [
    ("/missing/path", "no such directory"),
    ("./missing", "no such directory"),
    ("~/no-such-sparse-rl-model", "no such directory"),
    ("tiny_llama", "no such directory"),  # a misspelt preset is not a hub id (no org/)
    ("runs/x/final", "no such directory"),
    ("{empty_dir}", "no config.json"),
    ("{file}", "not a directory"),
])
def test_bad_model_names_the_field(model, reason, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    model = model.format(empty_dir=tmp_path / "empty", file=tmp_path / "weights.bin")
    with pytest.raises(ConfigError, match=f"^model=.*{reason}.*config.json, or a preset model "
                                          r"\(smollm2-135m-instruct \| smollm2-135m-count-warm \| "
                                          r"smollm2-135m-lookup-warm \| "
                                          r"smollm2-135m-lookup-stress-warm \| tiny-llama \| tiny-char\)"):
        load_config("tiny", [f"model={model}"])


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m-instruct", "{hf_dir}", "Qwen/Qwen2.5-1.5B"])
def test_good_model_passes(model, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    model = model.format(hf_dir=tmp_path)
    assert load_config("tiny", [f"model={model}"]).model == model


@pytest.mark.parametrize("command", [["train", "--config", "tiny", "model=/missing/path"],
                                     ["eval", "--config", "qwen2.5-math", "--model", "/missing/path"]])
def test_cli_missing_model_exits_2_before_starting_anything(command, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", *command, f"run_dir={tmp_path / 'runs'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "sparse-rl: bad config: model='/missing/path': no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_cli_bad_config_exits_2_naming_the_field():
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", "tiny",
                           "actors.engine.compressor.method=lru"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "compressor.method='lru'" in proc.stderr


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="smollm2-gsm8k"):
        load_config("no-such-preset")


# --- every checkable input is checked at start (files, data sets, services, YAML syntax) -------------------------

def test_eval_data_is_checked_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval\.data='/nonexistent\.jsonl': no such file, and not train_task or "
                                          r"one of gsm8k_test"):
        load_config("tiny", ["eval.data=/nonexistent.jsonl"])
    with pytest.raises(ConfigError, match=r"^eval\.data='train_task': actors\.data\.source=gsm8k_jsonl"):
        load_config("tiny", ["eval.data=train_task", "actors.data.source=gsm8k_jsonl", f"actors.data.path={__file__}"])
    data = tmp_path / "items.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    for good in ("train_task", "gsm8k_test", str(data)):
        assert load_config("tiny", [f"eval.data={good}"]).eval.data == good
    assert load_config("tiny", ["eval.data=/nonexistent.jsonl", "eval.enabled=false"])  # not evaluated: not read
    assert load_config("tiny", ["eval.data=/nonexistent.jsonl"], check_files=False)  # a cluster's file


def test_training_data_file_is_checked_at_start():
    with pytest.raises(ConfigError, match=r"^actors\.data\.path='/nope\.jsonl': no such file"):
        load_config("tiny", ["actors.data.source=gsm8k_jsonl", "actors.data.path=/nope.jsonl", "eval.data=gsm8k_test"])


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then closed)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_broker_names_broker_url(redis_server):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    with pytest.raises(ConfigError, match=rf"^broker\.url='{re.escape(url)}': Redis does not answer \(ConnectionError"):
        load_config("tiny", [f"broker.url={url}"])
    assert load_config("tiny", [f"broker.url={redis_server.url}"]).broker.url == redis_server.url
    assert load_config("tiny", [f"broker.url={url}"], check_files=False)  # composing a cluster's config
    with pytest.raises(ConfigError, match=r"^broker\.url: embeds a password") as err:
        load_config("tiny", ["broker.url=redis://user:hunter2@127.0.0.1:6379/0"])
    assert "hunter2" not in str(err.value)


def test_broker_password_is_checked_and_never_printed(monkeypatch):
    from broker.redis_server import LocalRedis

    with LocalRedis(password="right-secret") as server:
        monkeypatch.setenv("SPARSE_RL_REDIS_PASSWORD", "wrong-secret")
        with pytest.raises(ConfigError, match=r"^broker\.url=.*Redis does not answer \(AuthenticationError") as err:
            load_config("tiny", [f"broker.url={server.url}"])
        assert "secret" not in str(err.value)
        monkeypatch.setenv("SPARSE_RL_REDIS_PASSWORD", "right-secret")
        assert load_config("tiny", [f"broker.url={server.url}"])


def test_unreachable_ray_address_names_ray_address():
    import socket

    port = closed_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ConfigError, match=rf"^ray\.address='{re.escape(address)}': cannot connect to 127\.0\.0\.1"):
            load_config("tiny", [f"ray.address={address}"])
    with pytest.raises(ConfigError, match=r"^ray\.address='nohost': expected"):
        load_config("tiny", ["ray.address=nohost"])
    with socket.socket() as listener:  # something answers: accepted
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"ray://127.0.0.1:{listener.getsockname()[1]}"
        assert load_config("tiny", [f"ray.address={address}"]).ray.address == address
    assert load_config("tiny", ["ray.address=auto"])  # resolved by Ray itself


def test_yaml_syntax_error_is_one_line_with_file_line_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: tiny-llama\nactors: {count: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(bad))
    assert re.fullmatch(rf"config file {re.escape(str(bad))}:4:1: YAML syntax error: .+ \(while parsing a flow "
                        rf"mapping at line 3, column 9\)", str(err.value))  # where the unclosed {{ opened
    text = tmp_path / "config.txt"
    text.write_text("name: x\n")
    with pytest.raises(ConfigError, match=r"config '.*config.txt': expected a .yaml or .yml file, or a preset name"):
        load_config(str(text))


@pytest.mark.parametrize("override, message", [
    ("eval.data=/nonexistent.jsonl", "eval.data='/nonexistent.jsonl': no such file"),
    ("broker.url=redis://127.0.0.1:{port}/0", "broker.url='redis://127.0.0.1:{port}/0': Redis does not answer"),
    ("ray.address=127.0.0.1:{port}", "ray.address='127.0.0.1:{port}': cannot connect"),
    ("learner.lr=-1", "learner.lr=-1.0: expected a finite value >= 0"),
    ("learner.replay_quant_gap=true", "learner.replay_quant_gap=True: it measures the replayed forward"),
])
def test_cli_bad_input_exits_2_before_anything_starts(override, message, tmp_path):
    port = closed_port()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", "tiny", override.format(port=port),
                           f"run_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sparse-rl: bad config: {message.format(port=port)}"), lines
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("mlflow*"))
    assert time.monotonic() - started < 60  # import + checks; nothing started (Ray alone takes longer to boot)


@pytest.mark.parametrize("override", ["actors.engine.compressor.budget_control=off",
                                      "actors.engine.compressor.budget_tiers=off",
                                      "eval.sparse_compressor.budget_control=off"])
def test_a_bare_off_means_off(override):
    """YAML reads a bare `off` as False; the budget options take it as "off" (as learner.correction does)."""
    cfg = load_config("tiny", [override])
    compressor = cfg.eval.sparse_compressor if override.startswith("eval.") else cfg.actors.engine.compressor
    assert getattr(compressor, override.split(".")[-1].split("=")[0]) == "off"


def test_budget_metric_defaults_to_the_acceptance_rate_when_top_k_is_on():
    """compressor.budget_metric "" -> accept_upper_p5 (the p5 of the acceptance rate's upper bound, the one near the
    exact p5 on a real batch: docs/SPEC.md §5.1) with actors.sampling.topk_logprobs > 0, else xi_sym_p5; an accept_*
    metric turns top-k on at 20; accept_p5 (the lower bound) and xi_* stay available."""
    control = ["actors.engine.compressor.budget_control=mismatch", "actors.engine.compressor.kv_budget_min=16",
               "actors.engine.compressor.kv_budget_max=64", "actors.engine.compressor.kv_budget=32"]
    plain = load_config("tiny", control)
    assert (plain.actors.engine.compressor.budget_metric, plain.actors.sampling.topk_logprobs) == ("xi_sym_p5", 0)
    top = load_config("tiny", control + ["actors.sampling.topk_logprobs=8"])
    assert (top.actors.engine.compressor.budget_metric, top.actors.sampling.topk_logprobs) == ("accept_upper_p5", 8)
    assert load_config("tiny", control + ["actors.engine.compressor.budget_metric=accept_p5",
                                          "actors.sampling.topk_logprobs=8"]).actors.engine.compressor.budget_metric \
        == "accept_p5"
    named = load_config("tiny", control + ["actors.engine.compressor.budget_metric=accept_p5"])
    assert named.actors.sampling.topk_logprobs == 20
    # the acceptance rate does not need the correction's ratio tail
    assert load_config("tiny", control + ["actors.engine.compressor.budget_metric=accept_p5",
                                          "learner.correction=off"]).learner.correction == "off"
    with pytest.raises(ConfigError, match="learner.correction=off"):
        load_config("tiny", control + ["learner.correction=off"])
    with pytest.raises(ConfigError, match="actors.sampling.topk_logprobs=-1"):
        load_config("tiny", ["actors.sampling.topk_logprobs=-1"])


def test_length_schedule_runs_on_both_engines():
    """budget_schedule length: accepted on the torch engine and on SGLang (its backend follows each request's budget
    from its host step count, docs/sglang.md "The length schedule"); on SGLang the refusals that still apply stay,
    e.g. a KV precision its backend cannot store, and the length schedule's own (with tiers) on both engines."""
    length = ["actors.engine.compressor.budget_schedule=length", "actors.engine.compressor.budget_growth=0.5",
              "actors.engine.compressor.kv_budget_final=96", "actors.engine.compressor.kv_budget=48"]
    assert load_config("tiny", length).actors.engine.compressor.budget_schedule == "length"
    sglang = load_config("tiny", length + ["actors.engine.backend=sglang", "eval.modes=[sparse]"], check_files=False)
    assert (sglang.actors.engine.backend, sglang.actors.engine.compressor.budget_schedule) == ("sglang", "length")
    with pytest.raises(ConfigError, match=re.escape("actors.engine.compressor.kv_dtype=int8: the sparse backend's")):
        load_config("tiny", length + ["actors.engine.backend=sglang", "eval.modes=[sparse]",
                                      "actors.engine.compressor.kv_dtype=int8"], check_files=False)
    for backend in ("torch", "sglang"):
        with pytest.raises(ConfigError, match="budget_schedule='length' cannot be combined with"):
            load_config("tiny", length + [f"actors.engine.backend={backend}", "eval.modes=[sparse]",
                                          "actors.engine.compressor.budget_tiers=confidence"], check_files=False)


@pytest.mark.parametrize("rows, reason", [('{"question": "1+1", "answer": "#### 2"}\n{"question": "x" "answer"}\n',
                                           "line 2: not JSON"),
                                          ("", "empty file")])
def test_eval_cli_reads_the_eval_data_before_it_scores(rows, reason, tmp_path):
    """`sparse-rl eval` checks the eval.data file's rows as `train` does: one line, exit 2, no model loaded."""
    data = tmp_path / "items.jsonl"
    data.write_text(rows)
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "--model", "tiny-llama", "--config", "tiny",
                           f"eval.data={data}"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"sparse-rl: bad config: eval.data={data}: {reason}"), proc.stderr


@pytest.mark.parametrize("override, message", [
    ("learner.collective_timeout_s=inf", "learner.collective_timeout_s=inf: expected a finite number"),
    ("learner.tis_cap=.inf", "learner.tis_cap=inf: expected a finite number"),
    ("train.wait_report_s=nan", "train.wait_report_s=nan: expected a finite number"),
    ("learner.token_mask_bounds=[0.5,inf]", "learner.token_mask_bounds[1]=inf: expected a finite number"),
])
def test_any_non_finite_number_is_refused_naming_the_field(override, message):
    """No config field takes NaN or infinity: each would fail later in the run (a timeout's timedelta overflows)
    or train on silently (learner.distill_coef=inf trained every weight to NaN and exited 0)."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override], check_files=False)
    assert str(err.value) == message


def test_a_section_field_given_at_the_top_level_names_the_dotted_field():
    """`policy_target=sparse` (no section): the error says where the field lives; an unknown key gets no guess."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["policy_target=sparse"], check_files=False)
    assert str(err.value).endswith("; did you mean learner.policy_target?"), str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["kv_budget=8"], check_files=False)
    assert str(err.value).endswith("; did you mean actors.engine.compressor.kv_budget?"), str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["nonsense=1"], check_files=False)
    assert "did you mean" not in str(err.value)


def test_sglang_settings_become_engine_arguments():
    """actors.engine.sglang: the named fields and engine_kwargs become sglang.Engine's keyword arguments; fields left
    null are left out (SGLang's default), deterministic maps to enable_deterministic_inference."""
    sglang = ["actors.engine.backend=sglang", "eval.modes=[sparse]", "actors.engine.sglang.mem_fraction_static=0.6",
              "actors.engine.sglang.max_running_requests=16", "actors.engine.sglang.deterministic=true",
              "actors.engine.sglang.engine_kwargs.random_seed=3"]
    cfg = load_config("tiny", sglang, check_files=False)
    assert cfg.actors.engine.sglang.kwargs() == {"mem_fraction_static": 0.6, "max_running_requests": 16,
                                                 "enable_deterministic_inference": True, "random_seed": 3}
    assert load_config("tiny", check_files=False).actors.engine.sglang.kwargs() == {}


@pytest.mark.parametrize("override, message", [
    ("mem_fraction_static=1.5", "mem_fraction_static=1.5: expected 0 < f < 1"),
    ("max_total_tokens=0", "max_total_tokens=0: expected >= 1"),
    ("schedule_conservativeness=0", "schedule_conservativeness=0.0: expected > 0"),
    ("engine_kwargs.dtype=float16", "engine_kwargs.dtype: sparse-rl sets it"),
    ("engine_kwargs.max_running_requests=4", "engine_kwargs.max_running_requests: use its own field"),
    # sparse mode (tiny's compressor is snapkv): settings the sparse backend cannot run under
    ("engine_kwargs.attention_backend=triton",
     "engine_kwargs.attention_backend='triton': sparse mode runs in 'sparse_rl_kv'"),
    ("engine_kwargs.disable_radix_cache=false", "engine_kwargs.disable_radix_cache=False: sparse KV compression needs"),
    # a mapping written without a space after its colon: OmegaConf reads {page_size:4} as {"page_size:4": None}
    ("engine_kwargs={page_size:4}", "engine_kwargs.'page_size:4': not a keyword argument name"),
])
def test_sglang_settings_are_checked_naming_the_field(override, message):
    """actors.engine.sglang.<override> fails at config check with one message naming the dotted field."""
    with pytest.raises(ConfigError, match=re.escape(f"actors.engine.sglang.{message}")):
        load_config("tiny", ["actors.engine.backend=sglang", f"actors.engine.sglang.{override}"], check_files=False)


def test_weight_sync_fingerprint_setting_is_checked_and_its_probe_fits_the_smallest_budget():
    """learner.weight_sync_fingerprint: error by default, off as YAML reads it (a boolean), anything else named; the
    actors get the probe's length (min(16, the smallest budget), 0 when off); a budget the probe cannot fit is
    refused naming both fields, unless the check is off. Allowed on SGLang (its engine scores too).
    learner.weight_sync_fingerprint_every: 1 by default, >= 1, passed to the actors."""
    from deploy.config import rollout_config

    cfg = load_config("tiny", [], check_files=False)
    assert cfg.learner.weight_sync_fingerprint == "error" and rollout_config(cfg).fingerprint_tokens == 8
    off = load_config("tiny", ["learner.weight_sync_fingerprint=off"], check_files=False)
    assert off.learner.weight_sync_fingerprint == "off" and rollout_config(off).fingerprint_tokens == 0
    tiers = ["actors.engine.compressor.kv_budget=12", "actors.engine.compressor.window=4",
             "actors.engine.compressor.budget_tiers=confidence"]
    assert rollout_config(load_config("tiny", tiers, check_files=False)).fingerprint_tokens == 6   # 12 x 0.5
    by_bytes = ["actors.engine.compressor.kv_budget_bytes=100000", "actors.engine.compressor.kv_budget=512",
                "actors.engine.compressor.window=4"]   # tokens known at the engine only: the least, window + 1
    assert rollout_config(load_config("tiny", by_bytes, check_files=False)).fingerprint_tokens == 5
    assert cfg.learner.weight_sync_fingerprint_every == 1 and rollout_config(cfg).fingerprint_every == 1
    every = load_config("tiny", ["learner.weight_sync_fingerprint_every=4"], check_files=False)
    assert rollout_config(every).fingerprint_every == 4
    with pytest.raises(ConfigError, match=r"learner.weight_sync_fingerprint_every=0: expected >= 1"):
        load_config("tiny", ["learner.weight_sync_fingerprint_every=0"], check_files=False)
    with pytest.raises(ConfigError, match=r"learner.weight_sync_fingerprint='loud': expected one of"):
        load_config("tiny", ["learner.weight_sync_fingerprint=loud"], check_files=False)
    small = ["actors.engine.compressor.kv_budget=3", "actors.engine.compressor.window=2"]
    with pytest.raises(ConfigError, match=r"learner.weight_sync_fingerprint=warn: .*smallest KV budget \(3 tokens\).*"
                                          r"actors.engine.compressor.kv_budget=3"):
        load_config("tiny", [*small, "learner.weight_sync_fingerprint=warn"], check_files=False)
    assert load_config("tiny", [*small, "learner.weight_sync_fingerprint=off"], check_files=False)
    sglang = load_config("tiny-sglang", ["learner.weight_sync_fingerprint=warn"], check_files=False)
    assert sglang.learner.weight_sync_fingerprint == "warn"


@pytest.mark.parametrize("overrides, message", [
    (["protect_values=40"], "actors.engine.compressor.protect_values=40 protected + actors.engine.compressor.window=8 "
                            "leave no slot to choose in actors.engine.compressor.kv_budget=48"),
    (["sinks=4", "protect_prompt=last:36"], "actors.engine.compressor.sinks=4 + actors.engine.compressor."
                                            "protect_prompt=last:36 protected + actors.engine.compressor.window=8"),
    (["method=random", "h2o_recent=16"], "actors.engine.compressor.h2o_recent=16 is read by method h2o only"),
])
def test_protection_beyond_the_budget_and_h2o_fields_on_random_are_refused(overrides, message):
    """One ConfigError line naming the dotted fields (the CLI's exit-2 path)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", [f"actors.engine.compressor.{o}" for o in overrides], check_files=False)


@pytest.mark.parametrize("override, reason", [
    ("method=h2o", "method=h2o: needs each slot's accumulated attention mass"),   # h2o_recent 64 < kv_budget 128
    ("kv_dtype=fp8_e4m3", "kv_dtype=fp8_e4m3: the sparse backend's KV pool stores the model dtype"),
    ("kv_dtype=int8", "kv_dtype=int8: the sparse backend's KV pool stores the model dtype"),
])
def test_compressor_settings_sglang_cannot_run_are_refused_each_with_its_reason(override, reason):
    """deploy/config.py check_sglang: one line, the dotted field and its own reason
    (contract.unsupported_compressor_settings), then what to do; the same setting loads on the torch engine. The
    fp8 try on the CPU lane (contract.FP8_POOL_TRY) is quoted for fp8_e4m3 only, SGLang's own fp8 pool."""
    overrides = [f"actors.engine.compressor.{override}", "actors.engine.compressor.kv_budget=128"]
    assert load_config("tiny", overrides, check_files=False)
    with pytest.raises(ConfigError, match="^" + re.escape(f"actors.engine.compressor.{reason}") + r".* \(refused "
                       r"with actors\.engine\.backend=sglang\): use actors\.engine\.backend=torch$") as refused:
        load_config("tiny", ["actors.engine.backend=sglang", *overrides], check_files=False)
    assert ("Intel AMX" in str(refused.value)) == (override == "kv_dtype=fp8_e4m3")


@pytest.mark.parametrize("override", ["method=random", "protect_prompt=all", "protect_prompt=last:4",
                                      "protect_values=2", "sinks=2"])
def test_random_and_protection_load_on_sglang(override):
    """contract.unsupported_compressor_settings no longer refuses random or protection on the sparse_rl_kv backend
    (tests/sglang/test_sglang_records.py: its records equal the torch engine's)."""
    overrides = ["actors.engine.backend=sglang", "eval.modes=[sparse]", f"actors.engine.compressor.{override}",
                 "actors.engine.compressor.kv_budget=128"]
    assert load_config("tiny", overrides, check_files=False).actors.engine.backend == "sglang"


def test_every_refused_compressor_setting_is_named_in_one_line_with_its_reason():
    """Several at once: each dotted field with its own reason, in one line (the CLI's exit-2 path), not one
    generic reason for all."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["actors.engine.backend=sglang", "actors.engine.compressor.method=h2o",
                             "actors.engine.compressor.kv_budget=128", "actors.engine.compressor.kv_dtype=int8"],
                    check_files=False)
    line = str(e.value)
    assert "\n" not in line
    assert re.match(r"^actors\.engine\.compressor\.method=h2o: needs each slot's accumulated attention mass .*; "
                    r"actors\.engine\.compressor\.kv_dtype=int8: the sparse backend's KV pool stores the model "
                    r"dtype", line), line
    assert "seed" not in line and "prompt length" not in line


def test_a_run_config_saved_before_protection_resumes_without_sinks(tmp_path):
    """A config.yaml written when sinks were StreamingLLM's alone (no protect_values, sinks: 4 under rkv) resumes
    with sinks null, 0 for rkv; streamingllm's own sinks stay."""
    from deploy.record import resume_config

    for method, sinks in (("rkv", 0), ("streamingllm", 4)):
        saved = OmegaConf.to_container(OmegaConf.structured(load_config(
            "tiny", [f"actors.engine.compressor.method={method}"], check_files=False)))
        saved["actors"]["engine"]["compressor"]["sinks"] = 4
        for name in ("protect_values", "protect_prompt"):
            del saved["actors"]["engine"]["compressor"][name]
        (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
        assert resume_config(tmp_path).actors.engine.compressor.sink_tokens == sinks


def test_weight_checksums_are_refused_on_sglang():
    """learner.weight_sync_verify reads the torch engine's parameters: refused with sglang, naming both fields."""
    assert load_config("tiny", ["learner.weight_sync_verify=true"], check_files=False).learner.weight_sync_verify
    with pytest.raises(ConfigError, match=r"learner.weight_sync_verify=true .*actors.engine.backend=sglang"):
        load_config("tiny", ["learner.weight_sync_verify=true", "actors.engine.backend=sglang"], check_files=False)


def test_the_kv_quantizer_is_an_mlflow_param():
    """deploy/config.py derived_params: `kv/dtype` is the KVQuant name the groups carry (logged beside the config's
    own keys by the driver)."""
    from deploy.config import derived_params
    from deploy.tracking import public_params
    assert public_params(derived_params(load_config("tiny")))["kv/dtype"] == "model"


def test_quantized_kv_loads_on_the_torch_engine_and_is_refused_where_nothing_stores_or_replays_it():
    """kv_dtype int8 / fp8_e4m3 load on the torch engine (the actors' and eval.sparse_compressor's: the evaluation
    under its own cache stores it too); refused in one line on the SGLang engine, naming actors.engine.backend and
    the field, and with method full under policy_target sparse (no eviction record to replay it along)."""
    run = load_config("tiny", ["actors.engine.compressor.kv_dtype=int8", "learner.policy_target=sparse",
                               "eval.sparse_compressor.method=rkv", "eval.sparse_compressor.kv_dtype=fp8_e4m3"])
    assert run.actors.engine.compressor.kv_quant().name == "int8/token_head"
    assert run.eval.sparse_compressor.kv_quant().name == "fp8_e4m3/token_head"
    with pytest.raises(ConfigError, match=r"^actors\.engine\.compressor\.kv_dtype=fp8_e4m3: the sparse backend's "
                                          r"KV pool stores the model dtype .*actors\.engine\.backend=sglang"):
        load_config("tiny", ["actors.engine.compressor.kv_dtype=fp8_e4m3", "actors.engine.backend=sglang"])
    with pytest.raises(ConfigError, match=r"^actors\.engine\.compressor\.kv_dtype='int8' with method full and "
                                          r"learner\.policy_target=sparse: "):
        load_config("tiny", ["actors.engine.compressor.kv_dtype=int8", "actors.engine.compressor.method=full",
                             "learner.policy_target=sparse"])
    assert load_config("tiny", ["actors.engine.compressor.kv_dtype=int8", "actors.engine.compressor.method=full"])


def test_replay_quant_gap_without_a_quantized_cache_to_replay_is_refused():
    """learner.replay_quant_gap with policy_target sparse but kv_dtype model would measure nothing: one line naming
    the fields (deploy/config.py check_kv_precision)."""
    with pytest.raises(ConfigError, match=r"^learner\.replay_quant_gap=true measures the replay of a quantized KV "
                                          r"cache: .*actors\.engine\.compressor\.kv_dtype other than model \(now "
                                          r"'model'\)$"):
        load_config("tiny", ["learner.policy_target=sparse", "learner.replay_quant_gap=true"])


@pytest.mark.parametrize("overrides, message", [
    (["actors.engine.compressor.kv_budget_bytes=-1"], r"actors\.engine\.compressor\.kv_budget_bytes=-1 must be >= 0"),
    (["actors.engine.compressor.kv_budget_bytes=9000"],      # the tiny preset sets kv_budget=48
     r"actors\.engine\.compressor\.kv_budget_bytes=9000 with actors\.engine\.compressor\.kv_budget=48: the byte "
     r"budget is the one budget"),
    (["actors.engine.compressor.kv_budget_bytes=9000", "actors.engine.compressor.kv_budget=512",
      "actors.engine.compressor.budget_schedule=linear", "actors.engine.compressor.kv_budget_final=600"],
     r"actors\.engine\.compressor\.kv_budget_bytes=9000 with actors\.engine\.compressor\.budget_schedule=linear: "),
    (["actors.engine.compressor.kv_budget_bytes=9000", "actors.engine.compressor.kv_budget=512",
      "actors.engine.compressor.budget_tiers=confidence"],
     r"actors\.engine\.compressor\.kv_budget_bytes=9000 with actors\.engine\.compressor\.budget_tiers=confidence: "),
    (["actors.engine.compressor.kv_budget_bytes=9000", "actors.engine.compressor.kv_budget=512",
      "actors.engine.compressor.method=full"],
     r"actors\.engine\.compressor\.kv_budget_bytes=9000 with actors\.engine\.compressor\.method=full: nothing"),
    (["actors.engine.compressor.kv_budget_bytes=9000", "actors.engine.compressor.kv_budget=512",
      "actors.engine.backend=sglang"], r"actors\.engine\.compressor\.kv_budget_bytes=9000: a byte budget is "
                                      r"resolved to tokens by the torch engine only"),
])
def test_a_byte_budget_is_the_one_budget(overrides, message):
    """compressor.kv_budget_bytes (resolved to tokens by the torch engine and the preflight) is refused beside
    anything else that states the budget in tokens, with method full, and on the SGLang engine, naming the fields;
    alone (kv_budget back at its default) it loads."""
    with pytest.raises(ConfigError, match="^" + message):
        load_config("tiny", overrides)
    run = load_config("tiny", ["actors.engine.compressor.kv_budget_bytes=9000",
                               "actors.engine.compressor.kv_budget=512"])
    assert run.actors.engine.compressor.kv_budget_bytes == 9000
