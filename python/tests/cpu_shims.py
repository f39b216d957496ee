"""The smallest shims that let megatron-core's training path run on a CPU (listed in
python/README.md, "CPU shims of the tests"). Each one only stands in where megatron-core asks
for CUDA by name; the computation, the collectives (gloo) and every patched function are real.

1. ``torch.cuda.current_device()`` returns ``"cpu"``: megatron-core allocates buffers
   (collective outputs, DDP grad buffers) on the current CUDA device.
2. A torch function mode turns ``device="cuda"`` (or a CUDA device index) in tensor factory
   calls into ``"cpu"``: ``clip_grads`` and ``local_multi_tensor_l2_norm`` create small
   tensors with ``device="cuda"``.
3. ``Tensor.type()`` without arguments names a CPU tensor's CUDA type (``torch.cuda.FloatTensor``):
   ``get_megatron_optimizer`` (via the distributed / float16 optimizer) and ``clip_grads``
   refuse parameters whose type string is not a CUDA one.
4. ``torch.cuda.synchronize()`` does nothing: megatron-core's timers call it.
5. The model-parallel RNG tracker's ``fork()`` is a no-op context: its states are CUDA
   generator states, and the tiny models here have dropout 0, so the forked regions draw no
   random numbers.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {
    torch.tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
}


def _is_cuda(device):
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return device is not None and str(device).startswith("cuda")


class CudaFactoriesOnCpu(TorchFunctionMode):
    """Shim 2: ``device="cuda"`` in a tensor factory call means the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


_type = torch.Tensor.type
_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int64: "torch.cuda.LongTensor",
}


def _type_named_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
    """Shim 3: ``t.type()`` of a CPU tensor names the CUDA type of its dtype."""
    if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPES:
        return _CUDA_TYPES[self.dtype]
    return _type(self, dtype, non_blocking, **kwargs)


_installed = []


def install():
    """Installs shims 1-4 in this process (once); shim 5 needs megatron-core, see
    :func:`no_rng_tracker_fork`."""
    if _installed or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # shim 1
    mode = CudaFactoriesOnCpu()  # shim 2
    mode.__enter__()
    torch.Tensor.type = _type_named_as_cuda  # shim 3
    torch.cuda.synchronize = lambda *args, **kwargs: None  # shim 4
    _installed.append(mode)


def no_rng_tracker_fork():
    """Shim 5: the model-parallel RNG tracker's fork() becomes a no-op context."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
