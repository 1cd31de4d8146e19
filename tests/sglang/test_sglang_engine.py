"""SGLangEngine on CPU with a tiny random Qwen2: dense log-probs equal a transformers recompute (temperature
0.7 and greedy), stop strings, and weight updates (in-process tensors, and SGLang's own group over gloo)."""
import socket
import threading
import time

import pytest
import torch
from transformers import Qwen2ForCausalLM

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import SGLangEngine
from tests.sglang.conftest import CPU_ENGINE_KWARGS
from tests.sglang.weight_group import join_weight_group, receive_weights_from_distributed, sglang_sender_group

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
PROMPTS = [[5, 17, 33, 4, 90], [7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    eng = SGLangEngine(str(tiny_qwen2_dir), weight_version=3, timeout_s=120,
                       attention_backend="torch_native", **CPU_ENGINE_KWARGS)
    yield eng
    eng.shutdown()


def recompute_logp(model, sample, temperature: float) -> torch.Tensor:
    """The learner's definition: log_softmax(logits / T) at each response token, one teacher-forced fp64 pass."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    if temperature > 0:
        logits = logits / temperature
    p = len(sample.prompt_ids)
    cols = torch.arange(p - 1, p - 1 + len(sample.response_ids))
    return logits.log_softmax(-1)[cols, torch.tensor(sample.response_ids)]


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_dense_logprobs_equal_learner_recompute(engine, tiny_qwen2_dir, temperature):
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    out = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=12, n=2, ignore_eos=True))
    assert [len(g) for g in out] == [2, 2]
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            assert s.prompt_ids == prompt and len(s.response_ids) == 12 and s.finish_reason == "length"
            assert s.logp_sparse.dtype.name == "float32" and s.logp_sparse.shape == (12,)
            ref = recompute_logp(model, s, temperature)
            assert torch.allclose(torch.from_numpy(s.logp_sparse).double(), ref, atol=2e-5), (s.logp_sparse, ref)
            assert s.kv_retained_tokens == len(prompt) + 11
    if temperature == 0.0:        # greedy: both samples of a prompt are the same argmax path
        assert all(g[0].response_ids == g[1].response_ids for g in out)
    else:                         # the untempered log-prob would differ: the check above tests the temperature
        s = out[0][0]
        assert not torch.allclose(torch.from_numpy(s.logp_sparse).double(), recompute_logp(model, s, 1.0), atol=1e-3)


def test_stop_string_ends_response_and_keeps_token(engine):
    free = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))[0][0]
    # A 4-character word (ids >= 100: "wNNN") cannot occur inside another token's word in the decoded text.
    k = next(i for i, t in enumerate(free.response_ids) if t >= 100 and t not in free.response_ids[:i])
    stop = f"w{free.response_ids[k]}"
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12, stop_strings=[stop]))[0][0]
    assert out.finish_reason == "stop"
    assert out.response_ids == free.response_ids[:k + 1]            # the token completing the stop string is kept
    assert len(out.logp_sparse) == k + 1


def perturbed(model, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def assert_serves_new_weights(engine, model, new, params, before):
    """Greedy outputs changed, and their log-probs equal a recompute with the `new` weights."""
    after = engine.generate(PROMPTS, params)
    assert any(a[0].response_ids != b[0].response_ids for a, b in zip(after, before))
    model.load_state_dict(dict(new), strict=False)
    for group in after:
        ref = recompute_logp(model, group[0], 0.0)
        assert torch.allclose(torch.from_numpy(group[0].logp_sparse).double(), ref, atol=2e-5)


def test_load_weights_changes_outputs_and_version(engine, tiny_qwen2_dir):
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = engine.generate(PROMPTS, params)
    with pytest.raises(ValueError, match="not_a_weight"):
        engine.load_weights([("not_a_weight", torch.zeros(2))], version=9)
    assert engine.weight_version == 3
    assert engine.generate(PROMPTS, params)[0][0].response_ids == before[0][0].response_ids

    new = perturbed(model, 0.2, seed=1)
    engine.load_weights(new, version=4)
    assert engine.weight_version == 4
    assert_serves_new_weights(engine, model, new, params, before)


def test_weight_update_over_gloo_group(engine, tiny_qwen2_dir):
    """The learner (a thread here: rank 0, torch only) broadcasts over SGLang's own group, in two buckets."""
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = engine.generate(PROMPTS, params)
    new = perturbed(model, 0.3, seed=2)
    half = len(new) // 2
    buckets = [[(n, "float32", tuple(t.shape)) for n, t in new[:half]],
               [(n, "float32", tuple(t.shape)) for n, t in new[half:]]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group, errors = {}, []

    def learner_join():
        try:
            group["pg"] = sglang_sender_group("127.0.0.1", port, world_size=2, group_name="test_weights",
                                              backend="gloo", timeout_s=60)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    def learner_send():
        try:
            for _, t in new:
                torch.distributed.broadcast(t.contiguous(), src=0, group=group["pg"])
        except Exception as e:
            errors.append(e)

    joiner = threading.Thread(target=learner_join)
    joiner.start()
    join_weight_group(engine, "127.0.0.1", port, rank_offset=1, world_size=2, group_name="test_weights",
                      backend="gloo")
    joiner.join(60)
    assert not errors and "pg" in group
    sender = threading.Thread(target=learner_send)
    sender.start()
    receive_weights_from_distributed(engine, buckets, version=5)
    sender.join(60)
    assert not errors and not sender.is_alive()
    assert engine.weight_version == 5
    assert_serves_new_weights(engine, model, new, params, before)


def test_failed_scheduler_raises_instead_of_killing_this_process(engine, tiny_qwen2_dir):
    """A real fault: SIGKILL this engine's own SGLang scheduler (not the module `engine`'s, which is alive too:
    the first scheduler among this process's children is that one's). SGLang's watchdog then SIGQUITs this
    process, whose default SGLang handler would SIGKILL pytest itself; the engine must raise RuntimeError instead,
    and only the engine whose subprocess died fails: the module's `engine` keeps serving. Keep it last in this
    file: SGLang's shutdown of `eng` kills every child of this process, the module engine's scheduler too."""
    import os
    import signal

    eng = SGLangEngine(str(tiny_qwen2_dir), timeout_s=120, attention_backend="torch_native", **CPU_ENGINE_KWARGS)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        assert len(eng.generate(PROMPTS, params)) == 2
        own = [pid for pid, title in eng.subprocesses().items() if title.startswith("sglang::scheduler")]
        assert own and not set(own) & set(engine.subprocesses()), (eng.subprocesses(), engine.subprocesses())
        os.kill(own[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=rf"generate failed: an SGLang subprocess failed \(sglang::scheduler"
                                               rf"\S* pid {own[0]}"):
            eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
        with pytest.raises(RuntimeError, match="generate refused"):
            eng.generate(PROMPTS, params)
        time.sleep(2)                       # past SGLang's watchdog poll (1 s): its SIGQUIT has been handled
        assert len(engine.generate(PROMPTS, params)) == 2          # the other engine was not failed with it
    finally:
        eng.shutdown()
