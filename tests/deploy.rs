//! The deployment files (deploy/compose.yaml, deploy/Dockerfile, deploy/grafana) against
//! the real binary: every flag they pass must be one `nrtxn serve` accepts, the nodes must
//! agree on the shared services, and the dashboard must chart every metric a running
//! server exposes. No Docker or network is needed (the dashboard's test starts a server
//! on loopback).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_yaml_ng::Value;

const NRTXN_SERVICES: [&str; 2] = ["nrtxn-0", "nrtxn-1"];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn compose() -> Value {
    let path = deploy_dir().join("compose.yaml");
    serde_yaml_ng::from_str(&read(&path))
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()))
}

fn service<'a>(compose: &'a Value, name: &str) -> &'a Value {
    compose
        .get("services")
        .and_then(|s| s.get(name))
        .unwrap_or_else(|| panic!("compose.yaml has no service {name}"))
}

/// A YAML scalar as the string the container would get (`"0"` and `0` alike).
fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("expected a scalar, got {other:?}"),
    }
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for key in path {
        cur = cur
            .get(*key)
            .unwrap_or_else(|| panic!("missing key {key} of {path:?}"));
    }
    cur.as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string: {cur:?}"))
}

/// The `command:` of a service, in list form.
fn command(compose: &Value, name: &str) -> Vec<String> {
    service(compose, name)
        .get("command")
        .and_then(Value::as_sequence)
        .unwrap_or_else(|| panic!("{name}: `command` should be a list"))
        .iter()
        .map(scalar)
        .collect()
}

/// The last `CMD` and `ENTRYPOINT` of the Dockerfile (the final stage's), each a JSON
/// array. Continuation lines are joined and comments dropped, so the `CMD` inside a
/// `HEALTHCHECK` is not taken for one.
fn dockerfile_exec_forms() -> (Vec<String>, Vec<String>) {
    let text = read(&deploy_dir().join("Dockerfile"));
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                instructions.push(std::mem::take(&mut current));
            }
        }
    }
    let last = |keyword: &str| -> Vec<String> {
        let json = instructions
            .iter()
            .rev()
            .find_map(|i| {
                let (word, rest) = i.split_once(char::is_whitespace)?;
                word.eq_ignore_ascii_case(keyword).then_some(rest.trim())
            })
            .unwrap_or_else(|| panic!("the Dockerfile has no {keyword}"));
        serde_json::from_str(json)
            .unwrap_or_else(|e| panic!("{keyword} {json} is not an exec-form JSON array: {e}"))
    };
    (last("ENTRYPOINT"), last("CMD"))
}

fn nrtxn(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nrtxn"));
    cmd.args(args);
    // Options may come from NRTXN_* variables: keep the caller's out of the way.
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("NRTXN_") {
            cmd.env_remove(key);
        }
    }
    cmd.output().expect("run nrtxn")
}

/// The long flags `nrtxn serve --help` lists, from its option lines.
fn serve_flags() -> BTreeSet<String> {
    let out = nrtxn(&["serve", "--help"]);
    assert!(out.status.success(), "nrtxn serve --help failed: {out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    let flags: BTreeSet<String> = help
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| l.split([' ', ',', '=']))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect();
    // The parse must find the flags this file relies on, or every check below is vacuous.
    for known in [
        "--listen",
        "--data-dir",
        "--kafka-brokers",
        "--node-id",
        "--help",
    ] {
        assert!(flags.contains(known), "{known} not found in:\n{help}");
    }
    flags
}

/// `--flag value` pairs of a `serve` command line; `--flag=value` is split too.
fn options(args: &[String]) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        assert!(
            arg.starts_with("--"),
            "{arg:?} is not a flag (a value without one before it?) in {args:?}"
        );
        let (flag, value) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), v.to_string()),
            None => {
                let v = rest
                    .next()
                    .unwrap_or_else(|| panic!("{arg} has no value in {args:?}"));
                assert!(!v.starts_with("--"), "{arg} has no value in {args:?}");
                (arg.clone(), v.clone())
            }
        };
        assert!(
            map.insert(flag.clone(), value).is_none(),
            "{flag} given twice in {args:?}"
        );
    }
    map
}

/// The flags of `args` (a whole `serve ...` line) the binary does not list.
fn unknown_flags(args: &[String], accepted: &BTreeSet<String>) -> Vec<String> {
    assert_eq!(
        args.first().map(String::as_str),
        Some("serve"),
        "the subcommand should be `serve`: {args:?}"
    );
    options(&args[1..])
        .into_keys()
        .filter(|f| !accepted.contains(f))
        .collect()
}

/// Runs the binary on `args` plus a `--config` file that does not exist: clap must accept
/// every flag and value (types included), so the run stops at reading the config file,
/// before anything is opened or connected.
fn assert_binary_parses(args: &[String], what: &str) {
    assert!(
        !args
            .iter()
            .any(|a| a == "--config" || a.starts_with("--config=")),
        "{what}: uses --config, which this check relies on being free"
    );
    let missing = std::env::temp_dir().join("nrtxn-deploy-test-no-such-dir/none.toml");
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(["--config", missing.to_str().unwrap()]);
    let out = nrtxn(&all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("config: cannot read"),
        "{what}: `nrtxn {}` was not accepted by the argument parser: {stderr}",
        args.join(" ")
    );
}

#[test]
fn compose_defines_kafka_mongo_and_two_nrtxn_nodes_built_from_the_dockerfile() {
    let c = compose();
    for name in ["kafka", "mongo"].into_iter().chain(NRTXN_SERVICES) {
        service(&c, name);
    }
    for name in NRTXN_SERVICES {
        let s = service(&c, name);
        let context = str_at(s, &["build", "context"]);
        let dockerfile = str_at(s, &["build", "dockerfile"]);
        let path = deploy_dir().join(context).join(dockerfile);
        assert!(
            path.is_file(),
            "{name}: build {context}/{dockerfile} is not a file ({})",
            path.display()
        );
        assert_eq!(
            path.canonicalize().unwrap(),
            deploy_dir().join("Dockerfile").canonicalize().unwrap(),
            "{name} should be built from deploy/Dockerfile"
        );
        for dep in ["kafka", "mongo"] {
            assert_eq!(
                str_at(s, &["depends_on", dep, "condition"]),
                "service_healthy",
                "{name} should wait for {dep} to be healthy"
            );
        }
    }
}

#[test]
fn nrtxn_nodes_have_distinct_ids_and_share_brokers_mongo_and_group() {
    let c = compose();
    let opts: Vec<BTreeMap<String, String>> = NRTXN_SERVICES
        .iter()
        .map(|name| options(&command(&c, name)[1..]))
        .collect();
    let get = |i: usize, flag: &str| opts[i].get(flag).cloned();

    assert_eq!(get(0, "--node-id").as_deref(), Some("0"));
    assert_eq!(get(1, "--node-id").as_deref(), Some("1"));
    for flag in [
        "--kafka-brokers",
        "--mongo-uri",
        "--kafka-group",
        "--kafka-requests-topic",
        "--kafka-partitions",
    ] {
        assert_eq!(get(0, flag), get(1, flag), "the nodes differ in {flag}");
    }
    let brokers = get(0, "--kafka-brokers").expect("--kafka-brokers is set");
    let mongo = get(0, "--mongo-uri").expect("--mongo-uri is set");

    // They point at the services of this file.
    assert_eq!(brokers, "kafka:9092");
    assert!(
        mongo.starts_with("mongodb://mongo:27017/"),
        "mongo uri {mongo}"
    );
    let mongod = command(&c, "mongo");
    let repl_set = mongod
        .iter()
        .position(|a| a == "--replSet")
        .map(|i| mongod[i + 1].clone())
        .expect("mongod runs with --replSet");
    assert!(
        mongo.contains(&format!("replicaSet={repl_set}")),
        "{mongo} should name the replica set {repl_set}"
    );

    // Each node has its own host port and its own data volume.
    let distinct = |key: &str| {
        let values: BTreeSet<String> = NRTXN_SERVICES
            .iter()
            .map(|name| {
                let list = service(&c, name)
                    .get(key)
                    .and_then(Value::as_sequence)
                    .unwrap_or_else(|| panic!("{name}: no {key}"));
                list.iter().map(scalar).collect::<Vec<_>>().join(",")
            })
            .collect();
        assert_eq!(
            values.len(),
            NRTXN_SERVICES.len(),
            "{key} shared: {values:?}"
        );
    };
    distinct("ports");
    distinct("volumes");
}

#[test]
fn compose_services_pass_only_flags_the_binary_accepts() {
    let accepted = serve_flags();
    let c = compose();
    for name in NRTXN_SERVICES {
        let args = command(&c, name);
        let unknown = unknown_flags(&args, &accepted);
        assert!(
            unknown.is_empty(),
            "{name} passes flags `nrtxn serve` does not have: {unknown:?} (it has {accepted:?})"
        );
        assert_binary_parses(&args, name);
    }
}

#[test]
fn dockerfile_runs_nrtxn_serve_with_only_flags_the_binary_accepts() {
    let accepted = serve_flags();
    let (entrypoint, cmd) = dockerfile_exec_forms();
    assert_eq!(entrypoint, ["nrtxn"]);
    let unknown = unknown_flags(&cmd, &accepted);
    assert!(
        unknown.is_empty(),
        "the Dockerfile's CMD passes flags `nrtxn serve` does not have: {unknown:?}"
    );
    assert_binary_parses(&cmd, "Dockerfile CMD");
}

#[test]
fn the_image_and_the_nodes_listen_on_the_exposed_port_and_keep_data_in_the_volume() {
    let text = read(&deploy_dir().join("Dockerfile"));
    let (_, cmd) = dockerfile_exec_forms();
    let image = options(&cmd[1..]);
    assert_eq!(image["--listen"], "0.0.0.0:8080");
    assert_eq!(image["--data-dir"], "/var/lib/nrtxn");
    assert!(
        text.lines().any(|l| l.trim() == "EXPOSE 8080"),
        "EXPOSE 8080"
    );
    assert!(
        text.lines()
            .any(|l| l.trim() == r#"VOLUME ["/var/lib/nrtxn"]"#),
        "the data dir should be a volume"
    );

    let c = compose();
    for name in NRTXN_SERVICES {
        let node = options(&command(&c, name)[1..]);
        assert_eq!(node["--listen"], image["--listen"], "{name} --listen");
        assert_eq!(node["--data-dir"], image["--data-dir"], "{name} --data-dir");
        let s = service(&c, name);
        let ports: Vec<String> = s["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(scalar)
            .collect();
        assert!(
            ports.len() == 1 && ports[0].ends_with(":8080"),
            "{name} should publish container port 8080: {ports:?}"
        );
        let volumes: Vec<String> = s["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(scalar)
            .collect();
        assert!(
            volumes.iter().any(|v| v.ends_with(":/var/lib/nrtxn")),
            "{name} should mount a volume at /var/lib/nrtxn: {volumes:?}"
        );
        let check: Vec<String> = s["healthcheck"]["test"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{name}: healthcheck test should be a list"))
            .iter()
            .map(scalar)
            .collect();
        assert!(
            check.iter().any(|a| a == "http://127.0.0.1:8080/readyz"),
            "{name} should check /readyz: {check:?}"
        );
    }
}

/// The nodes listen on 0.0.0.0, so protected mode refuses to start them with no access
/// key: compose must create one in the store they read before they start.
#[test]
fn compose_creates_an_admin_key_in_the_nodes_store_before_they_start() {
    let c = compose();
    let script = service(&c, "nrtxn-keys")
        .get("command")
        .and_then(Value::as_sequence)
        .and_then(|c| c.first())
        .and_then(Value::as_str)
        .expect("nrtxn-keys runs a shell script");
    // Compose turns `$$` into `$` before the shell sees it.
    let script = script.replace("$$", "$");
    let mongo = options(&command(&c, "nrtxn-0")[1..])["--mongo-uri"].clone();
    assert!(
        script.contains(&format!("uri='{mongo}'")),
        "nrtxn-keys should use the nodes' --mongo-uri {mongo}:\n{script}"
    );
    for needed in [
        "nrtxn keys list --mongo-uri \"$uri\"",
        "nrtxn keys create --role admin",
    ] {
        assert!(script.contains(needed), "{needed:?} not in:\n{script}");
    }
    // The secret goes to a file, never to the log.
    assert!(
        script.contains("> /var/lib/nrtxn-keys/admin.key"),
        "{script}"
    );
    for name in NRTXN_SERVICES {
        assert_eq!(
            str_at(
                service(&c, name),
                &["depends_on", "nrtxn-keys", "condition"]
            ),
            "service_completed_successfully",
            "{name} should start after the key step"
        );
    }
    // The flags the script passes are the binary's.
    let out = nrtxn(&["keys", "create", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--role", "--name", "--mongo-uri"] {
        assert!(help.contains(flag), "`nrtxn keys create` has no {flag}");
    }
}

/// The metric names a PromQL expression reads, histogram series named by their family
/// (`x_bucket`, `x_sum`, `x_count` are `x`).
fn metrics_read(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("nrtxn_"))
        .map(|t| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| t.strip_suffix(s))
                .unwrap_or(t)
                .to_string()
        })
        .collect()
}

/// The dashboard's panels (rows' nested panels included), checked for what Grafana's
/// import needs, and the metrics their expressions read.
fn dashboard_metrics() -> BTreeSet<String> {
    let path = deploy_dir().join("grafana/nrtxn.json");
    let dash: serde_json::Value = serde_json::from_str(&read(&path))
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()));
    assert!(
        dash["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion"
    );
    assert!(dash["title"].is_string() && dash["uid"].is_string());
    let vars = dash["templating"]["list"].as_array().expect("templating");
    assert!(
        vars.iter().any(|v| v["type"] == "datasource"
            && v["query"] == "prometheus"
            && v["name"] == "datasource"),
        "a datasource variable of type prometheus named datasource"
    );
    let mut panels: Vec<&serde_json::Value> = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        panels.push(p);
        panels.extend(p["panels"].as_array().into_iter().flatten());
    }
    let mut ids = BTreeSet::new();
    let mut read = BTreeSet::new();
    for p in panels {
        assert!(ids.insert(p["id"].as_u64().expect("a panel id")), "{p}");
        for k in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][k].is_u64(), "gridPos.{k} of {}", p["title"]);
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{} has no target", p["title"]);
        for t in targets {
            assert!(t["refId"].is_string(), "{t}");
            let expr = t["expr"].as_str().expect("a Prometheus expr");
            let names = metrics_read(expr);
            assert!(!names.is_empty(), "{expr} reads no nrtxn metric");
            // Each panel follows the node chosen at its top.
            assert!(expr.contains("instance=~\"$instance\""), "{expr}");
            read.extend(names);
        }
    }
    read
}

/// The metric names of the manual's table of metrics (its rows' first cells), in the
/// book's API page.
fn readme_metrics() -> BTreeSet<String> {
    let readme = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src/api.md"));
    let table = readme
        .split_once("| name | type | labels | meaning |")
        .expect("the manual's table of metrics")
        .1;
    table
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.split('`').nth(1).expect("a `name` cell").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grafana_dashboard_and_readme_cover_every_metric_the_server_exposes() {
    use common::*;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s1", &[("sku-1", 5)]).await;
    let base = server.url("/v1/shops/s1");
    let sale = serde_json::json!({ "seller": "a", "item": "sku-1", "qty": 9, "request_id": "o-1" });
    assert_eq!(post(&c, &format!("{base}/txns"), sale).await.0, 200);
    let hold = serde_json::json!({ "item": "sku-1", "qty": 1, "ttl_ms": 100, "request_id": "h-1" });
    assert_eq!(post(&c, &format!("{base}/holds"), hold).await.0, 200);
    assert_eq!(get(&c, &format!("{base}/txns/nope")).await.0, 404);
    let text = metrics_text(&c, &server).await;
    let exposed: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect();
    // The scrape must have found the metrics, or the checks below are vacuous.
    for known in [
        "nrtxn_decisions_total",
        "nrtxn_http_requests_total",
        "nrtxn_stage_seconds",
    ] {
        assert!(exposed.contains(known), "{known} not in:\n{text}");
    }
    let charted = dashboard_metrics();
    let documented = readme_metrics();
    let uncharted: Vec<_> = exposed.difference(&charted).collect();
    assert!(
        uncharted.is_empty(),
        "deploy/grafana/nrtxn.json charts none of {uncharted:?}"
    );
    let undocumented: Vec<_> = exposed.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "the manual's table of metrics (docs/src/api.md) lacks {undocumented:?}"
    );
    // And nothing charted that the server does not have (a renamed metric).
    let unknown: Vec<_> = charted.difference(&documented).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard reads metrics the manual does not list: {unknown:?}"
    );
}

/// A `Cpus_allowed_list` (`0-1,4`) as its cores.
fn core_list(list: &str) -> BTreeSet<usize> {
    let mut cores = BTreeSet::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (from, to) = part.split_once('-').unwrap_or((part, part));
        cores.extend(from.parse::<usize>().unwrap()..=to.parse::<usize>().unwrap());
    }
    cores
}

/// The cores a thread (`/proc/PID/task/TID`, or `/proc/self`) may run on.
fn allowed_cores(proc_dir: &Path) -> BTreeSet<usize> {
    let status = read(&proc_dir.join("status"));
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list in status");
    core_list(list)
}

/// The cores each engine thread (`actix-rt|…`) of a running server may run on, once
/// `placed` holds of them or after `wait`, whichever comes first.
fn engine_thread_cores(
    pid: u32,
    wait: std::time::Duration,
    placed: impl Fn(&[BTreeSet<usize>]) -> bool,
) -> Vec<BTreeSet<usize>> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the server's threads");
        let cores: Vec<BTreeSet<usize>> = tasks
            .map(|t| t.unwrap().path())
            .filter(|t| read(&t.join("comm")).starts_with("actix-rt"))
            .map(|t| allowed_cores(&t))
            .collect();
        if placed(&cores) || std::time::Instant::now() > deadline {
            return cores;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn engine_threads_are_kept_one_to_a_core_only_when_the_cores_allowed_are_one_each() {
    use common::Server;
    use std::time::Duration;
    let allowed = allowed_cores(Path::new("/proc/self"));
    let one_each = allowed.len().to_string();
    let one_each_pinned = |cores: &[BTreeSet<usize>]| {
        cores.len() == allowed.len()
            && cores.iter().all(|c| c.len() == 1)
            && cores.iter().flatten().copied().collect::<BTreeSet<_>>() == allowed
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--arbiters", &one_each]);
    let cores = engine_thread_cores(server.pid(), Duration::from_secs(10), one_each_pinned);
    if allowed.len() >= 2 {
        assert!(
            one_each_pinned(&cores),
            "{one_each} engine threads on the cores {allowed:?}: each should have a core of its own, they have {cores:?}"
        );
    }
    drop(server);
    // Turned off, or with more engine threads than cores, the scheduler places them.
    let more = (allowed.len() + 1).to_string();
    for flags in [
        &["--arbiters", &one_each, "--pin-threads", "false"][..],
        &["--arbiters", &more][..],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::start(dir.path(), flags);
        // A placement is made as the server starts: a second is ample to see one.
        let cores = engine_thread_cores(server.pid(), Duration::from_secs(1), one_each_pinned);
        assert!(
            !cores.is_empty() && cores.iter().all(|c| *c == allowed),
            "with {flags:?} every engine thread should keep the cores {allowed:?}, they have {cores:?}"
        );
    }
}
