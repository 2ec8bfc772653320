"""bench/itl_gap.py's small readers: a Prometheus sample, the server's thread log line, the
--threads settings."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))
try:
    _spec = importlib.util.spec_from_file_location("moed_bench_itl_gap", BENCH / "itl_gap.py")
    itl = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(itl)
finally:
    sys.path.remove(str(BENCH))

METRICS = """\
# HELP moed_capacity_decode_step_seconds Measured mean time of a recent engine step that decoded
# TYPE moed_capacity_decode_step_seconds gauge
moed_capacity_decode_step_seconds 0.0093
moed_capacity_decode_step_seconds_created 1.7e9
moed_step_seconds_bucket{le="0.01"} 12.0
moed_capacity_prefill_tokens_per_second NaN
"""


def test_metric_reads_one_unlabelled_sample():
    assert itl.metric(METRICS, "moed_capacity_decode_step_seconds") == pytest.approx(0.0093)
    assert itl.metric(METRICS, "moed_step_seconds") is None          # only labelled samples
    nan = itl.metric(METRICS, "moed_capacity_prefill_tokens_per_second")
    assert nan != nan


def test_server_threads_from_json_and_console_logs():
    js = ('{"torch_threads": 1, "cores_available": 2, "chosen_by": "auto", '
          '"event": "engine_threads", "level": "info"}\n')
    console = "2026-12-01 [info ] engine_threads  chosen_by=auto cores_available=16 torch_threads=15\n"
    assert itl.server_threads(js) == 1
    assert itl.server_threads(console) == 15
    assert itl.server_threads("engine_started kv_blocks=3\n") is None


def test_thread_settings():
    assert itl.parse_setting("auto") == ("auto", False)
    assert itl.parse_setting("2+pin") == ("2", True)
    for bad in ("two", "2+bind", "auto+"):
        with pytest.raises(ValueError):
            itl.parse_setting(bad)


def test_window_mean_is_the_histograms_mean_between_two_scrapes():
    before = "moed_decode_step_seconds_sum 1.5\nmoed_decode_step_seconds_count 100.0\n"
    after = "moed_decode_step_seconds_sum 2.0\nmoed_decode_step_seconds_count 150.0\n"
    assert itl.window_mean(before, after, "moed_decode_step_seconds") == pytest.approx(0.01)
    assert itl.window_mean(before, before, "moed_decode_step_seconds") is None    # no steps between
    assert itl.window_mean("", after, "moed_decode_step_seconds") is None         # not exported


def test_window_mean_adds_up_label_sets():
    before = 'moed_inter_token_latency_seconds_sum{model_name="m"} 1.0\nmoed_inter_token_latency_seconds_count{model_name="m"} 10.0\n'
    after = 'moed_inter_token_latency_seconds_sum{model_name="m"} 1.5\nmoed_inter_token_latency_seconds_count{model_name="m"} 60.0\n'
    assert itl.window_mean(before, after, "moed_inter_token_latency_seconds") == pytest.approx(0.01)
