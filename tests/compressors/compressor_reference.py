"""A loop-by-loop numpy reference of docs/SPEC.md §5, written from the formulas (float64), used only by tests.

It shares no code with `compressors`: every (sequence, KV head) row is scored with explicit Python loops.
"""
from __future__ import annotations

import numpy as np


def importance_row(K, Q, valid, window, pool_kernel):
    """K [seq, d] keys of one KV head, Q [group, w, d] the group's last w queries, valid [seq] bool.
    Returns the pooled importance of the seq - window candidates."""
    seq, d = K.shape
    n = seq - window
    cand = [j for j in range(n) if valid[j]]
    imp = np.zeros(n)
    for t in range(Q.shape[1]):
        if not cand:
            break
        logits = np.array([max(Q[g, t] @ K[j] for g in range(Q.shape[0])) / np.sqrt(d) for j in cand])
        p = np.exp(logits - logits.max())
        p /= p.sum()
        imp[cand] += p / Q.shape[1]
    r = pool_kernel // 2
    return np.array([imp[max(0, j - r): j + r + 1].max() for j in range(n)])


def redundancy_row(K, valid, threshold):
    """R-KV redundancy of every key of one KV head (softmax over the valid keys)."""
    seq = K.shape[0]
    S = np.zeros((seq, seq))
    for i in range(seq):
        for j in range(seq):
            if i != j and valid[i] and valid[j]:
                S[i, j] = K[i] @ K[j] / ((np.linalg.norm(K[i]) + 1e-8) * (np.linalg.norm(K[j]) + 1e-8))
    for i in range(seq):
        similar = [j for j in range(seq) if S[i, j] > threshold]
        if similar:
            S[i, max(similar)] = 0.0
    raw = S.sum(axis=0) / max(1, int(valid.sum()))
    out = np.zeros(seq)
    e = np.exp(raw[valid] - raw[valid].max())
    out[valid] = e / e.sum()
    return out


def scores(method, K, Q, valid, cfg, attn_mass=None):
    """Scores of the candidate slots, [batch, kv_heads, n_candidates] float64, per SPEC §5."""
    batch, kv_heads, seq, _ = K.shape
    group = Q.shape[1] // kv_heads if Q is not None else 1
    protected = cfg.h2o_recent if method == "h2o" else cfg.window
    n = seq - protected
    out = np.zeros((batch, kv_heads, n))
    for b in range(batch):
        for h in range(kv_heads):
            if method in ("rkv", "snapkv"):
                Qg = Q[b, h * group:(h + 1) * group]
                imp = importance_row(K[b, h], Qg, valid[b, h], cfg.window, cfg.pool_kernel)
                if method == "snapkv":
                    out[b, h] = imp
                else:
                    red = redundancy_row(K[b, h], valid[b, h], cfg.similarity_threshold)[:n]
                    out[b, h] = cfg.rkv_lambda * imp - (1 - cfg.rkv_lambda) * red
            elif method == "h2o":
                out[b, h] = attn_mass[b, h, :n]
            elif method == "streamingllm":
                first_valid = [j for j in range(seq) if valid[b, h, j]][:cfg.sinks]
                out[b, h] = [2 * seq if j in first_valid else j for j in range(n)]
    return out


def keep(method, K, Q, valid, cfg, attn_mass=None):
    """Kept slots per row, [batch, kv_heads] nested lists of sorted ints, plus the per-row score margin at
    the budget boundary (to skip float near-ties)."""
    batch, kv_heads, seq, _ = K.shape
    sc = scores(method, K, Q, valid, cfg, attn_mass)
    protected = sc.shape[-1]
    vrow = valid
    if cfg.selection == "shared":
        sc = np.repeat(sc.mean(axis=1, keepdims=True), kv_heads, axis=1)
        vrow = np.repeat(valid.all(axis=1, keepdims=True), kv_heads, axis=1)
    n = protected
    take = cfg.kv_budget - (seq - n)
    kept, margins = [], []
    for b in range(batch):
        kept.append([])
        margins.append([])
        for h in range(kv_heads):
            # valid candidates by (score, slot) descending, then invalid ones, most recent first
            order = sorted(range(n), key=lambda j: (bool(vrow[b, h, j]), sc[b, h, j] if vrow[b, h, j] else 0, j),
                           reverse=True)
            chosen = sorted(order[:take] + list(range(n, seq)))
            kept[b].append(chosen)
            vals = [sc[b, h, j] for j in order if vrow[b, h, j]]
            margins[b].append(abs(vals[take - 1] - vals[take]) if len(vals) > take else np.inf)
    return kept, margins
