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


M32 = 2**32 - 1


def mix32(x):
    """The 32-bit mixer of compressors.scores, on Python ints (its formula, written again)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x5BD1E995) % 2**32
    return x ^ (x >> 16)


def random_hash(seed, layer, head, position, event):
    """The hash of one (sample seed, layer, KV head, position, event), from its docstring's formula."""
    seed %= 2**64                                              # the int64's two's complement bits
    h = mix32((seed % 2**32) ^ 0x165667B1)
    for part in (seed >> 32, layer, head, position % 2**32, event % 2**32):
        h = mix32(h ^ part)
    return h


def scores(method, K, Q, valid, cfg, attn_mass=None, ctx=None):
    """Scores of all slots, [batch, kv_heads, seq] float64, per SPEC §5 (the window's are never used)."""
    batch, kv_heads, seq, _ = K.shape
    group = Q.shape[1] // kv_heads if Q is not None else 1
    out = np.zeros((batch, kv_heads, seq))
    n = seq - cfg.window
    for b in range(batch):
        for h in range(kv_heads):
            if method in ("rkv", "snapkv"):
                Qg = Q[b, h * group:(h + 1) * group]
                imp = importance_row(K[b, h], Qg, valid[b, h], cfg.window, cfg.pool_kernel)
                if method == "snapkv":
                    out[b, h, :n] = imp
                else:
                    red = redundancy_row(K[b, h], valid[b, h], cfg.similarity_threshold)[:n]
                    out[b, h, :n] = cfg.rkv_lambda * imp - (1 - cfg.rkv_lambda) * red
            elif method == "h2o":
                out[b, h] = attn_mass[b, h]
            elif method == "streamingllm":
                out[b, h] = np.arange(seq)
            elif method == "random":
                out[b, h] = [random_hash(int(ctx["seed"][b]), ctx["layer"], h, int(ctx["positions"][b, j]),
                                         int(ctx["event"][b])) for j in range(seq)]
    return out


def classes(valid, cfg, ctx):
    """Keep class of every slot [batch, heads, seq] (3 window, 2 sink, 1 protected, 0 other) from the config's
    rules: sinks = the first `sink_tokens` valid slots; protect_prompt over positions; protect_values = the k
    largest value norms (ties: the later slot) among the valid slots before the window."""
    batch, heads, seq = valid.shape
    recent = cfg.h2o_recent if cfg.method == "h2o" else cfg.window
    kind, last = cfg.prompt_protection()
    cls = np.zeros((batch, heads, seq), dtype=int)
    for b in range(batch):
        for h in range(heads):
            valid_slots = [j for j in range(seq) if valid[b, h, j]]
            if kind != "off":
                plen = int(ctx["prompt_len"][b])
                lo = plen - last if kind == "last" else 0
                for j in valid_slots:
                    if lo <= int(ctx["positions"][b, j]) < plen:
                        cls[b, h, j] = 1
            if cfg.protect_values:
                norm = np.linalg.norm(ctx["values"][b], axis=-1)          # [kv_heads, seq]
                norm = norm.mean(axis=0) if heads == 1 else norm[h]
                cands = [j for j in valid_slots if j < seq - recent]
                for j in sorted(cands, key=lambda j: (norm[j], j), reverse=True)[:cfg.protect_values]:
                    cls[b, h, j] = 1
            for j in valid_slots[:cfg.sink_tokens]:
                cls[b, h, j] = 2
            cls[b, h, seq - recent:] = 3
    return cls


def keep(method, K, Q, valid, cfg, attn_mass=None, ctx=None):
    """Kept slots per row, [batch, kv_heads] nested lists of sorted ints, plus the per-row score margin at
    the budget boundary (to skip float near-ties; inf where the boundary is not between two scored slots)."""
    batch, kv_heads, seq, _ = K.shape
    sc = scores(method, K, Q, valid, cfg, attn_mass, ctx)
    vrow = valid
    if cfg.selection == "shared":
        sc = sc.mean(axis=1, keepdims=True)
        vrow = valid.all(axis=1, keepdims=True)
    cls = classes(vrow, cfg, ctx)
    kept, margins = [], []
    for b in range(batch):
        kept.append([])
        margins.append([])
        for h in range(kv_heads):
            hs = 0 if cfg.selection == "shared" else h
            key = [(cls[b, hs, j], bool(vrow[b, hs, j]) or cls[b, hs, j] == 3,
                    sc[b, hs, j] if vrow[b, hs, j] and cls[b, hs, j] < 3 else 0, j) for j in range(seq)]
            order = sorted(range(seq), key=lambda j: key[j], reverse=True)
            kept[b].append(sorted(order[:cfg.kv_budget]))
            a, z = key[order[cfg.kv_budget - 1]], key[order[cfg.kv_budget]]
            margins[b].append(abs(a[2] - z[2]) if a[:2] == z[:2] and a[1] else np.inf)
    return kept, margins
