"""The policy fingerprint of a weight sync: a fixed probe both ends score after every sync (every k-th with
learner.weight_sync_fingerprint_every = k: `fingerprinted`), so that a sync that never reached the rollout engine (the
engine reports the new version, its weights are the old ones) is seen at once (within k syncs).

The learner scores the probe with its own model at the version it sends (teacher-forced log-probs of every token
given its prefix, the dense forward of its old-policy recompute); each actor scores it with its engine after it
swapped that version in (`RolloutEngine.score`); the driver compares the two (`max_abs`) against `tolerance` of the
sync dtype (learner.weight_sync_fingerprint: error | warn | off; metric weight_sync/fingerprint_max_abs).

The probe: PROBE_SEQUENCES sequences of PROBE_TOKENS token ids drawn uniformly from [0, vocab_size - 1) with a fixed
seed, the same on every process for the same vocabulary (both ends' vocabularies are equal: the weight manifest's
check compares the embedding shapes). Assumption: a probe sequence is no longer than the smallest KV budget the run
may use (a sparse engine compresses a prompt only when it holds more than its budget), so a sparse engine's prefill
keeps every key and its log-probs are the dense ones; `probe` shortens the sequences to that budget and refuses
one shorter than MIN_PROBE_TOKENS (the config check refuses such a run, naming the fields).

Cost: one forward of the probe per side per fingerprinted sync. On a CPU that forward is bound by reading the
weights, not by the probe's tokens (SmolLM2-135M fp32, one thread: 4 x 16 tokens 0.22 s, 2 x 8 0.12 s, 1 x 2 0.06 s),
so the probe is as short as still tells two versions apart (2 x 8: one update moves it > 10x the fp32 tolerance,
tests/deploy/test_weight_sync_fingerprint.py), and learner.weight_sync_fingerprint_every divides what is left
(bench/weight_sync.py fingerprint_vs_sync).
"""
from __future__ import annotations

import numpy as np

PROBE_SEQUENCES = 2
"""Sequences in the probe."""
PROBE_TOKENS = 8
"""Tokens per probe sequence (log-probs: PROBE_TOKENS - 1 per sequence), before `probe` shortens them to the run's
smallest KV budget."""
MIN_PROBE_TOKENS = 4
"""The shortest probe sequence `probe` makes (3 log-probs per sequence, 6 in all): below it the probe says too
little to tell two versions apart."""
PROBE_SEED = 7_349_201
"""Seed of the probe's draw (numpy's default generator)."""
MODES = ("error", "warn", "off")
"""learner.weight_sync_fingerprint: error (a mismatch ends the run with one line) | warn (the line, the run goes on)
| off (nothing is scored)."""

TOLERANCE = {"float32": 1e-3, "bfloat16": 1.0, "float16": 0.1}
"""Largest max |logp difference| (nats) two scorings of the same weights may show, by the sync dtype; see
`tolerance`."""
_DTYPE_NAMES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def probe_tokens(smallest_budget: int | None) -> int:
    """Tokens per probe sequence for a run whose smallest KV budget is `smallest_budget` tokens (None: the engine
    never compresses, compressor method full): min(PROBE_TOKENS, smallest_budget). Raises ValueError when that is
    below MIN_PROBE_TOKENS."""
    tokens = PROBE_TOKENS if smallest_budget is None else min(PROBE_TOKENS, int(smallest_budget))
    if tokens < MIN_PROBE_TOKENS:
        raise ValueError(f"the weight-sync fingerprint's probe must fit the smallest KV budget ({smallest_budget} "
                         f"tokens) so that no prefill compresses it; it needs >= {MIN_PROBE_TOKENS} tokens")
    return tokens


def probe(vocab_size: int, tokens: int = PROBE_TOKENS) -> list[list[int]]:
    """The probe: PROBE_SEQUENCES lists of `tokens` token ids (int, in [0, vocab_size - 1): SGLang reports ids from
    vocab_size - 1 up as 0 in its log-prob index), the same for the same arguments on every process; a shorter
    probe is a prefix of the full one (the draw is PROBE_SEQUENCES x PROBE_TOKENS, cut). Raises ValueError for
    vocab_size < 2 or `tokens` outside [MIN_PROBE_TOKENS, PROBE_TOKENS]."""
    if vocab_size < 2 or not MIN_PROBE_TOKENS <= tokens <= PROBE_TOKENS:
        raise ValueError(f"probe(vocab_size={vocab_size}, tokens={tokens}): expected vocab_size >= 2 and "
                         f"{MIN_PROBE_TOKENS} <= tokens <= {PROBE_TOKENS}")
    draw = np.random.default_rng(PROBE_SEED).integers(0, vocab_size - 1, size=(PROBE_SEQUENCES, PROBE_TOKENS))
    return [[int(t) for t in row[:tokens]] for row in draw]


def fingerprinted(version: int, every: int) -> bool:
    """Whether weight version `version` is fingerprinted (scored by the learner at its send and by each actor after
    its swap) under learner.weight_sync_fingerprint_every = `every` (>= 1): the multiples of `every`, version 0
    included. A sync that never reaches an engine is then caught within `every` syncs of its first version; a single
    missed version between two multiples (the next sync loads the whole weights again) is not seen. Raises
    ValueError for every < 1."""
    if every < 1:
        raise ValueError(f"fingerprinted(version={version}, every={every}): expected every >= 1")
    return version % every == 0


def tolerance(dtype) -> float:
    """Largest max |logp difference| in nats (`max_abs`) between two scorings of the same weights in `dtype` (the
    sync dtype: a torch dtype or its name, "float32" | "fp32" | "bfloat16" | "bf16" | "float16" | "fp16").

    Measured on SmolLM2-135M (CPU, the probe of its vocabulary), the largest difference between forwards of the
    same weights with another batch shape (4 sequences at once or one by one) or attention kernel (sdpa, eager):
    float32 1.4e-5, float16 0.039, bfloat16 0.36 (mean over positions 0.074) on the first, 4 x 16 probe; 1.7e-5,
    0.019, 0.20 on the 2 x 8 one (2026-12-07). The probe's random tokens are
    unlikely ones (log-probs -10 to -22), where bfloat16's coarse spacing shows (numbers of 16 to 32 lie 0.125 apart).
    float32: 1e-3, 70x the measured noise (it assumes no TF32 matmuls, torch's default; a GPU setup that turns them
    on rounds like a 10-bit dtype: use warn there). One update of the tiny-learn preset (lr 1e-2) moved the probe
    by ~1 nat, one of a tiny Llama at lr 1e-3 by more than 10x this (tests/deploy/test_weight_sync_fingerprint.py,
    tests/learner/test_learner_fingerprint.py); a step whose advantages are all 0 (every reward equal) moves it
    only by its weight decay (~1e-5 on the tiny preset).
    float16: 0.1; bfloat16: 1.0, ~3x the measured noise, since a false alarm ends the run under `error`. One update
    at a small learning rate moves a bf16 probe less than that: there the check sees a sync that never arrives
    once the versions have drifted apart (learner.weight_sync_verify compares bytes, torch engine only).
    Raises ValueError for another dtype."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_NAMES.get(name, name)
    if name not in TOLERANCE:
        raise ValueError(f"no fingerprint tolerance for dtype {dtype!r}: expected one of {sorted(TOLERANCE)}")
    return TOLERANCE[name]


def max_abs(expected: list[np.ndarray], got: list[np.ndarray]) -> float:
    """max over every sequence and position of |expected - got|, nats: two scorings of the probe (per sequence float32
    [len - 1] log-probs). inf when a value is NaN or infinite in one and not equal in the other. Raises ValueError
    when the two differ in the number of sequences or a sequence's length (they scored different probes)."""
    if len(expected) != len(got) or any(np.shape(e) != np.shape(g) for e, g in zip(expected, got)):
        raise ValueError(f"fingerprints of different probes: shapes {[np.shape(e) for e in expected]} and "
                         f"{[np.shape(g) for g in got]}")
    worst = 0.0
    for e, g in zip(expected, got):
        e, g = np.asarray(e, dtype=np.float64), np.asarray(g, dtype=np.float64)
        if e.size == 0:
            continue
        with np.errstate(invalid="ignore"):
            diff = np.where(e == g, 0.0, np.abs(e - g))   # equal infinities are equal; NaN never is
        if not np.isfinite(diff).all():
            return float("inf")
        worst = max(worst, float(diff.max()))
    return worst
