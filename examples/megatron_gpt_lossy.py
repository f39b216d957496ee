#!/usr/bin/env python3
"""A small megatron-core GPT, tensor-parallel over two ranks, trained through the lossy plugin.

    python examples/megatron_gpt_lossy.py --profile configs/uniform-1pct.toml \
        --stats runs/u1/stats --log runs/u1/train.jsonl --steps 200
    python examples/megatron_gpt_lossy.py --loss-rate 0.01 --burst-length 8 \
        --no-loss-on-forward --nproc 4 --tensor-model-parallel-size 2

starts two ranks itself (``--nproc 2``; under torchrun, which sets ``RANK``, it is one rank).
Both ranks use ``cuda:0``: each gets its own ``NCCL_HOSTID`` (``fakehost<rank>``), so NCCL takes
them for two hosts and every byte between them goes through the network plugin (see the
project's GPU notes in ``bench/gpu/README.md``).

The model: megatron-core's ``GPTModel`` with the local (no Transformer Engine) layer spec,
4 layers, hidden 512, 8 heads, sequence 512, vocabulary 256 (bytes), tensor-parallel size
``--tensor-model-parallel-size`` (default: every rank), data-parallel over the rest, sequence
parallelism on, so the run's traffic is all three collective kinds: AllGather and ReduceScatter
(sequence-parallel layers, forward and backward; the distributed optimizer's gradients and
parameters), AllReduce (the vocab-parallel cross entropy, the sequence-parallel layer-norm
gradients, the gradient norm). Training goes through megatron-core's own path, the one the
compatibility patch rewires: the model wrapped in megatron-core's ``DistributedDataParallel``,
``finalize_model_grads``, and the optimizer ``get_megatron_optimizer`` builds (the distributed
optimizer, Adam with decoupled weight decay, gradient clipping at ``--clip-grad``). The data is
byte-level text (the repository's own Markdown files by default) or a synthetic learnable
sequence.

``nccl_lossy.LossyMegatronIntegration`` sets the environment before NCCL starts, applies the
megatron-core compatibility patch, and marks forward/backward phases and steps, so profile
rules on ``phase`` and ``steps`` apply. ``--loss-rate`` / ``--burst-length`` set the default
loss model (burst length 1: independent loss; longer: Gilbert-Elliott), on top of ``--profile``;
``--no-loss-on-forward`` / ``--no-loss-on-backward`` keep loss out of that phase. Rank 0 writes
one JSON line per step (loss, gradient norm, step time, tokens/s) to ``--log``.

``--cpu`` runs the same code on the CPU with the gloo backend (tiny sizes by default), for a
dry run without a GPU: the plugin is not on that path (gloo has its own TCP), but the
integration (environment, patch, phase and step control) runs as on a GPU. megatron-core's
optimizer path asks for CUDA by name in a few places; the dry run loads the test suite's CPU
shims for those (``python/tests/cpu_shims.py``, listed in ``python/README.md``).
``--no-plugin`` uses NCCL's own Socket transport instead (the baseline).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent



def _key_value(text):
    """A --set argument: KEY=VALUE, checked when the command line is read."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. model.rate=0.02), got {text!r}")
    return text

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not under a launcher")
    p.add_argument("--cpu", action="store_true", help="CPU + gloo dry run (tiny sizes unless given)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=None, help="default 4 (CPU: 2)")
    p.add_argument("--hidden", type=int, default=None, help="default 512 (CPU: 64)")
    p.add_argument("--heads", type=int, default=None, help="default 8 (CPU: 4)")
    p.add_argument("--seq", type=int, default=None, help="default 512 (CPU: 64)")
    p.add_argument("--micro-batch", type=int, default=None, help="default 8 (CPU: 2)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="tensor-parallel size (default: all ranks); the rest is data-parallel")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient norm clipping (0: off)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", choices=("text", "synthetic"), default="text")
    p.add_argument("--text", nargs="*", default=None, help="text files (default: the repository's *.md)")
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--profile", default=None, help="lossy profile (default: configs/lossless.toml)")
    p.add_argument("--set", action="append", default=[], type=_key_value,
                   help="profile override KEY=VALUE (repeatable)")
    p.add_argument("--stats", default=None, help="directory for the plugin's statistics files")
    p.add_argument("--log", default=None, help="JSONL file rank 0 writes (one line per step)")
    p.add_argument("--setting", default="", help="a label copied into every log line")
    p.add_argument("--no-plugin", action="store_true", help="NCCL's own Socket transport (baseline)")
    p.add_argument("--loss-rate", type=float, default=None,
                   help="default loss model: this fraction of packets lost (on top of --profile)")
    p.add_argument("--burst-length", type=float, default=None,
                   help="mean loss burst in packets (1: independent loss; >1: Gilbert-Elliott)")
    p.add_argument("--effect", default=None, help="what a lost packet does: zero, stale, retransmit, bitflip")
    p.add_argument("--no-loss-on-forward", action="store_true", help="no loss while the model runs forward")
    p.add_argument("--no-loss-on-backward", action="store_true", help="no loss while gradients flow back")
    p.add_argument("--loss-on", choices=("both", "forward", "backward"), default="both",
                   help="phases in which the plugin injects loss (rules see the phase either way); "
                        "the --no-loss-on-* flags say the same")
    a = p.parse_args(argv)
    a.loss_on_forward = a.loss_on in ("both", "forward") and not a.no_loss_on_forward
    a.loss_on_backward = a.loss_on in ("both", "backward") and not a.no_loss_on_backward
    gpu_defaults = dict(layers=4, hidden=512, heads=8, seq=512, micro_batch=8)
    cpu_defaults = dict(layers=2, hidden=64, heads=4, seq=64, micro_batch=2)
    for key, value in (cpu_defaults if a.cpu else gpu_defaults).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


# -- launching ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, base=None) -> dict:
    """The environment of one rank on this host: torch.distributed's variables, plus what lets
    two ranks share one GPU through the network (each rank its own NCCL host id)."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["NCCL_HOSTID"] = f"fakehost{rank}"
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # NCCL 2.30+; older versions ignore it
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core's advice for sequence parallelism
    return env


def spawn(argv, nproc: int, script: str) -> int:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, *argv], env=rank_env(r, nproc, port))
             for r in range(nproc)]
    rc = 0
    try:
        while procs:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code != 0:
                    rc = rc or code
                    for q in procs:  # one rank failed: the others would wait forever
                        q.terminate()
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
    return rc


# -- data --------------------------------------------------------------------------------------


def load_tokens(args) -> list:
    if args.data == "synthetic":
        return []
    files = [Path(f) for f in args.text] if args.text else sorted(REPO.glob("*.md")) + sorted(REPO.glob("docs/*.md"))
    data = b"\n".join(f.read_bytes() for f in files if f.is_file())
    if len(data) < 4 * (args.seq + 1):
        raise SystemExit(f"not enough text in {[str(f) for f in files]}: {len(data)} bytes")
    return list(data)


def batches(args, tokens, torch, device):
    """Identical batches on every tensor-parallel rank (same seed): tokens, labels."""
    rng = random.Random(args.seed)
    b, s = args.micro_batch, args.seq
    while True:
        if tokens:
            starts = [rng.randrange(0, len(tokens) - s - 1) for _ in range(b)]
            rows = [tokens[i:i + s + 1] for i in starts]
        else:  # a learnable synthetic language: x[i+1] = (5 x[i] + 3 + small noise) mod 256
            rows = []
            for _ in range(b):
                x = [rng.randrange(256)]
                for _ in range(s):
                    x.append((5 * x[-1] + 3 + (rng.random() < 0.05) * rng.randrange(256)) % 256)
                rows.append(x)
        t = torch.tensor(rows, dtype=torch.long, device=device)
        yield t[:, :-1].contiguous(), t[:, 1:].contiguous()


# -- training ----------------------------------------------------------------------------------


def layer_spec(config, torch):
    """megatron-core's local GPT layer spec with a torch LayerNorm that supports sequence
    parallelism (megatron-core's own torch wrapper refuses it; its fused one needs apex): the
    norm itself is the same per token, only its parameters are marked ``sequence_parallel`` so
    their gradients are all-reduced across the tensor-parallel group, as Megatron does."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    class SeqParallelLayerNorm(torch.nn.LayerNorm):
        def __init__(self, config, hidden_size, eps=1e-5, **_ignored):
            super().__init__(hidden_size, eps=eps)
            for p in self.parameters():
                setattr(p, "sequence_parallel", bool(config.sequence_parallel))

    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = SeqParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SeqParallelLayerNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=SeqParallelLayerNorm)


def finite(x):
    return x if isinstance(x, float) and math.isfinite(x) else None


def integration(args):
    """The LossyMegatronIntegration the flags describe (checked here: a wrong value stops the
    run before anything starts, with LossyConfigError naming the key)."""
    import nccl_lossy

    profile = args.profile or str(REPO / "configs" / "lossless.toml")
    overrides = [tuple(kv.split("=", 1)) for kv in args.set]
    return nccl_lossy.LossyMegatronIntegration(
        profile,
        loss_rate=args.loss_rate,
        burst_length=args.burst_length,
        effect=args.effect,
        enable_on_forward=args.loss_on_forward,
        enable_on_backward=args.loss_on_backward,
        set=overrides or None,
        stats_dir=args.stats,
    )


def cpu_shims():
    """The test suite's CPU shims (python/tests/cpu_shims.py): megatron-core's optimizer path
    asks for CUDA by name in a few places; on the CPU these stand in for exactly those."""
    sys.path.insert(0, str(REPO / "python" / "tests"))
    import cpu_shims as shims

    shims.install()
    return shims


def worker(args) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s rank%(process)d %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    import nccl_lossy
    from nccl_lossy.megatron import apply_megatron_core_patch, patch_summary

    import warnings

    # torch warns on every call of the _base collectives the megatron-core patch binds.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\._")
    warnings.filterwarnings("ignore", category=UserWarning, message=r"Transformer Engine and Apex")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp = args.tensor_model_parallel_size or world
    if world % tp:
        raise SystemExit(f"--tensor-model-parallel-size {tp} does not divide the {world} ranks")
    if args.cpu:
        torch.set_num_threads(1)  # several ranks on a small machine: no thread oversubscription
    if not args.cpu and "NCCL_HOSTID" not in os.environ:
        os.environ["NCCL_HOSTID"] = f"fakehost{rank}"  # under torchrun: one host id per rank
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")

    integ = None
    if args.no_plugin:
        if not args.cpu:
            os.environ["NCCL_NET"] = "Socket"
            os.environ["NCCL_NET_PLUGIN"] = "none"
        patch_results = apply_megatron_core_patch()
    else:
        integ = integration(args)
        integ.enable()  # environment (NCCL has not started), megatron-core patch, injection on
        patch_results = integ.patch_results

    shims = cpu_shims() if args.cpu else None
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(0)  # every rank on the one GPU
        device = torch.device("cuda", 0)
        dist.init_process_group("nccl", rank=rank, world_size=world)

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    dp_rank = parallel_state.get_data_parallel_rank()
    torch.manual_seed(args.seed)
    if shims is None:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    else:
        shims.no_rng_tracker_fork()  # dropout is 0 here: the forked regions draw nothing
    sp = not args.no_sequence_parallel and tp > 1
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        perform_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, torch),
        vocab_size=256,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
        parallel_output=True,
        share_embeddings_and_output_weights=True,
    ).to(device)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                        decoupled_weight_decay=True, clip_grad=args.clip_grad,
                        use_distributed_optimizer=True),
        [model],
    )
    optimizer_classes = sorted({type(o.optimizer).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])})
    if integ is not None:
        integ.attach(model, optimizer)  # phases forward/backward, step counter after optimizer.step

    args.seed += 1000 * dp_rank  # each data-parallel rank its own batches, the same within a TP group
    tokens = load_tokens(args)
    data = batches(args, tokens, torch, device)
    position_ids = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    # Causal mask given explicitly (True = masked): megatron-core's default one is built on "cuda".
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    dp_group = parallel_state.get_data_parallel_group()
    dp_size = parallel_state.get_data_parallel_world_size()

    log = open(args.log, "a", encoding="utf-8") if (args.log and rank == 0) else None
    head = {"event": "start", "setting": args.setting, "profile": None if args.no_plugin else (args.profile or "configs/lossless.toml"),
            "set": args.set, "loss_rate": args.loss_rate, "burst_length": args.burst_length, "effect": args.effect,
            "no_plugin": args.no_plugin, "cpu": args.cpu, "world": world, "tensor_parallel": tp, "data_parallel": dp_size,
            "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq, "micro_batch": args.micro_batch,
            "sequence_parallel": sp, "steps": args.steps, "lr": args.lr, "clip_grad": args.clip_grad, "data": args.data,
            "loss_on_forward": args.loss_on_forward, "loss_on_backward": args.loss_on_backward,
            "loss_on": {(True, True): "both", (True, False): "forward", (False, True): "backward"}.get(
                (args.loss_on_forward, args.loss_on_backward), "none"),
            "optimizer": optimizer_classes, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if not args.cpu else None}
    if log:
        log.write(json.dumps(head) + "\n")
        log.flush()

    losses, tps = [], []
    for step in range(1, args.steps + 1):
        inputs, labels = next(data)
        sync()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        per_token = model(inputs, position_ids, causal, labels=labels)  # [b, s], vocab-parallel CE
        loss = per_token.float().mean()
        loss.backward()  # the gradient hook marks phase "backward"
        finalize_model_grads([model])  # data-parallel reduce-scatter, sequence-parallel all-reduce
        ok, grad_norm, _ = optimizer.step()  # integration: phase "any" during the step, then the step counter
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)  # the loss over the data-parallel ranks
        sync()
        dt = time.perf_counter() - t0
        value = float(mean.item()) / dp_size
        losses.append(value)
        tps.append(args.micro_batch * args.seq * dp_size / dt)
        if log:
            log.write(json.dumps({"event": "step", "setting": args.setting, "step": step, "loss": finite(value),
                                  "grad_norm": finite(float(grad_norm)) if grad_norm is not None else None,
                                  "update_ok": bool(ok), "step_time_s": dt, "tokens_per_s": tps[-1]}) + "\n")
            log.flush()
        if rank == 0 and (step == 1 or step % 20 == 0 or step == args.steps):
            print(f"step {step:5d}  loss {value:8.4f}  {tps[-1]:10.0f} tokens/s", flush=True)

    plugin_total = None
    if integ is not None and not args.cpu:
        plugin_total = nccl_lossy.stats().get("total")
        if args.stats:
            integ.write_stats()
    if log:
        warm = tps[min(5, len(tps) - 1):]  # leave the first steps (allocation, NCCL setup) out
        log.write(json.dumps({"event": "end", "setting": args.setting, "final_loss": finite(losses[-1]),
                              "mean_loss_last10": finite(sum(losses[-10:]) / len(losses[-10:])),
                              "tokens_per_s": sum(warm) / len(warm), "plugin_total_rank0": plugin_total,
                              "integration_step": integ.step_number if integ is not None else None,
                              "megatron_patch": patch_summary(patch_results),
                              "megatron_patch_missing": [f"{r.module}.{r.attribute}" for r in patch_results
                                                         if r.status == "missing"]}) + "\n")
        log.close()
    if integ is not None:
        integ.detach()
        integ.disable()
    # megatron-core's teardown first: its globals hold the model-parallel groups.
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        for path in (args.log, args.stats):
            if path:
                Path(path if path == args.stats else Path(path).parent).mkdir(parents=True, exist_ok=True)
        if args.log and Path(args.log).exists():
            Path(args.log).unlink()
        return spawn(argv, args.nproc, str(Path(__file__).resolve()))
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
