"""tensor_parallel: split the model across the ranks of the process group, as tp_sharding
decided.

Each column/row linear becomes a call to `fxstar.runtime.tp_ops.column_linear`/`row_linear` on
this rank's weight shard (the store derives the shard; `engine.state_dict()` all-gathers it
back, so call it on every rank); shape arguments between them get per-rank head counts; with
sequence parallelism the edges tp_sharding found get `scatter_to_seq`, `gather_from_seq` and
`grad_all_reduce` nodes. Every collective is a graph node, so `fxstar.dump`/`diff` show it.

The collectives run on the engine's tensor-parallel group (`Program.topology`, named by
`group=` in the nodes), which the topology makes at the first compile, where the ranks agree
on plan, graph and (first compile: full, unsharded) parameters before any pass
(`Topology.agree`; a program captured outside an engine agrees here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from fxstar.dump import note
from fxstar.passes import Pass, register
from fxstar.passes.tp_sharding import LinearSite, Sharding, TPShardingError
from fxstar.program import Program
from fxstar.runtime import rng_tracker, tp_ops
from fxstar.runtime import vocab_parallel as vp
from fxstar.runtime.rank_group import ATTR, RankGroup, process_group

__all__ = ["TensorParallel", "shard_of", "unshard"]


def shard_of(full: torch.Tensor, dim: int, parts: int, n: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full` along `dim`; a fused tensor (q, k, v stacked along `dim`)
    gives each rank its slice of every part."""
    return full.unflatten(dim, (parts, -1)).chunk(n, dim + 1)[rank].flatten(dim, dim + 1)


def unshard(shards: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The inverse of `shard_of` over every rank's shard."""
    pieces = [s.unflatten(dim, (parts, -1)) for s in shards]
    return torch.cat(pieces, dim + 1).flatten(dim, dim + 1)


def _consolidate(dim: int, parts: int, group: RankGroup):
    def glue(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (shard,) = tensors.values()
        return unshard(tp_ops.gather_shards(shard.detach(), group), dim, parts)

    return glue


def _group_node(gm: fx.GraphModule, group: RankGroup) -> fx.Node:
    """The graph's get_attr of the group its collectives run on, added as its submodule."""
    gm.add_submodule(ATTR, group)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        return gm.graph.get_attr(ATTR)


def _local_val(val: Any, dim: int, n: int) -> Any:
    """The node's value metadata with `dim` split n ways (dumps show per-rank shapes)."""
    if isinstance(val, list | tuple):
        return type(val)(_local_val(v, dim, n) for v in val)
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return val
    shape = list(val.shape)
    shape[dim] //= n
    return _shaped_val(val, tuple(shape))


@register
class TensorParallel(Pass):
    """Rewrite: sharded linears, per-rank shapes and collectives as graph nodes."""

    name = "tensor_parallel"
    phase = "shard"  # first: every later pass and analysis sees per-rank tensors
    rewrites = True
    requires = ("tp_sharding",)
    implements = ("tensor_parallel", "mem_saving_comm", "dist_timeout")
    tolerance = (1e-5, 1e-6)

    def enabled_by(self, plan: Any) -> bool:
        return plan.tensor_parallel is not None and plan.tensor_parallel.size > 1

    def __call__(self, program: Program) -> Program:
        config = program.plan.tensor_parallel
        if not dist.is_available() or not dist.is_initialized():
            raise TPShardingError(
                "tensor_parallel needs a process group: call "
                "torch.distributed.init_process_group first (torchrun sets it up)"
            )
        if not program.decisions.tp_agreed:  # captured outside an engine, which agrees first
            program.topology.agree(program)
        group = program.topology.tensor_group
        ranks = dist.get_world_size(process_group(group))
        if ranks != config.size:
            raise TPShardingError(
                f"plan.tensor_parallel.size is {config.size} but the engine's tensor-parallel "
                f"group has {ranks} ranks; they must be equal"
            )
        if program.plan.verify:
            raise TPShardingError(
                "plan.verify compares each stage with a single-process run on full tensors; a "
                "tensor-parallel program computes on shards: turn verify off (compare the "
                "consolidated gradients, store.consolidate_grads, with the model's instead)"
            )
        if program.store is None:
            raise TPShardingError("tensor_parallel needs an engine's ParameterStore (compile)")
        sharding: Sharding = program.decisions.tp_sharding
        if rng_tracker.new_stream_needed(group):  # collective: every rank, once a group
            rng_tracker.new_stream(group)
        _Rewrite(program, sharding, config, program.plan.mem_saving_comm, group).run()
        return program


class _Rewrite:
    def __init__(
        self, program: Program, sharding: Sharding, config: Any, mem_saving: bool, group: str
    ):
        self.program = program
        self.sharding = sharding
        self.graph = program.graph_module.graph
        self.nodes = {node.name: node for node in self.graph.nodes}
        # the rank within the tensor-parallel group: on a 2-D mesh not the global one
        self.n, self.rank = config.size, dist.get_rank(process_group(group))
        self.sp = config.sequence_parallel
        self.async_comm = config.async_communication
        # measured (benchmarks/tp.py): overlapped with grad_input the re-gather costs no time
        # and saves (N-1)/N of each gathered input; in sync mode it is a step of its own
        recompute = config.recompute_allgather
        self.recompute = config.async_communication if recompute is None else recompute
        self.mem_saving = mem_saving
        self.group = group
        self.group_node = _group_node(program.graph_module, group)  # what the nodes name

    def run(self) -> None:
        s = self.sharding
        self.full_vals = old_vals = {n: node.meta.get("val") for n, node in self.nodes.items()}
        for name, args in s.args.items():
            self.nodes[name].args = args
        for name, dim in s.sharded.items():
            self.nodes[name].meta["val"] = _local_val(old_vals[name], dim, self.n)
        for name in s.seq_nodes:
            self.nodes[name].meta["val"] = _local_val(old_vals[name], -2, self.n)
        for name, dim in s.split_params.items():
            self._split_param(name, dim)
        for site in s.sites:
            self._replace_site(site)
        for name, how in s.reduced.items():
            if how in ("rms_norm", "layer_norm"):
                self._norm(name, how)
            else:
                self._all_reduce(name, how)
        if s.vocab is not None:
            self._vocab(s.vocab)
        self._boundaries(s.scatters, tp_ops.scatter_to_seq, "scatter")
        self._boundaries(s.gathers, tp_ops.gather_from_seq, "gather")
        self._boundaries(s.grad_reduces, tp_ops.grad_all_reduce, "grad_reduce")
        self._random_streams(s)

    # -- linears --------------------------------------------------------------------------------

    def _shard_param(self, node_name: str, param: str, dim: int, parts: int) -> fx.Node:
        """Feed this rank's shard of `param` through a new placeholder."""
        n, rank = self.n, self.rank
        parts_made = self.program.store.derive(
            param,
            lambda full: {"": shard_of(full, dim, parts, n, rank)},
            _consolidate(dim, parts, self.group),
        )
        (full_name,) = parts_made
        self.sharding.splits[full_name] = (dim, parts)
        old = self.nodes[node_name]
        new = self.program.add_input("parameter", full_name, f"{old.name}_tp")
        new.meta.update(old.meta)
        new.meta["val"] = _local_val(old.meta.get("val"), dim, n)
        note(new, "tp", f"shard(dim={dim}{f', parts={parts}' if parts > 1 else ''})")
        info = self.program.param(node_name)
        info.placeholders = tuple(new.name if p == old.name else p for p in info.placeholders)
        info.shape = tuple(new.meta["val"].shape)
        return new

    def _split_param(self, name: str, dim: int) -> None:
        """A parameter read by split work outside a linear (a norm weight over a sharded
        projection, Mamba's A_log): this rank's slice fed in its place."""
        old = self.nodes[name]
        new = self._shard_param(name, self.program.placeholder_kinds()[name].target, dim, 1)
        old.replace_all_uses_with(new)
        self.program.remove_input(old)
        self.nodes[name] = new

    def _collective(self, fn, x: fx.Node, name: str) -> fx.Node:
        kwargs = {"mem_saving": self.mem_saving, "group": self.group_node}
        return self.graph.create_node("call_function", fn, (x,), kwargs, name=name)

    def _norm(self, name: str, how: str) -> None:
        """A norm over the split last dim, in aten ops: each statistic the mean of the ranks'
        means (all-reduced; its gradient, partial on each rank, summed where split work
        reads it), computed in fp32 as torch's norms compute, weight and bias split."""
        node = self.nodes[name]
        aten, g = torch.ops.aten, self.graph
        layer = how == "layer_norm"
        x = node.args[0]
        weight = node.args[2] if len(node.args) > 2 else None
        bias = node.args[3] if layer and len(node.args) > 3 else None
        eps = node.args[4 if layer else 3] if len(node.args) > (4 if layer else 3) else None
        val = x.meta["val"]
        if eps is None:
            eps = 1e-5 if layer else torch.finfo(val.dtype).eps
        full, stat, f32 = tuple(val.shape), (*val.shape[:-1], 1), torch.float32
        made: list[tuple[fx.Node, tuple, torch.dtype]] = []

        def op(fn, *args, shape=full, dtype=f32, name=None) -> fx.Node:
            new = g.create_node("call_function", fn, args, name=name)
            made.append((new, shape, dtype))
            return new

        def across(local: fx.Node, label: str) -> fx.Node:
            total = self._collective(tp_ops.all_reduce_forward, local, f"all_reduce_{label}")
            mean = op(aten.div.Tensor, total, self.n, shape=stat)
            summed = self._collective(tp_ops.grad_all_reduce, mean, f"grad_reduce_{label}")
            made.extend(((total, stat, f32), (summed, stat, f32)))
            return summed

        with g.inserting_before(node):
            xf = op(aten.to.dtype, x, f32)
            centred = xf
            if layer:
                mu = across(op(aten.mean.dim, xf, [-1], True, shape=stat), f"mean_{name}")
                centred = op(aten.sub.Tensor, xf, mu)
            square = op(aten.pow.Tensor_Scalar, centred, 2)
            var = across(op(aten.mean.dim, square, [-1], True, shape=stat), f"var_{name}")
            inv = op(aten.rsqrt.default, op(aten.add.Tensor, var, eps, shape=stat), shape=stat)
            out = op(aten.to.dtype, op(aten.mul.Tensor, centred, inv), val.dtype, dtype=val.dtype)
            for param, fn in ((weight, aten.mul.Tensor), (bias, aten.add.Tensor)):
                if isinstance(param, fx.Node):
                    out = op(fn, out, param, dtype=node.meta["val"].dtype)
        for new, shape, dtype in made:
            new.meta["val"] = _shaped_val(val, shape, dtype)
            new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            note(new, "tp", f"{how} across ranks")
        node.replace_all_uses_with(out)
        g.erase_node(node)
        self.nodes[name] = out

    def _all_reduce(self, name: str, how: str) -> None:
        """A sum or mean over the split dim: each rank's partial, all-reduced (a mean of
        equal parts is the mean of the ranks' means). Its backward is the identity: readers
        split by rank sum their gradients at their grad_reduce edges, replicated readers
        hand every rank the whole gradient."""
        node = self.nodes[name]
        kwargs = {"mem_saving": self.mem_saving, "group": self.group_node}
        with self.graph.inserting_after(node):
            total = self.graph.create_node(
                "call_function",
                tp_ops.all_reduce_forward,
                (node,),
                kwargs,
                name=f"all_reduce_{name}",
            )
        last = total
        if how == "mean":
            with self.graph.inserting_after(total):
                last = self.graph.create_node(
                    "call_function", torch.ops.aten.div.Tensor, (total, self.n),
                    name=f"mean_of_{name}",
                )  # fmt: skip
        for new in {total, last}:
            new.meta["val"] = self.full_vals[name]
            new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        note(total, "tp", f"all-reduce({how})")
        node.replace_all_uses_with(last, delete_user_cb=lambda user: user is not total)
        self.nodes[name] = last  # edges name the reduction: they mean its all-reduced value

    def _replace_site(self, site: LinearSite) -> None:
        column = site.style == "column"
        # column: split the output features, row: the input features; nn.Linear stores
        # [out, in], Conv1D [in, out]
        wdim = int(column == site.transposed)
        weight = self._shard_param(site.weight, site.weight_name, wdim, site.parts)
        bias = self.nodes[site.bias] if site.bias else None
        if bias is not None and column:
            bias = self._shard_param(site.bias, site.bias_name, 0, site.parts)
        x = self.nodes[site.input]
        out = self.nodes[site.output]
        kwargs = {"sequence_parallel": self.sp, "async_comm": self.async_comm}
        if column:
            kwargs["recompute"] = self.recompute
        kwargs.update(mem_saving=self.mem_saving, transposed=site.transposed, group=self.group_node)
        fn = tp_ops.column_linear if column else tp_ops.row_linear
        with self.graph.inserting_before(out):
            name = f"{site.style}_{site.module.replace('.', '_')}"
            new = self.graph.create_node("call_function", fn, (x, weight, bias), kwargs, name=name)
        new.meta["nn_module_stack"] = out.meta.get("nn_module_stack", {})
        val = self.full_vals[site.output]
        if column:
            new.meta["val"] = _local_val(val, -1, self.n)
        elif self.sp:
            new.meta["val"] = _local_val(val, -2, self.n)
        else:
            new.meta["val"] = val
        note(new, "tp", site.style + (f"x{site.parts}" if site.parts > 1 else ""))
        out.replace_all_uses_with(new)
        for node_name in reversed(site.nodes):
            self.graph.erase_node(self.nodes[node_name])
        self.nodes[site.output] = new  # edges name the site's output: they mean the new node
        for placeholder in (site.weight, site.bias if column else None):
            node = self.nodes.get(placeholder) if placeholder else None
            if node is not None and not node.users:
                self.program.remove_input(node)

    # -- the vocabulary: embeddings on the head's shard, the loss on the logits' shards --------

    def _vocab(self, vocab) -> None:
        kwargs = {"mem_saving": self.mem_saving, "group": self.group_node}
        head = self.nodes[vocab.head]  # the column_linear that replaced the head
        head_weight = head.args[1]
        slots = self.program.placeholder_kinds()
        for name in vocab.embeddings:
            node = self.nodes[name]
            weight = node.args[0]
            if weight.name == self.sharding.site(vocab.head).weight:  # tied: the head's shard
                shard = head_weight
            else:
                shard = self._shard_param(weight.name, slots[weight.name].target, 0, 1)
            padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            node.target, node.args, node.kwargs = (
                vp.vocab_embedding,
                (shard, node.args[1], padding_idx),
                kwargs,
            )
            note(node, "tp", "vocab-parallel")
            if name in vocab.scattered:  # summed and cut into token blocks at once
                node.kwargs = {**kwargs, "sequence_parallel": True}
                node.meta["val"] = _local_val(self.full_vals[name], -2, self.n)
                note(node, "tp", "vocab-parallel, reduce-scatter")
            if not weight.users:
                self.program.remove_input(weight)
        loss = self.nodes[vocab.loss]
        loss.target, loss.kwargs = vp.vocab_cross_entropy, {**loss.kwargs, **kwargs}
        for name in vocab.returned:
            producer = self.nodes[name]
            output = next(u for u in producer.users if u.op == "output")
            with self.graph.inserting_before(output):
                gathered = self.graph.create_node(
                    "call_function",
                    vp.gather_from_vocab,
                    (producer,),
                    kwargs,
                    name=f"gather_{name}",
                )
            gathered.meta["val"] = self.full_vals[name]
            note(gathered, "tp", "gather(vocab)")
            output.replace_input_with(producer, gathered)

    # -- dropout: this rank's stream on splits, the shared one's mask sliced on sequences -----

    def _random_streams(self, s: Sharding) -> None:
        for name in s.rank_random:
            node = self.nodes[name]
            dropout = node.target is torch.ops.aten.dropout.default
            node.target = rng_tracker.rank_dropout if dropout else rng_tracker.rank_attention
            node.kwargs = {**node.kwargs, "group": self.group_node}
            note(node, "rng", "rank stream")
        for name in s.seq_random:
            node = self.nodes[name]
            node.target = rng_tracker.seq_dropout
            node.kwargs = {**node.kwargs, "group": self.group_node}
            note(node, "rng", "sequence mask, own block")

    # -- collectives at the edges of the sequence-sharded region ---------------------------------

    def _boundaries(self, edges, fn, label: str) -> None:
        made: dict[tuple, fx.Node] = {}
        order = {node: i for i, node in enumerate(self.graph.nodes)}
        for edge in sorted(edges, key=lambda e: order[self.nodes[e.consumer]]):
            producer, consumer = self.nodes[edge.producer], self.nodes[edge.consumer]
            args: tuple = (producer,)
            if label == "scatter":  # the block is cut from the tokens' shape
                args = (producer, self._token_shape(edge))
            new = made.get(args)
            if new is None:
                kwargs = {"mem_saving": self.mem_saving, "group": self.group_node}
                with self.graph.inserting_before(consumer):
                    new = self.graph.create_node(
                        "call_function", fn, args, kwargs, name=f"{label}_{producer.name}"
                    )
                new.meta["nn_module_stack"] = consumer.meta.get("nn_module_stack", {})
                val = producer.meta.get("val")
                if label == "scatter":
                    val = _shaped_val(val, _local_shape(args[1] or val.shape, self.n))
                elif label == "gather":
                    val = _shaped_val(val, tp_ops.full_shape(val.shape, self.n))
                new.meta["val"] = val
                note(new, "tp", label)
                made[args] = new
            consumer.replace_input_with(producer, new)

    def _token_shape(self, edge) -> tuple[int, ...] | None:
        """What a replicated tensor broadcasts to among the consumer's tokens (every dim but
        the features), None when it is its own shape: a rank's token block is cut from it."""
        own = tuple(self.full_vals[edge.producer].shape)
        tokens = tuple(self.full_vals[edge.consumer].shape[:-1])
        shape = (*torch.broadcast_shapes(own[:-1], tokens), own[-1])
        return None if shape == own else shape


def _local_shape(shape: Any, n: int) -> tuple[int, ...]:
    local = list(shape)
    local[-2] //= n
    return tuple(local)


def _shaped_val(val: Any, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Any:
    """`val`'s metadata with shape `shape` (a scatter's block, a gather's full tensor), and
    `dtype` when given."""
    if not isinstance(val, torch.Tensor):
        return val
    dtype = dtype or val.dtype
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    with mode:
        return torch.empty(shape, dtype=dtype, device=val.device)
