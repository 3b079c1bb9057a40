"""The `fxstar` command: dump, diff, plan and train from a shell.

fxstar dump fxstar.models.gpt:tiny --passes shape_memory
fxstar diff fxstar.models.gpt:tiny capture shape_memory --passes shape_memory
fxstar plan examples/my_model.py:make --plan plan.json
fxstar train --steps 200
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from fxstar.plan import Plan

DEVICE_MEMORY_HELP = (
    "compute-tier budget, e.g. 64MiB or 40%% (of the parameter bytes): parameters are paged "
    "through it in chunks"
)
EPILOG = """TARGET is MODULE:FACTORY: a dotted module or a .py file, and a callable in it that
returns (model, example_inputs[, plan]). fxstar.models.gpt:tiny is the reference GPT."""


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
    from fxstar.engine import compile
    from fxstar.targets import load_target

    target = load_target(args.target)
    plan = _plan(args, target.plan)
    missing = [p for p in extra_passes if p not in plan.passes]
    if missing:
        plan = plan.replace(passes=[*plan.passes, *missing])
    return compile(target.model, plan, example_inputs=target.example_inputs)


def cmd_dump(args: argparse.Namespace) -> None:
    from fxstar.dump import dump

    print(dump(_engine(args), args.stage, show_noise=args.show_noise), end="")


def cmd_diff(args: argparse.Namespace) -> None:
    from fxstar.dump import diff

    color = {"auto": None, "always": True, "never": False}[args.color]
    text = diff(_engine(args), args.a, args.b, color=color)
    print(text or f"stages {args.a} and {args.b} are identical", end="" if text else "\n")


def cmd_plan(args: argparse.Namespace) -> None:
    from fxstar.estimate import format_estimate

    engine = _engine(args, extra_passes=("shape_memory",))
    used = engine.plan.used_options()
    print("plan: " + (", ".join(used) if used else "all defaults"))
    print(format_estimate(engine.program))
    if engine.chunks is not None:
        print(engine.chunks.layout.describe())
    print(engine.report())


def cmd_train(args: argparse.Namespace) -> None:
    from fxstar.train import TrainConfig, train, write_json

    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        seed=args.seed,
        log_every=args.log_every,
        data=args.data,
        timeline=args.timeline,
    )
    plan = _plan(args)
    result = train(config, plan, progress=not args.no_progress)
    if args.json:
        write_json(args.json, config, plan, result)
        print(f"wrote {args.json}")


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

    p = sub.add_parser("train", help="train the reference GPT on a small text (the demo)")
    p.add_argument("--plan", metavar="PLAN.json", help="plan options as JSON")
    p.add_argument("--passes", metavar="A,B", help="passes to run in addition to the plan's")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, help="learning rate (default: the plan's)")
    p.add_argument("--device-memory", metavar="SIZE", help=DEVICE_MEMORY_HELP)
    p.add_argument("--timeline", metavar="PNG", help="with --device-memory: memory per moment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    p.add_argument("--data", metavar="TEXT_FILE", help="train on this text instead")
    p.add_argument("--json", metavar="PATH", help="write losses and the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)
    return parser


def _stage(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("stage", "a", "b"):
        if hasattr(args, name):
            setattr(args, name, _stage(getattr(args, name)))
    from fxstar.errors import FxstarError
    from fxstar.plan import PlanError

    try:
        args.func(args)
    except (FxstarError, PlanError, NotImplementedError, ValueError, LookupError, ImportError,
            OSError) as error:  # fmt: skip
        print(f"fxstar {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
