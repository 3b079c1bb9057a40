"""The `fxstar` command: dump, diff, plan, train and export from a shell.

fxstar dump fxstar.models.gpt:tiny --passes shape_memory
fxstar diff fxstar.models.gpt:tiny capture shape_memory --passes shape_memory
fxstar plan examples/my_model.py:make --plan plan.json
fxstar train --steps 200
fxstar train examples/my_model.py:make --steps 20 --device-memory 50%
fxstar train --model-config ./tiny-llama --data notes.txt --device-memory 50%
fxstar export runs/step-1000 exported/
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
GPT_SIZES = {
    "layers": ("n_layer", 4, 4),
    "heads": ("n_head", 4, 8),
    "width": ("n_embd", 128, 512),
}
BATCH_SIZES = {  # every model trained on a text: the GPT's defaults
    "batch_size": ("batch_size", 8, 2),
    "seq_len": ("seq_len", 64, 32),
}
SIZES = {**GPT_SIZES, **BATCH_SIZES}
DTYPES = ("float32", "bfloat16", "float16")  # what `fxstar export --dtype` casts to
TRAIN_ABOUT = """\
Train a model through fxstar.compile, as a loop of your own would, and report what the
engine did. What is trained is the first of these that is given:

  TARGET              your MODULE:FACTORY, on its example inputs (the same batch every step)
  --model-config DIR  a transformers causal language model built from DIR/config.json (fresh
                      weights, nothing downloaded), on a text
  neither             the reference GPT, a character at a time, on a text

The text is --data FILE, or a short one that ships with fxstar; a tenth of it is held out
and the held-out loss printed at the end. A transformers model reads it through --tokenizer
DIR (a local tokenizer directory), or through a byte-level BPE trained on the text. With a
share as --device-memory (40%), the GPT's sizes not given default to a larger model whose
parameters outweigh its activations, so the share holds both.

On a terminal a progress bar shows the loss, tokens a second and the MiB each memory tier of
the chunk engine holds (compute: parameter chunks at their fullest, kept: chunks kept there
with their optimizer state, activations, host); into a log it is one line per tenth of the
run. The run ends with the engine's report."""
TRAIN_EXAMPLES = """examples:
  fxstar train
      the reference GPT on the shipped text, 200 steps
  fxstar train --device-memory 40% --steps 50
      its parameters paged through a compute tier of 40% of their bytes
  fxstar train --model-config ./tiny-llama --data notes.txt --seq-len 128 --steps 100
      a transformers model from a local config, tokenizer trained on notes.txt
  fxstar train --model-config ./gpt2 --tokenizer ./gpt2 --data corpus.txt --device-memory 1GiB
      its own tokenizer; parameters paged through 1 GiB
  fxstar train examples/my_model.py:make --steps 20 --json run.json
      your model on its example inputs; losses and the report as JSON"""
EXPORT_ABOUT = """\
Write a checkpoint directory that engine.save wrote (at any topology: one process,
tensor-parallel or data-parallel ranks) as files any library reads, without building an
engine: a transformers model directory that from_pretrained opens (config.json, the weights
in safetensors, sharded by --max-shard-size with model.safetensors.index.json), or with
--state-dict one safetensors file of the model's state dict (any model). The checkpoint's
files are checked against their checksums first; the tensors are read and written one at a
time.

A transformers model's config is recorded in the checkpoint when it is saved; give
--model-config DIR for a checkpoint without one. OUT may be absent, empty or an earlier
export; a directory or file holding anything else is refused, and nothing of it deleted."""
EXPORT_EXAMPLES = """examples:
  fxstar export runs/step-1000 exported
      then AutoModelForCausalLM.from_pretrained("exported")
  fxstar export runs/step-1000 exported --max-shard-size 2GB --dtype bfloat16
  fxstar export runs/step-1000 gpt.safetensors --state-dict
      then model.load_state_dict(safetensors.torch.load_file("gpt.safetensors"))"""
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
    optimizer = {k: getattr(args, k, None) for k in ("lr", "state_dtype")}
    if any(v is not None for v in optimizer.values()):
        changes["optimizer"] = dataclasses.replace(
            plan.optimizer, **{k: v for k, v in optimizer.items() if v is not None}
        )
    if getattr(args, "device_memory", None) is not None:
        changes["device_memory"] = args.device_memory
    if getattr(args, "disk", None) is not None:
        changes["disk"] = args.disk
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
    _check_what_trains(args)
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
    if args.model_config is not None:
        _train_transformers(args, plan)
        return
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


def _check_what_trains(args: argparse.Namespace) -> None:
    """Flags that do not fit what is trained are refused before anything is built."""
    if args.model_config is None:
        if args.tokenizer is not None:
            raise UsageError("--tokenizer: for a transformers model; give --model-config DIR")
        return
    if args.target is not None:
        raise UsageError("--model-config: trains a transformers model; leave TARGET out")
    given = [f"--{f.replace('_', '-')}" for f in GPT_SIZES if getattr(args, f) is not None]
    given += ["--res-check"] if args.res_check else []
    if given:
        raise UsageError(f"{', '.join(given)}: the reference GPT's options; the model of "
                         "--model-config is as its config.json says")  # fmt: skip


def _train_transformers(args: argparse.Namespace, plan: Plan) -> None:
    from fxstar.train import write_json
    from fxstar.train_transformers import TransformersRun, train_transformers

    sizes = {field: getattr(args, flag) if getattr(args, flag) is not None else default
             for flag, (field, default, _) in BATCH_SIZES.items()}  # fmt: skip
    run = TransformersRun(model_config=args.model_config, data=args.data,
                          tokenizer=args.tokenizer, steps=args.steps, seed=args.seed,
                          log_every=args.log_every, timeline=args.timeline,
                          **sizes)  # fmt: skip
    result = train_transformers(run, plan, progress=not args.no_progress)
    if args.json:
        write_json(args.json, dataclasses.asdict(run), plan, result)
        print(f"wrote {args.json}")


def cmd_export(args: argparse.Namespace) -> None:
    import torch

    from fxstar.saving.export import export_state_dict, save_pretrained

    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    if args.state_dict:
        ignored = [flag for flag, value in (("--model-config", args.model_config),
                   ("--max-shard-size", args.max_shard_size)) if value is not None]  # fmt: skip
        if ignored:
            raise UsageError(f"{', '.join(ignored)}: for a transformers directory, not "
                             "--state-dict")  # fmt: skip
        written = export_state_dict(args.checkpoint, args.out, dtype=dtype)
        print(f"wrote {written} ({written.stat().st_size:,} bytes)")
        return
    written = save_pretrained(args.checkpoint, args.out, max_shard_size=args.max_shard_size,
                              dtype=dtype, config=args.model_config)  # fmt: skip
    files = sorted(written.iterdir())
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {written}: {', '.join(f.name for f in files)} ({total:,} bytes)")


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
    title, *lines = [line for line in __doc__.splitlines() if line]
    examples = "examples:\n" + "\n".join(f"  {line}" for line in lines)
    parser = argparse.ArgumentParser(
        prog="fxstar",
        description=title,
        epilog=f"{examples}\n\n{EPILOG}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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

    about = "train the reference GPT, a transformers model from a config, or TARGET"
    p = sub.add_parser("train", help=about, description=TRAIN_ABOUT, epilog=TRAIN_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    what = p.add_argument_group("what to train")
    what.add_argument("target", metavar="TARGET", nargs="?",
                      help="MODULE:FACTORY whose model returns its loss; trained on its example "
                      "inputs, the same batch every step (default: the reference GPT)")  # fmt: skip
    what.add_argument("--model-config", metavar="DIR",
                      help="a transformers config directory (config.json): its causal language "
                      "model, with fresh weights, trained on the text")  # fmt: skip
    what.add_argument("--tokenizer", metavar="DIR",
                      help="with --model-config: a local tokenizer directory (default: a "
                      "byte-level BPE trained on the text)")  # fmt: skip
    what.add_argument(
        "--data",
        metavar="TEXT_FILE",
        help="the text to train on (default: a short one shipped with fxstar)",
    )
    gpt = p.add_argument_group("the reference GPT's sizes")
    for flag, (field, default, paged) in GPT_SIZES.items():
        gpt.add_argument(f"--{flag}", type=_count(1),
                         help=f"its {field} (default {default}; {paged} with a share)")  # fmt: skip
    steps = p.add_argument_group("training")
    steps.add_argument("--steps", type=_count(1), default=200, help="optimizer steps (200)")
    for flag, what in (("batch_size", "sequences a step"), ("seq_len", "tokens a sequence")):
        _, default, paged = BATCH_SIZES[flag]
        steps.add_argument(f"--{flag.replace('_', '-')}", type=_count(1),
                           help=f"{what} (default {default}; the GPT's {paged} with a "
                           "share)")  # fmt: skip
    steps.add_argument("--lr", type=float, help="learning rate (default: the plan's)")
    steps.add_argument("--state-dtype", choices=("fp32", "bf16", "8bit"),
                       help="Adam's moments in fp32 (8 bytes a parameter), bf16 (4) or 8-bit "
                       "blockwise (about 2); default: the plan's")  # fmt: skip
    steps.add_argument("--seed", type=int, default=0, help="weights, batches, dropout (0)")
    memory = p.add_argument_group("plan and memory")
    memory.add_argument("--plan", metavar="PLAN.json", help="plan options as JSON")
    memory.add_argument("--passes", metavar="A,B", help="passes to run in addition to the plan's")
    memory.add_argument("--device-memory", metavar="SIZE", help=DEVICE_MEMORY_HELP)
    memory.add_argument("--disk", metavar="DIR",
                        help="keep the optimizer's moments in files under DIR (the disk tier; "
                        "needs --device-memory), removed when training ends")  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--log-every", type=_count(0), default=10,
                     help="print the loss every N steps (0: never)")  # fmt: skip
    out.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    out.add_argument("--json", metavar="PATH", help="write losses and the report as JSON")
    out.add_argument("--timeline", metavar="PNG",
                     help="with --device-memory: draw memory per moment")  # fmt: skip
    checks = p.add_argument_group("checks")
    checks.add_argument(
        "--res-check",
        action="store_true",
        help="under torchrun (2+ ranks): train the GPT data parallel and in one "
        "process on the same batches (dropout off); print both losses per step",
    )
    p.set_defaults(func=cmd_train)

    about = "write a checkpoint as a transformers directory or a state dict file"
    p = sub.add_parser("export", help=about, description=EXPORT_ABOUT, epilog=EXPORT_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory engine.save wrote")
    p.add_argument("out", metavar="OUT", help="the directory (or with --state-dict, the file)")
    p.add_argument("--state-dict", action="store_true",
                   help="one safetensors file of the model's state dict (any model)")  # fmt: skip
    p.add_argument("--model-config", metavar="DIR",
                   help="the transformers config directory the model was built from (default: "
                   "the config the checkpoint recorded)")  # fmt: skip
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="the most bytes of one weight file, e.g. 5GB (default: transformers' "
                   "50GB)")  # fmt: skip
    p.add_argument("--dtype", choices=DTYPES,
                   help="cast the floating-point weights (default: as trained)")  # fmt: skip
    p.set_defaults(func=cmd_export)
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
