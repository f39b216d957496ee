"""One rank of the 2-process gloo test (started by test_gloo.py): runs megatron-core's
tensor-parallel mappings with the patch applied, and a tiny model under
LossyMegatronIntegration's hooks. Prints one JSON line."""

import json
import os
import warnings

import torch
import torch.distributed as dist

import nccl_lossy
from nccl_lossy.megatron import apply_megatron_core_patch

import cpu_shims  # noqa: E402

# megatron-core allocates collective outputs on torch.cuda.current_device(): on a CPU-only
# machine the shims point that at the CPU (the collectives themselves are torch's, over gloo).
cpu_shims.install()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
results = apply_megatron_core_patch()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import mappings  # noqa: E402

parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
out = {"rank": rank, "bound": mappings.dist_all_gather_func.__name__}


def collective(name, fn):
    """Runs one collective; an error in it fails this rank (and the test), never a skip."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    out[name] = {"value": value.tolist(), "warnings": [str(w.message)[:80] for w in caught]}


x = torch.arange(6.0).reshape(3, 2) + 100 * rank
collective("gather_last", lambda: mappings.gather_from_tensor_model_parallel_region(x))
collective("gather_first", lambda: mappings.gather_from_sequence_parallel_region(x))
collective(
    "reduce_scatter_first",
    lambda: mappings.reduce_scatter_to_sequence_parallel_region(torch.arange(8.0).reshape(4, 2) * (rank + 1)),
)

# Phase hooks on a tiny tensor-parallel model: record the phase the plugin was told about
# when each collective runs, forward and backward.
seen = []


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, inp):
        seen.append(("forward", integ.phase))
        h = mappings.copy_to_tensor_model_parallel_region(self.lin(inp))  # all-reduce in backward
        h.register_hook(lambda g: seen.append(("backward", integ.phase)))
        return mappings.reduce_from_tensor_model_parallel_region(h).sum()  # all-reduce in forward


model = Tiny()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
integ = nccl_lossy.LossyMegatronIntegration(enable_on_forward=False, apply_env=False, patch_megatron=False)
with integ:
    integ.attach(model, optimizer)
    injecting = []
    for _ in range(2):
        loss = model(torch.ones(1, 2) * (rank + 1))
        injecting.append(("forward", integ.injecting()))
        loss.backward()
        injecting.append(("backward", integ.injecting()))
        optimizer.step()
        optimizer.zero_grad()
    out["after_steps"] = {"step": integ.step_number, "phase": integ.phase}
out["seen"] = seen
out["injecting"] = injecting
out["after_exit"] = {"enabled": integ.enabled, "phase": integ.phase}
out["patch"] = [[r.module, r.attribute, r.status] for r in results]
dist.destroy_process_group()
print(json.dumps(out))
