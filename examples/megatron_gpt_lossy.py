#!/usr/bin/env python3
"""A small megatron-core GPT, tensor-parallel over two ranks, trained through the lossy plugin.

    python examples/megatron_gpt_lossy.py --profile configs/uniform-1pct.toml \
        --stats runs/u1/stats --log runs/u1/train.jsonl --steps 200

starts two ranks itself (``--nproc 2``; under torchrun, which sets ``RANK``, it is one rank).
Both ranks use ``cuda:0``: each gets its own ``NCCL_HOSTID`` (``fakehost<rank>``), so NCCL takes
them for two hosts and every byte between them goes through the network plugin (see the
project's GPU notes in ``bench/gpu/README.md``).

The model: megatron-core's ``GPTModel`` with the local (no Transformer Engine) layer spec,
4 layers, hidden 512, 8 heads, sequence 512, vocabulary 256 (bytes), tensor-parallel size 2,
sequence parallelism on, so the run's traffic is all three collective kinds: AllGather and
ReduceScatter (sequence-parallel layers, forward and backward), AllReduce (the vocab-parallel
cross entropy, the sequence-parallel layer-norm gradients). Data parallelism is 1, so the
optimizer is a plain ``torch.optim.AdamW`` on each rank's shard. The data is byte-level text
(the repository's own Markdown files by default) or a synthetic learnable sequence.

``nccl_lossy.LossyMegatronIntegration`` sets the environment before NCCL starts, applies the
megatron-core compatibility patch, and marks forward/backward phases and steps, so profile
rules on ``phase`` and ``steps`` apply. Rank 0 writes one JSON line per step (loss, step time,
tokens/s) to ``--log``.

``--cpu`` runs the same code on the CPU with the gloo backend (tiny sizes by default), for a
dry run without a GPU: the plugin is not on that path (gloo has its own TCP), but the
integration (environment, patch, phase and step control) runs as on a GPU.
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
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", choices=("text", "synthetic"), default="text")
    p.add_argument("--text", nargs="*", default=None, help="text files (default: the repository's *.md)")
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--profile", default=None, help="lossy profile (default: configs/lossless.toml)")
    p.add_argument("--set", action="append", default=[], help="profile override KEY=VALUE (repeatable)")
    p.add_argument("--stats", default=None, help="directory for the plugin's statistics files")
    p.add_argument("--log", default=None, help="JSONL file rank 0 writes (one line per step)")
    p.add_argument("--setting", default="", help="a label copied into every log line")
    p.add_argument("--no-plugin", action="store_true", help="NCCL's own Socket transport (baseline)")
    p.add_argument("--loss-on", choices=("both", "forward", "backward"), default="both",
                   help="phases in which the plugin injects loss (rules see the phase either way)")
    a = p.parse_args(argv)
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


def worker(args) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s rank%(process)d %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    import nccl_lossy
    from nccl_lossy.megatron import apply_megatron_core_patch

    import warnings

    # torch warns on every call of the _base collectives the megatron-core patch binds.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\._")
    warnings.filterwarnings("ignore", category=UserWarning, message=r"Transformer Engine and Apex")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu:
        torch.set_num_threads(1)  # two ranks on a small machine: no thread oversubscription
    if not args.cpu and "NCCL_HOSTID" not in os.environ:
        os.environ["NCCL_HOSTID"] = f"fakehost{rank}"  # under torchrun: one host id per rank
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")

    integ = None
    if args.no_plugin:
        if not args.cpu:
            os.environ["NCCL_NET"] = "Socket"
            os.environ["NCCL_NET_PLUGIN"] = "none"
        apply_megatron_core_patch()
    else:
        profile = args.profile or str(REPO / "configs" / "lossless.toml")
        overrides = [tuple(kv.split("=", 1)) for kv in args.set]
        integ = nccl_lossy.LossyMegatronIntegration(
            profile,
            enable_on_forward=args.loss_on in ("both", "forward"),
            enable_on_backward=args.loss_on in ("both", "backward"),
            set=overrides or None,
            stats_dir=args.stats,
        )
        integ.enable()  # environment (NCCL has not started), megatron-core patch, injection on

    if args.cpu:
        device = torch.device("cpu")
        # megatron-core allocates some buffers on torch.cuda.current_device(): point it at the CPU.
        torch.cuda.current_device = lambda: "cpu"
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(0)  # every rank on the one GPU
        device = torch.device("cuda", 0)
        dist.init_process_group("nccl", rank=rank, world_size=world)

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(args.seed)
    if not args.cpu:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    else:
        # The model-parallel RNG tracker keeps CUDA generator states; on the CPU there are none.
        # Dropout is 0 here, so the regions it forks need no randomness: make fork() a no-op.
        import contextlib

        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.fork = lambda *a, **k: contextlib.nullcontext()
    sp = not args.no_sequence_parallel
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=world,
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if integ is not None:
        integ.attach(model, optimizer)  # phases forward/backward, step counter after optimizer.step

    tokens = load_tokens(args)
    data = batches(args, tokens, torch, device)
    position_ids = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    # Causal mask given explicitly (True = masked): megatron-core's default one is built on "cuda".
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize

    log = open(args.log, "a", encoding="utf-8") if (args.log and rank == 0) else None
    head = {"event": "start", "setting": args.setting, "profile": None if args.no_plugin else (args.profile or "configs/lossless.toml"),
            "set": args.set, "no_plugin": args.no_plugin, "cpu": args.cpu, "world": world, "layers": args.layers,
            "hidden": args.hidden, "heads": args.heads, "seq": args.seq, "micro_batch": args.micro_batch,
            "sequence_parallel": sp, "steps": args.steps, "lr": args.lr, "data": args.data, "loss_on": args.loss_on,
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if not args.cpu else None}
    if log:
        log.write(json.dumps(head) + "\n")
        log.flush()

    losses, tps = [], []
    for step in range(1, args.steps + 1):
        inputs, labels = next(data)
        sync()
        t0 = time.perf_counter()
        per_token = model(inputs, position_ids, causal, labels=labels)  # [b, s], vocab-parallel CE
        loss = per_token.float().mean()
        loss.backward()
        if sp_params:  # sequence-parallel layer norms: their gradients are partial per rank
            if integ is not None:
                integ.mark_backward()
            grads = [p.grad for p in sp_params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=tp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        optimizer.step()  # integration: phase "any" during the step, then the step counter
        optimizer.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        value = float(loss.item())
        losses.append(value)
        tps.append(args.micro_batch * args.seq / dt)
        if log:
            log.write(json.dumps({"event": "step", "setting": args.setting, "step": step, "loss": finite(value),
                                  "step_time_s": dt, "tokens_per_s": tps[-1]}) + "\n")
            log.flush()
        if rank == 0 and (step == 1 or step % 20 == 0 or step == args.steps):
            print(f"step {step:5d}  loss {value:8.4f}  {tps[-1]:10.0f} tokens/s", flush=True)

    plugin_total = None
    if integ is not None and not args.cpu:
        plugin_total = nccl_lossy.stats().get("total")
        if args.stats:
            nccl_lossy.write_stats()
    if log:
        warm = tps[min(5, len(tps) - 1):]  # leave the first steps (allocation, NCCL setup) out
        log.write(json.dumps({"event": "end", "setting": args.setting, "final_loss": finite(losses[-1]),
                              "mean_loss_last10": finite(sum(losses[-10:]) / len(losses[-10:])),
                              "tokens_per_s": sum(warm) / len(warm), "plugin_total_rank0": plugin_total,
                              "integration_step": integ.step_number if integ is not None else None,
                              "megatron_patch_applied": sum(1 for r in (integ.patch_results if integ else [])
                                                            if getattr(r, "status", "") == "applied")}) + "\n")
        log.close()
    if integ is not None:
        integ.detach()
        integ.disable()
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
