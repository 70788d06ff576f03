"""What a new user tripped over (issue 37), each checked: slow refusals and listings, an old flag spelling, help
text, messages, the CPU thread count.

Run: ``.venv/bin/python -m pytest tests/test_newcomer.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import warnings

import pytest

from ljperf.cli import COMMANDS, build_parser, main

from conftest import cli_env

TINY = ["--model", "torch/llama-tiny"]

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


def test_a_second_model_listing_builds_nothing_and_imports_no_torch(tmp_path):
    """``ljperf models`` took 13–17 s to print a static table: it built every catalog model on the meta device."""
    env = cli_env(LJPERF_CACHE_DIR=str(tmp_path))
    code = "import sys; from ljperf.cli import main; code = main(['models', '--json']); print('torch' in sys.modules)"
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert first.stdout.split()[-1] == "True" and second.stdout.split()[-1] == "False"
    assert first.stdout == second.stdout.replace("False", "True")


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
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    command = argv[0]
    assert err == [
        f"ljperf {command}: --timeout is deprecated here: write {new}",
        f"ljperf {command}: error: {new} must be larger than zero and at most 2147483647 (got {argv[-1]})",
    ], err


METAVARS = re.compile(r"N|N\[,N\]|SIZE|FILE|PATH|DIR|PLAN|NAME|HOST:PORT|ENGINE/NAME|\{[a-z0-9_,.-]+\}|.*[=,\[].*")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_shows_one_metavar_per_kind_and_titles_in_one_style(command):
    """Help showed argparse's own metavars (``MICRO_BATCH``, ``DEEPSPEED_CONFIG``) beside ``N`` and ``FILE`` for
    the same kinds, and group titles mixed ``model`` with sentences."""
    parser = build_parser(command)
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
    assert main(["benchmark", *TINY, "--lr", "1e40"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--lr must be larger than zero and fit a float32, at most 3.4e+38 (got 1e+40)"), err


def test_an_unsupported_layout_is_said_in_a_whole_sentence():
    """BERT's refusal ended mid-sentence: "... or GPT-2 and Falcon (transformer.h) are"."""
    from transformers import BertConfig, BertForMaskedLM

    from ljperf.core.errors import UsageError
    from ljperf.models.layout import decoder_layers

    bert = BertForMaskedLM(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))
    with pytest.raises(UsageError) as refused:
        decoder_layers(bert)
    assert str(refused.value).endswith("as Llama, Qwen, Gemma and OPT are (model.layers) or as GPT-2 and Falcon are"
                                       " (transformer.h)"), str(refused.value)  # fmt: skip


def test_a_hook_warning_is_one_line_that_a_scripts_filter_does_not_hide(capsys):
    """Hook warnings were ``train.py:19: UserWarning: [ljperf] ...`` and ``warnings.simplefilter("ignore")`` in
    the script hid them (the DeepSpeed bucket advice among them)."""
    from ljperf.startup_hooks.messages import warn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warn("recomputing 8/8 layers (does not fit)")
    assert capsys.readouterr().err == "[ljperf] warning: recomputing 8/8 layers (does not fit)\n"


def test_a_cpu_run_sets_and_records_its_threads_and_says_when_nobody_chose(tmp_path, monkeypatch, capsys):
    """CPU step times followed the thread count (ratios 1.26-1.55 apart with torch's default, 1.009 with one)."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    previous = torch.get_num_threads()
    out = tmp_path / "r.json"
    run = ["benchmark", *TINY, "--seq-len", "32", "--steps", "1", "--warmup", "0", "--output", str(out)]
    try:
        assert main([*run, "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
        assert json.loads(out.read_text())["config"]["train"]["threads"] == 1
        assert "--threads N" not in capsys.readouterr().err
        assert main(run) == 0
    finally:
        torch.set_num_threads(previous)
    assert "give --threads N (or OMP_NUM_THREADS) to compare runs" in capsys.readouterr().err
    assert json.loads(out.read_text())["config"]["train"]["threads"] >= 1
