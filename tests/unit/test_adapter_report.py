"""The adapters' lines in a rank's output, and the health step's verdict on them."""

import pytest

from dsv41.adapterlog import PREFIX, read_report
from coordinator import config, plan
from coordinator.bringup.health import adapter_problem, enabled_adapters
from tests.configtext import HOME, REPO

pytestmark = pytest.mark.unit

PROFILE = (REPO / "docs" / "cpu-rehearsal.env").read_text()


def lines(*messages: str) -> list[str]:
    return [PREFIX + m for m in messages]


def rehearsal_plans():
    return plan.render_cluster(config.parse(PROFILE, "cpu-rehearsal.env", HOME))


def test_the_report_collects_installed_adapters_across_processes_and_every_line_that_leaves_one_out():
    report = read_report([
        "[2026-12-06 02:17:06] Applied 1 hook(s) to sglang.srt...",
        *lines("tp3_pad installed (DeepSeek-V4 heads ...; via HookRegistry)", "tp3_pad installed (again; via x)",
               "loop_abort stays out: DSV41_LOOP_NGRAM: must be an integer, got 'x'",
               "inflight could not patch sglang.srt.x.y: no such attribute; inflight stays out",
               "api_key: the HTTP API requires the key read from DSV41_API_KEY_FILE=/x"),
        "dsv41-adapter:tp3_pad installed (no space after the prefix: not an adapter line)",
    ])
    assert report.installed == {"tp3_pad"}
    assert report.left_out == ("loop_abort stays out: DSV41_LOOP_NGRAM: must be an integer, got 'x'",
                               "inflight could not patch sglang.srt.x.y: no such attribute; inflight stays out")


def test_the_rehearsal_profile_switches_on_only_adapters_a_dense_model_installs():
    head = rehearsal_plans()[0]
    assert enabled_adapters(head) == {"tp3_pad", "mxfp8_b12x", "prefill_empty_cache", "admission_gate", "loop_abort",
                                      "max_new_tokens", "inflight", "api_key", "forward_progress"}


def test_rank_0_fails_for_an_adapter_that_never_installed_and_a_worker_for_one_left_out():
    head, worker = rehearsal_plans()[:2]
    everything = [f"{name} installed (x)" for name in sorted(enabled_adapters(head))]
    assert adapter_problem(head, read_report(lines(*everything))) is None
    missing = adapter_problem(head, read_report(lines(*everything[1:])))
    assert missing.startswith(f"adapters switched on but never reported installed: {sorted(enabled_adapters(head))[0]}")
    assert "PYTHONPATH" in adapter_problem(head, read_report([]))
    # before a chat was served (the health step), only lines saying an adapter stayed out count
    assert adapter_problem(head, read_report([]), require_installed=False) is None
    # a worker's rank runs no HTTP server: only what it says of itself counts
    assert adapter_problem(worker, read_report(lines("tp3_pad installed (x)"))) is None
    left_out = adapter_problem(worker, read_report(lines("loop_abort stays out: bad setting")))
    assert left_out == "adapter not in effect: loop_abort stays out: bad setting"
