"""Per-request KV budgets reach SGLang without anything that runs per decode step (docs/sglang.md).

`SGLangEngine.generate` used to attach a no-op custom logit processor (`KVBudgetCarrier`) to every request, so
that SGLang handed each request's custom params to the model worker. SGLang then runs its custom-processor pass
in the sampler on every decode step (`Sampler._preprocess_logits` -> `apply_custom_logit_processor`: a Python
pass over the batch, the logits gathered and scattered back, the processor called). Now no processor is
attached; a budget that differs from the run's rides in the request id (`budget_rid`) and the backend reads it
once, at the prefill (`ForwardBatch.rids`). Fast tests of the request generate sends (`sglang_request`, a pure
function) and of SGLang's own sampler pre-processing with and without the old carrier; the engine-level check that the
budgets still bound each row (through the ids, on a real engine started without `enable_custom_logit_processor`) is
test_sglang_triton.py's per-request test."""
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import budget_rid, rid_budget, sglang_request

pytestmark = pytest.mark.sglang
RUN_BUDGET = 16
PARAMS = SamplingParams(temperature=0, max_new_tokens=2, n=2, ignore_eos=True)


class KVBudgetCarrier(CustomLogitProcessor):
    """The earlier budget carrier (no longer attached by `SGLangEngine.generate`): a no-op custom logit processor
    that made SGLang hand each request's `custom_params` to the model worker's batch, at the cost of SGLang's
    per-decode-step custom processor pass (what test_old_carrier_path_runs_per_decode_step shows)."""

    def __call__(self, logits, custom_param_list=None):
        return logits


def sent_budgets(request) -> list[int]:
    return [rid_budget(r, RUN_BUDGET) for r in request.get("rid") or [None] * len(request["sampling_params"])]


@pytest.mark.parametrize("budgets,want",
                         [([16, 16], [16] * 4), ([12, 20], [12, 12, 20, 20]), ([16, 20], [16, 16, 20, 20])])
def test_request_carries_budgets_in_ids_and_no_per_step_processor(budgets, want):
    request = sglang_request(PARAMS, budgets, RUN_BUDGET)
    assert "custom_logit_processor" not in request                             # nothing runs per decode step
    assert all("custom_params" not in sp for sp in request["sampling_params"])
    assert sent_budgets(request) == want, request.get("rid")
    assert ("rid" in request) == (want != [16] * 4)                            # the run's budget: SGLang's own ids
    if "rid" in request:
        assert len(set(request["rid"])) == len(request["rid"])                  # ids stay unique (SGLang checks)


def test_dense_request_sends_no_budgets():
    assert "rid" not in sglang_request(PARAMS, [12, 20], run_budget=None)


def test_budget_rid_round_trip():
    assert rid_budget(budget_rid(12), 16) == 12
    assert rid_budget("3f2a9c", 16) == 16 and rid_budget(None, 16) == 16        # SGLang's own uuid ids
    assert rid_budget("x:sparse_rl_kv_budget=oops", 16) == 16


class CarrierBatch:
    """The sampling info SGLang 0.5.23 builds for a decode batch of `bs` requests that all carry the old carrier
    (srt/sampling/sampling_batch_info.py: one ProcessorEntry with the rows cached on the device)."""

    def __init__(self, bs: int, carrier: bool):
        from sglang.srt.sampling.sampling_batch_info import ProcessorEntry

        self.bs, self.has_custom_logit_processor = bs, carrier
        self.custom_params = [{"sparse_rl_kv_budget": 16}] * bs if carrier else None
        self.custom_logit_processor = {0: ProcessorEntry(processor=KVBudgetCarrier(), rows=list(range(bs)),
                                                         indices=torch.arange(bs))} if carrier else None

    def __len__(self):
        return self.bs


class OpRecorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_old_carrier_path_runs_per_decode_step():
    """The guard on SGLang's per-step sampler pre-processing: with the old carrier every decode step gathers and
    scatters back the whole [batch, vocab] logits (index_select, index_copy_) and calls the processor; without a
    processor (what generate sends now) the step runs neither."""
    from sglang.srt.layers.sampler import Sampler

    def per_step_ops(carrier: bool) -> list[str]:
        logits = torch.randn(5, 256)
        with OpRecorder() as rec:
            Sampler._preprocess_logits(None, logits, CarrierBatch(5, carrier))
        return rec.ops

    assert {"index_select", "index_copy_"} <= set(per_step_ops(carrier=True))          # the old path
    assert not {"index_select", "index_copy_"} & set(per_step_ops(carrier=False))      # today's path
