"""The weight-sync fingerprint's probe (broker/fingerprint.py): the same token ids on every process for a
vocabulary, shortened to the run's smallest KV budget and refused below MIN_PROBE_TOKENS; the tolerance by sync
dtype; max_abs over the probe's log-probs."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from broker import fingerprint as fp


def test_the_probe_is_the_same_on_every_process_and_a_shorter_one_is_its_prefix():
    here = fp.probe(49152)
    code = "from broker.fingerprint import probe; print(probe(49152))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert str(here) == there.strip()                                   # another process, another hash seed
    assert len(here) == fp.PROBE_SEQUENCES and {len(s) for s in here} == {fp.PROBE_TOKENS}
    assert all(0 <= t < 49152 - 1 for s in here for t in s) and len({t for s in here for t in s}) > 10
    assert fp.probe(49152, 5) == [s[:5] for s in here]
    assert fp.probe(256) != fp.probe(257) and fp.probe(256) == fp.probe(256)
    for vocab, tokens in ((1, 16), (256, fp.MIN_PROBE_TOKENS - 1), (256, fp.PROBE_TOKENS + 1)):
        with pytest.raises(ValueError, match="probe"):
            fp.probe(vocab, tokens)


def test_the_probe_is_short_one_forward_of_a_few_tokens():
    """Its cost is a forward of PROBE_SEQUENCES x PROBE_TOKENS tokens per side per fingerprinted sync (bench/
    weight_sync.py): 2 x 8 (14 log-probs), which still tells two versions apart (tests/learner/
    test_learner_fingerprint.py, tests/deploy/test_weight_sync_fingerprint.py: one update moves it > 10x the
    tolerance)."""
    assert (fp.PROBE_SEQUENCES, fp.PROBE_TOKENS) == (2, 8)


def test_fingerprinted_versions_every_k_syncs():
    assert [v for v in range(10) if fp.fingerprinted(v, 1)] == list(range(10))
    assert [v for v in range(10) if fp.fingerprinted(v, 3)] == [0, 3, 6, 9]
    for every in (0, -1):
        with pytest.raises(ValueError, match="every"):
            fp.fingerprinted(3, every)


def test_probe_tokens_fit_the_smallest_budget_or_are_refused():
    assert fp.probe_tokens(None) == fp.PROBE_TOKENS == fp.probe_tokens(48)
    assert fp.probe_tokens(7) == 7 and fp.probe_tokens(fp.MIN_PROBE_TOKENS) == fp.MIN_PROBE_TOKENS
    with pytest.raises(ValueError, match=r"smallest KV budget \(3 tokens\)"):
        fp.probe_tokens(3)


def test_tolerance_by_sync_dtype():
    assert fp.tolerance(torch.float32) == fp.tolerance("fp32") == fp.tolerance("float32") == 1e-3
    assert fp.tolerance(torch.bfloat16) == fp.tolerance("bf16") > fp.tolerance(torch.float16) == fp.tolerance("fp16")
    assert fp.tolerance("bf16") > 10 * fp.tolerance("fp32")
    with pytest.raises(ValueError, match="int8"):
        fp.tolerance("int8")


def test_max_abs_over_every_position_nan_is_a_mismatch_and_other_shapes_are_refused():
    a = [np.zeros(15, dtype=np.float32), np.full(15, -3.0, dtype=np.float32)]
    b = [np.zeros(15, dtype=np.float32), np.full(15, -3.0, dtype=np.float32)]
    assert fp.max_abs(a, b) == 0.0
    b[1][7] = -3.25
    assert fp.max_abs(a, b) == fp.max_abs(b, a) == pytest.approx(0.25)
    b[0][0] = np.nan
    assert fp.max_abs(a, b) == float("inf")
    inf = [np.array([-np.inf, -1.0])]
    assert fp.max_abs(inf, [np.array([-np.inf, -1.0])]) == 0.0 and fp.max_abs(inf, [np.array([-5.0, -1.0])]) == np.inf
    with pytest.raises(ValueError, match="different probes"):
        fp.max_abs(a, a[:1])
    with pytest.raises(ValueError, match="different probes"):
        fp.max_abs(a, [a[0], a[1][:9]])
