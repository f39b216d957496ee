"""One rank of a real megatron-core training run on the CPU over gloo (started by
test_megatron_training.py): a tiny GPTModel, tensor-parallel (sequence parallel on when TP > 1)
times data-parallel, wrapped in megatron-core's DistributedDataParallel, trained with the
optimizer ``get_megatron_optimizer`` builds (distributed optimizer, gradient clipping), the
gradients finished by ``finalize_model_grads`` and the optimizer timed by megatron's Timers.

argv[1] is a JSON list of runs, done one after the other in this process, each
``{"patch": bool, "decoupled": bool, "steps": int, "standins": bool, "distributed": bool,
"fp16": bool}``; ``standins`` first binds stand-ins for what a Transformer Engine install
makes megatron-core choose (the patch must replace them all). Prints one JSON line: per run
the losses, the optimizer classes, the patch results, and how often each patched function was
called from each megatron-core module (counted with ``sys.setprofile``, which observes calls
without replacing anything).
"""

import inspect
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import cpu_shims

cpu_shims.install()
torch.set_num_threads(1)  # up to four ranks on a small machine: no thread oversubscription
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

from nccl_lossy import megatron as patch  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
TP = int(os.environ.get("TP", "1"))
dist.init_process_group("gloo", rank=RANK, world_size=WORLD)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.timers import Timers  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    local_multi_tensor_applier,
    local_multi_tensor_l2_norm,
    local_multi_tensor_scale,
)

parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
cpu_shims.no_rng_tracker_fork()

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 2, 32, 4

# The functions the patch binds, by the code object that runs when they are called (torch
# wraps its collectives in a logging decorator: the function inside it is the one watched).
WATCHED = {
    inspect.unwrap(f).__code__: name
    for name, f in {
        "_all_gather_base": dist._all_gather_base,
        "_reduce_scatter_base": dist._reduce_scatter_base,
        "all_gather_into_tensor": dist.all_gather_into_tensor,
        "reduce_scatter_tensor": dist.reduce_scatter_tensor,
        "local_multi_tensor_applier": local_multi_tensor_applier,
        "local_multi_tensor_l2_norm": local_multi_tensor_l2_norm,
        "local_multi_tensor_scale": local_multi_tensor_scale,
    }.items()
}
_WRAPPERS = {"torch.distributed.c10d_logger", "typing_extensions", "warnings"}


class Counter:
    """Counts calls of WATCHED functions per calling module, e.g.
    ``"_all_gather_base <- megatron.core.tensor_parallel.mappings"``."""

    def __init__(self):
        self.calls = {}

    def __call__(self, frame, event, arg):
        if event == "call":
            name = WATCHED.get(frame.f_code)
            if name is not None:
                back = frame.f_back
                while back is not None and back.f_globals.get("__name__") in _WRAPPERS:
                    back = back.f_back
                caller = back.f_globals.get("__name__", "?") if back is not None else "?"
                key = f"{name} <- {caller}"
                self.calls[key] = self.calls.get(key, 0) + 1

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


class StandIn:
    """What a Transformer Engine install binds (FusedAdam, its kernels): never to be used."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"the stand-in for {self.name} was called: the patch missed it")


def bind_standins():
    """Binds what megatron-core would choose with Transformer Engine installed; returns the
    originals to restore."""
    values = {
        "Adam": StandIn("FusedAdam"),
        "SGD": StandIn("FusedSGD"),
        "HAVE_APEX_OR_TE": True,
        "USING_TE_OPTIMIZER": True,
        "USING_APEX_OPTIMIZER": False,
        "USING_PYTORCH_OPTIMIZER": False,
        "multi_tensor_applier": StandIn("te multi_tensor_applier"),
        "l2_norm_impl": StandIn("te multi_tensor_l2norm"),
        "multi_tensor_scale_impl": StandIn("te multi_tensor_scale"),
    }
    saved = []
    for module_name, attribute in patch.patch_targets():
        module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
        if attribute in values and hasattr(module, attribute):
            saved.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, values[attribute])
    return saved


class SeqParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm with its parameters marked ``sequence_parallel`` (megatron-core's own
    torch norm refuses sequence parallelism; its fused one needs apex), so that
    finalize_model_grads all-reduces their gradients across the tensor-parallel group."""

    def __init__(self, config, hidden_size, eps=1e-5, **_ignored):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)


def build(run):
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=TP,
        sequence_parallel=TP > 1,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        fp16=run.get("fp16", False),
        params_dtype=torch.float16 if run.get("fp16") else torch.float32,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = SeqParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SeqParallelLayerNorm
    block = TransformerBlockSubmodules(layer_specs=[spec] * LAYERS, layer_norm=SeqParallelLayerNorm)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope", parallel_output=True,
                     share_embeddings_and_output_weights=True)
    distributed = run.get("distributed", True)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    timers = Timers(log_level=2, log_option="minmax")
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.1,
                                 decoupled_weight_decay=run["decoupled"], clip_grad=0.05,
                                 use_distributed_optimizer=distributed, fp16=run.get("fp16", False),
                                 timers=timers)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return config, ddp, optimizer, timers


def batches():
    """A learnable sequence x[i+1] = (5 x[i] + 3) mod VOCAB, a different one per data-parallel
    rank, the same on the ranks of a tensor-parallel group."""
    gen = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
    while True:
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        rows = [start]
        for _ in range(SEQ):
            rows.append((5 * rows[-1] + 3) % VOCAB)
        t = torch.cat(rows, dim=1)
        yield t[:, :-1].contiguous(), t[:, 1:].contiguous()


def train(run):
    saved = bind_standins() if run.get("standins") else []
    results = patch.apply_megatron_core_patch() if run["patch"] else []
    config, ddp, optimizer, timers = build(run)
    inner = [type(o).__module__ + "." + type(o).__qualname__ for o in _inner_optimizers(optimizer)]
    data = batches()
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    losses, norms = [], []
    started = time.perf_counter()
    with Counter() as counter:
        for _ in range(run["steps"]):
            tokens, labels = next(data)
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(tokens, position_ids, causal, labels=labels).float().mean()
            loss.backward()
            finalize_model_grads([ddp])
            ok, grad_norm, _ = optimizer.step()
            assert ok, "optimizer step skipped"
            # the mean loss over the data-parallel group (each rank saw its own batch)
            value = loss.detach().clone()
            dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
            losses.append(value.item() / parallel_state.get_data_parallel_world_size())
            norms.append(float(grad_norm))
        timers.log(["optimizer-inner-step"], rank=0)  # all ranks' times through dist_all_gather_func
    seconds = time.perf_counter() - started
    bound = {f"{m}.{a}": _describe(getattr(sys.modules[m], a)) for m, a in patch.patch_targets()
             if m in sys.modules and hasattr(sys.modules[m], a)}
    if run["patch"]:
        patch.revert_megatron_core_patch()
    for module, attribute, value in saved:
        setattr(module, attribute, value)
    return {
        "losses": losses,
        "grad_norms": norms,
        "optimizers": inner,
        "results": [[r.module, r.attribute, r.status, r.reason] for r in results],
        "calls": counter.calls,
        "seconds": seconds,
        "bound": bound,
    }


def _inner_optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chained]


def _describe(value):
    if isinstance(value, (bool, type(None))):
        return repr(value)
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"


out = {"rank": RANK, "tp": TP, "dp": parallel_state.get_data_parallel_world_size(),
       "runs": [train(run) for run in json.loads(sys.argv[1])]}
# megatron-core's own teardown first: its module globals hold the model-parallel groups, which
# destroy_process_group() alone leaves to the interpreter's exit to free, in whatever order
# (once in CI a rank then died in gloo with "terminate called without an active exception").
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
print(json.dumps(out))
