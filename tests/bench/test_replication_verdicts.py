"""The pre-registered verdicts of bench/replication.py (docs/results.md section 6.2) on hand-made run figures."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("replication", Path(__file__).parents[2] / "bench" / "replication.py")
replication = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replication)


def run(final, spike=2.0, collapse=False, eval_dense=0.5, eval_sparse=0.4):
    return {"final_reward": final, "grad_norm_spike": spike, "collapse": collapse,
            "eval/dense/reward": eval_dense, "eval/sparse/reward": eval_sparse}


def test_run_stats_by_hand():
    h = {"reward_mean": np.array([0.1, 0.2, 0.3, 0.8, 0.3, 0.3, 0.3]), "grad_norm": np.array([1, 1, 2, 30, 1, 1, 1.0]),
         "kv_retained_ratio": np.array([0.4] * 7), "response_truncated_fraction": np.array([0.1] * 7),
         "mismatch_kl": np.array([0.1] * 7), "rejection_rate": np.array([0.0] * 7)}
    st = replication.run_stats(h, {"eval/dense/reward": 0.7, "eval/dense/n": 64})
    assert st["reward_gain"] == pytest.approx(0.3 - 0.2)            # last 3 (0.3) - first 3 (0.2)
    assert st["final_reward"] == pytest.approx(0.3) and st["peak_reward"] == 0.8
    assert st["collapse"] is True                                   # 0.3 < 0.8 / 2
    assert st["grad_norm_spike"] == pytest.approx(30.0)             # max 30 / median 1
    assert st["eval/dense/reward"] == 0.7 and "eval/dense/n" not in st


def test_spike_with_steps_that_have_no_gradient():
    h = {"reward_mean": np.array([0.5] * 6), "grad_norm": np.array([0, 0, 0, 0.5, 1, 5.0]),
         "kv_retained_ratio": np.array([0.4] * 6), "response_truncated_fraction": np.array([0.0] * 6),
         "mismatch_kl": np.array([0.1] * 6), "rejection_rate": np.array([0.0] * 6)}
    st = replication.run_stats(h, {})
    assert st["grad_norm_spike"] == pytest.approx(20.0)                  # 5 / median (0 + 0.5) / 2
    assert st["grad_norm_spike_with_gradient"] == pytest.approx(5.0)     # 5 / median of 0.5, 1, 5
    assert st["steps_without_gradient"] == 3
    assert replication.spike_ratio(np.array([0, 0, 0, 2.0])) == "inf"    # median 0: a strict-JSON "inf"
    assert replication.spike_ratio(np.array([0, 0.0])) is None
    assert replication.spiked("inf") and replication.spiked(10.5) and not replication.spiked(10.0)
    assert not replication.spiked(None)


def test_h1_needs_both_training_and_held_out_reward_within_5_percent():
    dense = {0: run(0.60, eval_dense=0.80), 1: run(0.40, eval_dense=0.60)}          # means 0.50, 0.70
    # 0.48 >= 0.475, 0.67 >= 0.665
    close = {"sparse_rl": {0: run(0.50, eval_dense=0.70), 1: run(0.46, eval_dense=0.64)}}
    assert replication.verdicts(close, dense, {})["h1"]["confirmed"] is True
    low_eval = {"sparse_rl": {0: run(0.50, eval_dense=0.70), 1: run(0.46, eval_dense=0.62)}}  # 0.66 < 0.665
    assert replication.verdicts(low_eval, dense, {})["h1"]["confirmed"] is False


def test_h2_by_margin_spike_or_collapse_and_refuted_otherwise():
    srl = {s: run(f) for s, f in enumerate([0.50, 0.55, 0.60])}
    margin = {"sparse_rl": srl, "naive_sparse": {s: run(f) for s, f in enumerate([0.20, 0.25, 0.30])}}
    h2 = replication.verdicts(margin, {}, {})["h2"]
    assert h2["confirmed"] and h2["final_reward_lower_by_more_than_spread"] and h2["seed_spread"] == pytest.approx(0.1)
    close = {s: run(f) for s, f in enumerate([0.48, 0.50, 0.58])}                   # 0.03 below, spread 0.1
    assert replication.verdicts({"sparse_rl": srl, "naive_sparse": close}, {}, {})["h2"]["confirmed"] is False
    spiky = {s: run(f, spike=25.0 if s < 2 else 2.0) for s, f in enumerate([0.48, 0.50, 0.58])}
    h2 = replication.verdicts({"sparse_rl": srl, "naive_sparse": spiky}, {}, {})["h2"]
    assert h2["confirmed"] and h2["seeds_with_naive_only_grad_spike"] == [0, 1]
    one_spike = {s: run(f, spike=25.0 if s == 0 else 2.0) for s, f in enumerate([0.48, 0.50, 0.58])}
    assert replication.verdicts({"sparse_rl": srl, "naive_sparse": one_spike}, {}, {})["h2"]["confirmed"] is False
    both_spike = {"sparse_rl": {s: run(f, spike=25.0) for s, f in enumerate([0.50, 0.55, 0.60])}, "naive_sparse": spiky}
    assert replication.verdicts(both_spike, {}, {})["h2"]["confirmed"] is False     # Sparse-RL spikes too


def test_h3_compares_under_the_same_sparse_cache():
    arms = {"sparse_rl": {0: run(0.5, eval_sparse=0.40), 1: run(0.5, eval_sparse=0.30)}}     # mean 0.35
    above = {0: {"sparse/reward": 0.30}, 1: {"sparse/reward": 0.30}}
    below = {0: {"sparse/reward": 0.40}, 1: {"sparse/reward": 0.35}}
    assert replication.verdicts(arms, {}, above)["h3"]["confirmed"] is True
    assert replication.verdicts(arms, {}, below)["h3"]["confirmed"] is False


@pytest.mark.parametrize("argv", [[], ["--config", "smollm2-count-warm"]])
def test_default_grid_runs_the_pre_registered_config(argv, tmp_path):
    """The grid of docs/results.md 6.2 was registered at commit b1c3cb8; the main job's preset has moved on since
    (no group std, batches of 4 prompts), so the bench pins the registered values, also when the preset is named."""
    from deploy.config import load_config

    args = replication.parse_args([*argv, "--out", str(tmp_path)])
    cfg = load_config(args.config, args.overrides, check_files=False)
    assert cfg.learner.norm_adv_by_std and cfg.learner.loss_agg_mode == "seq-mean-token-mean"
    assert not cfg.learner.fuse_logp_old and cfg.learner.policy_target == "dense"   # the preset replays since 6.12
    assert cfg.actors.prompts_per_batch == 2 and cfg.train.learner_num_cpus == 2 and cfg.learner.lr == 2e-5
    assert args.budgets == [48, 72] and args.steps == 20 and args.seeds == 3 and args.eval_limit == 64
    assert args.records is not None and args.records.name == "replication-decode"



def test_ablation_arms_differ_from_sparse_rl_in_one_setting_each(tmp_path):
    """6.11's ablations: the sparse_rl arm with the token mask off, or with every TIS weight flat (cap 1e-6); not in
    the default grid; --only-seeds keeps the grid's order and refuses a seed outside 0..N-1."""
    from deploy.config import load_config

    args = replication.parse_args(["--arms", "sparse_rl,sparse_rl_no_token_mask,sparse_rl_flat_tis", "--budgets", "48",
                                   "--only-seeds", "2,0", "--out", str(tmp_path)])
    assert replication.grid(args) == [(arm, 48, seed) for seed in (2, 0)
                                      for arm in ("sparse_rl", "sparse_rl_no_token_mask", "sparse_rl_flat_tis")]
    learner = {arm: load_config(args.config, [*args.overrides, *replication.ARMS[arm]], check_files=False).learner
               for arm in args.arms}
    assert learner["sparse_rl"].token_mask and learner["sparse_rl"].tis_cap == 1.5
    assert not learner["sparse_rl_no_token_mask"].token_mask and learner["sparse_rl_no_token_mask"].tis_cap == 1.5
    assert learner["sparse_rl_flat_tis"].token_mask and learner["sparse_rl_flat_tis"].tis_cap == 1e-6
    assert {learner[a].rejection for a in learner} == {"veto"} and {learner[a].eps for a in learner} == {1e-4}
    default = replication.parse_args(["--out", str(tmp_path)])
    assert not {arm for arm, _, _ in replication.grid(default)} & {"sparse_rl_no_token_mask", "sparse_rl_flat_tis"}
    with pytest.raises(SystemExit):
        replication.parse_args(["--only-seeds", "3", "--out", str(tmp_path)])

def test_missing_budgets_of_a_dense_record():
    record = {"evals": {"48": {"sparse/reward": 0.9}, "96": {"sparse/reward": 0.95}}}
    assert replication.missing_budgets("dense-s0", record, [48, 64]) == [64]      # the grid's budgets changed
    assert replication.missing_budgets("dense-s0", record, [48, 96]) == []
    assert replication.missing_budgets("naive_sparse-b48-s0", {"evals": {}}, [48, 64]) == []


def test_a_dense_model_is_scored_at_another_budget_from_its_weights_not_its_own_score(tmp_path):
    """With --budgets 72 alone, a dense run evaluated under R-KV 48 had its R-KV 48 score recorded as its 72 one
    (the budget was the invocation's first). The run's own evaluation budget is its config's; any other budget
    needs the weights, and with --only-report stays missing rather than borrowing the 48 score."""
    run_dir = tmp_path / "dense-s0-20261204-000000-abcd"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("eval:\n  sparse_compressor:\n    method: rkv\n    kv_budget: 48\n")
    summary = {"run_dir": str(run_dir), "eval/sparse/reward": 0.9}
    assert replication.own_eval_budget(summary) == 48
    assert replication.own_eval_budget({"run_dir": str(tmp_path / "gone")}) is None
    assert replication.dense_sparse_eval(None, 0, 48, summary) == {"sparse/reward": 0.9}
    args = replication.parse_args(["--budgets", "72", "--only-report", "--out", str(tmp_path / "out")])
    record = {"summary": summary, "evals": {"48": {"sparse/reward": 0.9}}}
    assert replication.with_dense_evals(args, "dense-s0", record)["evals"] == {"48": {"sparse/reward": 0.9}}


def test_runs_table_has_a_row_per_run_and_budget_with_the_dense_model_under_each_cache():
    dense = {"final_reward": 0.9, "peak_reward": 1.0, "response_truncated_fraction": 0.1, "kv_retained_ratio": 1.0,
             "mismatch_kl": 0.0, "rejection_rate": 0.0, "grad_norm_spike": 14.0, "grad_norm_spike_with_gradient": 6.5,
             "steps_without_gradient": 7, "eval_before/dense/reward": 0.88, "eval/dense/reward": 0.96,
             "eval_before/sparse/reward": 0.62, "eval/sparse/reward": 0.90}
    srl = {**dense, "final_reward": 0.5, "kv_retained_ratio": 0.26, "mismatch_kl": 0.0105, "grad_norm_spike": "inf",
           "eval/sparse/reward": 0.64, "eval_before/dense/reward": None, "eval_before/sparse/reward": 0.7}
    table = replication.runs_table({("sparse_rl", 72, 0): srl, ("dense", None, 0): dense},
                                   {(0, 48): 0.90, (0, 72): 0.94}, [48, 72])
    lines = table.splitlines()
    assert len(lines) == 2 + 3                                   # header, rule, dense at 48 and 72, sparse_rl at 72
    assert lines[2] == ("| dense | 48 | 0 | 0.900 | 1.000 | 0.10 |  |  |  | 14.0 (6.5; 7) | 0.880 -> 0.960 "
                        "| 0.620 -> 0.900 |")
    assert lines[3].startswith("| dense | 72 | 0 |") and lines[3].endswith("| 0.880 -> 0.960 | 0.940 |")
    assert lines[4] == ("| sparse_rl | 72 | 0 | 0.500 | 1.000 | 0.10 | 0.26 | 0.0105 | 0.000 | inf (6.5; 7) | 0.960 "
                        "| 0.700 -> 0.640 |")                 # its own run's before, under its own cache (72)


def test_verdicts_text_names_each_verdict_with_every_seeds_numbers():
    dense = {0: run(0.60, eval_dense=0.80), 1: run(0.40, eval_dense=0.60)}
    arms = {"sparse_rl": {0: run(0.50, eval_dense=0.70, eval_sparse=0.55), 1: run(0.46, eval_dense=0.64)},
            "naive_sparse": {0: run(0.49), 1: run(0.45, spike="inf")}}
    block = replication.verdicts(arms, dense, {0: {"sparse/reward": 0.5}, 1: {"sparse/reward": 0.3}})
    lines = replication.verdicts_text({"budget_48": block}, [48, 72]).splitlines()
    assert lines[0].startswith("- budget 48, H1: **confirmed**: Sparse-RL final 0.480 vs 0.95 x dense 0.500")
    assert ("seed 1: Sparse-RL final 0.460, dense final 0.400, Sparse-RL held-out 0.640, dense held-out 0.600"
            in lines[0])
    assert lines[1].startswith("- budget 48, H2: **refuted**: (a) naive final 0.470 vs Sparse-RL 0.480")
    assert "seeds with a naive-only grad-norm spike [1]" in lines[1] and "naive spike inf" in lines[1]
    assert lines[2] == ("- budget 48, H3: **confirmed**: held-out under the budget-48 cache: Sparse-RL 0.475 vs the "
                        "dense-trained model 0.400. seed 0: Sparse-RL 0.550, dense-trained 0.500; seed 1: Sparse-RL "
                        "0.400, dense-trained 0.300")
    assert lines[3:] == [f"- budget 72, H{i}: not decided (runs missing)" for i in (1, 2, 3)]


def test_committed_report_names_its_committed_plot_and_table(tmp_path):
    """--only-report on the committed records: the JSON written beside them names the copies beside it (a path
    under the results folder, which is not committed, would point nowhere in a clone)."""
    import json
    import shutil
    records = tmp_path / "docs" / "results" / "replication-decode"
    shutil.copytree(Path(__file__).parents[2] / "docs" / "results" / "replication-decode", records)
    replication.main(["--only-report", "--records", str(records), "--out", str(tmp_path / "out")])
    result = json.loads(records.with_suffix(".json").read_text())
    assert result["plot"] == str(tmp_path / "docs" / "replication-decode.png")
    assert result["table"] == str(records.with_suffix(".md"))
    assert Path(result["plot"]).stat().st_size > 0 and "| arm | budget |" in Path(result["table"]).read_text()
    assert result["complete"] is True and result["seeds"] == 3


def replay_run(final, eval_dense=0.9, eval_sparse=0.9, worst=2e-5, gap=0.3, steps=20):
    return {**run(final, eval_dense=eval_dense, eval_sparse=eval_sparse), "replay_logp_max_abs_max": worst,
            "replay_dense_gap_max_max": gap, "replay_logp_max_abs_steps": steps}


def test_replay_rules_r1_to_r4_and_the_preset_switch_by_hand():
    """docs/results.md 6.12: dense finals 0.96, naive 0.96, Sparse-RL 0.77 (6.10's means); held-out under the cache
    dense-trained 0.87, Sparse-RL 0.86, naive 0.90."""
    dense = {s: run(0.96, eval_dense=0.96) for s in range(3)}
    naive = {s: run(0.96, eval_sparse=0.90) for s in range(3)}
    srl = {s: run(0.77, eval_sparse=0.86) for s in range(3)}
    dense_sparse = {s: {"sparse/reward": 0.87} for s in range(3)}
    good = {s: replay_run(0.95, eval_dense=0.93, eval_sparse=0.93) for s in range(3)}   # R2: 0.93 - 0.87 > 0.046
    arms = {"naive_sparse": naive, "sparse_rl": srl, "sparse_replay": good,
            "sparse_replay_distill": {0: replay_run(0.95), 1: replay_run(0.88), 2: replay_run(0.89, worst=2e-4)}}
    v = replication.replay_verdicts(arms, dense, dense_sparse, steps=20)
    r = v["sparse_replay"]
    assert r["r1"]["holds"] and r["r2"]["holds"] and r["r3"]["holds"] and r["r4"]["holds"] and r["switch"]
    assert r["r2"]["eval_sparse_reward"] == pytest.approx(0.93)
    d = v["sparse_replay_distill"]
    # finals 0.95, 0.88, 0.89: mean 0.907 < 0.95 x 0.96 = 0.912 and two seeds more than 0.05 below naive's 0.96
    assert not d["r1"]["holds"] and d["r1"]["seeds_within_0.05_of_naive"] == 1
    assert not d["r2"]["holds"] and not d["r2"]["refuted_against_naive"]   # 0.90 - 0.87 < 0.046; naive - 0.90 = 0
    assert not d["r4"]["holds"]                                             # 2e-4 > 1e-4 in seed 2
    assert d["switch"] is False
    low = replication.replay_verdicts({**arms, "sparse_replay": {s: replay_run(0.95, eval_sparse=0.80, eval_dense=0.90)
                                                                 for s in range(3)}}, dense, dense_sparse, steps=20)
    assert low["sparse_replay"]["r2"]["refuted_against_naive"]            # 0.90 - 0.80 > 0.046
    assert not low["sparse_replay"]["r3"]["holds"]                        # 0.90 < 0.95 x 0.96
    short = replication.replay_verdicts({**arms, "sparse_replay": {s: replay_run(0.95, steps=19) for s in range(3)}},
                                        dense, dense_sparse, steps=20)
    assert not short["sparse_replay"]["r4"]["holds"]                      # a step without the check: not exact
    text = "\n".join(replication.replay_verdicts_text(v, 48))
    assert "sparse_replay, R1: **holds**" in text and "sparse_replay_distill, R4: **fails**" in text


def test_summarize_keeps_an_infinite_spike_ratio_of_one_seed():
    """A seed whose median grad norm is 0 has spike ratio "inf" (a string); its mean over seeds is "inf", not a
    TypeError (the crash of --only-report on the lookup-stress records, docs/results.md 9)."""
    out = replication.summarize({0: run(0.1, spike="inf"), 1: run(0.3, spike=2.0)})
    assert out["grad_norm_spike"] == "inf" and out["final_reward"] == pytest.approx(0.2)
    assert out["per_seed"][0]["grad_norm_spike"] == "inf"


def test_episode_rules_s1_to_s5_and_the_switch_by_hand():
    """docs/results.md section 9, margin 0.1: replay final 0.70 vs dense 0.75 (S1 needs >= 0.65) and held-out under
    the cache 0.55 vs the dense arm's held-out dense 0.60 (>= 0.50); Sparse-RL 0.30 (S2 needs > 0.40, 2 of 3
    seeds above); naive 0.50 (S3 within); dense-trained under the cache 0.40 (S4 needs > 0.50)."""
    dense = {s: run(0.75, eval_dense=0.60) for s in range(3)}
    srl = {s: run(0.2, eval_sparse=0.30) for s in range(3)}
    naive = {s: run(0.5, eval_sparse=0.50) for s in range(3)}
    dense_sparse = {s: {"sparse/reward": 0.40} for s in range(3)}
    good = {s: replay_run(0.70, eval_sparse=0.55, steps=8) for s in range(3)}
    arms = {"sparse_rl": srl, "naive_sparse": naive, "sparse_replay": good}
    v = replication.episode_verdicts(arms, dense, dense_sparse, steps=8)
    assert v["s1"]["holds"] and v["s2"]["holds"] and v["s5"]["holds"] and v["switch"] is True
    assert v["s3"]["verdict"] == "within" and v["s4"]["holds"]        # 0.55 - 0.50 = 0.05; 0.55 > 0.40 + 0.1
    weak = {s: replay_run(0.60, eval_sparse=0.38, steps=8) for s in range(3)}   # final 0.60 < 0.65; 0.38 < 0.40
    w = replication.episode_verdicts({**arms, "sparse_replay": weak}, dense, dense_sparse, steps=8)
    assert not w["s1"]["holds"] and not w["s2"]["holds"] and w["s3"]["verdict"] == "below" and not w["s4"]["holds"]
    assert w["switch"] is False and w["s2"]["seeds_above"] == 3
    one = {0: replay_run(0.7, eval_sparse=0.9, steps=8), 1: replay_run(0.7, eval_sparse=0.2, steps=8),
           2: replay_run(0.7, eval_sparse=0.25, steps=8)}              # mean 0.45 > 0.40 but above Sparse-RL in 1 seed
    assert not replication.episode_verdicts({**arms, "sparse_replay": one}, dense, dense_sparse, 8)["s2"]["holds"]
    inexact = {**good, 2: replay_run(0.70, eval_sparse=0.55, worst=2e-4, steps=8)}
    assert not replication.episode_verdicts({**arms, "sparse_replay": inexact}, dense, dense_sparse, 8)["switch"]
    text = "\n".join(replication.episode_verdicts_text(w, 64))
    assert "S1: **fails**" in text and "S3: **below**" in text and "S5: **holds**" in text
    assert replication.episode_verdicts({"sparse_rl": srl}, dense, dense_sparse, 8) == {}


def test_scorer_rules_by_hand():
    """docs/results.md section 10 at budget 48. R-KV replay (sparse_replay): finals 0.95, held-out under its cache
    0.96. random_replay: finals 0.92 (>= 0.95 - 0.05), held-out 0.93 (>= 0.96 - 0.046): matches; streamingllm_replay:
    held-out 0.90 (< 0.914): does not; random_naive held-out 0.85, 0.95, 0.84: random_replay is higher in seeds 0 and
    2 and 0.93 - 0.88 = 0.05 > 0.046: replay rescues random. Seed 2 of random_replay has no replay check on one step:
    not exact."""
    rkv = {s: replay_run(0.95, eval_sparse=0.96) for s in range(3)}
    random = {0: replay_run(0.92, eval_sparse=0.93), 1: replay_run(0.92, eval_sparse=0.93),
              2: replay_run(0.92, eval_sparse=0.93, steps=19)}
    arms = {"sparse_replay": rkv, "random_replay": random,
            "streamingllm_replay": {s: replay_run(0.95, eval_sparse=0.90) for s in range(3)},
            "random_naive": {0: run(0.9, eval_sparse=0.85), 1: run(0.9, eval_sparse=0.95),
                             2: run(0.9, eval_sparse=0.84)}}
    v = replication.scorer_verdicts(arms, steps=20)
    assert v["random_replay"]["matches_rkv"]["holds"]
    assert v["random_replay"]["matches_rkv"]["against"] == "sparse_replay"
    assert not v["streamingllm_replay"]["matches_rkv"]["holds"]
    assert not v["random_replay"]["exact"]["holds"] and v["streamingllm_replay"]["exact"]["holds"]
    assert v["rescue"]["holds"] and v["rescue"]["seeds_higher"] == 2
    assert v["rescue"]["random_naive_eval_sparse_reward"] == pytest.approx(0.88)
    worse = replication.scorer_verdicts({**arms, "random_replay": {s: replay_run(0.89, eval_sparse=0.93)
                                                                    for s in range(3)}}, steps=20)
    assert not worse["random_replay"]["matches_rkv"]["holds"]              # 0.89 < 0.95 - 0.05
    alone = replication.scorer_verdicts({"random_replay": random}, steps=20)
    assert set(alone) == {"random_replay"} and set(alone["random_replay"]) == {"exact"}   # nothing to compare with


def test_scorer_arms_differ_from_their_baselines_in_the_compressor_only(tmp_path):
    """section 10's arms: random / StreamingLLM under replay differ from sparse_replay (R-KV) in the method only;
    random_naive from naive_sparse likewise; the protected pair both protect the prompt and 4 sinks."""
    from deploy.config import load_config

    args = replication.parse_args(["--out", str(tmp_path)])
    cfg = {arm: load_config(args.config, [*args.overrides, *replication.ARMS[arm]], check_files=False)
           for arm in ("sparse_replay", "random_replay", "streamingllm_replay", "naive_sparse", "random_naive",
                       "rkv_protect_replay", "random_protect_replay")}
    comp = {arm: c.actors.engine.compressor for arm, c in cfg.items()}
    assert (comp["sparse_replay"].method, comp["random_replay"].method, comp["streamingllm_replay"].method,
            comp["random_naive"].method) == ("rkv", "random", "streamingllm", "random")
    for arm, base in (("random_replay", "sparse_replay"), ("streamingllm_replay", "sparse_replay"),
                      ("random_naive", "naive_sparse"), ("random_protect_replay", "rkv_protect_replay")):
        assert cfg[arm].learner == cfg[base].learner, arm
    assert cfg["random_replay"].learner.policy_target == "sparse"
    assert cfg["random_naive"].learner.policy_target == "dense"
    assert {(comp[a].protect_prompt, comp[a].sink_tokens) for a in ("rkv_protect_replay", "random_protect_replay")} \
        == {("all", 4)}
    assert (comp["random_replay"].protect_prompt, comp["random_replay"].sink_tokens) == ("off", 0)


SMOLLM2_135M = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
"""The KV-relevant fields of SmolLM2-135M's config.json (the model smollm2-count-warm warms up)."""


def test_equal_bytes_arms_are_sparse_replay_with_fp8_kv_at_fp32_r_kv_48s_bytes_and_half(tmp_path):
    """section 11's arms: 2 x 30 layers x 3 KV heads x 64 x 4 B = 46,080 B per token at fp32 (512 B per layer and
    KV head), x 48 = 2,211,840 B; fp8_e4m3 with a float32 scale: 2 x 30 x 3 x (64 + 4) = 12,240 B (136 B), so 180
    tokens fit the bytes (2,203,200 B) and 90 fit half of them (1,101,600 B of 1,105,920). The arms differ from
    sparse_replay in the compressor only, and keep their bytes when the grid's budget 48 is set before them."""
    import json
    from types import SimpleNamespace

    from compressors.kv_quant import KVQuant, budget_tokens
    from deploy.config import ConfigError, load_config

    config = SimpleNamespace(**SMOLLM2_135M)
    cached = Path.home() / ".cache" / "sparse-rl" / "smollm2-135m-count-warm" / "config.json"
    if cached.exists():   # the warmed-up model, where this machine has it
        assert {k: json.loads(cached.read_text())[k] for k in SMOLLM2_135M} == SMOLLM2_135M
    head_dim = config.hidden_size // config.num_attention_heads
    fp32 = KVQuant("model").token_bytes(config.num_hidden_layers, config.num_key_value_heads, head_dim, 4)
    fp8 = KVQuant("fp8_e4m3", "token_head").token_bytes(config.num_hidden_layers, config.num_key_value_heads,
                                                        head_dim, 4)
    assert (fp32, fp8) == (replication.TOKEN_BYTES_FP32, 12_240) == (46_080, 12_240)
    assert replication.FP32_48_BYTES == 48 * fp32 == 2_211_840
    assert budget_tokens(2_211_840, fp8) == 180 and budget_tokens(2_211_840 // 2, fp8) == 90

    args = replication.parse_args(["--arms", "sparse_replay,fp8_replay_eqbytes,fp8_replay_halfbytes", "--budgets",
                                   "48", "--out", str(tmp_path)])
    cfg = {arm: load_config(args.config, replication.train_overrides(args, arm, 48, 0, arm), check_files=False)
           for arm in args.arms}
    comp = {arm: c.actors.engine.compressor for arm, c in cfg.items()}
    assert (comp["sparse_replay"].kv_dtype, comp["sparse_replay"].kv_budget, comp["sparse_replay"].kv_budget_bytes) \
        == ("model", 48, 0)
    for arm, bytes_ in (("fp8_replay_eqbytes", 2_211_840), ("fp8_replay_halfbytes", 1_105_920)):
        c = comp[arm]
        assert (c.kv_dtype, c.kv_scale, c.kv_budget, c.kv_budget_bytes) == ("fp8_e4m3", "token_head", 512, bytes_)
        assert (c.method, c.window, c.interval) == (comp["sparse_replay"].method, 8, 8)
        assert cfg[arm].learner == cfg["sparse_replay"].learner and cfg[arm].learner.policy_target == "sparse"
        with pytest.raises(ConfigError, match="kv_budget"):   # the budget after the arm: refused, not run
            load_config(args.config, [*args.overrides, *replication.ARMS[arm],
                                      "actors.engine.compressor.kv_budget=48"], check_files=False)
    assert {arm for arm, _, _ in replication.grid(replication.parse_args(["--out", str(tmp_path)]))}.isdisjoint(
        replication.EQUAL_BYTES)


def test_equal_bytes_arms_predicted_kv_peak_is_within_5_percent_of_their_targets():
    """The preflight's formula (prompt 46 + response 176 tokens, interval 8): fp32 R-KV 48 peaks at 56 slots x 30
    layers x 1,536 B + a 46-token prefill of one layer (70,656 B) = 2,651,136 B per sequence (the committed records'
    eval/sparse/kv_peak_bytes); fp8 at 180 tokens at 188 slots x 30 x 408 B + one layer read back at fp32 (188 x
    1,536 = 288,768 B) = 2,589,888 B (-2.3 % of 2,651,136); at 90 tokens 98 x 30 x 408 + 98 x 1,536 = 1,350,048 B
    (+1.8 % of half, 1,325,568)."""
    from types import SimpleNamespace

    from actors.engines.kv_memory import ModelShape, kv_peak_bytes_per_sequence

    config = SimpleNamespace(**SMOLLM2_135M)
    fp32 = ModelShape.from_hf_config(config, "fp32")
    fp8 = ModelShape.from_hf_config(config, "fp32", "fp8_e4m3", "token_head")
    ref = kv_peak_bytes_per_sequence(fp32, 46, 176, 48, 8, compress=True)
    eq, half = (kv_peak_bytes_per_sequence(fp8, 46, 176, b, 8, compress=True) for b in (180, 90))
    assert (ref, eq, half) == (2_651_136, 2_589_888, 1_350_048)
    assert abs(eq / ref - 1) <= replication.BYTES_TOLERANCE and abs(half / (ref / 2) - 1) <= replication.BYTES_TOLERANCE


def fp8_run(final, eval_sparse, kv=2_589_888, eval_dense=0.9, worst=2e-4, steps=20):
    return {**replay_run(final, eval_dense=eval_dense, eval_sparse=eval_sparse, worst=worst, steps=steps),
            "eval/sparse/kv_peak_bytes": kv, "kv_retained_ratio": 0.8}


def equal_bytes(arm, runs, ref=None):
    """equal_bytes_verdicts for `arm` ({seed: run_stats}) against fp32 R-KV 48: by default finals 0.95, held-out
    under its cache 0.90, held-out dense 0.94, KV peak 2,651,136 B per sequence in every seed."""
    ref = ref or {s: fp8_run(0.95, 0.90, kv=2_651_136, eval_dense=0.94) for s in range(3)}
    return replication.equal_bytes_verdicts({"sparse_replay": ref, arm: runs}, steps=20)[arm]


def test_equal_bytes_reward_rules_by_hand():
    """Reference: final 0.95, held-out 0.90. better: held-out > 0.946, final >= 0.90, higher in >= 2 seeds; no worse:
    held-out >= 0.854 and final >= 0.90; worse otherwise."""
    eq = "fp8_replay_eqbytes"
    v = equal_bytes(eq, {s: fp8_run(0.91, 0.95) for s in range(3)})             # 0.95 > 0.946, 0.91 >= 0.90
    assert v["verdict"] == "better" and v["seeds_higher"] == 3 and v["at_stated_bytes"]
    assert v["target_kv_peak_bytes"] == 2_651_136 and v["ref_eval_dense_reward"] == pytest.approx(0.94)
    assert equal_bytes(eq, {s: fp8_run(0.91, 0.945) for s in range(3)})["verdict"] == "no worse"   # 0.945 <= 0.946
    assert equal_bytes(eq, {s: fp8_run(0.89, 0.95) for s in range(3)})["verdict"] == "worse"       # 0.89 < 0.90
    assert equal_bytes(eq, {s: fp8_run(0.95, 0.855) for s in range(3)})["verdict"] == "no worse"   # 0.855 >= 0.854
    assert equal_bytes(eq, {s: fp8_run(0.95, 0.853) for s in range(3)})["verdict"] == "worse"      # 0.853 < 0.854
    # held-out per seed against the reference's 0.80, 0.95, 0.95 (mean 0.90): both means 0.953 > 0.946
    ref = {s: fp8_run(0.95, x, kv=2_651_136) for s, x in enumerate([0.80, 0.95, 0.95])}
    two = {s: fp8_run(0.95, x) for s, x in enumerate([1.0, 0.96, 0.90])}        # higher in seeds 0 and 1
    one = {s: fp8_run(0.95, x) for s, x in enumerate([1.0, 0.93, 0.93])}        # higher in seed 0 only
    assert equal_bytes(eq, two, ref)["verdict"] == "better" and equal_bytes(eq, two, ref)["seeds_higher"] == 2
    assert equal_bytes(eq, one, ref)["verdict"] == "no worse" and equal_bytes(eq, one, ref)["seeds_higher"] == 1


def test_equal_bytes_needs_every_seed_within_5_percent_of_its_target():
    """Half the reference's 2,651,136 B: target 1,325,568 B, 5 % of it 66,278.4 B: 1,259,289.6 .. 1,391,846.4."""
    half = "fp8_replay_halfbytes"

    def runs(*kv):
        return {s: fp8_run(0.95, 0.90, kv=k) for s, k in enumerate(kv)}

    v = equal_bytes(half, runs(1_350_048, 1_391_800, 1_259_300))
    assert v["target_kv_peak_bytes"] == 1_325_568 and v["at_stated_bytes"] and v["verdict"] == "no worse"
    for kv in ((1_350_048, 1_391_900, 1_350_048), (1_259_200, 1_350_048, 1_350_048), (1_350_048, None, 1_350_048)):
        v = equal_bytes(half, runs(*kv))
        assert v["verdict"] == "not at the stated bytes" and v["reward_verdict"] == "no worse", kv
    # the equal-bytes arm measured at the half arm's bytes: its rewards do not count either
    assert equal_bytes("fp8_replay_eqbytes", runs(1_350_048, 1_350_048, 1_350_048))["verdict"] \
        == "not at the stated bytes"


def test_equal_bytes_exactness_text_and_missing_reference():
    """Replay of a quantized cache is held to 1e-3 (not 1e-4) on every step; without the reference nothing is
    decided."""
    eq = "fp8_replay_eqbytes"
    assert equal_bytes(eq, {s: fp8_run(0.95, 0.90, worst=9e-4) for s in range(3)})["exact"]["holds"]
    assert not equal_bytes(eq, {s: fp8_run(0.95, 0.90, worst=2e-3) for s in range(3)})["exact"]["holds"]
    assert not equal_bytes(eq, {s: fp8_run(0.95, 0.90, steps=19) for s in range(3)})["exact"]["holds"]
    assert replication.equal_bytes_verdicts({eq: {s: fp8_run(0.95, 0.9) for s in range(3)}}, steps=20) == {}
    v = replication.equal_bytes_verdicts({"sparse_replay": {s: fp8_run(0.95, 0.90, kv=2_651_136) for s in range(3)},
                                          eq: {s: fp8_run(0.91, 0.95) for s in range(3)}}, steps=20)
    line, = replication.equal_bytes_text(v, 48)
    assert line.startswith("- budget 48, fp8_replay_eqbytes: **better** (rewards: better): held-out under its cache "
                           "0.950 vs sparse_replay 0.900 (+-0.046), higher in 3 seeds; final 0.910 vs 0.950")
    assert "seed 0: 2,589,888" in line and "vs target 2,651,136 (1.0 x sparse_replay's, +-5%)" in line


def lora_run(gain, final, eval_sparse=0.95, eval_dense=0.95, worst=2e-5, steps=20):
    return {**replay_run(final, eval_dense=eval_dense, eval_sparse=eval_sparse, worst=worst, steps=steps),
            "reward_gain": gain}


def test_lora_rules_r1_r3_r4_by_hand():
    """docs/results.md section 12 at budget 48. Full fine-tuning (sparse_replay): gains 0.30, finals 0.95, held-out
    0.96 / 0.95. LoRA gains 0.25, 0.25, 0.22 (mean 0.24 = 0.8 x 0.30; none below 0.15), finals 0.91 (>= 0.90),
    held-out 0.92 / 0.91 (>= 0.914 / 0.904): trains as full fine-tuning. Then each rule broken at its boundary."""
    full = {s: lora_run(0.30, 0.95, eval_sparse=0.96) for s in range(3)}
    lora = {0: lora_run(0.25, 0.91, 0.92, 0.91), 1: lora_run(0.25, 0.91, 0.92, 0.91), 2: lora_run(0.22, 0.91, 0.92,
                                                                                                   0.91)}

    def decide(runs):
        return replication.lora_verdicts({"sparse_replay": full, "lora_replay": runs}, steps=20)["lora_replay"]

    v = decide(lora)
    assert v["decided"] == "trains as full fine-tuning" and v["r1"]["gain"] == pytest.approx(0.24)
    assert v["against"] == "sparse_replay" and v["r1"]["seeds_below_half"] == []
    assert not decide({**lora, 2: lora_run(0.21, 0.91, 0.92, 0.91)})["r1"]["holds"]        # mean 0.2367 < 0.24
    assert not decide({**lora, 2: lora_run(0.22, 0.87, 0.92, 0.91)})["r1"]["holds"]        # final 0.897 < 0.90
    low = decide({0: lora_run(0.30, 0.91, 0.92, 0.91), 1: lora_run(0.30, 0.91, 0.92, 0.91),
                  2: lora_run(0.14, 0.91, 0.92, 0.91)})                                      # mean 0.247, 0.14 < 0.15
    assert not low["r1"]["holds"] and low["r1"]["seeds_below_half"] == [2]
    assert not decide({s: lora_run(0.25, 0.91, 0.91, 0.91) for s in range(3)})["r3"]["holds"]   # 0.91 < 0.914
    assert not decide({s: lora_run(0.25, 0.91, 0.92, 0.90) for s in range(3)})["r3"]["holds"]   # 0.90 < 0.904
    worse = decide({**lora, 1: lora_run(0.25, 0.91, 0.92, 0.91, worst=2e-4)})
    assert not worse["r4"]["holds"] and worse["decided"] == "does not"
    assert replication.lora_verdicts({"lora_replay": lora}, steps=20) == {}
    line, = replication.lora_text(replication.lora_verdicts({"sparse_replay": full, "lora_replay": lora}, 20), 48)
    assert "**trains as full fine-tuning**" in line and "seed 2: gain 0.220 (full 0.300)" in line


def test_lora_arm_is_sparse_replay_with_the_pre_registered_adapter(tmp_path):
    """section 12's arm differs from sparse_replay in learner.lora and learner.lr only (rank 16, alpha 32, lr 2e-4)."""
    from dataclasses import replace

    from deploy.config import load_config

    args = replication.parse_args(["--out", str(tmp_path)])
    full, lora = (load_config(args.config, [*args.overrides, *replication.ARMS[a]], check_files=False)
                  for a in ("sparse_replay", "lora_replay"))
    assert (lora.learner.lora.rank, lora.learner.lora.alpha, lora.learner.lr, lora.learner.lora.dropout) \
        == (16, 32.0, 2e-4, 0.0)
    assert full.learner.lora.rank == 0 and full.learner.lr == 2e-5
    assert replace(lora.learner, lora=full.learner.lora, lr=full.learner.lr) == full.learner
    assert lora.actors == full.actors and lora.broker == full.broker
