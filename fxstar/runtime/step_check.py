"""Step fingerprints: a rank out of step with the others raises at its first collective,
instead of pairing it with another step's (a sum of different steps' gradients, or in gloo a
message of the wrong size, which aborts the process).

Every collective an engine's process group runs is preceded by a header: one all-gather of a
few int64 words saying where the rank is (the engine's step count, the training forward it is
in, the collective's number since that forward began, which capture runs, a CRC-32 of the
collective's description and, on a tensor-parallel group, of the inputs). Every rank gathers
every rank's words, so all see the same difference and raise the same CollectiveError.

Why a header before each collective rather than one check per step: a rank that raised
mid-forward and went on (`try: ... except: zero_grad(); continue`) stopped between two
collectives, so its next collective is the header of its next forward, while the others' next
is the header of the collective they are about to run: headers pair with headers, and the
difference shows before any payload is exchanged. A check once per step would pair with the
others' payloads. The cost is one small all-gather per collective (benchmarks/data_parallel.py
measures it). Headers run on the group itself under gloo; under another backend (NCCL) on a
gloo group beside it, so reading them back never waits for the device.

Counted: training forwards (grad enabled: one per micro-batch on every rank); a forward under
torch.no_grad() starts nothing new (a replicated rank may evaluate alone where it runs no
collective). Tensor-parallel ranks must be fed the same inputs: their CRC-32 (of each tensor's
bytes, a strided sample of those over SAMPLE_BYTES) goes into that group's headers.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxstar.errors import CollectiveError

__all__ = ["StepCursor", "begin_forward", "out_of_step_message"]

MAGIC = 0x66787374_5354  # 'fxstST': a header, not another collective's payload
WORDS = ("magic", "step", "forward", "collective", "capture", "what", "inputs")
SAMPLE_BYTES = 4 << 20  # a larger input tensor is fingerprinted from a strided sample


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


class StepCursor:
    """Where this rank is in its group's sequence of collectives, and the header check."""

    def __init__(self, pg: Any):
        self.pg = pg  # the group the headers run on (gloo)
        self.world = dist.get_world_size(pg)
        self.role: str | None = None  # 'data-parallel', 'tensor-parallel', 'mesh' once known
        self.step = 0  # the engine's step count when the current forward began
        self.forward = 0  # training forwards begun
        self.collective = 0  # collectives since the current forward began
        self.capture = 0  # CRC-32 of the current forward's capture key
        self.capture_text = "(the example inputs)"
        self.inputs = 0  # tensor parallel: CRC-32 of the current forward's inputs
        self.words = torch.zeros(len(WORDS), dtype=torch.int64)
        self.gathered = torch.zeros(self.world * len(WORDS), dtype=torch.int64)
        self._words = self.words.numpy()
        self._rows = self.gathered.numpy().reshape(self.world, len(WORDS))

    def begin(self, step: int, capture: tuple[str, int]) -> None:
        """A training forward begins (`capture`: its key as shown and its CRC-32): its
        collectives are counted from 0."""
        self.step, self.forward, self.collective = step, self.forward + 1, 0
        self.capture_text, self.capture = capture

    def check(self, what: str) -> None:
        """Before the collective `what` (the same text on every rank): every rank's header
        must be this rank's, else every rank raises the same CollectiveError. Under a fake
        tensor mode (compile measuring shapes) no collective runs, so neither does a header."""
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            return
        self._words[:] = (MAGIC, self.step, self.forward, self.collective, self.capture,
                          _crc(what), self.inputs)  # fmt: skip
        dist.all_gather_single(self.gathered, self.words, group=self.pg)
        self.collective += 1
        rows = self._rows
        if (rows == rows[0]).all():
            return
        texts = None
        if (rows[:, 0] == MAGIC).all():  # every rank is here: the descriptions can follow
            texts = [None] * self.world
            dist.all_gather_object(texts, (what, self.capture_text), group=self.pg)
        raise CollectiveError(out_of_step_message(rows.tolist(), texts, self.role))


def _position(row: Sequence[int], text: tuple[str, str] | None) -> str:
    if row[0] != MAGIC:
        return "in a collective that is not one of the engine's steps"
    _, step, forward, collective, _, _, _ = row
    what = f": {text[0]}" if text is not None else ""
    return f"step {step}, training forward {forward}, its collective {collective}{what}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _grouped(values: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    """(value, the ranks that have it), in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return list(groups.items())


def out_of_step_message(
    rows: Sequence[Sequence[int]], texts: Sequence[tuple[str, str]] | None, role: str | None
) -> str:
    """The error every rank raises for the gathered headers `rows` (one per group rank, in
    order), `texts` each rank's (collective, capture key) when every rank sent a header."""
    name = f"the {role} ranks" if role else "the ranks of the engine's process group"
    column = {w: i for i, w in enumerate(WORDS)}
    lines, fixes = [], []

    def differ(word: str) -> bool:
        return len({row[column[word]] for row in rows}) > 1

    positions = [tuple(row[: column["capture"]]) + (row[column["what"]],) for row in rows]
    if len(set(positions)) > 1:
        lines.append(f"{name} are out of step (every rank raises this; no collective of "
                     "different steps ran):")  # fmt: skip
        for _, ranks in _grouped(positions):
            text = texts[ranks[0]] if texts is not None else None
            lines.append(f"  {_ranks(ranks)}: {_position(rows[ranks[0]], text)}")
        lines.append(
            "  a rank that raised inside forward, backward or step and went on (try/except: "
            "continue), or that skipped or added one, stopped where the others still are"
        )
        fixes.append(
            "every rank must run the same forwards, backwards and steps: when one raises, "
            "stop every rank (or raise on all) and resume from the last checkpoint"
        )
    if differ("capture"):
        lines.append(f"{name} run different input signatures (a batch shape that changed on "
                     "some ranks only):")  # fmt: skip
        for capture, ranks in _grouped([row[column["capture"]] for row in rows]):
            shown = texts[ranks[0]][1] if texts is not None else f"crc32={capture:08x}"
            lines.append(f"  {_ranks(ranks)}: {shown}")
        fixes.append(
            "give every rank batches of the same shapes at each step (drop_last=True, or pad "
            "the last batch), or compile with dynamic_shapes"
        )
    if differ("inputs"):
        values = [f"crc32={row[column['inputs']]:08x}" for row in rows]
        lines.append(f"{name} were fed different inputs: " + "; ".join(
            f"{_ranks(ranks)}: {value}" for value, ranks in _grouped(values)))  # fmt: skip
        fixes.append(
            "feed every rank of a tensor-parallel group the same batch (shard the data over "
            "the data-parallel replicas, not over every rank)"
        )
    return "\n".join([*lines, f"fix: {'; '.join(fixes)}"])


# -- the engine's side ----------------------------------------------------------------------------


def _capture_key(training: bool, args: tuple, kwargs: Mapping[str, Any], dynamic: bool
                 ) -> tuple[str, int]:  # fmt: skip
    """What selects a capture (Engine.signature), devices left out (each rank has its own):
    the mode, each tensor input's dtype and shape (its rank under dynamic shapes), other
    inputs by value, and their structure. As shown in errors, and its CRC-32 (with the
    structure)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape = f"{leaf.dim()}-d" if dynamic else ",".join(map(str, leaf.shape))
            grad = " requires_grad" if leaf.requires_grad else ""
            parts.append(f"{str(leaf.dtype).removeprefix('torch.')}[{shape}]{grad}")
        else:
            text = repr(leaf)
            parts.append(text if len(text) <= 40 else text[:37] + "...")
    shown = f"{'train' if training else 'eval'} ({', '.join(parts)})"
    return shown, zlib.crc32(str(spec).encode(), _crc(shown))


def _inputs_crc(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """CRC-32 of every tensor input's shape and bytes (a strided sample past SAMPLE_BYTES)."""
    crc = 0
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if not isinstance(leaf, torch.Tensor):
            crc = zlib.crc32(repr(leaf).encode(), crc)
            continue
        flat = leaf.detach().reshape(-1)
        crc = zlib.crc32(f"{leaf.dtype}{tuple(leaf.shape)}".encode(), crc)
        if flat.nbytes > SAMPLE_BYTES:
            flat = flat[:: math.ceil(flat.nbytes / SAMPLE_BYTES)]
        try:
            raw = flat.contiguous().cpu().view(torch.uint8).numpy()
        except (RuntimeError, TypeError):  # no bytes to read (meta, fake)
            continue
        crc = zlib.crc32(np.ascontiguousarray(raw), crc)
    return crc


def begin_forward(engine: Any, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """At the start of every engine forward: a training forward (grad enabled) begins a new
    count of each engine group's collectives with the engine's step count and capture key;
    tensor-parallel groups take the inputs' fingerprint (their ranks run every forward)."""
    topology = engine.topology
    groups = [(name, group) for name, group in topology.groups().items()
              if group.steps is not None]  # fmt: skip
    if not groups:
        return
    training = torch.is_grad_enabled()
    capture = inputs = None
    if training:
        capture = _capture_key(engine.model.training, args, kwargs,
                               engine.dynamic_shapes is not None)  # fmt: skip
    for name, group in groups:
        cursor = group.steps
        cursor.role = name  # the topology's: 'tensor-parallel', 'data-parallel', 'mesh'
        if group is topology.tensor_group:
            cursor.inputs = inputs = _inputs_crc(args, kwargs) if inputs is None else inputs
        if training:
            cursor.begin(engine.step_count, capture)
