"""The engine's process groups under a backend without host tensors (NCCL).

No GPU runs here, so the world is gloo made to look like NCCL: `dist.get_backend()` says
"nccl" (rank_group then makes each group's gloo side group beside it), and every collective
refuses host tensors and pickled objects on the groups made for the device backend, as NCCL
does. A data-parallel (sharded, clipped, saved and loaded) and a tensor-parallel engine then
train; any collective left on the device group fails the run, naming itself. The losses are
the plain gloo run's, bitwise (the side group changes where a collective runs, not what it
sums).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from conftest import SEQ, VOCAB

import fxstar
from fxstar.dist_launch import spawn
from fxstar.plan import Plan

COLLECTIVES = (
    "all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast", "reduce", "send",
    "recv", "all_gather", "all_gather_object", "broadcast_object_list", "gather_object",
)  # fmt: skip
OBJECTS = {"all_gather_object", "broadcast_object_list", "gather_object"}
PLANS = {
    "data parallel": {"chunk_size": 4096, "device_memory": "auto", "dist_timeout": 30,
                      "optimizer": {"type": "adamw", "clip_grad_norm": 1.0}},
    "tensor parallel": {"tensor_parallel": {"size": 2}, "dist_timeout": 30,
                        "optimizer": {"type": "adamw", "clip_grad_norm": 1.0}},
}  # fmt: skip


def _host_data(args: tuple, kwargs: dict) -> bool:
    """Whether a collective's tensors (or lists of them) include a host tensor."""
    found = [*args, *kwargs.values()]
    tensors = [t for x in found for t in (x if isinstance(x, list | tuple) else [x])
               if isinstance(t, torch.Tensor)]  # fmt: skip
    return any(t.device.type == "cpu" for t in tensors)


def _as_if_nccl(refused: list[str]) -> None:
    """This process's torch.distributed as under NCCL: groups made for the default backend
    take no host tensor and no object."""
    device_groups: set = set()
    new_group = dist.new_group

    def made(*args, backend=None, **kwargs):
        pg = new_group(*args, backend=backend, **kwargs)
        if backend is None:
            device_groups.add(pg)
        return pg

    def refusing(name, collective):
        @functools.wraps(collective)
        def call(*args, **kwargs):
            pg = kwargs.get("group")
            if pg in device_groups and (name in OBJECTS or _host_data(args, kwargs)):
                refused.append(name)
                raise RuntimeError(f"(as NCCL) {name}: no host tensors or objects on this group")
            return collective(*args, **kwargs)

        return call

    dist.new_group = made
    get_backend = dist.get_backend
    dist.get_backend = lambda group=None: (
        "nccl" if group is None or group in device_groups else get_backend(group)
    )
    for name in COLLECTIVES:
        setattr(dist, name, refusing(name, getattr(dist, name)))


def _train(name: str, rank: int, world: int, directory: str) -> list[float]:
    from fxstar.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))
    g = torch.Generator().manual_seed(rank if name == "data parallel" else 0)  # TP: one batch
    data = [(torch.randint(0, VOCAB, (2, SEQ), generator=g),
             torch.randint(0, VOCAB, (2, SEQ), generator=g)) for _ in range(3)]  # fmt: skip
    engine = fxstar.compile(model, Plan.from_dict(PLANS[name]), example_inputs=data[0])
    losses = []
    for step, (ids, targets) in enumerate(data):
        loss = engine(ids, targets)
        loss.backward()
        engine.step()
        losses.append(loss.item())
        if step == 1:
            engine.save(f"{directory}/{name.replace(' ', '_')}")
            engine.load(f"{directory}/{name.replace(' ', '_')}")
    engine.close()
    return losses


def _worker(rank: int, world: int, directory: str, nccl: bool) -> dict:
    refused: list[str] = []
    if nccl:
        _as_if_nccl(refused)
    out = {}
    for name in PLANS:
        try:
            out[name] = _train(name, rank, world, f"{directory}/{int(nccl)}")
        except Exception as error:
            out[name] = f"{type(error).__name__}: {error}"
    return {"runs": out, "refused": refused}


def test_host_collectives_run_on_the_gloo_side_group_under_nccl(tmp_path):
    plain = spawn(_worker, 2, str(tmp_path), False)
    nccl = spawn(_worker, 2, str(tmp_path), True)
    for rank in range(2):
        assert nccl[rank]["refused"] == [], nccl[rank]
        for name in PLANS:
            got, want = nccl[rank]["runs"][name], plain[rank]["runs"][name]
            assert isinstance(want, list), want
            assert got == want, f"rank {rank}, {name}: {got} != {want}"
