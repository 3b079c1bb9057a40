"""Rank agreement: at compile, every rank checks that the others compile the same thing.

Ranks whose plans differ (sequence_parallel, accumulation_steps, clipping), whose graphs differ
(another model, other input shapes) or whose replicated parameters differ (another seed, one
rank loaded a checkpoint) do not fail on their own: they hang in mismatched collectives, abort
inside gloo, or train different replicas without a word. One small all-gather of fingerprints
turns all of these into one error. Every rank computes it from the same gathered data, so every
rank raises the same message and none is left waiting.

A fingerprint is a plain dict: the plan's options (JSON-shaped, so differences are named with
their values), a hash of the captured graph's text, and per parameter and buffer its shape,
dtype and the CRC-32 of its bytes (replicas must be bitwise equal; CRC-32 runs at memory speed
and, unlike a sum, sees swapped or sign-flipped values). Only when the graph hashes differ are
the texts themselves exchanged, to show the first differing line.
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxstar.errors import RankMismatchError
from fxstar.runtime.rank_group import RankGroup, guard, host_process_group

__all__ = ["RankMismatchError", "agree", "fingerprint", "mismatch_message"]

SHOWN = 8  # differing parameters listed by name; the rest are counted


# -- fingerprints ---------------------------------------------------------------------------------


def _plan_options(plan: Any) -> dict[str, Any]:
    """Option -> JSON-shaped value (groups as dicts); loss_fn by its qualified name."""
    options = plan.to_dict()
    fn = options.get("loss_fn")
    if fn is not None:
        module = getattr(fn, "__module__", None) or "?"
        options["loss_fn"] = f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return options


def _checksum(t: torch.Tensor) -> tuple[tuple[int, ...], str, int | None]:
    """(shape, dtype, CRC-32 of the bytes); None where there are no bytes to read (meta or
    fake tensors, layouts without a flat view), which then compare as equal."""
    t = t.detach()
    shape, dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")
    try:
        flat = t.reshape(-1).contiguous().cpu()
        raw = flat.view(torch.uint8).numpy()
    except (RuntimeError, TypeError, NotImplementedError):
        return shape, dtype, None
    return shape, dtype, zlib.crc32(raw)


def fingerprint(
    plan: Any, graph_text: str, tensors: Mapping[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """What ranks compare: the plan's options, a hash of the graph text, and per tensor
    (each once, under its first name) its shape, dtype and checksum."""
    sums: dict[str, tuple] | None = None
    if tensors is not None:
        sums, seen = {}, set()
        for name, t in tensors.items():
            if id(t) not in seen:
                seen.add(id(t))
                sums[name] = _checksum(t)
    digest = hashlib.sha256(graph_text.encode()).hexdigest()
    return {"plan": _plan_options(plan), "graph": digest, "tensors": sums}


# -- naming the differences -----------------------------------------------------------------------

_ABSENT = object()


def _short(value: Any, limit: int = 60) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _per_rank(values: Sequence[Any], show=_short) -> str:
    """'rank 0: 1, rank 1: 2', ranks with equal values grouped ('ranks 0, 2: 1; ...')."""
    groups: list[tuple[Any, list[int]]] = []
    for rank, value in enumerate(values):
        for seen, ranks in groups:
            if seen is value or (seen is not _ABSENT and value is not _ABSENT and seen == value):
                ranks.append(rank)
                break
        else:
            groups.append((value, [rank]))
    parts = []
    for value, ranks in groups:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {show(value)}")
    return "; ".join(parts)


def _differ(values: Sequence[Any]) -> bool:
    first = values[0]
    return any((v is _ABSENT) != (first is _ABSENT) or v != first for v in values[1:])


def _keys(dicts: Sequence[Mapping]) -> list[str]:
    """Every key of `dicts`, in order of first appearance."""
    return list(dict.fromkeys(itertools.chain.from_iterable(dicts)))


def _plan_lines(plans: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for name in _keys(plans):
        values = [p.get(name, _ABSENT) for p in plans]
        if not _differ(values):
            continue
        if all(isinstance(v, Mapping) for v in values):  # an option group: name the field
            for sub in _keys(values):
                subs = [v.get(sub, _ABSENT) for v in values]
                if _differ(subs):
                    lines.append(f"plan.{name}.{sub}: {_per_rank(subs)}")
        else:
            lines.append(f"plan.{name}: {_per_rank(values)}")
    return lines


def _show_tensor(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    shape, dtype, crc = value
    text = f"{dtype}[{','.join(map(str, shape))}]"
    return text if crc is None else f"{text} crc32={crc:08x}"


def _tensor_lines(tables: Sequence[Mapping[str, tuple]]) -> list[str]:
    differing = []
    for name in _keys(tables):
        values = [t.get(name, _ABSENT) for t in tables]
        if _differ(values):
            differing.append((name, values))
    if not differing:
        return []
    lines = [f"{len(differing)} parameter(s) or buffer(s) differ:"]
    for name, values in differing[:SHOWN]:
        lines.append(f"  {name}: {_per_rank(values, _show_tensor)}")
    if len(differing) > SHOWN:
        lines.append(f"  ... and {len(differing) - SHOWN} more")
    return lines


def _graph_line(texts: Sequence[str]) -> str:
    """Where the first rank whose graph differs from rank 0's departs from it."""
    base = texts[0].splitlines()
    for rank, text in enumerate(texts[1:], 1):
        if text == texts[0]:
            continue
        pairs = itertools.zip_longest(base, text.splitlines(), fillvalue="(end of graph)")
        for number, (a, b) in enumerate(pairs, 1):
            if a != b:
                return f"first at line {number}: rank 0: {a.strip()!r}; rank {rank}: {b.strip()!r}"
    return "the texts differ"


def mismatch_message(prints: Sequence[Mapping], texts: Sequence[str] | None = None) -> str | None:
    """The error every rank raises for the gathered fingerprints `prints` (one per rank, in
    rank order), or None when they agree. `texts`: the graph texts, to locate a difference."""
    lines, fixes = [], []
    plan_lines = _plan_lines([p["plan"] for p in prints])
    if plan_lines:
        lines += ["the plans differ:", *(f"  {line}" for line in plan_lines)]
        fixes.append("build the same Plan on every rank")
    tables = [p["tensors"] for p in prints]
    if all(t is not None for t in tables):
        tensor_lines = _tensor_lines(tables)
        if tensor_lines:
            lines += tensor_lines
            fixes.append(
                "create the model under the same torch.manual_seed on every rank (or load the "
                "same checkpoint into it) before compiling"
            )
    if _differ([p["graph"] for p in prints]):
        where = _graph_line(texts) if texts is not None else "see fxstar.dump(engine, 'capture')"
        hashes = _per_rank([p["graph"][:12] for p in prints])
        lines.append(f"the captured graphs differ ({hashes}), {where}")
        fixes.append("run the same model code with inputs of the same shapes on every rank")
    if not lines:
        return None
    head = f"the {len(prints)} ranks compiled different programs (every rank raises this error):"
    return "\n".join([head, *lines, f"fix: {'; '.join(fixes)}"])


# -- agreeing -------------------------------------------------------------------------------------


def _all_gather(obj: Any, group: RankGroup | None, purpose: str) -> list[Any]:
    pg = host_process_group(group)
    out: list[Any] = [None] * dist.get_world_size(pg)
    with guard(f"all_gather_object ({purpose}, at compile)", group):
        dist.all_gather_object(out, obj, group=pg)
    return out


def agree(program: Any, group: RankGroup | None, *, tensors: bool = True) -> None:
    """Compare this rank's plan, captured graph and (with `tensors`) the store's parameters
    and buffers with every other rank's over `group`; raise RankMismatchError on every rank if
    they differ. Pass tensors=True only while the store holds full, replicated values (an
    engine's first compile, before any pass shards them). Marks program.decisions.tp_agreed."""
    text = program.stages[0].text if program.stages else ""
    store = program.store if tensors else None
    mine = fingerprint(program.plan, text, store.tensors() if store is not None else None)
    prints = _all_gather(mine, group, "comparing plans, graphs and parameters")
    texts = None
    if _differ([p["graph"] for p in prints]):  # every rank sees it: all exchange the texts
        texts = _all_gather(text, group, "exchanging the captured graphs")
    message = mismatch_message(prints, texts)
    if message is not None:
        raise RankMismatchError(message)
    program.decisions.tp_agreed = True
