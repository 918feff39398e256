//! The Grafana dashboard and the Prometheus rules in deploy/: the chart carries copies
//! of both, every query names a metric the services document, every panel and alert
//! has what operators need, the real processes expose each queried metric with its
//! type, and promtool (Debian: `prometheus`, when installed) parses and unit-tests the
//! PromQL.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use sluice_e2e::deploy_files::{panels, read, root as repo};
use sluice_e2e::pytools::{bounded, pytools};
use sluice_e2e::{Spec, TestCluster};

const PROMTOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// The metric names dashboards and alerts may use (docs/metrics.md; the names are the
/// contract with cluster's telemetry module). Histograms also expose _bucket/_count/_sum.
const COUNTERS_AND_GAUGES: [&str; 38] = [
    "sluice_build_info",
    "sluice_requests_total",
    "sluice_prompt_tokens_total",
    "sluice_cached_tokens_total",
    "sluice_generated_tokens_total",
    "sluice_requests_running",
    "sluice_router_workers",
    "sluice_prefill_tokens_total",
    "sluice_prefill_requests_waiting",
    "sluice_prefill_requests_running",
    "sluice_prefix_cache_query_tokens_total",
    "sluice_prefix_cache_hit_tokens_total",
    "sluice_kv_transfer_bytes_total",
    "sluice_kv_pages_used",
    "sluice_kv_pages_total",
    "sluice_decode_tokens_total",
    "sluice_decode_requests_running",
    "sluice_decode_requests_waiting",
    "sluice_kv_state_slots_used",
    "sluice_kv_state_slots_total",
    "sluice_decode_cuda_graph_captures_refused_total",
    "sluice_prefix_cache_recompute_tokens_total",
    "sluice_prefix_cache_errors_total",
    "sluice_prefix_cache_put_bytes_total",
    "sluice_kvstore_lookups_total",
    "sluice_kvstore_query_tokens_total",
    "sluice_kvstore_hit_tokens_total",
    "sluice_kvstore_miss_tokens_total",
    "sluice_kvstore_read_bytes_total",
    "sluice_kvstore_written_bytes_total",
    "sluice_kvstore_entries",
    "sluice_kvstore_stored_bytes",
    "sluice_kvstore_evictions_total",
    "sluice_kvstore_disk_bytes",
    "sluice_kvstore_capacity_bytes",
    "sluice_kvstore_put_dropped_total",
    "sluice_kvstore_write_errors_total",
    "sluice_kvstore_corrupt_records_total",
];
const HISTOGRAMS: [&str; 8] = [
    "sluice_request_ttft_seconds",
    "sluice_request_inter_token_latency_seconds",
    "sluice_request_e2e_seconds",
    "sluice_request_queue_seconds",
    "sluice_kv_transfer_seconds",
    "sluice_decode_step_seconds",
    "sluice_prefix_cache_restore_seconds",
    "sluice_kvstore_get_seconds",
];

#[test]
fn chart_copies_equal_their_sources() {
    for (copy, source) in [
        ("deploy/helm/sluice/dashboards/sluice-dashboard.json", "deploy/grafana/sluice-dashboard.json"),
        ("deploy/helm/sluice/rules/alerts.yaml", "deploy/prometheus/alerts.yaml"),
    ] {
        assert!(read(copy) == read(source), "{copy} differs from {source}: copy it again (cp {source} {copy})");
    }
}

/// Metric names used in a PromQL expression (recording-rule names contain ':' and are
/// not metric names of ours).
fn metric_names(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut names = Vec::new();
    let mut i = 0;
    while let Some(off) = expr[i..].find("sluice_") {
        let start = i + off;
        let mut end = start;
        while end < bytes.len() && word(bytes[end]) {
            end += 1;
        }
        let inside_string = expr[..start].matches('"').count() % 2 == 1;
        if (start == 0 || !word(bytes[start - 1])) && !inside_string {
            names.push(expr[start..end].to_string());
        }
        i = end.max(start + 1);
    }
    names
}

fn known_metric(name: &str) -> bool {
    COUNTERS_AND_GAUGES.contains(&name)
        || HISTOGRAMS.iter().any(|h| ["_bucket", "_count", "_sum"].iter().any(|s| name == format!("{h}{s}")))
}

#[test]
fn dashboard_is_valid_and_queries_known_metrics() {
    let dash: Value = serde_json::from_str(&read("deploy/grafana/sluice-dashboard.json")).expect("dashboard is JSON");
    assert_eq!(dash["uid"], "sluice-overview");
    let vars: BTreeMap<&str, &Value> =
        dash["templating"]["list"].as_array().unwrap().iter().map(|v| (v["name"].as_str().unwrap(), v)).collect();
    assert_eq!(vars["datasource"]["type"], "datasource");
    assert_eq!(vars["datasource"]["query"], "prometheus");
    for v in ["job", "instance"] {
        assert_eq!(vars[v]["datasource"]["uid"], "${datasource}", "{v}");
        assert!(vars[v]["definition"].as_str().unwrap().contains("sluice_build_info"), "{v}");
    }

    let mut exprs = Vec::new();
    let mut ids = BTreeSet::new();
    for p in panels(&dash) {
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "duplicate panel id {}", p["id"]);
        if p["type"] == "row" {
            continue;
        }
        let title = p["title"].as_str().unwrap_or("?");
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("panel {title} has no targets"));
        assert!(!targets.is_empty(), "panel {title} has no targets");
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_else(|| panic!("a target of {title} has no expr"));
            assert!(!expr.trim().is_empty(), "a target of {title} has an empty expr");
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{title}: {expr} queries no sluice metric");
            for n in names {
                assert!(known_metric(&n), "{title}: unknown metric {n} in {expr}");
            }
            if !expr.starts_with("sluice_build_info") {
                assert!(
                    expr.contains(r#"job=~"$job""#) && expr.contains(r#"instance=~"$instance""#),
                    "{title}: {expr}"
                );
            }
            exprs.push(expr.to_string());
        }
    }
    let all = exprs.join("\n");
    // What the dashboard must show.
    for want in [
        "sum(rate(sluice_prefix_cache_hit_tokens_total{",
        "sum by (pool) (rate(sluice_prefix_cache_hit_tokens_total{",
        "histogram_quantile(0.5, sum by (le) (rate(sluice_request_ttft_seconds_bucket{",
        "histogram_quantile(0.9, sum by (le) (rate(sluice_request_ttft_seconds_bucket{",
        "histogram_quantile(0.99, sum by (le) (rate(sluice_request_ttft_seconds_bucket{",
        "histogram_quantile(0.5, sum by (le) (rate(sluice_request_inter_token_latency_seconds_bucket{",
        "histogram_quantile(0.99, sum by (le) (rate(sluice_request_inter_token_latency_seconds_bucket{",
        "sum(rate(sluice_generated_tokens_total{",
        "sum(rate(sluice_prompt_tokens_total{",
        "sum(rate(sluice_kv_transfer_bytes_total{",
        "sluice_prefill_requests_waiting{",
        "sluice_decode_requests_waiting{",
        "sum by (job) (sluice_kv_pages_used{",
        "sum by (status) (rate(sluice_requests_total{",
        "sum by (instance) (rate(sluice_decode_tokens_total{",
        "sum by (instance) (rate(sluice_prefill_tokens_total{",
    ] {
        assert!(all.contains(want), "the dashboard has no query with {want}");
    }
}

#[test]
fn alert_rules_are_well_formed() {
    let tools = pytools();
    let docs = tools.yaml_docs(&repo().join("deploy/prometheus/alerts.yaml"));
    assert_eq!(docs.len(), 1, "one document");
    let groups = docs[0]["groups"].as_array().expect("top-level groups:");
    let mut alerts = BTreeSet::new();
    let mut records = BTreeSet::new();
    for g in groups {
        let group = g["name"].as_str().expect("group name");
        let rules = g["rules"].as_array().unwrap_or_else(|| panic!("{group}: no rules"));
        assert!(!rules.is_empty(), "{group}: no rules");
        for r in rules {
            let expr = r["expr"].as_str().unwrap_or_else(|| panic!("{group}: a rule without expr: {r}"));
            for n in metric_names(expr) {
                assert!(known_metric(&n), "{group}: unknown metric {n} in {expr}");
            }
            if let Some(name) = r["record"].as_str() {
                assert!(
                    name.starts_with("sluice:"),
                    "recording rule {name}: level:metric:operations, prefixed sluice:"
                );
                records.insert(name.to_string());
                continue;
            }
            let name = r["alert"].as_str().unwrap_or_else(|| panic!("{group}: rule neither record nor alert: {r}"));
            assert!(r["for"].as_str().is_some_and(|f| !f.is_empty()), "{name}: no `for`");
            let severity = r["labels"]["severity"].as_str().unwrap_or_else(|| panic!("{name}: no labels.severity"));
            assert!(["critical", "warning", "info"].contains(&severity), "{name}: severity {severity}");
            for a in ["summary", "description"] {
                assert!(r["annotations"][a].as_str().is_some_and(|s| !s.is_empty()), "{name}: no annotations.{a}");
            }
            // Recording rules used by an alert must exist.
            for token in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
                if token.starts_with("sluice:") {
                    assert!(records.contains(token), "{name} uses {token}, which no earlier rule records");
                }
            }
            assert!(alerts.insert(name.to_string()), "duplicate alert {name}");
        }
    }
    for want in [
        "SluiceTTFTBudgetBurnFast",
        "SluiceTTFTBudgetBurnSlow",
        "SluicePrefixCacheHitRateCollapse",
        "SluiceKVPoolExhausted",
        "SluiceCudaGraphsOff",
        "SluiceNoHealthyWorkers",
        "SluiceWorkersLost",
        "SluiceTargetDown",
        "SluiceHighErrorRate",
    ] {
        assert!(alerts.contains(want), "no alert {want}: {alerts:?}");
    }
    // The TTFT threshold must be a real bucket boundary, or the burn-rate alerts never fire.
    let text = read("deploy/prometheus/alerts.yaml");
    assert!(text.contains(r#"sluice_request_ttft_seconds_bucket{le="2.5"}"#));
}

/// Every metric the dashboard and the alerts query is exposed by the real processes, with
/// the right type, and the TTFT SLO threshold of the alerts is one of the histogram's buckets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alert_metrics_are_exposed_by_the_services() {
    let dash: Value = serde_json::from_str(&read("deploy/grafana/sluice-dashboard.json")).unwrap();
    let mut used: BTreeSet<String> = panels(&dash)
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .flat_map(|t| metric_names(t["expr"].as_str().unwrap_or_default()))
        .collect();
    used.extend(read("deploy/prometheus/alerts.yaml").lines().flat_map(metric_names));
    assert!(used.len() >= 20, "the dashboard and alerts query {} metrics: {used:?}", used.len());

    let spec = Spec { kvstore: Some(sluice_e2e::KvSpec::policy("periodic:1024")), ..Spec::new(1, 1) };
    let c = TestCluster::start(spec).await;
    let mut exposed = BTreeMap::new();
    let mut text = String::new();
    for service in ["router", "prefill-0", "decode-0", "kvstore"] {
        let scraped = c.scrape(service).await;
        for line in scraped.lines() {
            if let Some([name, kind]) =
                line.strip_prefix("# TYPE ").map(|l| l.split_whitespace().collect::<Vec<_>>()).as_deref()
            {
                exposed.insert(name.to_string(), kind.to_string());
            }
        }
        text.push_str(&scraped);
    }
    for name in &used {
        let (base, kind) = match HISTOGRAMS.iter().find(|h| name.starts_with(*h) && name != *h) {
            Some(h) => (h.to_string(), "histogram"),
            None => (name.clone(), ""),
        };
        let got =
            exposed.get(&base).unwrap_or_else(|| panic!("{name} is queried but not exposed; exposed: {exposed:?}"));
        assert!(kind.is_empty() || got == kind, "{base} is a {got}, queried as a {kind}");
    }
    assert!(text.contains(r#"sluice_request_ttft_seconds_bucket{le="2.5"}"#), "no 2.5 s TTFT bucket:\n{text}");
}

/// promtool (Debian: `prometheus`) parses every PromQL expression: the rules, their unit
/// tests (alerts_test.yaml), and the dashboard's queries. Skipped, saying so, without it.
#[test]
fn promtool_checks_rules_and_dashboard_queries() {
    let promtool = std::env::var_os("PROMTOOL").map(PathBuf::from).or_else(|| {
        std::env::var_os("PATH")
            .and_then(|p| std::env::split_paths(&p).map(|d| d.join("promtool")).find(|p| p.is_file()))
    });
    let Some(promtool) = promtool else {
        eprintln!("promtool not found (apt-get install prometheus, or set PROMTOOL): PromQL not checked");
        return;
    };
    let prom = repo().join("deploy/prometheus");
    let check =
        bounded(Command::new(&promtool).args(["check", "rules"]).arg(prom.join("alerts.yaml")), PROMTOOL_TIMEOUT);
    assert!(check.success(), "promtool check rules:\n{}", check.output());
    let test = bounded(
        Command::new(&promtool).args(["test", "rules", "alerts_test.yaml"]).current_dir(&prom),
        PROMTOOL_TIMEOUT,
    );
    assert!(test.success(), "promtool test rules:\n{}", test.output());

    // The dashboard's queries as recording rules, with Grafana's variables filled in.
    let dash: Value = serde_json::from_str(&read("deploy/grafana/sluice-dashboard.json")).unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, t) in panels(&dash).iter().flat_map(|p| p["targets"].as_array().into_iter().flatten()).enumerate() {
        let expr = t["expr"]
            .as_str()
            .unwrap()
            .replace("$__rate_interval", "5m")
            .replace("$job", ".*")
            .replace("$instance", ".*");
        rules.push_str(&format!("      - record: dashboard:query:{i}\n        expr: {}\n", Value::String(expr)));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard-rules.yaml");
    std::fs::write(&file, rules).unwrap();
    let check = bounded(Command::new(&promtool).args(["check", "rules"]).arg(&file), PROMTOOL_TIMEOUT);
    assert!(check.success(), "promtool check rules (dashboard queries):\n{}", check.output());
}
