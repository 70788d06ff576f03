"""Bad input across every subcommand: exit 2 and one line that names the problem, never a traceback.

A table of bad inputs runs through the real ``ljperf.cli.main`` (in-process: no training starts, since
each input must be refused before anything runs), plus a property-based test over the argument parser.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ljperf import cli
from ljperf.core.errors import LINE_LIMIT
from ljperf.models.catalog import read_config_dict

BAD_JSON = "{not: json"
WRONG_BATCH = json.dumps({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
MISSING_FIELDS = json.dumps({"model_type": "llama", "hidden_size": 64})
ODD_HIDDEN = json.dumps(
    {"model_type": "llama", "vocab_size": 64, "hidden_size": 7, "num_hidden_layers": 1, "num_attention_heads": 2}
)
NO_LAYERS = json.dumps(
    {"model_type": "llama", "vocab_size": 64, "hidden_size": 8, "num_hidden_layers": 0, "num_attention_heads": 2}
)
XLNET = json.dumps({"model_type": "xlnet", "d_model": 64, "n_layer": 2, "n_head": 2, "d_inner": 128, "vocab_size": 512})

TINY = ["--model", "torch/llama-tiny"]

# (argv, environment, text the one line must contain). Names in braces ("{bad}", "{xlnet}", ...) are files.
CASES = [
    (["no-such-command"], {}, "invalid choice"),
    (["benchmark", "--model", "torch/llama-tinyy"], {}, "closest: llama-tiny"),
    (["benchmark", "--model", "tpu/llama-tiny"], {}, "unknown engine"),
    (["benchmark", "--model-config", "{bad}"], {}, "not valid JSON"),
    (["benchmark", "--model-config", "{missing}"], {}, "missing"),
    (["benchmark", "--model-config", "{xlnet}"], {}, "XLNetLMHeadModel keeps its decoder layers elsewhere"),
    (["benchmark", "--model-config", "{odd}"], {}, "hidden size (7) is not a multiple"),
    (["plan", "--model-config", "{empty}"], {}, "num_hidden_layers must be a whole number of 1 or more"),
    (["benchmark", *TINY, "--micro-batch", "-1"], {}, "--micro-batch"),
    (["benchmark", *TINY, "--seq-len", "0"], {}, "--seq-len"),
    (["benchmark", *TINY, "--seq-len", "1"], {}, "--seq-len must be 2 or more"),  # was a run with a nan loss
    (["plan", *TINY, "--seq-len", "1"], {}, "--seq-len must be 2 or more"),
    (["benchmark", *TINY, "--grad-accum", "0"], {}, "--grad-accum"),
    (["benchmark", *TINY, "--steps", "0"], {}, "--steps"),
    (["benchmark", *TINY, "--warmup", "-1"], {}, "--warmup"),
    (["benchmark", *TINY, "--seq-len", "10000000"], {}, "max positions"),
    (["benchmark", *TINY, "--lr", "-1"], {}, "--lr"),
    (["benchmark", *TINY, "--collective-timeout", "0"], {}, "--collective-timeout"),
    # inf: an OverflowError when the group formed
    (["benchmark", *TINY, "--collective-timeout", "inf"], {}, "--collective-timeout"),
    (["benchmark", *TINY, "--lr", "nan"], {}, "--lr"),
    (["benchmark", *TINY, "--seed", "1180591620717411303424"], {}, "--seed must be in"),  # a ValueError in the run
    (["benchmark", *TINY, "--micro-batch", "99999999999999999999"], {}, "--micro-batch"),
    (["benchmark", *TINY, "--nproc-per-node", "100000"], {}, "--nproc-per-node"),
    (["benchmark", *TINY, "--nnodes", "2"], {}, "--rdzv-endpoint"),
    (["benchmark", *TINY, "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "h:1"], {}, "--node-rank"),
    (["benchmark", *TINY, "--engine", "fsdp"], {}, "contradicts"),
    (["benchmark", "--model", "deepspeed/llama-tiny", "--precision", "bf16"], {}, "deepspeed keeps fp32 master"),
    (["plan", "--model", "deepspeed/llama-tiny", "--precision", "bf16"], {}, "deepspeed keeps fp32 master weights"),
    (["benchmark", "--model", "deepspeed/llama-tiny", "--zero-stage", "4"], {}, "--zero-stage"),
    (["benchmark", "--model", "deepspeed/llama-tiny", "--deepspeed-config", "{bad}"], {}, "JSON"),
    (["benchmark", "--model", "deepspeed/llama-tiny", "--deepspeed-config", "{wrong_batch}"], {}, "7"),
    (["benchmark", *TINY, "--recompute", "sometimes"], {}, "--recompute"),
    (["benchmark", *TINY, "--compile-mode", "fast"], {}, "'fast': choose one of regional, whole, deepspeed, off"),
    (["benchmark", *TINY, "--compile-mode", "deepspeed"], {}, "deepspeed is DeepSpeed's engine.compile()"),
    (["benchmark", *TINY, "--compile", "--warmup", "0"], {}, "--compile needs --warmup 1 or more"),
    (["benchmark", *TINY, "--compile", "--compile-mode", "off"], {}, "contradicts --compile-mode off"),
    (["benchmark", *TINY, "--nproc-per-node", "2", "--rdzv-endpoint", "node0:99999"], {}, "port in 1..65535"),
    (["benchmark", *TINY, "--nnodes", "2", "--rdzv-endpoint", "node 0:29500"], {}, "--rdzv-endpoint"),
    (["benchmark", *TINY, "--nnodes", "2", "--rdzv-endpoint", "localhost"], {}, "write HOST:PORT"),
    (["benchmark", *TINY, "--recompute", "auto"], {"LJPERF_MEMORY_BUDGET": "abc"}, "LJPERF_MEMORY_BUDGET"),
    (["benchmark", *TINY, "--micro-batch", "1e9"], {}, "invalid int"),
    (["benchmark", *TINY, "--device", "cuda"], {}, "no CUDA device"),
    (["benchmark", *TINY, "--attn-implementation", "flash_attention_2"], {}, "flash_attention_2 runs on CUDA only"),
    (["benchmark", *TINY, "--precision", "fp8"], {}, "--precision"),
    (["benchmark", *TINY, "--attn-implementation", "bogus"], {}, "--attn-implementation"),
    (["benchmark", *TINY, "--memory-budget", "1GiB"], {}, "--memory-budget is the budget of --recompute auto"),
    (["plan", *TINY, "--recompute", "auto", "--memory-budget", "-5GiB"], {}, "written --flag=VALUE"),
    (["plan", *TINY, "--gpu-memory", "8GiB", "--recompute", "auto", "--memory-budget=-5GiB"], {}, "not a size"),
    (["benchmark", *TINY, "--deepspeed-config", "{bad}"], {}, "for the deepspeed engine"),
    (["benchmark", "--model-config", "/nonexistent/config.json"], {}, "no such file"),
    (["plan", "--model-config", "{folder}"], {}, "is a folder, and its config.json: no such file"),
    (["benchmark"], {}, "exactly one of --model"),
    (["plan", "--model", "torch/nope"], {}, "unknown model"),
    (["plan", "--model", "torch/llama-tiny", "--deepspeed-config", "{bad}"], {}, "for the deepspeed engine"),
    (
        ["plan", "--model-config", "{xlnet}", "--device", "cpu"],
        {},
        "XLNetLMHeadModel keeps its decoder layers elsewhere",
    ),
    (["plan", "--model", "torch/llama-tiny", "--gpu-memory", "80XB"], {}, "80XB"),
    (["plan", "--model", "torch/llama-tiny", "--gpus", "0"], {}, "--gpus"),
    (["plan", *TINY, "--gpu-memory", "80"], {}, "--gpu-memory '80' is 80 bytes: write a unit, e.g. 80GiB"),
    (["plan", *TINY, "--device", "cpu", "--micro-batch", "99999999999"], {}, "--micro-batch must be larger than zero"),
    (["plan", "--model", "torch/llama-tiny", "--micro-batch", "0"], {}, "--micro-batch"),
    (["plan", "--model", "torch/llama-tiny", "--seq-len", "0"], {}, "--seq-len"),
    (["plan", "--model", "deepspeed/llama-tiny", "--zero-stage", "0"], {}, "--zero-stage 0"),
    # another engine's flag was ignored: a ZeRO-3-like figure for "fsdp --zero-stage 2", no change for DDP
    (["plan", "--model", "fsdp/llama-tiny", "--zero-stage", "2"], {}, "--zero-stage is for the deepspeed engine"),
    (["benchmark", "--model", "torch/llama-tiny", "--no-reshard-after-forward"], {}, "is for the fsdp engine"),
    (["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--gpu", "H100"], {}, "the plan is for --device cpu"),
    (["plan", "--model", "torch/llama-tiny", "--gpu", "NOPE-GPU"], {}, "NOPE-GPU"),
    (["plan", "--calibrate", "/nonexistent/results.json"], {}, "results.json"),
    (["plan", "--calibrate", "{bad}"], {}, "JSON"),
    (["plan", "--calibrate", "{folder}"], {}, "cannot read it"),
    (["plan", "--calibrate", "{listed}"], {}, "must hold a JSON object"),
    (["plan", "--model", "deepspeed/llama-tiny", "--deepspeed-config", "{zero_null}"], {}, "zero_optimization must be"),
    (["doctor", "--deepspeed-config", "/nonexistent/ds.json"], {}, "ds.json"),
    (["doctor", "--deepspeed-config", "{bad}"], {}, "JSON"),
    (["comm", "--ops", "all_nothing"], {}, "all_nothing"),
    (["comm", "--min-bytes", "1G", "--max-bytes", "1K"], {}, "--min-bytes"),
    (["comm", "--min-bytes", "abc"], {}, "abc"),
    (["benchmark", *TINY, "--optimizer-impl", "adam"], {}, "--optimizer-impl 'adam': choose one of single"),
    (["benchmark", "--model", "deepspeed/llama-tiny", "--optimizer-impl", "fused"], {}, "from --deepspeed-config"),
    (["ablation", *TINY, "--variants", "base,nope"], {}, "nope"),
    (["ablation", *TINY, "--variant", "novalue"], {}, "--variant"),
    (["ablation", *TINY, "--repeat", "0"], {}, "--repeat"),
    (["ablation", *TINY, "--run-timeout", "nan"], {}, "--run-timeout"),
    (["ablation", *TINY, "--out", "/proc/ljperf-ablation"], {}, "--out"),
    (["ablation", *TINY, "--variants", ""], {}, "has an empty name"),
    (["ablation", *TINY, "--variants", "base,,compile"], {}, "has an empty name"),
    (["report", "{damaged_runs}"], {}, "holds no valid ablation runs: 2 file(s) are not run records ("),
    (["report", "{folder}"], {}, "holds no ablation runs (runs/*/*.json)"),
    (["ablation", *TINY, "--env", "noequals"], {}, "--env"),
    (["report", "/nonexistent/run-dir"], {}, "/nonexistent/run-dir: no such folder"),
    (["compile-report", *TINY, "--seq-lens", "12,abc"], {}, "abc"),
    (["compile-report", *TINY, "--steps", "99999999999999999999"], {}, "--steps"),
    (["compile-report", *TINY, "--seq-lens", "64,99999999999"], {}, "lengths from 2 to"),
    (["compile-report", *TINY, "--seq-lens", "128,128"], {}, "names a length twice"),
    (["compile-report", *TINY, "--seq-lens", "64,100000"], {}, "--seq-lens 100000 is longer"),
    (["models", "--bogus-flag"], {}, "--bogus-flag"),
    (
        ["benchmark", *TINY, "--mirco-batch", "2"],
        {},
        "ljperf benchmark: error: unrecognized arguments: --mirco-batch 2; did you mean --micro-batch?",
    ),
    # another tool's flag gets ljperf's equivalent in this command, or no hint (not a similar spelling)
    (["plan", *TINY, "--nproc-per-node", "8"], {}, "--nproc-per-node 8; did you mean --gpus N (the world size"),
    (["benchmark", *TINY, "--gradient_accumulation_steps", "4"], {}, "4; did you mean --grad-accum N? (see"),
    (["compile-report", *TINY, "--nproc-per-node", "2"], {}, "unrecognized arguments: --nproc-per-node 2 (see"),
    ([], {}, "ljperf: error: name a command"),
    (["benchmark", "--model-config", "{kv3}"], {}, "num_key_value_heads (3) must divide num_attention_heads (4)"),
    (["benchmark", *TINY, "--output", ""], {}, "--output is empty"),
    (["doctor", "--output", ""], {}, "--output is empty"),
    (["benchmark", *TINY, "--recompute", "auto", "--memory-budget", "80"], {}, "'80' is 80 bytes: write a unit"),
    (["benchmark", *TINY, "--recompute", "auto"], {"LJPERF_MEMORY_BUDGET": "64"}, "is 64 bytes: write a unit"),
    # libgomp could not start them: a segmentation fault after 21 s, with nothing from ljperf
    (["benchmark", *TINY, "--threads", "100000"], {}, "--threads 100000: this machine has"),
    (["benchmark", *TINY], {"OMP_NUM_THREADS": "100000"}, "OMP_NUM_THREADS=100000: this machine has"),
    # the picture overwrote the JSON record, exit 0
    (["benchmark", *TINY, "--output", "{png}", "--plot", "{png}"], {}, "--output and --plot name the same file"),
    (["benchmark", *TINY, "--output", "{trace}", "--profile", "{folder}"], {}, "is in --profile"),
    (["benchmark", *TINY, "--plot", "{png}", "--profile", "{png}"], {}, "is in --profile"),
    # planned as if it were 4096
    (["plan", "--model-config", "{no_positions}"], {}, "max_position_embeddings must be a whole number of 1 or more"),
    (["benchmark", "--model-config", "{nan_head}"], {}, "head_dim must be a whole number of 1 or more (got nan)"),
    # echoed whole: a line of 100 KB
    (["benchmark", "--model", "torch/" + "x" * 100_000], {}, "characters cut) … "),
    (["plan", "--model", "torch/llama-tiny", "--precision", "x" * 100_000], {}, "characters cut) … "),
    # a file name longer than the system's: tracebacks from pathlib's checks
    (["benchmark", "--model-config", "/tmp/" + "x" * 300], {}, "a path is longer than this system allows"),
    (["benchmark", *TINY, "--output", "{long}"], {}, "a path is longer than this system allows"),
    (["benchmark", *TINY, "--profile", "{long}"], {}, "a path is longer than this system allows"),
    (["plan", *TINY, "--device", "cpu", "--plot", "{long}.png"], {}, "a path is longer than this system allows"),
    (["report", "{long}"], {}, "a path is longer than this system allows"),
    (["doctor", "--output", "{long}"], {}, "a path is longer than this system allows"),
    (["comm", "--output", "{long}"], {}, "a path is longer than this system allows"),
    # plan and doctor took it (exit 0, OK) while benchmark refused it: one check for all three
    (["plan", "--model", "deepspeed/llama-tiny", "--device", "cpu", "--deepspeed-config", "{nan_lr}"], {}, "lr is NaN"),
    (["benchmark", "--model", "deepspeed/llama-tiny", "--deepspeed-config", "{nan_lr}"], {}, "lr is NaN (fix: write"),
]


@pytest.fixture
def files(tmp_path):
    paths = {
        "bad": tmp_path / "bad.json",
        "wrong_batch": tmp_path / "ds.json",
        "missing": tmp_path / "cfg.json",
        "xlnet": tmp_path / "xlnet.json",
        "odd": tmp_path / "odd.json",
        "empty": tmp_path / "empty.json",
        "folder": tmp_path,
        "listed": tmp_path / "list.json",
        "zero_null": tmp_path / "zero_null.json",
        "damaged_runs": tmp_path / "ablation",
        "kv3": tmp_path / "kv3.json",
        "png": tmp_path / "same.png",
        "trace": tmp_path / "rank0.trace.json.gz",
        "no_positions": tmp_path / "no_positions.json",
        "nan_head": tmp_path / "nan_head.json",
        "nan_lr": tmp_path / "nan_lr.json",
        "long": tmp_path / ("x" * 300),
    }
    tiny = read_config_dict(name="llama-tiny")
    paths["no_positions"].write_text(json.dumps({**tiny, "max_position_embeddings": 0}))
    paths["nan_head"].write_text(json.dumps({**tiny, "head_dim": float("nan")}))
    paths["nan_lr"].write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}))
    paths["kv3"].write_text(json.dumps({**read_config_dict(name="llama-tiny"), "num_key_value_heads": 3}))
    paths["bad"].write_text(BAD_JSON)
    paths["wrong_batch"].write_text(WRONG_BATCH)
    paths["missing"].write_text(MISSING_FIELDS)
    paths["xlnet"].write_text(XLNET)  # layers at transformer.layer
    paths["odd"].write_text(ODD_HIDDEN)
    paths["empty"].write_text(NO_LAYERS)
    paths["listed"].write_text("[1, 2]")
    paths["zero_null"].write_text(json.dumps({"zero_optimization": None}))
    (paths["damaged_runs"] / "runs" / "local").mkdir(parents=True)
    (paths["damaged_runs"] / "runs" / "local" / "base.r1.json").write_text('{"trunc')
    (paths["damaged_runs"] / "runs" / "local" / "base.r2.json").write_text("[]")
    return {k: str(v) for k, v in paths.items()}


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_the_table_covers_every_subcommand():
    assert len(CASES) >= 30
    assert set(cli.COMMANDS) <= {argv[0] for argv, _, _ in CASES if argv}


@pytest.mark.parametrize(("argv", "env", "expected"), CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_exits_2_with_one_line(argv, env, expected, files, monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = [a.format(**files) for a in argv]
    code, err = run_main(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err and expected in lines[0], err
    assert len(lines[0]) <= LINE_LIMIT, len(lines[0])


FLAGS = ["--micro-batch", "--seq-len", "--grad-accum", "--steps", "--warmup", "--precision", "--lr", "--zero-stage"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flags=st.lists(
        st.tuples(st.sampled_from(FLAGS), st.one_of(st.integers(-5, 0), st.text(min_size=1, max_size=6))),
        min_size=1,
        max_size=3,
    )
)
def test_parser_never_tracebacks_on_invalid_values(flags, capsys):
    """Any mix of non-positive or arbitrary text values is refused with exit 2 and one line (or accepted)."""
    argv = ["benchmark", "--model", "torch/llama-tiny", "--device", "meta-never-valid"]
    for flag, value in flags:
        argv += [flag, str(value)]
    code, err = run_main(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--json"], []])
def test_a_reader_that_stops_early_gets_no_traceback(args):
    """``ljperf models --json | head``: the closed pipe ends the command quietly (141, as a shell reports it);
    also a table printed by rich (its console exited 1 on a closed pipe)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ljperf", "models", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and stderr == ""


def test_a_command_leaves_its_objects_to_the_end_of_its_process():
    """The interpreter's exit would collect garbage over every object torch and transformers made (~0.5-0.8
    CPU-s a process, paid by each rank of each run): ljperf's exit freezes them first."""
    script = "import atexit, gc, sys\n"
    script += "atexit.register(lambda: print('frozen', gc.get_freeze_count()))\n"
    script += "sys.argv = ['ljperf', 'models', '--json']\n"
    script += "from ljperf.cli import entry\n"
    script += "entry()\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.rsplit("frozen ", 1)[1]) > 0


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_explains_every_flag_and_shows_its_default(command):
    parser = cli.build_parser(command)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in sub.choices[command]._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings}: no help"
        default = action.default
        if default not in (None, argparse.SUPPRESS, "", []) and not isinstance(action, argparse._StoreTrueAction):
            shown = {("on" if default else "off")} if isinstance(default, bool) else {str(default)}
            shown |= {f"{default:g}"} if isinstance(default, float) else set()
            assert any(f"(default: {s})" in action.help for s in shown), f"{command} {action.option_strings}"


def test_help_and_a_mistyped_flag_answer_without_importing_torch():
    """``ljperf benchmark --help`` took 3-8 s, nearly all of it importing torch (and ``--bogus`` as long)."""
    code = """
import contextlib, io, sys
from ljperf import cli
from ljperf.core.errors import LINE_LIMIT
for command in cli.COMMANDS:
    for flag in ("--bogus", "--help"):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                cli.main([command, flag])
            except SystemExit as exc:
                assert exc.code == (2 if flag == "--bogus" else 0), (command, flag, exc.code, err.getvalue())
        assert "torch" not in sys.modules and "transformers" not in sys.modules, (command, flag)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-3000:]
