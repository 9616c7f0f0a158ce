"""The start-up report: a phase named again either adds to the first (the model runner builds a
graph runner, precompiles every runner's kernels, then captures) or stands on its own (each
`warm_up` call's phases)."""

from __future__ import annotations

import time

from mmpipe.startup import StartupReport


def test_merged_phases_add_up_and_keep_their_first_place():
    report = StartupReport()
    with report.phase("prefill graphs", merge=True):
        time.sleep(0.02)
    with report.phase("Triton precompile"):
        pass
    with report.phase("prefill graphs", merge=True) as phase:
        time.sleep(0.03)
        phase.detail = "740 graphs"
    names = [p.name for p in report.phases]
    assert names == ["prefill graphs", "Triton precompile"]
    prefill = report.phases[0]
    assert prefill.seconds >= 0.05 and prefill.detail == "740 graphs"
    assert report.line().startswith("start-up ") and f"prefill graphs {prefill.seconds:.1f} s (740 graphs)" in report.line()


def test_unmerged_phases_of_one_name_stay_apart():
    report = StartupReport()
    for graphs in ("3 graphs", "5 graphs"):
        with report.phase("ViT graphs") as phase:
            phase.detail = graphs
    assert [(p.name, p.detail) for p in report.phases] == [("ViT graphs", "3 graphs"), ("ViT graphs", "5 graphs")]
