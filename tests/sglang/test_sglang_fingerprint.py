"""SGLangEngine.score, the rollout side of the weight-sync fingerprint (broker/fingerprint.py), on CPU with a tiny
random Qwen2, dense and in sparse mode (torch reference backend) with a budget the probe fits: the prefill's input
log-probs equal the HF model's own teacher-forced log-probs and the torch engine's score, far inside the fp32
tolerance; after load_weights they are the new weights', moved by far more than the tolerance."""
import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from actors.engines.sglang.engine import TORCH_SPARSE_BACKEND, SGLangEngine
from actors.engines.torch_engine import TorchEngine
from broker import fingerprint as fp
from compressors import CompressorConfig
from tests.sglang.conftest import CPU_ENGINE_KWARGS
from tests.sglang.test_sglang_engine import perturbed

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
BUDGET = 16


@pytest.fixture(scope="module", params=["dense", "sparse"])
def engine(request, tiny_qwen2_dir):
    if request.param == "dense":
        eng = SGLangEngine(str(tiny_qwen2_dir), timeout_s=120, attention_backend="torch_native", **CPU_ENGINE_KWARGS)
    else:
        eng = SGLangEngine(str(tiny_qwen2_dir), timeout_s=120, sparse_backend=TORCH_SPARSE_BACKEND,
                           compressor_cfg=CompressorConfig(method="rkv", kv_budget=BUDGET, window=4, interval=8),
                           **CPU_ENGINE_KWARGS)
    yield eng
    eng.shutdown()


def hf_score(model, token_ids) -> list:
    """log_softmax of the HF model's fp64 logits at each next token, one sequence at a time."""
    out = []
    for ids in token_ids:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        out.append(logits[:-1].log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy())
    return out


def test_score_is_the_teacher_forced_log_probs_and_follows_load_weights(engine, tiny_qwen2_dir):
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    probe = fp.probe(engine.vocab_size, fp.probe_tokens(BUDGET)) + [[3, 9, 27, 81, 200]]   # (>= the window)
    got = engine.score(probe)
    assert [g.shape for g in got] == [(fp.probe_tokens(BUDGET) - 1,)] * fp.PROBE_SEQUENCES + [(4,)]
    assert {g.dtype.name for g in got} == {"float32"}
    tolerance = fp.tolerance("float32")
    assert fp.max_abs(hf_score(model, probe), got) < tolerance / 10
    torch_engine = TorchEngine(model, AutoTokenizer.from_pretrained(tiny_qwen2_dir), CompressorConfig(method="full"))
    assert fp.max_abs(torch_engine.score(probe), got) < tolerance / 10   # what the learner's dense forward gives

    new = perturbed(model, 0.02, seed=1)
    engine.load_weights(new, version=4)
    moved = engine.score(probe)
    assert fp.max_abs(got, moved) > 10 * tolerance
    model.load_state_dict(dict(new), strict=False)
    assert fp.max_abs(hf_score(model, probe), moved) < tolerance / 10
    with pytest.raises(ValueError, match="score"):
        engine.score([[3]])
