"""``ljperf ablation``: the end-to-end contribution of each optimization, measured with repeats.

Run: ``ljperf ablation --model torch/llama-tiny --variants base,compile,compile+ckpt --repeat 3 --out runs/tiny``
then ``ljperf report runs/tiny`` to re-render. Modules: ``variants`` (named flag sets), ``runner`` (fresh
``ljperf benchmark`` subprocess per run, interleaved, resumable), ``stats`` (median, spread, speedups),
``report`` (terminal table, report.md, PNG). User guide: docs/ablation.md.
"""
