"""The job behind `fxstar train`: the reference GPT, character-level, on a small text; or a
user's MODULE:FACTORY target on its example inputs.

It trains through `fxstar.compile` exactly as a user's loop would, shows a progress bar, logs
the loss per step, evaluates the GPT on held-out text, and ends with the engine's report.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import torch
from tqdm import tqdm

from fxstar.engine import compile
from fxstar.errors import TargetError, UsageError
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.plan import Plan
from fxstar.res_check import ResCheck, res_check
from fxstar.targets import Target


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    seed: int = 0
    log_every: int = 10
    data: str | None = None  # a text file; None: the text that ships with fxstar
    timeline: str | None = None  # write the memory timeline PNG here (chunk engine only)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    eval_loss: float | None = None  # held-out loss: the GPT demo only
    tokens_per_second: float | None = None  # None: the inputs hold no token ids
    steps_per_second: float = 0.0
    compile_seconds: float = 0.0
    report: str = ""


class CharData:
    """Characters as tokens; the last tenth of the text is held out for evaluation."""

    def __init__(self, text: str, seq_len: int, seed: int):
        if len(text) < 4 * (seq_len + 1):
            raise UsageError(
                f"data: the text has {len(text)} characters, too few for --seq-len {seq_len} "
                f"(needs at least {4 * (seq_len + 1)})"
            )
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        tokens = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        split = max(int(len(tokens) * 0.9), len(tokens) - 10 * seq_len)
        self.train, self.held_out = tokens[:split], tokens[split - seq_len :]
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch_size: int, held_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        source = self.held_out if held_out else self.train
        starts = torch.randint(0, len(source) - self.seq_len - 1, (batch_size,),
                               generator=self.generator)  # fmt: skip
        idx = torch.stack([source[s : s + self.seq_len] for s in starts])
        targets = torch.stack([source[s + 1 : s + 1 + self.seq_len] for s in starts])
        return idx, targets


def load_text(path: str | None) -> str:
    if path is None:
        return resources.files("fxstar.data").joinpath("tiny.txt").read_text(encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


def train(config: TrainConfig, plan: Plan, *, progress: bool = True) -> TrainResult:
    torch.manual_seed(config.seed)
    data = CharData(load_text(config.data), config.seq_len, config.seed)
    model_config = GPTConfig(
        vocab_size=data.vocab_size,
        block_size=config.seq_len,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        dropout=config.dropout,
    )
    model = GPT(model_config)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT: {config.n_layer} layers, width {config.n_embd}, {config.n_head} heads, "
        f"vocabulary {data.vocab_size} characters, {n_params / 1e6:.2f}M parameters; "
        f"batch {config.batch_size} x {config.seq_len} tokens"
    )
    result = TrainResult()
    first = data.batch(config.batch_size)
    engine = compile_engine(model, plan, first, {}, result)

    def batch(step: int) -> tuple[tuple, dict]:
        return (first if step == 0 else data.batch(config.batch_size)), {}

    tokens = config.batch_size * config.seq_len
    elapsed = run_steps(engine, batch, config.steps, config.log_every, progress, result, tokens)
    result.tokens_per_second = result.steps_per_second * tokens

    engine.eval()
    with torch.no_grad():
        losses = [engine(*data.batch(config.batch_size, held_out=True)).item() for _ in range(4)]
    engine.train()
    result.eval_loss = sum(losses) / len(losses)
    print(
        f"trained {config.steps} steps in {elapsed:.1f}s ({result.tokens_per_second:,.0f} "
        "tokens/s); train loss "
        f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}, held-out loss "
        f"{result.eval_loss:.3f} (uniform guess: {math.log(data.vocab_size):.3f})"
    )
    finish(engine, result, config.timeline)
    return result


def res_check_gpt(config: TrainConfig, plan: Plan) -> ResCheck:
    """`fxstar train --res-check`: the reference GPT (without dropout: its draws differ per
    rank) trained `config.steps` steps data parallel over the launched ranks and in one
    process on the same global batches; rank 0 prints both losses per step."""
    data = CharData(load_text(config.data), config.seq_len, config.seed)
    model_config = GPTConfig(vocab_size=data.vocab_size, block_size=config.seq_len,
                             n_layer=config.n_layer, n_head=config.n_head,
                             n_embd=config.n_embd, dropout=0.0)  # fmt: skip

    def make_model() -> GPT:
        torch.manual_seed(config.seed)
        return GPT(model_config)

    batches = [data.batch(config.batch_size) for _ in range(config.steps)]
    check = res_check(make_model, plan, batches)
    if check.serial is not None:
        print(check.table())
    return check


def train_target(
    target: Target,
    plan: Plan,
    *,
    steps: int,
    log_every: int = 10,
    timeline: str | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train a MODULE:FACTORY target on its example inputs, the same batch every step: the
    whole path (capture, passes, chunks, optimizer) on the user's own model, without a data
    loader. The model must return its loss (a tensor, a 'loss' entry, or first in a tuple)
    or the plan must set loss_fn."""
    model = target.model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n_params / 1e6:.2f}M parameters; its example inputs, "
          f"repeated for {steps} steps")  # fmt: skip
    result = TrainResult()
    engine = compile_engine(model, plan, target.example_inputs, target.example_kwargs, result)
    tokens = tokens_per_step(target.example_inputs, target.example_kwargs)
    elapsed = run_steps(engine, lambda step: (target.example_inputs, target.example_kwargs),
                        steps, log_every, progress, result, tokens)  # fmt: skip
    rate = ""
    if tokens is not None:
        result.tokens_per_second = result.steps_per_second * tokens
        rate = f" ({result.tokens_per_second:,.0f} tokens/s)"
    print(f"trained {steps} steps in {elapsed:.1f}s{rate}; loss {result.losses[0]:.4f} -> "
          f"{result.losses[-1]:.4f}")  # fmt: skip
    finish(engine, result, timeline)
    return result


def tokens_per_step(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The tokens a step reads: the elements of its token ids, an integer tensor of a batch of
    sequences (`input_ids` when named so, else the first such input); None when there is none
    (images, features): a rate of tokens would mean nothing."""
    named = kwargs.get("input_ids")
    candidates = [named] if isinstance(named, torch.Tensor) else []
    candidates += [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    for x in candidates:
        if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
            return x.numel()
    return None


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output: the output itself, its 'loss' entry (transformers'
    ModelOutput), or the first element of a tuple."""
    loss = output
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, tuple | list) and output:
        loss = output[0]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TargetError(
            f"the model must return its loss (a scalar tensor, a 'loss' entry or first in a "
            f"tuple) to be trained; got {got}. Pass the labels in the example inputs, or set "
            "plan.loss_fn"
        )
    return loss


def compile_engine(model, plan: Plan, args: tuple, kwargs: dict, result: TrainResult):
    start = time.perf_counter()
    engine = compile(model, plan, example_inputs=args, example_kwargs=kwargs)  # captures now
    result.compile_seconds = time.perf_counter() - start
    passes = ", ".join(engine.program.passes_run()) or "none"
    print(f"compiled in {result.compile_seconds:.1f}s; passes: {passes}")
    return engine


def run_steps(
    engine,
    batch: Callable[[int], tuple[tuple, dict]],
    steps: int,
    log_every: int,
    progress: bool,
    result: TrainResult,
    tokens: int | None = None,
) -> float:
    """`steps` training steps on `batch(step)`: forward, backward, optimizer step, logging.
    Returns the seconds they took. The progress shows as a bar on a terminal; into a file
    or a pipe (a captured log) as one line per tenth of the run instead of the bar's redraws;
    both with the loss, tokens a second (`tokens`: a step's, None: not counted) and memory
    per tier of a chunk engine."""
    bar = tqdm(range(steps), desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not (progress and _on_terminal(sys.stderr)))  # fmt: skip
    lines = progress and bar.disable
    start = time.perf_counter()
    for step in bar:
        args, kwargs = batch(step)
        loss = loss_of(engine(*args, **kwargs))
        loss.backward()
        engine.step()
        result.losses.append(loss.item())
        done = step + 1
        status = _status(engine, result.losses[-1], tokens, done, time.perf_counter() - start)
        bar.set_postfix(status)
        if log_every and (step % log_every == 0 or step == steps - 1):
            tqdm.write(f"step {step:>5}  loss {result.losses[-1]:.4f}")
        if lines and (done * PROGRESS_LINES // steps > step * PROGRESS_LINES // steps):
            rate = done / (time.perf_counter() - start)
            rest = "".join(f", {k} {v}" for k, v in status.items() if k != "loss")
            print(f"train: {done}/{steps} steps ({100 * done // steps}%), loss "
                  f"{result.losses[-1]:.4f}, {rate:.2f} steps/s{rest}",
                  file=sys.stderr, flush=True)  # fmt: skip
    elapsed = time.perf_counter() - start
    result.steps_per_second = steps / elapsed
    return elapsed


PROGRESS_LINES = 10  # progress lines of a run when stderr is not a terminal
# the progress's names for train_metrics.tier_memory's figures (MiB)
TIERS = {"compute_chunks_peak_mib": "compute", "compute_kept_mib": "kept",
         "activations_peak_mib": "activations", "host_mib": "host",
         "cuda_max_allocated_mib": "cuda"}  # fmt: skip


def _status(engine, loss: float, tokens: int | None, done: int, seconds: float) -> dict[str, str]:
    """What the progress shows after `done` steps in `seconds`: the loss, tokens a second,
    and the MiB each tier of a chunk engine holds at its fullest (none without chunks: the
    model is not paged, everything lies in one memory)."""
    from fxstar.integrations.train_metrics import tier_memory

    status = {"loss": f"{loss:.4f}"}
    if tokens is not None:
        status["tok/s"] = f"{tokens * done / max(seconds, 1e-9):,.0f}"
    for name, mib in tier_memory(engine).items():
        if mib:
            status[TIERS.get(name, name)] = f"{mib:,.1f}MiB"
    return status


def _on_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def finish(engine, result: TrainResult, timeline: str | None) -> None:
    """The run's report and timeline; then the engine is closed: its threads stop and a disk
    tier's files go now, not whenever the engine is collected."""
    result.report = engine.report()
    print(result.report)
    if timeline:
        print(f"memory timeline: {engine.memory_timeline(timeline)}")
    engine.close()


def write_json(
    path: str, config: TrainConfig | Mapping[str, Any], plan: Plan, result: TrainResult
) -> None:
    """The run as JSON; `config` is a TrainConfig, or a dict describing a target's run."""
    config = dict(config) if isinstance(config, Mapping) else asdict(config)
    payload = {"config": config, "plan": json.loads(plan.replace(loss_fn=None).to_json()),
               **asdict(result)}  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(payload), f, indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinity (a diverged loss) as None: JSON has no such numbers
    (Python writes `NaN`, which other readers refuse), and null says "no number" to all."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
