"""The `fxstar` command: dump, diff, plan and train from a shell.

fxstar dump fxstar.models.gpt:tiny --passes shape_memory
fxstar diff fxstar.models.gpt:tiny capture shape_memory --passes shape_memory
fxstar plan examples/my_model.py:make --plan plan.json
fxstar train --steps 200
fxstar train examples/my_model.py:make --steps 20 --device-memory 50%
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys

from fxstar.errors import FxstarError, UsageError
from fxstar.plan import Plan
from fxstar.sizes import Share

DEVICE_MEMORY_HELP = (
    "compute-tier budget, e.g. 64MiB or 40%% (of the parameter bytes): parameters are paged "
    "through it in chunks"
)
EPILOG = """TARGET is MODULE:FACTORY: a dotted module or a .py file, and a callable in it that
returns (model, example_inputs[, plan]); example_inputs may be a dict of keyword inputs (a
transformers batch with its labels). fxstar.models.gpt:tiny is the reference GPT."""
# `fxstar train`'s GPT size: flag -> (TrainConfig field, default, default with a share as
# --device-memory). The second is `make demo`'s paged GPT: at the first size activations
# outweigh the parameters eight times over, so no share of the parameters could hold them.
SIZES = {
    "layers": ("n_layer", 4, 4),
    "heads": ("n_head", 4, 8),
    "width": ("n_embd", 128, 512),
    "batch_size": ("batch_size", 8, 2),
    "seq_len": ("seq_len", 64, 32),
}
# What a command reports in one line (exit status 2) instead of a traceback: the errors fxstar
# raises on purpose (a plan, target or flag it cannot use; an option not built yet), a path
# the user gave that is missing or not readable/writable (--plan, --data, a target file, an
# output), and a budget the machine cannot hold (the arena's MemoryError). Anything else is a
# bug, in fxstar or in the user's model, and keeps its traceback; so does a crash inside a
# pass (PassError), whose message says to report it.
REPORTED = (FxstarError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
            PermissionError, MemoryError)  # fmt: skip


def _plan(args: argparse.Namespace, base: Plan | None = None) -> Plan:
    """The plan: --plan file, else the factory's, else defaults; then command-line overrides."""
    plan = Plan.from_json(args.plan) if args.plan else (base or Plan())
    changes = {}
    if getattr(args, "passes", None):
        changes["passes"] = [*plan.passes, *(p for p in args.passes.split(",") if p)]
    if getattr(args, "lr", None) is not None:
        changes["optimizer"] = dataclasses.replace(plan.optimizer, lr=args.lr)
    if getattr(args, "device_memory", None) is not None:
        changes["device_memory"] = args.device_memory
    return plan.replace(**changes) if changes else plan


def _engine(args: argparse.Namespace, extra_passes: tuple[str, ...] = ()):
    """(engine, the user's plan, the passes this command added to it): a command's own
    passes (plan's shape_memory) are not the user's choice and are reported apart."""
    from fxstar.engine import compile
    from fxstar.targets import load_target

    target = load_target(args.target)
    plan = _plan(args, target.plan)
    added = tuple(p for p in extra_passes if p not in plan.passes)
    compiled = plan.replace(passes=[*plan.passes, *added]) if added else plan
    engine = compile(target.model, compiled, example_inputs=target.example_inputs,
                     example_kwargs=target.example_kwargs)  # fmt: skip
    return engine, plan, added


def _check_stages(engine, *keys: int | str | None) -> None:
    """Each stage named on the command line exists (else a UsageError listing them)."""
    for key in keys:
        try:
            engine.program.stage(key)
        except LookupError as error:
            raise UsageError(str(error)) from None


def cmd_dump(args: argparse.Namespace) -> None:
    from fxstar.dump import dump

    engine = _engine(args)[0]
    _check_stages(engine, args.stage)
    print(dump(engine, args.stage, show_noise=args.show_noise), end="")


def cmd_diff(args: argparse.Namespace) -> None:
    from fxstar.dump import diff

    color = {"auto": None, "always": True, "never": False}[args.color]
    engine = _engine(args)[0]
    _check_stages(engine, args.a, args.b)
    text = diff(engine, args.a, args.b, color=color)
    print(text or f"stages {args.a} and {args.b} are identical", end="" if text else "\n")


def cmd_plan(args: argparse.Namespace) -> None:
    from fxstar.estimate import format_estimate

    engine, plan, added = _engine(args, extra_passes=("shape_memory",))
    used = plan.used_options()
    print("plan: " + (", ".join(used) if used else "all defaults"))
    if added:
        print(f"(fxstar plan runs {', '.join(added)} for its estimate; not part of the plan)")
    print(format_estimate(engine.program))
    if engine.chunks is not None:
        print(engine.chunks.layout.describe())
    print(engine.report())


def cmd_train(args: argparse.Namespace) -> None:
    from fxstar.topology import Topology
    from fxstar.train import TrainConfig, res_check_gpt, train, train_target, write_json

    # everything checkable is checked before training: a mistake found after it loses the run
    for flag, path in (("--timeline", args.timeline), ("--json", args.json)):
        if path is not None:
            _check_output(flag, path)
    if args.timeline is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--timeline: needs matplotlib (pip install fxstar[viz])")
    target = None
    if args.target is not None and args.res_check:
        raise UsageError("--res-check: runs on the reference GPT; leave TARGET out")
    if args.target is not None:
        from fxstar.targets import load_target

        ignored = [f"--{f.replace('_', '-')}" for f in SIZES if getattr(args, f) is not None]
        ignored += ["--data"] if args.data is not None else []
        if ignored:
            raise UsageError(f"{', '.join(ignored)}: the reference GPT's options; TARGET's "
                             "factory makes its own model and inputs")  # fmt: skip
        target = load_target(args.target)
    plan = _plan(args, target.plan if target is not None else None)
    if args.timeline is not None and not Topology(plan).uses_chunks:
        raise UsageError("--timeline: draws the chunk engine's memory; give --device-memory")
    if target is not None:
        result = train_target(target, plan, steps=args.steps, log_every=args.log_every,
                              timeline=args.timeline, progress=not args.no_progress)  # fmt: skip
        if args.json:
            write_json(args.json, {"target": args.target, "steps": args.steps}, plan, result)
            print(f"wrote {args.json}")
        return
    paged = isinstance(plan.device_memory, Share)
    sizes = {}
    for flag, (field, default, paged_default) in SIZES.items():
        given = getattr(args, flag)
        sizes[field] = given if given is not None else paged_default if paged else default
    _check_gpt_sizes(sizes)
    if paged and any(getattr(args, flag) is None for flag in SIZES):
        print(f"device_memory {plan.device_memory} of the parameters: sizes not given are "
              "the larger demo GPT's, whose parameters outweigh its activations")  # fmt: skip
    config = TrainConfig(
        steps=args.steps,
        **sizes,
        seed=args.seed,
        log_every=args.log_every,
        data=args.data,
        timeline=args.timeline,
    )
    if args.res_check:
        from fxstar.dist_launch import init_from_env

        init_from_env()
        check = res_check_gpt(config, plan)
        if args.json and check.serial is not None:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(dataclasses.asdict(check), f, indent=2)
            print(f"wrote {args.json}")
        return
    result = train(config, plan, progress=not args.no_progress)
    if args.json:
        write_json(args.json, config, plan, result)
        print(f"wrote {args.json}")


def _check_gpt_sizes(sizes: dict[str, int]) -> None:
    """The reference GPT accepts these sizes (heads dividing the width), before its text is
    read and anything is built."""
    from fxstar.models.gpt import GPTConfig

    shape = {k: sizes[k] for k in ("n_layer", "n_head", "n_embd")}
    try:
        GPTConfig(block_size=sizes["seq_len"], **shape)
    except ValueError as error:  # GPTConfig's own checks; nothing else runs in there
        raise UsageError(str(error)) from None


def _check_output(flag: str, path: str) -> None:
    """`path` can be written: its directory exists and is writable, and it is not a folder."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def _count(minimum: int):
    """An argparse type: an int >= minimum (argparse then reports a bad value as usage)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxstar", description=__doc__.splitlines()[0],
                                     epilog=EPILOG)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def compiled(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG)
        p.add_argument("target", metavar="TARGET", help="MODULE:FACTORY")
        p.add_argument("--plan", metavar="PLAN.json", help="plan options as JSON")
        p.add_argument("--passes", metavar="A,B", help="passes to run in addition to the plan's")
        p.add_argument("--device-memory", metavar="SIZE", help=DEVICE_MEMORY_HELP)
        return p

    p = compiled("dump", "print one stage of the compiled graph")
    p.add_argument("--stage", help="stage name or number (default: the last)")
    p.add_argument("--show-noise", action="store_true", help="keep _assert_tensor_metadata etc.")
    p.set_defaults(func=cmd_dump)

    p = compiled("diff", "unified diff of two stages")
    p.add_argument("a", help="stage name or number")
    p.add_argument("b", help="stage name or number")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.set_defaults(func=cmd_diff)

    p = compiled("plan", "memory estimate of one training step under a plan")
    p.set_defaults(func=cmd_plan)

    about = "train the reference GPT on a small text (the demo), or TARGET on its example inputs"
    paged = (
        "With a share as --device-memory (40%), the GPT's sizes not given default to a "
        "larger model whose parameters outweigh its activations, so the share holds both."
    )
    p = sub.add_parser("train", help=about, description=f"{about}. {paged}", epilog=EPILOG)
    p.add_argument("target", metavar="TARGET", nargs="?",
                   help="MODULE:FACTORY whose model returns its loss; trained on its example "
                   "inputs, the same batch every step (default: the reference GPT)")  # fmt: skip
    p.add_argument("--plan", metavar="PLAN.json", help="plan options as JSON")
    p.add_argument("--passes", metavar="A,B", help="passes to run in addition to the plan's")
    p.add_argument("--steps", type=_count(1), default=200)
    for flag, (field, default, paged) in SIZES.items():
        p.add_argument(
            f"--{flag.replace('_', '-')}",
            type=_count(1),
            help=f"the GPT's {field} (default {default}; {paged} with a share)",
        )
    p.add_argument("--lr", type=float, help="learning rate (default: the plan's)")
    p.add_argument("--device-memory", metavar="SIZE", help=DEVICE_MEMORY_HELP)
    p.add_argument("--timeline", metavar="PNG", help="with --device-memory: memory per moment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=_count(0), default=10,
                   help="print the loss every N steps (0: never)")  # fmt: skip
    p.add_argument("--data", metavar="TEXT_FILE", help="train on this text instead")
    p.add_argument("--json", metavar="PATH", help="write losses and the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--res-check",
        action="store_true",
        help="under torchrun (2+ ranks): train the GPT data parallel and in one "
        "process on the same batches (dropout off); print both losses per step",
    )
    p.set_defaults(func=cmd_train)
    return parser


def _stage(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("stage", "a", "b"):
        if hasattr(args, name):
            setattr(args, name, _stage(getattr(args, name)))
    from fxstar.passes import PassError

    try:
        args.func(args)
    except PassError:
        raise
    except REPORTED as error:
        print(f"fxstar {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
