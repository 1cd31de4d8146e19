"""CPU-lane stand-in for the CUDA/AMX-only ``sgl_kernel`` package (test lane only, never the product path).

SGLang 0.5.23 with ``SGLANG_USE_CPU_ENGINE=1`` imports a few ``*_cpu`` ops from ``sgl_kernel`` at module
import time. The real CPU kernels are built from SGLang's source tree (not reachable here) and target AMX
CPUs. This stand-in implements in torch the one op the dense decode path calls
(``assign_req_to_token_pool_cpu``) and makes every other name a function that raises
``NotImplementedError`` when called, so importing works and a missing op fails loudly. Because
``torch.ops.sgl_kernel.convert_weight_packed`` does not exist, SGLang treats AMX as unavailable and uses its
torch-native layers. See docs/sglang.md ("CPU test lane").

Importing it also makes host-memory pinning a no-op when no accelerator is present (`pin_on_cpu_is_a_no_op`):
SGLang's LoRA layers pin their host tensors unconditionally.
"""

import functools
import importlib.abc
import sys
import types

import torch

PINNING_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")
"""SGLang 0.5.23's modules that pin host tensors unconditionally on the CPU lane's LoRA path (`torch.tensor(...,
pin_memory=True)`, `torch.empty(..., pin_memory=True)`)."""
_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def _unpinned(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)
    return make


class _TorchUnpinned(types.ModuleType):
    """`torch` as the PINNING_MODULES see it: the tensor factories drop `pin_memory`, the rest is torch. Only those
    modules get it: wrapping `torch.tensor` for the whole process changes what transformers' `from_pretrained` loads
    (seen: another model's logits)."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return _unpinned(attr) if name in _FACTORIES else attr


_TORCH_UNPINNED = _TorchUnpinned("torch")


class _UnpinOnImport(importlib.abc.MetaPathFinder):
    """Gives each PINNING_MODULES module `_TORCH_UNPINNED` as its `torch` right after it is executed."""

    def find_spec(self, name, path, target=None):
        if name not in PINNING_MODULES:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def execute_unpinned(module):
            execute(module)
            module.torch = _TORCH_UNPINNED
        spec.loader.exec_module = execute_unpinned
        return spec


def pin_on_cpu_is_a_no_op() -> None:
    """SGLang 0.5.23's LoRA layers and its torch LoRA backend pin host tensors unconditionally (PINNING_MODULES:
    `torch.tensor(..., pin_memory=True)`, `.pin_memory()`), which raises `RuntimeError: pin_memory=True requires a
    CUDA or other accelerator backend` on a CPU-only torch. Without an accelerator: those modules' tensor factories
    drop `pin_memory` (`_TorchUnpinned`) and `Tensor.pin_memory` returns the tensor itself (pinning only speeds
    host-to-device copies, of which there are none). Idempotent."""
    if torch.accelerator.is_available() or any(isinstance(f, _UnpinOnImport) for f in sys.meta_path):
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for name in PINNING_MODULES:
        if name in sys.modules:
            sys.modules[name].torch = _TORCH_UNPINNED
    sys.meta_path.insert(0, _UnpinOnImport())


pin_on_cpu_is_a_no_op()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write ``out_cache_loc`` slices into ``req_to_token[req, start:end]`` for each request, in order.

    req_pool_indices, start_offset, end_offset: [batch] int; req_to_token: [pool_size, max_context] int32;
    out_cache_loc: [sum(end - start)] int64. ``pool_len`` is unused (kept for the kernel's signature).
    """
    offset = 0
    for i in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[i]), int(end_offset[i])
        n = end - start
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the SGLang CPU test lane's stand-in")

    _missing.__name__ = name
    return _missing
