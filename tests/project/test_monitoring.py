"""The shipped monitoring files (deploy/monitoring/, issue 32) as Prometheus' own tool reads them: ``promtool check
rules`` of the alert rules, ``promtool test rules`` of their unit tests (each alert with series that should fire and
series that should not), ``promtool check config`` of the scrape config copied elsewhere with its rule file; and
the names both files and the Grafana dashboard use are the ones docs/metrics.md lists (or npu-exporter's).
The dashboard's queries against a real Prometheus: tests/system/monitoring/test_dashboard.py."""

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.support.prometheus import prometheus_problem

MONITORING = os.path.join(REPO_ROOT, "deploy", "monitoring")
ALERTS = os.path.join(MONITORING, "alerts.yml")
ALERTS_TEST = os.path.join(MONITORING, "alerts_test.yml")
SCRAPE_CONFIG = os.path.join(MONITORING, "prometheus.yml")
DASHBOARD = os.path.join(MONITORING, "grafana-dashboard.json")
METRICS_DOC = os.path.join(REPO_ROOT, "docs", "metrics.md")
PROMTOOL = "/usr/bin/promtool"  # Debian's prometheus package ships it beside the server (`make prometheus`)
NPU_EXPORTER_NAMES = {"npu_chip_info_utilization", "npu_chip_info_temperature", "npu_chip_info_power",
                      "npu_chip_info_used_memory", "npu_chip_info_total_memory"}  # Huawei's npu-exporter's names
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def promtool(*args: str, cwd: str = MONITORING) -> str:
    if not os.access(PROMTOOL, os.X_OK):
        pytest.skip("needs promtool: %s" % (prometheus_problem() or "%s is absent from the installed "
                                             "prometheus package" % PROMTOOL))
    done = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def alert_rules():
    with open(ALERTS) as handle:
        return [r for g in yaml.safe_load(handle)["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_alert_rules():
    out = promtool("check", "rules", ALERTS)
    assert "SUCCESS: %d rules found" % len(alert_rules()) in out, out


def test_promtool_runs_the_unit_tests_of_every_alert():
    assert "SUCCESS" in promtool("test", "rules", ALERTS_TEST)


def test_each_alert_has_for_severity_annotations_and_tests_that_fire_and_that_do_not():
    with open(ALERTS_TEST) as handle:
        tests = yaml.safe_load(handle)["tests"]
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"AtlasEdgeBoxDown", "AtlasEdgeBoxStale", "AtlasEdgeCameraStalled",
                                           "AtlasEdgeFrameAgeHigh", "AtlasEdgeMemoryGrowing",
                                           "AtlasEdgeBackendSaturated", "AtlasEdgeOutboxGrowing",
                                           "AtlasEdgeRollback", "AtlasEdgeNpuTemperatureHigh"}
    for rule in rules:
        assert "for" in rule and rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        cases = [(t, c) for t in tests for c in t["alert_rule_test"] if c["alertname"] == rule["alert"]]
        fired = sum(len(c["exp_alerts"]) for _t, c in cases)
        assert fired > 0, "%s: no test where it fires" % rule["alert"]
        # series that should not fire: more input series than alerts expected from them, or a case expecting none
        quiet = any(not c["exp_alerts"] or len(t["input_series"]) > len(c["exp_alerts"]) for t, c in cases)
        assert quiet, "%s: no input that should not fire" % rule["alert"]


def test_promtool_checks_the_scrape_config_away_from_the_repository(tmp_path):
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(os.path.join(MONITORING, name), str(tmp_path))
    out = promtool("check", "config", str(tmp_path / "prometheus.yml"), cwd=str(tmp_path))
    assert "SUCCESS: 1 rule files found" in out, out
    with open(SCRAPE_CONFIG) as handle:
        config = yaml.safe_load(handle)
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"atlas-edge-box", "atlas-edge-fleet", "npu-exporter"}
    assert 'up{job="atlas-edge-box"}' in [r["expr"] for r in alert_rules() if r["alert"] == "AtlasEdgeBoxDown"][0]
    for job in jobs.values():  # loopback examples only
        for static in job["static_configs"]:
            assert all(t.startswith("127.0.0.1:") for t in static["targets"]), job


def dashboard_exprs():
    with open(DASHBOARD) as handle:
        dashboard = json.load(handle)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    return dashboard, panels, [t["expr"] for p in panels for t in p["targets"]]


def series_names(expr: str):
    """The metric names an expression reads: identifiers followed by a selector, a range or a space/paren end."""
    words = set(re.findall(r"\b((?:atlas_edge|npu_chip_info)_[a-z_]+)\b", expr))
    return {HISTOGRAM_SUFFIX.sub("", w) if not w.endswith("_total") else w for w in words}


def test_every_series_the_dashboard_and_alerts_use_is_documented():
    with open(METRICS_DOC, encoding="utf-8") as handle:
        documented = set(re.findall(r"^\| `([a-z_]+)` \|", handle.read(), flags=re.M))
    assert len(documented) > 30, documented
    dashboard, panels, exprs = dashboard_exprs()
    used = set().union(*(series_names(e) for e in exprs + [r["expr"] for r in alert_rules()]))
    assert used - documented - NPU_EXPORTER_NAMES == set()
    assert {"atlas_edge_fleet_boxes", "atlas_edge_stage_seconds", "npu_chip_info_temperature"} <= used


def test_the_dashboard_is_a_plain_grafana_model_with_a_datasource_variable():
    dashboard, panels, exprs = dashboard_exprs()
    assert 36 <= dashboard["schemaVersion"] <= 39 and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"device", "source"} <= set(variables)
    assert len(panels) >= 15 and len(exprs) >= len(panels)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"] and panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
