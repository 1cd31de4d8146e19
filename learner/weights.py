"""The learner's weights, out: the one weight export over the weight sync (`WeightExport.send`), the ZeRO-3
gathers the other ranks enter meanwhile (`gather_buckets`), and the bytes of training state a rank holds
(`state_bytes`)."""
from __future__ import annotations

import contextlib

import torch

from broker.lora import adapter_parameters
from broker.weight_sync import WeightManifest, WeightSender, build_manifest


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The full shape of a parameter (ZeRO-3 keeps it in `ds_shape`; the local tensor is a partition)."""
    return tuple(getattr(p, "ds_shape", p.shape))


class WeightExport:
    """The weights of a DeepSpeed `engine` (ZeRO stage `zero_stage`) in the engine's `dtype`, by bucket; with
    `adapter` (learner.lora on) the LoRA adapter's tensors only (broker.lora.adapter_parameters), the frozen base
    never leaving the learner."""

    def __init__(self, engine, dtype: torch.dtype, zero_stage: int, adapter: bool = False):
        self.engine, self.dtype, self.zero_stage, self.adapter = engine, dtype, zero_stage, adapter

    def gathered(self, params: list[torch.Tensor]):
        """Context manager inside which `params` hold their full values: ZeRO-3 gathers them from every rank (a
        collective: every rank enters it with the same parameters in the same order); other stages hold full
        parameters already (a no-op)."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed  # only after DS_ACCELERATOR is set (learner.distributed.init_distributed)
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def manifest(self, bucket_mb: float) -> tuple[WeightManifest, list[torch.Tensor]]:
        """The weight-sync manifest of the model (broker.weight_sync.build_manifest: Hugging Face names, full
        shapes, the engine's dtype, tied aliases, buckets of `bucket_mb` MiB) and the live parameter behind each
        manifest name, in order (ZeRO-3: this rank's partition; enter `gathered` per bucket). With `adapter`: the
        adapter's tensors only, an adapter manifest (WeightManifest.adapter)."""
        module = self.engine.module
        named = adapter_parameters(module) if self.adapter else module.named_parameters(remove_duplicate=False)
        return build_manifest(named, self.dtype, bucket_mb, full_shape, adapter=self.adapter)

    def send(self, sender: WeightSender, version: int, peers_gather: bool = False) -> dict[str, float]:
        """The weights (of weight version `version`) through `sender`, bucket by bucket (ZeRO-3: each bucket
        gathered while it is packed). `peers_gather`: the other ranks run `gather_buckets` of the same manifest
        meanwhile; a failed send then still enters every remaining gather, so that they never wait on this rank.
        Returns WeightSender.send's stats; raises what it raises."""
        manifest, tensors = self.manifest(sender.bucket_mb)
        entered = []

        def gather(params):
            entered.append(1)
            return self.gathered(params)
        try:
            return sender.send(manifest, tensors, version, gather=gather)
        finally:
            if peers_gather:
                passes = 2 if sender.verify else 1
                for bucket in [b for _ in range(passes) for b in manifest.buckets][len(entered):]:
                    with self.gathered([tensors[i] for i in bucket]):
                        pass

    def gather_buckets(self, bucket_mb: float, passes: int = 1, keep: bool = False) -> dict[str, torch.Tensor]:
        """Enter the ZeRO-3 gathers of the manifest's buckets `passes` times, in order: what the other ranks do
        while rank 0 sends (a collective; without ZeRO-3 nothing is). With `keep`, returns CPU copies of the full
        weights in the engine's dtype by name, tied aliases included (the same tensor object as their target)."""
        manifest, tensors = self.manifest(bucket_mb)
        out = {}
        for _ in range(passes):
            for bucket in manifest.buckets:
                with self.gathered([tensors[i] for i in bucket]):
                    if keep:
                        out.update({manifest.names[i]: tensors[i].detach().to("cpu", self.dtype, copy=True)
                                    for i in bucket})
        if keep:
            out.update({alias: out[target] for alias, target in manifest.tied.items()})
        return out


def state_bytes(engine) -> dict[str, int]:
    """Bytes of training state this rank holds, each tensor storage counted once: `parameters` (the module's
    parameters, or this rank's ZeRO-3 partitions, and the optimizer's master copies), `gradients` (their
    .grad), `optimizer_state` (Adam moments and every other tensor the ZeRO optimizer keeps: flat buffers,
    gradient partitions) and `total`; the frozen reference model is left out. Measured, not computed from
    the parameter count: bench/learner.py compares it over ranks (zero3_state_bytes_per_rank_ratio)."""
    seen: set[int] = set()

    def nbytes(t) -> int:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return 0
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    def tensors(value, depth: int = 0):
        if isinstance(value, torch.Tensor):
            yield value
        elif depth < 3 and isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for v in value.values():
                yield from tensors(v, depth + 1)

    module = list(engine.module.parameters())
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch AdamW
    master = [p for group in inner.param_groups for p in group["params"]]
    out = {"parameters": sum(nbytes(getattr(p, "ds_tensor", p.data)) for p in module + master)}
    out["gradients"] = sum(nbytes(p.grad) for p in module + master)
    state = sum(nbytes(t) for v in inner.state.values() for t in tensors(v))
    if engine.optimizer is not inner:  # the ZeRO wrapper's own buffers
        state += sum(nbytes(t) for v in vars(engine.optimizer).values() for t in tensors(v))
    out["optimizer_state"] = state
    out["total"] = sum(out.values())
    return out
