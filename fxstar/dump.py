"""Readable text of a Program's stages, diffs between stages, and pictures of them.

Every stage prints one line per graph node, `name = target(args)  # notes`, where the notes
are the output's dtype and shape, what analysis passes wrote under `node.meta["fxstar_notes"]`
(bytes, chunk ids, ...), and the module the node came from (`@h.0.attn`). Stages keep this
text, so `dump` and `diff` work on any stage long after the graph moved on.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from fxstar.program import Program

__all__ = ["NOISE", "NOTES_KEY", "diff", "draw", "dump", "format_graph", "note", "to_dot"]

NOTES_KEY = "fxstar_notes"
"""node.meta key of a dict {label: value} that analysis passes want shown in dumps."""


def note(node: fx.Node, label: str, text: Any) -> None:
    """Show `label=text` after `node` in dumps and diffs (`fxstar.note`): how a pass says
    what it decided about a node. A later note under the same label replaces the earlier."""
    node.meta.setdefault(NOTES_KEY, {})[label] = str(text)


NOISE = frozenset(
    {
        "aten._assert_tensor_metadata",
        "aten._assert_scalar",
        "aten._assert_async",
        "aten.sym_constrain_range",
        "aten.sym_constrain_range_for_size",
    }
)
"""Targets hidden by default: runtime checks export inserts that say nothing about the model."""

_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64",
}  # fmt: skip
_LINE = re.compile(r"^    (?P<name>\w+) = (?P<target>[\w.]+)\((?P<args>.*)\)(?:  # (?P<note>.*))?$")


# -- printing -------------------------------------------------------------------------------------


def format_graph(program: Program | fx.GraphModule) -> str:
    """One line per node of the program's graph as it is now (no header)."""
    gm = program if isinstance(program, fx.GraphModule) else program.graph_module
    slots = {} if isinstance(program, fx.GraphModule) else program.placeholder_kinds()
    lines = []
    for node in gm.graph.nodes:
        lines.append(_format_node(node, slots))
        lines += ["    " + line for line in _body_of(gm, node)]
    return "\n".join(lines) + "\n"


def _body_of(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The lines of a submodule graph a call_function node runs (a checkpoint region),
    printed indented under the call."""
    if node.op != "call_function":
        return []
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(gm, str(arg.target), None)
            if isinstance(sub, fx.GraphModule):
                return format_graph(sub).splitlines()
    return []


def _format_node(node: fx.Node, slots: dict) -> str:
    if node.op == "placeholder":
        slot = slots.get(node.name)
        kind = slot.kind if slot is not None else "input"
        call = f"{kind}({(slot.target if slot and slot.target else node.target)!r})"
    elif node.op == "output":
        return f"    return {_format_arg(node.args[0])}"
    elif node.op == "get_attr":
        call = f"self.{node.target}"
    elif node.op == "call_module":
        call = f"self.{node.target}({_format_args(node)})"
    elif node.op == "call_method":
        call = f"{_format_arg(node.args[0])}.{node.target}({_format_args(node, skip=1)})"
    else:
        call = f"{target_name(node.target)}({_format_args(node)})"
    notes = _notes(node)
    return f"    {node.name} = {call}" + (f"  # {notes}" if notes else "")


def target_name(target: Any) -> str:
    """Short name of a call target: 'aten.linear', 'aten.add.Tensor', 'getitem', 'mod.fn'."""
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
        return name[: -len(".default")] if name.endswith(".default") else name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    if module in ("_operator", "operator", "builtins", ""):
        return qualname
    if module.startswith("fxstar.runtime."):  # fxstar's own graph ops: 'ops.fetch'
        module = module.rsplit(".", 1)[-1]
    return f"{module}.{qualname}"


def _format_args(node: fx.Node, skip: int = 0) -> str:
    parts = [_format_arg(a) for a in node.args[skip:]]
    parts += [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
    return ", ".join(parts)


def _format_arg(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, tuple):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"({inner},)" if len(arg) == 1 else f"({inner})"
    if isinstance(arg, list):
        return "[" + ", ".join(_format_arg(a) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_format_arg(v)}" for k, v in arg.items()) + "}"
    if isinstance(arg, torch.dtype):
        return str(arg)
    if isinstance(arg, torch.device):
        return repr(str(arg))
    if isinstance(arg, slice):
        return f"slice({_format_arg(arg.start)}, {_format_arg(arg.stop)}, {_format_arg(arg.step)})"
    return repr(arg)


def format_value(value: Any) -> str:
    """'f32[2,16,32]' for a tensor (or tensor metadata), tuples in parentheses, '' if unknown."""
    if isinstance(value, torch.Tensor) or hasattr(value, "shape") and hasattr(value, "dtype"):
        dtype = _DTYPES.get(value.dtype, str(value.dtype).removeprefix("torch."))
        return f"{dtype}[{','.join(str(s) for s in value.shape)}]"
    if isinstance(value, list | tuple):
        inner = [format_value(v) for v in value]
        return "(" + ", ".join(i or "-" for i in inner) + ")" if any(inner) else ""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool | int | float):
        return str(value)
    return ""


def _notes(node: fx.Node) -> str:
    parts = []
    value = format_value(node.meta.get("val", node.meta.get("tensor_meta")))
    if value and node.op != "output":
        parts.append(value)
    for key, note in node.meta.get(NOTES_KEY, {}).items():
        parts.append(f"{key}={note}")
    stack = node.meta.get("nn_module_stack")
    if stack and node.op not in ("placeholder", "output"):
        path = list(stack.values())[-1][0]
        if path:
            parts.append(f"@{path}")
    return " ".join(parts)


# -- dump and diff --------------------------------------------------------------------------------


def _program(x: Any) -> Program:
    from fxstar.program import Program

    if isinstance(x, Program):
        return x
    program = getattr(x, "program", None)
    if isinstance(program, Program):
        return program
    raise TypeError(f"expected an Engine or a Program, got {type(x).__name__}")


def _is_noise(line: str) -> bool:
    match = _LINE.match("    " + line.lstrip())  # region bodies are indented deeper
    return match is not None and match["target"] in NOISE


def dump(x: Any, stage: int | str | None = None, *, show_noise: bool = False) -> str:
    """Text of one stage (default: the last) of an Engine's or Program's history.

    The header names the stage and the passes before it; noise such as
    `_assert_tensor_metadata` is hidden unless `show_noise`.
    """
    program = _program(x)
    index, st = program.stage(stage)
    header = f"# stage {index}: {st.name}" + (f" (after {', '.join(st.after)})" if st.after else "")
    lines = [line for line in st.text.splitlines() if show_noise or not _is_noise(line)]
    return "\n".join([header, *lines]) + "\n"


def diff(
    x: Any,
    a: int | str,
    b: int | str,
    *,
    color: bool | None = None,
    context: int = 3,
    show_noise: bool = False,
) -> str:
    """Unified diff between stages `a` and `b` ('' when equal).

    `color=None` colours only when stdout is a terminal.
    """
    program = _program(x)
    (ia, sa), (ib, sb) = program.stage(a), program.stage(b)
    body_a = dump(program, ia, show_noise=show_noise).splitlines()[1:]
    body_b = dump(program, ib, show_noise=show_noise).splitlines()[1:]
    lines = list(
        difflib.unified_diff(
            body_a,
            body_b,
            fromfile=f"stage {ia}: {sa.name}",
            tofile=f"stage {ib}: {sb.name}",
            n=context,
            lineterm="",
        )
    )
    if color is None:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    if color:
        lines = [_colour(line) for line in lines]
    return "\n".join(lines) + ("\n" if lines else "")


def _colour(line: str) -> str:
    if line.startswith(("+++", "---")):
        code = "1"
    elif line.startswith("+"):
        code = "32"
    elif line.startswith("-"):
        code = "31"
    elif line.startswith("@@"):
        code = "36"
    else:
        return line
    return f"\033[{code}m{line}\033[0m"


# -- pictures -------------------------------------------------------------------------------------


def to_dot(x: Any, stage: int | str | None = None, *, show_noise: bool = False) -> str:
    """Graphviz DOT source of a stage, built from its text (no graphviz needed)."""
    program = _program(x)
    index, st = program.stage(stage)
    out = [
        "digraph fxstar {",
        f'  label="stage {index}: {st.name}"; labelloc=t;',
        '  node [shape=box, fontname="monospace", fontsize=10];',
    ]
    known: set[str] = set()
    for line in dump(program, index, show_noise=show_noise).splitlines()[1:]:
        match = _LINE.match(line)
        if match is None:
            if line.startswith("    return "):  # not a region body's return
                out.append('  "output" [shape=oval];')
                out += [f'  "{u}" -> "output";' for u in _names_in(line, known)]
            continue
        name = match["name"]
        note = f"\\n{_esc(match['note'])}" if match["note"] else ""
        label = f"{name}\\n{match['target']}{note}"
        out.append(f'  "{name}" [label="{label}"];')
        out += [f'  "{u}" -> "{name}";' for u in _names_in(match["args"], known)]
        known.add(name)
    out.append("}")
    return "\n".join(out) + "\n"


def _names_in(text: str, known: set[str]) -> list[str]:
    seen = []
    for token in re.findall(r"\b\w+\b", re.sub(r"'[^']*'", "", text)):
        if token in known and token not in seen:
            seen.append(token)
    return seen


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def draw(x: Any, stage: int | str | None = None, path: str | os.PathLike = "graph.svg") -> str:
    """Write an SVG picture of a stage through graphviz; returns the path written.

    Needs the `graphviz` Python package (`pip install fxstar[viz]`) and Graphviz's `dot`.
    """
    try:
        import graphviz
    except ImportError as error:
        raise ImportError(
            "fxstar.draw needs the graphviz Python package: pip install fxstar[viz] "
            "(and the Graphviz system binary `dot`, e.g. apt install graphviz)"
        ) from error
    source = graphviz.Source(to_dot(x, stage))
    try:
        svg = source.pipe(format="svg")
    except graphviz.ExecutableNotFound as error:
        raise ImportError(
            "fxstar.draw found the graphviz package but not the Graphviz system binary `dot`: "
            "install Graphviz (apt install graphviz / brew install graphviz)"
        ) from error
    with open(path, "wb") as file:
        file.write(svg)
    return os.fspath(path)
