"""The SGLang engine's top-k log-probs (docs/SPEC.md §4) from a request's meta_info, in SGLang's own layout
(`output_top_logprobs`: per generated token a list of K (logprob, token_id, text)); no SGLang needed. The engine
itself, with SGLang generating, is the opt-in lane tests/sglang."""
import numpy as np
import pytest

from actors.engines.sglang.engine import _top_logprobs


def test_top_logprobs_from_meta_info():
    meta = {"output_top_logprobs": [[(-0.1, 7, "a"), (-2.5, 3, "b")], [(-0.7, 9, None), (-0.9, 1, None)]]}
    top = _top_logprobs(meta, 2)
    assert top["topk_ids"].dtype == np.int32 and top["topk_ids"].tolist() == [[7, 3], [9, 1]]
    assert top["topk_logprobs"].dtype == np.float32
    assert np.allclose(top["topk_logprobs"], [[-0.1, -2.5], [-0.7, -0.9]])
    with pytest.raises(RuntimeError, match="2 positions .* for 3 tokens"):
        _top_logprobs(meta, 3)
    with pytest.raises(RuntimeError, match="positions"):
        _top_logprobs({"output_top_logprobs": [None, [(-0.1, 7, "a")]]}, 2)
