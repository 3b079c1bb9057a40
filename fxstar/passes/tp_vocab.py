"""tp_vocab: find the LM head that feeds the cross-entropy and the embeddings over the same
vocabulary, to shard them along the vocabulary (part of tp_sharding's decision).

Why: replicated, the head's logits [tokens, V] are often a step's largest activation, and
every rank holds the whole V x hidden matrix (twice when untied). Sharded, each rank holds
V/N rows and V/N logits per token; the cross-entropy runs on the shards
(`fxstar.runtime.vocab_parallel`). Automatic when the pattern is exact: one
`cross_entropy_loss` whose logits come from a linear through views, casts and per-element
ops of the logits alone (Cohere's logit scale, a soft cap), no class
weights or label smoothing, V divisible by the ranks. Anything else keeps the head whole and
says why (`VocabParallel` is then None and `Sharding.vocab_off` holds the reason); a plan rule
'replicate' on the head's module turns it off, 'column' demands it (then a misfit is an error
naming the node).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import fx

from fxstar.passes.tp_rules import (
    ELEMENTWISE,
    UNARY,
    VIEWS,
    Call,
    Refusal,
    Shard,
    TPShardingError,
    module_path,
    op_name,
    passive,
    rule_for,
    static_shape,
)
from fxstar.program import Program

__all__ = ["VocabParallel", "find_vocab"]

# what may sit between the head and the loss: views, casts, per-element ops of the logits
# alone (a scale, a soft cap: the same on every shard); dropout draws per rank, so not it
_CHAIN = VIEWS | UNARY | (ELEMENTWISE - {"dropout"})


@dataclass
class VocabParallel:
    """The head, the loss and the embeddings tp_sharding shards along the vocabulary."""

    head: str  # the head's linear node (its LinearSite, rule 'vocab', is in Sharding.sites)
    loss: str  # the cross_entropy_loss node, run on the logits' shards
    vocab: int
    tied: bool  # the head's weight is an embedding's too: one shard feeds both
    embeddings: list[str] = field(default_factory=list)  # aten.embedding nodes over V rows
    chain: list[str] = field(default_factory=list)  # views/casts head -> loss, split on V
    returned: list[str] = field(default_factory=list)  # chain nodes the model returns whole
    split: dict[str, tuple[int, str]] = field(default_factory=dict)  # chain: (dim, tp_rules rule)
    args: dict[str, tuple] = field(default_factory=dict)  # chain: args with per-rank sizes
    # embeddings read only on sequence-parallel token blocks: one reduce-scatter sums the
    # ranks' rows and hands each its block (no all-reduce, then a scatter)
    scattered: list[str] = field(default_factory=list)


def _plan_style(path: str, rules: dict[str, str]) -> tuple[str, str] | None:
    for pattern, style in rules.items():
        if fnmatch.fnmatchcase(path, pattern):
            return style, pattern
    return None


def _is_embedding_of(node: fx.Node, weight: fx.Node) -> bool:
    """aten.embedding(weight, ids) without sparse or frequency-scaled gradients."""
    if op_name(node) != "embedding" or node.args[0] is not weight:
        return False
    scale = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq", False)
    sparse = node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False)
    return not scale and not sparse


def find_vocab(program: Program, rules: dict[str, str], n: int) -> tuple[VocabParallel | None, str]:
    """(the vocab-parallel decision, '') or (None, why the head stays whole)."""
    graph = program.graph_module.graph
    losses = [node for node in graph.nodes if op_name(node) == "cross_entropy_loss"]
    if len(losses) != 1:
        return None, f"{len(losses)} cross_entropy_loss nodes (vocab-parallel needs one)"
    loss = losses[0]
    chain: list[fx.Node] = []
    x = loss.args[0]
    while isinstance(x, fx.Node) and op_name(x) in _CHAIN and len(x.all_input_nodes) == 1:
        chain.append(x)
        x = x.args[0]
    head = x
    if not isinstance(head, fx.Node) or op_name(head) != "linear":
        return None, (f"the logits of {loss.name} do not come from a linear through views "
                      "and per-element ops")  # fmt: skip
    path = module_path(head)
    chosen = _plan_style(path, rules)
    if chosen is not None and chosen[0] == "replicate":
        return None, f"plan rule {chosen[1]!r}: 'replicate' keeps the head {path} whole"
    if chosen is not None and chosen[0] == "row":
        raise TPShardingError(
            f"the LM head {head.name} at {path} feeds cross_entropy_loss {loss.name}: it can "
            f"be split by vocabulary ('column') or kept whole ('replicate'), not 'row'"
        )
    demanded = chosen is not None  # 'column': a misfit is an error, not a reason

    def off(why: str) -> tuple[None, str]:
        if demanded:
            raise TPShardingError(
                f"vocab-parallel head {head.name} at {path} (plan rule {chosen[1]!r}: "
                f"'column'): {why}.\n  fix: rules={{{chosen[1]!r}: 'replicate'}} keeps it whole"
            )
        return None, f"head {head.name} at {path}: {why}"

    if program.plan.cpu_embedding:
        return off("cpu_embedding keeps the embedding on the host, whole")
    defaults = (None, 1, -100, 0.0)  # weight, reduction, ignore_index, label_smoothing
    given = (*loss.args[2:], *defaults[len(loss.args) - 2 :])
    weight = loss.kwargs.get("weight", given[0])
    if weight is not None or loss.kwargs.get("label_smoothing", given[3]):
        return off(f"{loss.name} has class weights or label smoothing")
    logits_shape, target_shape = static_shape(loss.args[0]), static_shape(loss.args[1])
    if len(logits_shape or ()) != 2 or len(target_shape or ()) != 1:
        return off(f"{loss.name} reads logits {logits_shape} and targets {target_shape}, "
                   "not [tokens, classes] and [tokens]")  # fmt: skip
    slots = program.placeholder_kinds()
    w = head.args[1]
    slot = slots.get(w.name) if isinstance(w, fx.Node) else None
    if slot is None or slot.kind != "parameter":
        return off(f"its weight {w} is not a parameter")
    vocab, hidden = static_shape(w)
    if vocab % n:
        return off(f"the vocabulary ({vocab}) is not divisible by tensor_parallel.size={n}")
    others = [u for u in w.users if u is not head]
    if any(not _is_embedding_of(u, w) for u in others):
        return off(f"its weight is also read by {[u.name for u in others]}")
    decision = VocabParallel(head=head.name, loss=loss.name, vocab=vocab, tied=bool(others))
    decision.embeddings = [u.name for u in others]
    # untied: the embeddings over a matrix of the same [V, hidden] (not positions)
    for node in graph.nodes:
        m = node.args[0] if op_name(node) == "embedding" else None
        if m is None or m is w or not isinstance(m, fx.Node):
            continue
        if slots.get(m.name) is None or slots[m.name].kind != "parameter":
            continue
        if static_shape(m) == (vocab, hidden) and all(_is_embedding_of(u, m) for u in m.users):
            decision.embeddings.append(node.name)
    # the split carried from the head to the loss by tp_rules, and where the model returns it
    inside = {head, *chain}
    shards = {head: Shard(len(static_shape(head)) - 1)}
    for node in [head, *reversed(chain)]:
        users = [u for u in node.users if u not in inside and u is not loss and not passive(u)]
        if any(u.op != "output" for u in users):
            return off(f"its logits ({node.name}) are also read by {[u.name for u in users]}")
        if users:
            decision.returned.append(node.name)
    for node in reversed(chain):
        name, rule = rule_for(node)
        try:
            carried = rule(Call(node, n, shards))
        except Refusal as refusal:
            return off(f"{node.name} ({name}) between head and loss {refusal}")
        shards[node] = carried.shard
        decision.split[node.name] = (carried.shard.dim, name)
        if carried.args is not None:
            decision.args[node.name] = carried.args
    if shards[loss.args[0]] != Shard(1):
        return off(f"the logits {loss.args[0].name} reach {loss.name} not split by class")
    decision.chain = [node.name for node in reversed(chain)]
    return decision, ""
