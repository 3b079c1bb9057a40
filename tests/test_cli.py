"""The `fxstar` command as a user types it."""

import io
import json
import re
import sys

import pytest
import torch

from fxstar.cli import main

TINY = "fxstar.models.gpt:tiny"


def test_dump_prints_the_last_stage(capsys):
    assert main(["dump", TINY, "--passes", "shape_memory"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# stage 1: shape_memory (after capture)")
    assert "aten.linear" in out and "out=" in out


def test_dump_named_stage_and_diff(capsys):
    assert main(["dump", TINY, "--stage", "0"]) == 0
    assert capsys.readouterr().out.startswith("# stage 0: capture")
    assert main(["diff", TINY, "capture", "shape_memory", "--passes", "shape_memory"]) == 0
    out = capsys.readouterr().out
    assert "--- stage 0: capture" in out and "+++ stage 1: shape_memory" in out
    assert "\x1b[" not in out  # no colour when not on a terminal


def test_plan_prints_the_estimate(capsys):
    assert main(["plan", TINY]) == 0
    out = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state", "activations saved", "total"):
        assert row in out
    assert "h.1" in out  # the per-block table


def test_plan_file_and_errors(tmp_path, capsys, monkeypatch):
    from fxstar import engine

    # every option is built today: one the engine does not implement, for the refusal
    kept = tuple(o for o in engine.ENGINE_OPTIONS if o != "release_after_init")
    monkeypatch.setattr(engine, "ENGINE_OPTIONS", kept)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"release_after_init": True}))
    assert main(["dump", TINY, "--plan", str(plan)]) == 2
    assert "'release_after_init' is not implemented" in capsys.readouterr().err
    plan.write_text(json.dumps({"device_memroy": "1GiB"}))
    assert main(["plan", TINY, "--plan", str(plan)]) == 2
    assert "did you mean 'device_memory'" in capsys.readouterr().err
    assert main(["dump", "fxstar.models.gpt:nothing"]) == 2
    assert "no callable 'nothing'" in capsys.readouterr().err
    assert main(["dump", TINY, "--stage", "nope"]) == 2
    assert "no stage named 'nope'" in capsys.readouterr().err


def test_a_file_target(tmp_path, capsys):
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\n"
        "def make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())\n"
        "    return {'model': model, 'example_inputs': (torch.randn(2, 4),)}\n"
    )
    assert main(["dump", f"{path}:make"]) == 0
    assert "aten.linear" in capsys.readouterr().out


def test_train_learns_and_writes_json(tmp_path, capsys):
    out = tmp_path / "train.json"
    args = ["train", "--steps", "25", "--layers", "1", "--width", "32", "--heads", "2",
            "--seq-len", "16", "--no-progress", "--log-every", "5", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "step    20  loss" in printed and "fxstar engine for GPT" in printed
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 25
    assert result["losses"][-1] < result["losses"][0]
    assert result["eval_loss"] == pytest.approx(result["eval_loss"])  # a number, not NaN
    assert result["config"]["steps"] == 25 and result["plan"]["optimizer"]["type"] == "adamw"


def test_train_through_the_chunk_engine_draws_the_timeline(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    args = ["train", "--steps", "3", "--layers", "1", "--width", "32", "--heads", "2",
            "--seq-len", "16", "--no-progress", "--device-memory", "2MiB",
            "--timeline", str(png)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "passes: shape_memory, chunk_layout, chunk_schedule" in out
    assert "moved host->compute" in out and png.exists()


SMALL = ["--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "16", "--no-progress"]


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--seq-len", "--layers", "--width"])
def test_train_sizes_below_one_are_usage_errors(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", flag, "0"])
    assert info.value.code == 2
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_train_width_not_divisible_by_heads(capsys):
    assert main(["train", "--width", "130", "--heads", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "n_embd: 130 must be divisible by n_head 4" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "path", "message"),
    [
        ("--json", "missing/out.json", "the directory .*missing does not exist"),
        ("--timeline", "missing/t.png", "the directory .*missing does not exist"),
        ("--json", ".", "is a directory"),
    ],
)
def test_train_output_paths_are_checked_before_training(tmp_path, capsys, flag, path, message):
    args = ["train", "--steps", "1", *SMALL, "--device-memory", "2MiB", flag, str(tmp_path / path)]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert re.search(message, err) and "GPT:" not in out  # nothing trained


def test_train_timeline_needs_the_chunk_engine(tmp_path, capsys):
    assert main(["train", *SMALL, "--timeline", str(tmp_path / "t.png")]) == 2
    assert "--timeline: draws the chunk engine's memory" in capsys.readouterr().err


def test_train_with_the_disk_tier_leaves_nothing_behind(tmp_path, capsys):
    state = tmp_path / "state"
    args = ["train", "--steps", "2", *SMALL, "--device-memory", "auto", "--disk", str(state),
            "--state-dtype", "bf16", "--lr", "0.002"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "on the disk tier" in out and f"disk tier {state}" in out
    assert "optimizer state: bf16 Adam moments" in out
    assert not state.exists()
    assert main(["train", "--steps", "1", *SMALL, "--disk", str(state)]) == 2
    assert "disk: the disk tier holds" in capsys.readouterr().err


def test_an_arena_the_machine_cannot_hold_is_a_one_line_error(capsys):
    assert main(["train", "--steps", "1", *SMALL, "--device-memory", "1000TB"]) == 2
    err = capsys.readouterr().err
    # the host budget refuses it at compile, before anything is allocated
    assert "HostMemoryError: the chunk engine needs" in err and "host budget" in err
    assert "Traceback" not in err


def test_plan_does_not_list_its_own_pass_as_the_users(capsys):
    assert main(["plan", TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: all defaults\n")
    assert "runs shape_memory for its estimate; not part of the plan" in out
    assert main(["plan", TINY, "--passes", "shape_memory"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: passes\n") and "for its estimate" not in out


TAGGER = """
import torch


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, input_ids, labels=None):
        logits = self.fc(input_ids)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def make():
    torch.manual_seed(0)
    return Tagger(), {"input_ids": torch.randn(32, 16), "labels": torch.randint(0, 4, (32,))}


def logits_only():
    return torch.nn.Linear(16, 4), torch.randn(2, 16)
"""


def test_train_a_file_target_with_keyword_inputs(tmp_path, capsys):
    path = tmp_path / "numpy.py"  # named like a module: must not replace it
    path.write_text(TAGGER)
    out_json = tmp_path / "run.json"
    args = ["train", f"{path}:make", "--steps", "8", "--no-progress", "--lr", "0.05",
            "--json", str(out_json)]  # fmt: skip
    numpy_before = sys.modules.get("numpy")
    assert main(args) == 0
    assert "Tagger: " in capsys.readouterr().out and sys.modules.get("numpy") is numpy_before
    result = json.loads(out_json.read_text())
    assert len(result["losses"]) == 8 and result["losses"][-1] < result["losses"][0]
    assert result["config"] == {"target": f"{path}:make", "steps": 8}
    assert main(["train", f"{path}:make", "--width", "64"]) == 2
    assert "--width: the reference GPT's options" in capsys.readouterr().err
    assert main(["train", f"{path}:logits_only", "--steps", "1", "--no-progress"]) == 2
    assert "must return its loss" in capsys.readouterr().err


def test_readme_share_of_the_parameters_works_at_the_default_sizes(capsys):
    # `fxstar train --device-memory 40%` failed: the default GPT's activations are 8x its
    # parameters, so no share of the parameters held them
    args = ["train", "--device-memory", "40%", "--steps", "1", "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sizes not given are the larger demo GPT's" in out and "moved host->compute" in out


BROKEN = """
import torch


def bug():
    raise KeyError("a bug in the factory")


def missing_dependency():
    import fxstar_no_such_dependency  # noqa: F401


def make():
    return torch.nn.Linear(4, 3), torch.randn(2, 4)
"""


def test_bugs_keep_their_traceback(tmp_path, capsys):
    # only errors that explain themselves are one line; a bug must show where it happened
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    with pytest.raises(KeyError, match="a bug in the factory"):
        main(["dump", f"{path}:bug"])
    with pytest.raises(ModuleNotFoundError, match="fxstar_no_such_dependency"):
        main(["dump", f"{path}:missing_dependency"])
    assert capsys.readouterr().err == ""


def test_a_crashing_pass_keeps_its_traceback(tmp_path):
    from fxstar import passes
    from fxstar.passes import PassError

    def t_crash(program):
        raise ZeroDivisionError("inside a pass")

    passes.register(t_crash)
    try:
        with pytest.raises(PassError, match="pass 't_crash' failed: ZeroDivisionError") as info:
            main(["dump", TINY, "--passes", "t_crash"])
        assert isinstance(info.value.__cause__, ZeroDivisionError)
    finally:
        passes.unregister("t_crash")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dump", "fxstar_no_such_module:make"],
         "TargetError: 'fxstar_no_such_module': no module named 'fxstar_no_such_module'"),
        (["dump", "fxstar.models.no_such_model:make"],
         "no module named 'fxstar.models.no_such_model'"),
        (["dump", "missing/model.py:make"], "TargetError: 'missing/model.py': no such file"),
        (["dump", TINY, "--plan", "{missing}/plan.json"], "FileNotFoundError: .*plan.json"),
        (["dump", TINY, "--plan", "{bad_json}"], "PlanError: .*bad.json: not valid JSON"),
        (["plan", TINY, "--device-memory", "lots"], "PlanError: device_memory: expected"),
        (["diff", TINY, "capture", "nope"], "UsageError: no stage named 'nope'"),
        (["train", *SMALL, "--data", "{missing}/text.txt"], "FileNotFoundError: .*text.txt"),
        (["train", *SMALL, "--data", "{short}"], "UsageError: data: the text has 5 characters"),
        (["train", *SMALL, "--lr", "-1"], "PlanError: optimizer.lr: must be in"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line(tmp_path, capsys, args, message):
    (tmp_path / "bad.json").write_text("{device_memory: 1}")
    (tmp_path / "short.txt").write_text("hello")
    paths = {"missing": tmp_path / "missing", "bad_json": tmp_path / "bad.json",
             "short": tmp_path / "short.txt"}  # fmt: skip
    assert main([a.format(**paths) for a in args]) == 2
    out, err = capsys.readouterr()
    assert re.search(message, err) and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "GPT:" not in out  # nothing trained


# -- frictions: titles that say what was measured, stage names, JSON, progress in logs --------


def _plan_file(tmp_path, **options) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(options))
    return str(path)


def _saved(out: str) -> str:
    return re.search(r"activations saved +(\S+)", out).group(1)


def test_plan_says_the_rewrites_its_activations_were_measured_after(tmp_path, capsys):
    """The table's activation rows are measured on the graph the plan's rewrites left, and its
    title says after which: not "no memory passes" beside figures measured after checkpointing
    (with a budget), nor the figures of a graph the plan does not run (without one)."""
    assert main(["plan", TINY]) == 0
    plain = capsys.readouterr().out
    assert "(one step, no memory passes):" in plain
    for options in ({"checkpoint": "blocks"}, {"checkpoint": "blocks", "device_memory": "auto"}):
        assert main(["plan", TINY, "--plan", _plan_file(tmp_path, **options)]) == 0
        out = capsys.readouterr().out
        assert "no memory passes" not in out, options
        assert "activations measured after activation_checkpoint):" in out, options
        assert _saved(out) != _saved(plain), options  # the checkpointed graph's, measured


def test_dump_refuses_a_stage_name_two_stages_have(tmp_path, capsys):
    """With checkpointing and a budget, shape_memory is measured before the regions are cut
    and again before the chunks are laid out: two stages of one name."""
    plan = _plan_file(tmp_path, checkpoint="blocks", device_memory="auto")
    assert main(["dump", TINY, "--plan", plan, "--stage", "shape_memory"]) == 2
    out, err = capsys.readouterr()
    assert "UsageError: 2 stages are named 'shape_memory': 1 (after capture); " in err
    number = int(re.search(r"; (\d+) \(after activation_checkpoint\)", err).group(1))
    assert out == "" and "give the stage's number" in err
    assert main(["dump", TINY, "--plan", plan, "--stage", str(number)]) == 0
    assert capsys.readouterr().out.startswith(f"# stage {number}: shape_memory (after ")


def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_train_json_of_a_target_is_json_with_its_tokens_per_second(tmp_path, capsys):
    """A target's run has no held-out loss (null, not NaN) and reads its token ids each step:
    tokens/s is steps/s times their count."""
    out = tmp_path / "run.json"
    assert main(["train", TINY, "--steps", "3", "--no-progress", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = _strict_json(out.read_text())
    from fxstar.models.gpt import tiny

    tokens = tiny()[1][0].numel()
    assert result["eval_loss"] is None
    assert result["tokens_per_second"] == pytest.approx(result["steps_per_second"] * tokens)
    assert result["tokens_per_second"] > 0 and " tokens/s); loss " in printed


def test_train_json_writes_a_diverged_loss_as_null(tmp_path):
    from fxstar.plan import Plan
    from fxstar.train import TrainResult, write_json

    path = tmp_path / "run.json"
    result = TrainResult(losses=[2.0, float("nan"), float("inf")], steps_per_second=1.0)
    write_json(str(path), {"target": "t", "steps": 3}, Plan(), result)
    written = _strict_json(path.read_text())
    assert written["losses"] == [2.0, None, None] and written["tokens_per_second"] is None


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_into_a_log_is_a_line_per_tenth_not_a_bar(monkeypatch, capsys):
    """stderr captured (not a terminal): ten lines for a run, no bar redraws; on a terminal
    the bar."""
    args = ["train", "--steps", "40", "--layers", "1", "--width", "32", "--heads", "2",
            "--seq-len", "16", "--log-every", "0"]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train: ")]
    assert "\r" not in err and len(lines) == 10, err
    assert lines[0].startswith("train: 4/40 steps (10%), loss ")
    assert lines[-1].startswith("train: 40/40 steps (100%), loss ")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*args[:2], "3", *args[3:]]) == 0
    assert "\r" in terminal.getvalue() and "train: 3/3 steps" not in terminal.getvalue()


# -- a transformers model from a local config directory; export -----------------------------------


def _llama_config(directory, vocab_size: int = 512) -> str:
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(directory)  # fmt: skip
    return str(directory)


def test_train_a_transformers_model_from_its_config_on_a_text(tmp_path, capsys):
    """A config directory and a text, nothing downloaded: a tokenizer trained on the text, the
    loss falls, the progress lines show tokens/s and each tier's memory, the report ends it."""
    from fxstar.train import load_text

    config = _llama_config(tmp_path / "llama")
    text = tmp_path / "text.txt"
    text.write_text(load_text(None))
    out = tmp_path / "run.json"
    args = ["train", "--model-config", config, "--data", str(text), "--steps", "20",
            "--seq-len", "32", "--batch-size", "4", "--device-memory", "auto", "--lr", "3e-3",
            "--log-every", "0", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    printed, err = capsys.readouterr()
    assert "LlamaForCausalLM: " in printed and "tokenizer trained on the text" in printed
    assert "held-out loss" in printed and "fxstar engine for LlamaForCausalLM" in printed
    lines = [line for line in err.splitlines() if line.startswith("train: ")]
    assert len(lines) == 10 and all(
        re.search(r"tok/s [\d,]+, compute [\d.]+MiB, activations [\d.]+MiB, host [\d.]+MiB$", line)
        for line in lines
    ), lines  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["model_config"] == config and len(result["losses"]) == 20
    assert result["losses"][-1] < result["losses"][0]
    assert result["tokens_per_second"] == pytest.approx(result["steps_per_second"] * 4 * 32)
    assert result["eval_loss"] == pytest.approx(result["eval_loss"])  # a number, not NaN


def test_train_reads_a_local_tokenizer(tmp_path, capsys):
    from fxstar.integrations.local_text import train_tokenizer
    from fxstar.train import load_text

    train_tokenizer(load_text(None), vocab_size=300).save_pretrained(tmp_path / "tokenizer")
    args = ["train", "--tokenizer", str(tmp_path / "tokenizer"), "--steps", "2", "--seq-len",
            "16", "--batch-size", "2", "--no-progress"]  # fmt: skip
    assert main(["train", "--model-config", _llama_config(tmp_path / "llama"), *args[1:]]) == 0
    assert f"tokenizer from {tmp_path / 'tokenizer'} (300 tokens)" in capsys.readouterr().out
    small = _llama_config(tmp_path / "small", vocab_size=280)  # the tokenizer's ids pass it
    assert main(["train", "--model-config", small, *args[1:]]) == 2
    assert "beyond the model's vocabulary of 280" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", TINY, "--model-config", "{llama}"], "--model-config: trains a transformers"),
        (["train", "--model-config", "{llama}", "--layers", "2"], "--layers: the reference GPT"),
        (["train", "--tokenizer", "{llama}"], "--tokenizer: for a transformers model"),
        (["train", "--model-config", "{missing}"], "missing: no config.json there"),
        (["train", "--model-config", "{llama}", "--data", "{short}"], "too few for --seq-len"),
        (["export", "{missing}", "{out}"], "CheckpointError: no fxstar checkpoint"),
        (["export", "{gpt}", "{out}"], "ExportError: .*--state-dict"),
        (["export", "{gpt}", "{users}", "--state-dict"], "ExportError: .*fxstar did not export"),
        (["export", "{gpt}", "{out}", "--state-dict", "--max-shard-size", "1GB"],
         "UsageError: --max-shard-size: for a transformers directory"),
    ],
)  # fmt: skip
def test_transformers_and_export_mistakes_are_one_line(tmp_path, capsys, args, message):
    from fxstar.engine import compile

    (tmp_path / "short.txt").write_text("hello")
    (tmp_path / "users.safetensors").write_text("mine")
    paths = {"llama": _llama_config(tmp_path / "llama"), "missing": tmp_path / "missing",
             "short": tmp_path / "short.txt", "gpt": tmp_path / "gpt", "out": tmp_path / "out",
             "users": tmp_path / "users.safetensors"}  # fmt: skip
    if "{gpt}" in args:
        from fxstar.models.gpt import tiny

        model, inputs = tiny()[:2]
        compile(model, example_inputs=inputs).save(tmp_path / "gpt")
    assert main([a.format(**paths) for a in args]) == 2
    out, err = capsys.readouterr()
    assert re.search(message, err) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "trained" not in out
    assert (tmp_path / "users.safetensors").read_text() == "mine"


def test_export_a_checkpoint_for_transformers_and_as_a_state_dict(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from fxstar.engine import compile

    config = transformers.AutoConfig.from_pretrained(_llama_config(tmp_path / "llama"))
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (2, 8))
    engine = compile(model, example_kwargs={"input_ids": ids, "labels": ids})
    engine.save(tmp_path / "ckpt")
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "out"
    assert main(["export", ckpt, str(out), "--max-shard-size", "40KB", "--dtype", "bfloat16"]) == 0
    assert f"wrote {out}: config.json, generation_config.json, model-00001-of-" in (
        capsys.readouterr().out
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    expected = {k: v.to(torch.bfloat16) for k, v in engine.state_dict().items()}
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    # a config given in place of the one recorded, and the state dict file
    assert main(["export", ckpt, str(out), "--model-config", str(tmp_path / "llama")]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]  # fmt: skip
    assert main(["export", ckpt, str(tmp_path / "sd.safetensors"), "--state-dict"]) == 0
    state = load_file(tmp_path / "sd.safetensors")
    assert all(torch.equal(state[k], v) for k, v in engine.state_dict().items())


def _examples(help_text: str) -> list[list[str]]:
    return [line.split()[1:] for line in help_text.splitlines()
            if line.startswith("  fxstar ")]  # fmt: skip


def test_help_reads_like_a_manual_whose_examples_parse(capsys):
    """Each command's help explains itself and ends in examples, every one of which is a
    command line the parser accepts."""
    from fxstar.cli import build_parser

    parser = build_parser()
    found = []
    for command in ([], ["train"], ["export"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text
        found += _examples(text)
    assert len(found) >= 12 and {line[0] for line in found} == {
        "dump", "diff", "plan", "train", "export"}  # fmt: skip
    for line in found:
        parser.parse_args(line)  # a usage error would exit
