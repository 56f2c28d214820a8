"""`joader analyze`'s report (joader.client.tools.analyze): the model's check against the window it was
fit on, and what it prints."""

from __future__ import annotations

from joader.analysis import STATED_ERROR, HostWindow, JobWindow
from joader.client.tools.analyze import _since_start, analyze, format_report

HOST = HostWindow(cores=2.0, workers=1, decode_cpu_s=0.004, decodes_per_delivery=0.5,
                  fresh_decodes_per_delivery=0.5, server_cpu_per_sample=0.0001, jobs_cpu_per_sample=0.0002,
                  rest_cores=0.1, cache_bytes=100, data_bytes=400)


def test_the_report_states_its_error_and_the_models_stall_for_the_setting_measured() -> None:
    jobs = [JobWindow("slow", "s", 1000, 50.0, 0.02, 0.0196, 0.0004),
            JobWindow("fast", "f", 1000, 400.0, 0.8, 0.0005, 0.002)]
    report = analyze(jobs, HOST)
    assert report["stated_error"] == STATED_ERROR
    for job in report["jobs"]:
        assert job["model_check"]["within_stated_error"], job
        assert job["workers"][0]["workers"] == 1 and job["workers"][0]["stall"] == job["model_check"]["predicted_stall"]
    fast = next(j for j in report["jobs"] if j["name"] == "fast")
    assert fast["bound"] == "prep" and fast["recommendation"].startswith("prep-bound (stall 80%): try")
    text = format_report(report)
    assert "within 5 percentage points" in text and "1 (now): stall 80%" in text, text
    assert "model for this setting: 2%" in text and "misses" not in text, text


def test_a_window_the_model_cannot_reproduce_is_flagged() -> None:
    """A prep-bound job got 100/s where the model's one worker does 500/s: more than the
    calibration trusts (a mix that changed while analyze watched). Said, not hidden."""
    jobs = [JobWindow("a", "a", 1000, 100.0, 0.8, 0.002, 0.008)]
    report = analyze(jobs, HOST)
    check = report["jobs"][0]["model_check"]
    assert not check["within_stated_error"] and check["error"] < -STATED_ERROR, check
    text = format_report(report)
    assert "misses this window's stall by 30%" in text and "longer --interval" in text, text


def test_a_window_without_decodes_costs_a_smaller_caches_decodes_as_since_start() -> None:
    """A whole-dataset cache after its first epoch decodes nothing: the 1/2x what-if still
    needs decodes, priced at the workers' busy seconds per decode since joaderd started."""
    status = {"items_decoded": 600, "decodes": {"decode_s": 3.0}, "sharing": {"within_epoch": 4.0}}
    assert _since_start(status) == (0.005, 0.25)
    assert _since_start({"items_decoded": 0, "decodes": {"decode_s": 0.0}, "sharing": {"within_epoch": None}}) == (0.0, 1.0)
