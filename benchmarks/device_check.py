"""The accelerator path in one run: what a session lent a GPU should run first.

Every check trains a GPT on the compute device against eager PyTorch on the same device and
reports real device memory:
- chunks: the chunk engine at a budget of the activations plus 60% of the parameters (the
  arena on the device, pinned host homes, copies on the side stream): losses and gradients
  against eager, peak device memory against the budget;
- overlap: the same with gradient copies beside backward on the copy stream, bitwise equal
  to it, and the share of copy time hidden;
- hybrid: a budget with room for some chunks' optimizer state, kept on the device and updated
  by torch's fused AdamW, against torch AdamW on the eager model;
- offload: checkpointed blocks whose inputs wait in pinned host memory, against eager;
- meta: the GPT built on the meta device, compiled for the device (`plan.device`) with the
  tight budget, its weights read from a safetensors file of the eager model's into pinned
  host homes: the model never exists on the device, nor twice on the host.
On a card (and the simulated device) every check also needs the chunk blocks to come from the
allocator activations use (arena.PooledBlocks: dynamic partition); the script sets
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set already.
On a CPU-only machine the same checks run on the CPU (the device-only facts are skipped), so
the script itself is tested everywhere; `--device simulated` runs them on the CPU through
fxstar.testing.SimulatedDevice, whose copies between the tiers run later on worker threads
(a missing wait reads NaN there), as the suite does.

    python benchmarks/device_check.py                       # cuda when there is one
    python benchmarks/device_check.py --device cpu --layers 2 --width 64 --json check.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
from gpt_setup import add_gpt_args

import fxstar
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.runtime.arena import PooledBlocks
from fxstar.runtime.device import device_for, using_device
from fxstar.testing.async_device import SimulatedDevice
from fxstar.weights import write_safetensors

OPTIMIZER = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1}


@dataclass
class Check:
    name: str
    ok: bool = False
    max_loss_error: float = 0.0
    max_param_error: float = 0.0
    budget_bytes: int = 0
    peak_device_bytes: int | None = None  # torch.cuda.max_memory_allocated during the steps
    seconds: float = 0.0
    facts: dict[str, object] = field(default_factory=dict)


def make(args, device: torch.device) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.width, dropout=0.0, bias=False)  # fmt: skip
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), device=device)
    targets = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), device=device)
    return GPT(cfg).to(device), idx, targets


def budget(args, device: torch.device, share: float) -> int:
    """Activations at their peak plus `share` of the parameter bytes."""
    model, idx, targets = make(args, device)
    program = fxstar.compile(model, fxstar.Plan(passes=["shape_memory"]), (idx, targets)).program
    return nonmodel_peak(program) + int(share * program.param_bytes)


def run(
    name: str,
    args,
    device: torch.device,
    plan: fxstar.Plan,
    tolerance: float,
    meta: bool = False,
) -> Check:
    """`args.steps` AdamW steps of the engine and of eager on the same batches. With
    hybrid_adam the check also needs some chunks kept on the compute tier. `meta`: the
    engine's model is built on the meta device and read from the eager model's weights."""
    eager, idx, targets = make(args, device)
    weights = None
    if meta:
        weights = tempfile.mkdtemp(prefix="device_check-")
        write_safetensors(f"{weights}/model.safetensors", dict(eager.state_dict()))
        with torch.device("meta"):
            model = make(args, torch.device("meta"))[0]
        plan = plan.replace(device=str(device))
    else:
        model = make(args, device)[0]
    reference = torch.optim.AdamW(
        [{"params": [p for n, p in eager.named_parameters() if plan.optimizer.decays(n)]},
         {"params": [p for n, p in eager.named_parameters() if not plan.optimizer.decays(n)],
          "weight_decay": 0.0}], lr=OPTIMIZER["lr"], weight_decay=OPTIMIZER["weight_decay"],
    )  # fmt: skip
    check = Check(name, budget_bytes=plan.resolve_size("device_memory", 1) or 0)
    engine = fxstar.compile(model, plan, (idx, targets), weights=weights)
    if weights is not None:
        check.facts["model bytes / budget"] = (
            f"{engine.program.param_bytes / check.budget_bytes:.2f}"
        )
        shutil.rmtree(weights)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        expected = eager(idx, targets)
        expected.backward()
        reference.step()
        reference.zero_grad(set_to_none=True)
        loss = engine(idx, targets)
        loss.backward()
        engine.step()
        check.max_loss_error = max(check.max_loss_error,
                                  abs(float(loss.detach()) - float(expected.detach())))  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        check.peak_device_bytes = torch.cuda.max_memory_allocated(device)
    check.seconds = time.perf_counter() - start
    for (_, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters(), strict=True):
        error = float((p.detach().double() - q.detach().double().to(p.device)).abs().max())
        check.max_param_error = max(check.max_param_error, error)
    manager = engine.chunks
    pooled = manager is not None and isinstance(manager.arena, PooledBlocks)
    if manager is not None:
        check.facts["arena device"] = str(manager.arena.device)
        # dynamic partition: on a card chunk blocks come from the allocator activations use
        check.facts["chunk blocks"] = type(manager.arena).__name__
        check.facts["host homes pinned"] = bool(manager.chunks[0].payload.is_pinned())
        check.facts["kept chunks"] = f"{len(engine.optimizer.device_chunks)}/{len(manager.chunks)}"
        check.facts["bytes to compute per step"] = list(manager.stats.per_step_bytes)[-1:]
        overlap = manager.grad_copy_overlap()
        if overlap is not None:
            check.facts["gradient copies hidden"] = f"{overlap:.0%}"
    within_budget = check.peak_device_bytes is None or check.peak_device_bytes <= (
        check.budget_bytes + sum(p.numel() * p.element_size() for p in eager.parameters())
    )  # the eager reference model lives on the device too
    kept = manager is not None and bool(engine.optimizer.device_chunks)
    check.ok = check.max_param_error <= tolerance and within_budget
    check.ok = check.ok and (kept or not plan.hybrid_adam)
    # on a card and the simulated device the chunk blocks must be the allocator's
    check.ok = check.ok and (manager is None or pooled == device_for(device).pooled_chunk_blocks)
    return check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="a torch device, or 'simulated': the CPU through "
                        "fxstar.testing.SimulatedDevice")  # fmt: skip
    add_gpt_args(parser)
    parser.set_defaults(width=512, heads=8, layers=8, batch_size=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    # chunk blocks and activations share torch's caching allocator (dynamic partition):
    # expandable segments let a freed chunk block hold activations of other sizes
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    simulated = args.device == "simulated"
    device = torch.device("cpu" if simulated else args.device)
    with contextlib.ExitStack() as stack:
        if simulated:  # every engine's asynchronous work on it
            stack.enter_context(using_device(stack.enter_context(SimulatedDevice(seed=0))))
        checks = run_checks(args, device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = "simulated asynchronous device" if simulated else "cpu"
    return report(args, device, name, checks)


def run_checks(args, device: torch.device) -> list[Check]:
    tight, roomy = budget(args, device, 0.6), budget(args, device, 2.0)
    base = fxstar.Plan(optimizer=OPTIMIZER, device_memory=tight, hybrid_adam=False)
    checks = [
        run("chunks", args, device, base, 1e-4),
        run("overlap", args, device, base.replace(overlap_grad_copies="on"), 1e-4),
        run("hybrid", args, device, base.replace(device_memory=roomy, hybrid_adam=True), 1e-4),
        run(
            "offload",
            args,
            device,
            base.replace(checkpoint="blocks", offload_activations=True),
            1e-4,
        ),  # fmt: skip
        run("meta", args, device, base, 1e-4, meta=True),
    ]
    return checks


def report(args, device: torch.device, name: str, checks: list[Check]) -> int:
    """The table (and --json); 0 when every check passed."""
    print(f"device {device} ({name}); GPT {args.layers} layers, d={args.width}, "
          f"batch {args.batch_size} x {args.seq_len}")  # fmt: skip
    if device.type == "cuda":
        print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
    header = (f"{'check':<8} {'ok':<4} {'loss err':>9} {'param err':>9} {'budget':>12} "
              f"{'peak dev':>12} {'s':>6}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for c in checks:
        peak = "-" if c.peak_device_bytes is None else f"{c.peak_device_bytes:,}"
        print(f"{c.name:<8} {'yes' if c.ok else 'NO':<4} {c.max_loss_error:>9.1e} "
              f"{c.max_param_error:>9.1e} {c.budget_bytes:>12,} {peak:>12} "
              f"{c.seconds:>6.1f}")  # fmt: skip
        if c.facts:
            print("  " + "; ".join(f"{k}: {v}" for k, v in c.facts.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"args": vars(args), "checks": [asdict(c) for c in checks]}, file, indent=2)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
