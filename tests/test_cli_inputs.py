"""Bad input across every subcommand: exit 2 and one line that names the problem, never a traceback.

A table of bad inputs runs through the real ``ljperf.cli.main`` (in-process: no training starts, since
each input must be refused before anything runs), plus a property-based test over the argument parser, refusals
that import no torch, old flag spellings, help text, and JSON inputs read with limits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ljperf import cli
from ljperf.core.errors import LINE_LIMIT
from ljperf.models.catalog import read_config_dict

from conftest import cli_env

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
    (["plan", "--model", "llama-tny"], {}, "unknown model 'llama-tny' (closest: llama-tiny"),
    (["plan", "--model", "llama-tiny"], {}, "must be ENGINE/NAME, e.g. torch/llama-tiny"),
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


# --- refusals that import nothing, old flag spellings, help's metavars, and inputs past any machine ---------------

REFUSED = [
    ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "0"],
    ["benchmark", "--model", "deepspeed/llama-tiny", "--zero-stage", "5"],
    ["benchmark", "--model", "torch/llama-tiny", "--compile", "--warmup", "0"],
    ["benchmark", "--model", "torch/llama-tiny", "--memory-budget", "1GiB"],
    ["plan", "--model", "torch/llama-tiny", "--micro-batch", "0"],
    ["plan", "--model", "fsdp/llama-tiny", "--zero-stage", "2"],
    ["compile-report", "--model", "torch/llama-tiny", "--seq-lens", "0"],
    ["comm", "--iters", "0"],
    ["ablation", "--model", "torch/llama-tiny", "--repeat", "0"],
]


@pytest.mark.parametrize("argv", REFUSED, ids=[" ".join(a[:2] + a[-2:]) for a in REFUSED])
def test_a_refused_flag_value_imports_no_torch(argv):
    """Under load a refused value took 4.5–12 s: torch and transformers were imported before the check."""
    code = f"import sys; from ljperf.cli import main; code = main({argv!r}); print('torch' in sys.modules, code)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    assert out.stdout.split() == ["False", "2"], out.stderr[-2000:]


@pytest.mark.parametrize(
    ("argv", "new"),
    [
        (["benchmark", *TINY, "--timeout", "0"], "--collective-timeout"),
        (["comm", "--timeout", "0"], "--collective-timeout"),
        (["ablation", *TINY, "--timeout", "nan"], "--run-timeout"),
    ],
)
def test_the_old_timeout_spelling_says_its_new_name_and_still_counts(argv, new, capsys):
    """``--timeout`` was the hung-collective limit in benchmark and comm, and one run's wall time in ablation."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    command = argv[0]
    assert err == [
        f"ljperf {command}: --timeout is deprecated here: write {new}",
        f"ljperf {command}: error: {new} must be larger than zero and at most 2147483647 (got {argv[-1]})",
    ], err


METAVARS = re.compile(r"N|N\[,N\]|SIZE|FILE|PATH|DIR|PLAN|NAME|HOST:PORT|ENGINE/NAME|\{[a-z0-9_,.-]+\}|.*[=,\[].*")


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_shows_one_metavar_per_kind_and_titles_in_one_style(command):
    """Help showed argparse's own metavars (``MICRO_BATCH``, ``DEEPSPEED_CONFIG``) beside ``N`` and ``FILE`` for
    the same kinds, and group titles mixed ``model`` with sentences."""
    parser = cli.build_parser(command)
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    child = sub.choices[command]
    for action in child._actions:
        if action.nargs == 0 or action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        shown = action.metavar or ("{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper())
        assert METAVARS.fullmatch(shown), (action.option_strings, shown)
    for group in child._action_groups[2:]:
        assert re.fullmatch(r"[a-z][a-z ]*", group.title), group.title


def test_a_learning_rate_is_refused_for_what_it_is(capsys):
    """``--lr 1e40`` said it must be "at most 2147483647", a count's bound; it overflows torch's float32."""
    assert cli.main(["benchmark", *TINY, "--lr", "1e40"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--lr must be larger than zero and fit a float32, at most 3.4e+38 (got 1e+40)"), err


TINY_RUN = ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "32", "--steps", "1", "--warmup", "1"]


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["plan", "--model", "torch/llama-tiny", "--gpu-memory", "9" * 400 + "GiB"], "larger than 1 EiB"),
        (
            ["plan", "--model", "torch/llama-tiny", "--recompute", "auto", "--memory-budget", "9" * 40 + "TiB"],
            "larger than 1 EiB",
        ),
        (["comm", "--max-bytes", "9" * 400], "larger than 1 EiB"),
        ([*TINY_RUN, "--warmup", str(10**12)], "--warmup must be zero or more and at most"),
        (["comm", "--iters", str(10**12)], "--iters must be larger than zero and at most"),
        (["comm", "--warmup-iters", str(10**12)], "--warmup-iters must be zero or more and at most"),
    ],
)
def test_sizes_and_counts_past_any_machine_are_one_line(argv, text, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0] and len(err[0]) < 300, err


@pytest.mark.parametrize("content", ["nested", "/dev/zero", "fifo", "large"])
@pytest.mark.parametrize(
    "argv",
    [
        ["benchmark", "--model-config", "{file}"],
        ["plan", "--model", "deepspeed/llama-tiny", "--deepspeed-config", "{file}"],
        ["plan", "--calibrate", "{file}"],
        ["doctor", "--deepspeed-config", "{file}", "--skip", "driver,nccl-ifname,nccl,versions,compile"],
    ],
)
def test_every_json_input_is_read_with_limits(argv, content, tmp_path, capsys):
    """``'[' * 200000`` gave a RecursionError traceback, ``/dev/zero`` was read until memory ran out and a FIFO
    blocked for ever: one reader for every JSON input refuses each in one line naming the file."""
    path = tmp_path / "input.json"
    if content == "nested":
        path.write_text("[" * 200_000)
    elif content == "large":
        path.write_text(" " * (8 * 1024**2 + 1) + "{}")
    elif content == "fifo":
        os.mkfifo(path)
    else:
        path = content
    assert cli.main([a.replace("{file}", str(path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "Traceback" not in err[0], err
