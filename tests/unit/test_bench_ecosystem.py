"""``weir bench client`` (bench/ecosystem.py) reading aiperf's own output:
the summary row taken from a real ``profile_export_aiperf.json`` (aiperf
0.13.0's multi-turn workload against ``vllm serve`` and weir, from the run in
bench/results/2026-12-05-ecosystem-client.md, trimmed to the keys the parser
reads and the run's identity), errors counted either way aiperf reports them,
the side-by-side table and its ratios, and the options each workload sends."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest

from bench import ecosystem

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "aiperf"


def _export(server: str) -> dict:
    return json.loads((FIXTURES / f"{server}-multi-turn.json").read_text())


# What each column must be, in aiperf's names: the table says TTFT p90, so it is aiperf's TTFT p90.
EXPECTED = {
    "ISL mean": ("input_sequence_length", "avg"),
    "req/s": ("request_throughput", "avg"),
    "out tok/s": ("output_token_throughput", "avg"),
    "TTFT p50": ("time_to_first_token", "p50"),
    "TTFT p90": ("time_to_first_token", "p90"),
    "TTFT p99": ("time_to_first_token", "p99"),
    "ITL p50": ("inter_token_latency", "p50"),
    "ITL p99": ("inter_token_latency", "p99"),
    "E2E p50": ("request_latency", "p50"),
    "E2E p99": ("request_latency", "p99"),
}


def test_a_real_export_gives_each_column_its_metric_and_statistic() -> None:
    export = _export("vllm")
    row = ecosystem.summarize(export)
    assert [c for c, _, _ in ecosystem.COLUMNS] == list(EXPECTED)
    for column, (tag, stat) in EXPECTED.items():
        assert row[column] == pytest.approx(export[tag][stat]), column
    assert row["TTFT p50"] <= row["TTFT p90"] <= row["TTFT p99"]
    assert row["requests"] == export["request_count"]["avg"] > 0
    assert export["error_summary"] == [] and "error_request_count" not in export
    assert row["errors"] == 0 and row["cancelled"] is False


def test_errors_come_from_the_error_count_or_else_from_the_error_summary() -> None:
    export = _export("weir")
    counted = {**export, "error_request_count": {"unit": "requests", "avg": 3.0}}
    assert ecosystem.summarize(counted)["errors"] == 3
    listed = copy.deepcopy(export)
    listed["error_summary"] = [
        {"error_details": {"code": 400, "type": "BadRequestError"}, "count": 2},
        {"error_details": {"code": 503, "type": "ServiceUnavailable"}, "count": 1},
    ]
    assert ecosystem.summarize(listed)["errors"] == 3


def test_a_metric_the_run_lacks_is_a_dash_and_no_ratio() -> None:
    unstreamed = {k: v for k, v in _export("weir").items() if k not in ("time_to_first_token", "inter_token_latency")}
    row = ecosystem.summarize(unstreamed)
    assert row["TTFT p50"] is None and row["ITL p50"] is None
    text = ecosystem.table({"multi-turn": {"vllm": ecosystem.summarize(_export("vllm")), "weir": row}})
    weir_row = next(line for line in text.splitlines() if "| weir |" in line)
    ratio_row = next(line for line in text.splitlines() if "weir / vllm" in line)
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    assert weir_row.strip("|").split("|")[header.index("TTFT p50")].strip() == "-"
    assert ratio_row.strip("|").split("|")[header.index("TTFT p50")].strip() == ""
    # E2E is still there on both sides: its ratio is
    assert ratio_row.strip("|").split("|")[header.index("E2E p50")].strip() != ""


def test_the_table_puts_both_servers_side_by_side_with_weir_over_vllm() -> None:
    rows = {"multi-turn": {s: ecosystem.summarize(_export(s)) for s in ("vllm", "weir")}}
    text = ecosystem.table(rows)
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:4] == ["workload", "server", "ok", "errors"]
    assert len(lines) == 2 + 3  # header, rule, vllm, weir, ratio
    cells = {line.split("|")[2].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines[2:]}
    assert set(cells) == {"vllm", "weir", "weir / vllm"}
    for column in ecosystem.RATIOS:
        i = header.index(column)
        expected = rows["multi-turn"]["weir"][column] / rows["multi-turn"]["vllm"][column]
        assert float(cells["weir / vllm"][i]) == pytest.approx(expected, abs=0.005)
        assert float(cells["vllm"][i]) == pytest.approx(rows["multi-turn"]["vllm"][column], abs=0.005)
    assert cells["weir"][header.index("ok")] == str(rows["multi-turn"]["weir"]["requests"])
    # a workload run on one server only has no ratio row
    assert "weir / vllm" not in ecosystem.table({"shared-prefix": {"vllm": rows["multi-turn"]["vllm"]}})


def _defaults() -> argparse.Namespace:
    return ecosystem._parser().parse_args([])


def test_each_workload_sends_its_own_shape_and_load() -> None:
    args = _defaults()
    shared = ecosystem.workload_options("shared-prefix", args)
    multi = ecosystem.workload_options("multi-turn", args)
    assert shared[shared.index("--num-prefix-prompts") + 1] == str(args.prefixes)
    assert "--request-rate" in shared and "--concurrency" not in shared
    assert multi[multi.index("--conversation-turn-mean") + 1] == str(args.turns)
    assert multi[multi.index("--session-header") + 1] == "X-Session-ID"
    assert "--concurrency" in multi and "--request-rate" not in multi
    with pytest.raises(ValueError, match="unknown workload"):
        ecosystem.workload_options("nope", args)


def test_the_client_reads_the_tokenizer_from_disk_and_streams_chat(tmp_path: Path) -> None:
    argv = ecosystem.aiperf_argv("http://127.0.0.1:8000", "multi-turn", tmp_path, _defaults())
    tokenizer = Path(argv[argv.index("--tokenizer") + 1])
    # aiperf runs in its artifacts directory; a name it cannot find there goes to the hub
    assert tokenizer.is_absolute() and tokenizer.is_dir()
    assert argv[argv.index("--endpoint-type") + 1] == "chat" and "--streaming" in argv
    assert argv[argv.index("--artifact-dir") + 1] == str(tmp_path)
    assert argv[0] == str(ecosystem.VENV / "bin" / "aiperf")
    assert argv[argv.index("--warmup-request-count") + 1] == "10"
    # aiperf refuses a warm-up of 0 requests: none is asked for instead
    no_warmup = ecosystem._parser().parse_args(["--warmup", "0"])
    assert "--warmup-request-count" not in ecosystem.aiperf_argv(
        "http://127.0.0.1:8000", "shared-prefix", tmp_path, no_warmup
    )
