"""Verification (slapo's Verify): re-run after every pass and compare loss and gradients.

Each run uses fresh clones of the model's parameters and buffers (ties kept) and the same
seed, so dropout draws the same masks and the model itself is never touched. The capture is
compared with eager PyTorch, every later stage with the one before it: bitwise, unless the
pass declares a tolerance (rtol, atol).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from fxstar.errors import VerifyError
from fxstar.params import ParameterStore
from fxstar.program import Program
from fxstar.runtime import rng_tracker

__all__ = ["RunResult", "Verifier", "find_loss"]


def find_loss(output: Any) -> torch.Tensor | None:
    """The loss in what a model returns: a scalar tensor, `out['loss']`, or the first scalar
    floating tensor of a tuple; None when there is none (logits only)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 and output.is_floating_point() else None
    if isinstance(output, Mapping) or hasattr(output, "keys"):
        loss = output.get("loss") if hasattr(output, "get") else None
        if isinstance(loss, torch.Tensor):
            return loss
    if isinstance(output, tuple | list) or hasattr(output, "to_tuple"):
        items = output.to_tuple() if hasattr(output, "to_tuple") else output
        for item in items:
            if isinstance(item, torch.Tensor) and item.dim() == 0 and item.is_floating_point():
                return item
    return None


@dataclass
class RunResult:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]


class Verifier:
    """Runs eager and captured stages on the same inputs, tensors and seed; compares them."""

    def __init__(
        self,
        model: nn.Module,
        args: tuple,
        kwargs: Mapping[str, Any] | None = None,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed: int = 0,
        runner: Callable[[Program, tuple, dict, dict], Any] | None = None,
    ):
        """`runner(program, args, kwargs, tensors)` runs a stage whose graph needs a runtime
        (the chunk engine's); it may rebind names in `tensors` to what it trains instead."""
        self.model = model
        self.runner = runner
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        self.loss_fn = loss_fn
        self.seed = seed
        self.names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        self.originals = dict(model.named_parameters(remove_duplicate=False))
        self.originals.update(model.named_buffers(remove_duplicate=False))
        self.snapshot = {id(t): t.detach().clone() for t in self.originals.values()}
        self.last: tuple[str, RunResult] | None = None

    def _tensors(self, store: ParameterStore | None = None) -> dict[str, torch.Tensor]:
        """Clones of the model's tensors, plus clones of what a program's store feeds under
        other names (parts a pass derived: tiles, shards)."""
        clones: dict[int, torch.Tensor] = {}
        out = {}
        for name, t in self.originals.items():
            if id(t) not in clones:
                c = self.snapshot[id(t)].clone()
                if isinstance(t, nn.Parameter):
                    c.requires_grad_(t.requires_grad)
                clones[id(t)] = c
            out[name] = clones[id(t)]
        for name, t in (store.tensors() if store is not None else {}).items():
            if name not in out:
                if id(t) not in clones:
                    clones[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
                out[name] = clones[id(t)]
        return out

    def _run(
        self,
        forward: Callable[[dict[str, torch.Tensor]], Any],
        store: ParameterStore | None = None,
    ) -> RunResult:
        tensors = self._tensors(store)
        with rng_tracker.fork_all(), torch.enable_grad():
            torch.manual_seed(self.seed)
            output = forward(tensors)
            loss = find_loss(output)
            floats = [
                t for t in pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            ]  # fmt: skip
            if loss is None:
                loss = sum((t.float().sum() for t in floats if t.requires_grad), torch.zeros(()))
            if loss.requires_grad:
                loss.backward()
        grads = {n: t.grad for n, t in tensors.items()}
        if store is not None:  # parts' gradients glued back: compared in the model's space
            grads = store.consolidate_grads(grads)
        grads = {n: grads[n] for n in self.names}
        return RunResult([t.detach() for t in floats], grads)

    def run_eager(self) -> RunResult:
        def forward(tensors):
            if self.loss_fn is None:
                return functional_call(self.model, tensors, self.args, self.kwargs)
            *inputs, targets = self.args
            out = functional_call(self.model, tensors, tuple(inputs), self.kwargs)
            return self.loss_fn(out, targets)

        return self._run(forward)

    def run_program(self, program: Program) -> RunResult:
        if self.runner is not None:
            run = lambda t: self.runner(program, self.args, self.kwargs, t)  # noqa: E731
        else:
            run = lambda t: program.run(self.args, self.kwargs, tensors=t)  # noqa: E731
        return self._run(run, program.store)

    def baseline(self) -> None:
        """Take eager PyTorch as the reference for the first check."""
        self.last = ("eager", self.run_eager())

    def __call__(self, p: Any, program: Program) -> None:
        """Check `program` after pass `p` against the previous result; raises VerifyError."""
        name = getattr(p, "name", str(p))
        tolerance = getattr(p, "tolerance", None)
        result = self.run_program(program)
        if self.last is not None:
            _compare(self.last, (name, result), tolerance)
        self.last = (name, result)


def _compare(
    before: tuple[str, RunResult],
    after: tuple[str, RunResult],
    tolerance: tuple[float, float] | None,
) -> None:
    (prev, a), (name, b) = before, after
    pairs = [(f"output {i}", x, y) for i, (x, y) in enumerate(zip(a.outputs, b.outputs))]
    if len(a.outputs) != len(b.outputs):
        raise VerifyError(
            f"pass {name!r} changed the number of outputs: {len(a.outputs)} -> "
            f"{len(b.outputs)} (compared with {prev})",
            pass_name=name,
        )
    pairs += [(f"grad of {n}", a.grads[n], b.grads[n]) for n in a.grads]
    want = "bitwise equality" if tolerance is None else f"rtol={tolerance[0]}, atol={tolerance[1]}"
    for what, x, y in pairs:
        if x is None and y is None:
            continue
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            got = "missing" if x is None or y is None else f"{tuple(x.shape)} vs {tuple(y.shape)}"
            raise VerifyError(
                f"pass {name!r} broke the {what} ({got}; compared with {prev})",
                pass_name=name,
                tensor=what,
            )
        same = (
            torch.equal(x, y)
            if tolerance is None
            else torch.allclose(x, y, rtol=tolerance[0], atol=tolerance[1], equal_nan=True)
        )
        if not same:
            diff = (x.double() - y.double()).abs().max().item()
            raise VerifyError(
                f"pass {name!r} changed the {what}: max abs difference {diff:.3g} "
                f"(compared with {prev}; the pass allows {want})",
                pass_name=name,
                tensor=what,
            )
