//! The client commands of `nrtxn` against a real server over HTTP: `items
//! load` (batches, malformed lines, refusals, resuming), `items list`, `items get`, `txn
//! submit`, `txn get`, and their messages when the server is down or a key is refused.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use serde_json::{json, Value};

/// `nrtxn ARGS` against `url`, shop `shop`, with the test's NRTXN_* variables out of
/// the way.
fn nrtxn(url: &str, shop: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nrtxn"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("NRTXN_") {
            cmd.env_remove(key);
        }
    }
    cmd.args(args)
        .args(["--url", url, "--shop", shop])
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .output()
        .expect("run nrtxn")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn write_csv(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

async fn stock(c: &reqwest::Client, server: &Server, item: &str) -> Value {
    let (status, body) = get(c, &server.url(&format!("/v1/shops/shop/items/{item}"))).await;
    assert_eq!(status, 200, "{item}: {body}");
    body["stock"].clone()
}

/// A file of 2,500 lines with three malformed ones and one the server refuses: every
/// other line is loaded, each bad one is reported with its line number, and the exit
/// is non-zero. Run again after the lines are fixed, only what was not loaded is: a sale
/// made in between on an item of an unchanged batch is not undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_load_reports_bad_lines_by_number_and_a_rerun_loads_only_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let csv = dir.path().join("items.csv");
    let mut lines = vec!["item,stock,per_buyer_max".to_string()];
    lines.extend((0..2_500).map(|i| format!("sku-{i:04},{},", 10 + i)));
    // Line numbers are 1-based and the header is line 1: item i is on line i + 2.
    lines[2_000 + 1] = "sku-2000,-1,".into(); // line 2002
    lines[2_100 + 1] = "sku-2100,ten,".into(); // line 2102
    lines[2_200 + 1] = "sku-2200,5".into(); // line 2202: a field short
    lines[2_300 + 1] = format!("{},5,", "x".repeat(200)); // line 2302: refused (name too long)
    write_csv(&csv, &lines);
    let csv_arg = csv.to_str().unwrap();

    let out = nrtxn(&server.base, "shop", &["items", "load", csv_arg], &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for line in ["2002", "2102", "2202", "2302"] {
        assert!(
            err.contains(&format!("items.csv:{line}:")),
            "line {line}: {err}"
        );
    }
    assert!(err.contains("2496 items loaded"), "{err}");
    assert!(err.contains("4 records refused"), "{err}");
    assert_eq!(stock(&c, &server, "sku-0000").await, 10);
    assert_eq!(stock(&c, &server, "sku-2499").await, 2_509);
    let (status, _) = get(&c, &server.url("/v1/shops/shop/items/sku-2000")).await;
    assert_eq!(status, 404);

    // A sale on an item of the first batch, then the lines fixed and the command run again.
    let (status, sold) = post(
        &c,
        &server.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "sku-0005", "qty": 15, "request_id": "sale-1"}),
    )
    .await;
    assert_eq!((status, &sold["status"]), (200, &json!("ok")), "{sold}");
    lines[2_000 + 1] = "sku-2000,1,".into();
    lines[2_100 + 1] = "sku-2100,1,".into();
    lines[2_200 + 1] = "sku-2200,1,".into();
    lines[2_300 + 1] = "sku-long,1,".into();
    write_csv(&csv, &lines);
    let out = nrtxn(&server.base, "shop", &["items", "load", csv_arg], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        stock(&c, &server, "sku-0005").await,
        0,
        "the sale was undone"
    );
    for item in ["sku-2000", "sku-2100", "sku-2200", "sku-long"] {
        assert_eq!(stock(&c, &server, item).await, 1, "{item}");
    }
    // Every item listed once, and `items list` agrees.
    let out = nrtxn(&server.base, "shop", &["items", "list"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed = text(&out.stdout);
    let rows: Vec<&str> = listed.lines().collect();
    assert_eq!(rows[0], "item\tstock\treserved\tseq");
    // 2,499 sku-NNNN (sku-2300 became sku-long) and sku-long.
    assert_eq!(rows.len(), 1 + 2_500, "{}", &listed[..200]);
    // Loaded, sold out (its sold_out alert is seq 3), and not loaded again.
    assert!(rows.contains(&"sku-0005\t0\t0\t3"), "sku-0005");
}

/// The load file is RFC 4180: a quoted field keeps its commas and doubled quotes, may
/// span lines (one record, reported by the line it starts on), and blank lines are
/// skipped; a bad record after them is reported by its own line in the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_load_reads_quoted_fields_across_lines_and_names_the_lines_in_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let csv = dir.path().join("items.csv");
    std::fs::write(
        &csv,
        "item,stock\r\n\"sku, \"\"big\"\"\",3\r\n\"two\nlines\",4\r\n\r\nbad,-1\r\nlast,5\r\n",
    )
    .unwrap();
    let out = nrtxn(
        &server.base,
        "shop",
        &["items", "load", csv.to_str().unwrap()],
        &[],
    );
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    // Line 3 holds a name with a line break (the server refuses control characters),
    // line 5 is blank, line 6 has a negative stock.
    assert!(err.contains("items.csv:3: "), "{err}");
    assert!(err.contains("control characters"), "{err}");
    assert!(err.contains("items.csv:6: stock \"-1\""), "{err}");
    assert!(err.contains("2 items loaded"), "{err}");
    let (status, body) = get(&c, &server.url("/v1/shops/shop/items")).await;
    assert_eq!(status, 200);
    let names: Vec<&str> = body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["item"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["last", "sku, \"big\""], "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_without_the_columns_is_refused_before_anything_is_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let csv = dir.path().join("bad.csv");
    std::fs::write(&csv, "name,qty\nsku-1,5\n").unwrap();
    let out = nrtxn(
        &server.base,
        "shop",
        &["items", "load", csv.to_str().unwrap()],
        &[],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("bad.csv:1: the header must name the columns item and stock"),
        "{err}"
    );
    let (_, body) = get(&client(), &server.url("/v1/shops/shop/items")).await;
    assert_eq!(body["items"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_get_and_txn_submit_and_get_print_the_servers_answers() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "shop", &[("sku-1", 5)]).await;
    let out = nrtxn(&server.base, "shop", &["items", "get", "sku-1"], &[]);
    assert!(out.status.success());
    let item: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(item["stock"], 5);

    let sell = |qty: &str, id: &str| {
        nrtxn(
            &server.base,
            "shop",
            &[
                "txn",
                "submit",
                "--item",
                "sku-1",
                "--qty",
                qty,
                "--request-id",
                id,
            ],
            &[],
        )
    };
    let out = sell("3", "o-1");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let outcome: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&outcome["status"], &outcome["stock_after"]),
        (&json!("ok"), &json!(2))
    );
    // Refused by the rules: the outcome printed, and exit 1.
    let out = sell("3", "o-2");
    assert!(!out.status.success());
    let outcome: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(outcome["status"], "insufficient_stock");
    assert!(text(&out.stderr).contains("insufficient_stock"));

    let out = nrtxn(&server.base, "shop", &["txn", "get", "o-1"], &[]);
    assert!(out.status.success());
    let polled: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&polled["request_key"], &polled["status"]),
        (&json!("o-1"), &json!("ok"))
    );
    let out = nrtxn(&server.base, "shop", &["txn", "get", "nope"], &[]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("404"), "{}", text(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_says_when_the_server_is_down_or_the_key_is_refused() {
    // Nothing listens on a port just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let down = format!("http://127.0.0.1:{port}");
    let out = nrtxn(&down, "shop", &["items", "list"], &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("cannot reach the server at {down}")),
        "{err}"
    );
    assert!(err.contains("is `nrtxn serve` running there?"), "{err}");
    assert_eq!(text(&out.stdout), "", "nothing on stdout");

    let dir = tempfile::tempdir().unwrap();
    let keys = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_nrtxn"))
            .args(["keys", "create"])
            .args(args)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        text(&out.stdout).trim().to_string()
    };
    let seller = keys(&["--role", "seller", "--shop", "shop"]);
    let other = keys(&["--role", "operator", "--shop", "other"]);
    let server = Server::start(dir.path(), &[]);
    let out = nrtxn(&server.base, "shop", &["items", "list"], &[]);
    assert!(
        text(&out.stderr).contains("the server needs an access key"),
        "{}",
        text(&out.stderr)
    );
    let out = nrtxn(
        &server.base,
        "shop",
        &["items", "list", "--key", "nrtxn_x_y"],
        &[],
    );
    assert!(
        text(&out.stderr).contains("the server refused the access key"),
        "{}",
        text(&out.stderr)
    );
    let out = nrtxn(
        &server.base,
        "shop",
        &["items", "list"],
        &[("NRTXN_KEY", &other)],
    );
    let err = text(&out.stderr);
    assert!(
        err.contains("the access key may not do this in shop shop"),
        "{err}"
    );
    assert!(!out.status.success());
    let out = nrtxn(
        &server.base,
        "shop",
        &["items", "list"],
        &[("NRTXN_KEY", &seller)],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A seller may not load: the load says so and stops.
    let csv = dir.path().join("items.csv");
    std::fs::write(&csv, "item,stock\nsku-1,5\n").unwrap();
    let out = nrtxn(
        &server.base,
        "shop",
        &["items", "load", csv.to_str().unwrap()],
        &[("NRTXN_KEY", &seller)],
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("needs an operator key"),
        "{}",
        text(&out.stderr)
    );
}

/// `nrtxn watch --item I`: the item's state once its stream is open, then a line per
/// change of that item only (not another item's, not another shop's), in seq order,
/// and it stops after `--max-events`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_the_state_then_each_change_of_the_item_from_the_stream() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "shop", &[("sku-1", 10), ("sku-2", 10)]).await;
    load(&c, &server, "other", &[("sku-1", 10)]).await;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nrtxn"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("NRTXN_") {
            cmd.env_remove(key);
        }
    }
    let mut child = cmd
        .args(["watch", "--item", "sku-1", "--max-events", "3"])
        .args(["--url", &server.base, "--shop", "shop"])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run nrtxn watch");
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let wait = std::time::Duration::from_secs(30);
    // Its first line is written once the stream is open: the changes below are in it.
    let first = rx.recv_timeout(wait).expect("watch's first line");
    assert_eq!(first, "sku-1: stock 10 reserved 0 (seq 1)");
    let base = server.url("/v1/shops");
    let sale = |shop: &str, item: &str, id: &str, op: &str| json!({"seller": "s", "item": item, "qty": 2, "op": op, "request_id": format!("{shop}-{id}")});
    assert_eq!(
        post(
            &c,
            &format!("{base}/other/txns"),
            sale("other", "sku-1", "1", "decrement")
        )
        .await
        .0,
        200
    );
    assert_eq!(
        post(
            &c,
            &format!("{base}/shop/txns"),
            sale("shop", "sku-2", "2", "decrement")
        )
        .await
        .0,
        200
    );
    assert_eq!(
        post(
            &c,
            &format!("{base}/shop/txns"),
            sale("shop", "sku-1", "3", "decrement")
        )
        .await
        .0,
        200
    );
    assert_eq!(
        post(
            &c,
            &format!("{base}/shop/txns"),
            sale("shop", "sku-1", "4", "increment")
        )
        .await
        .0,
        200
    );
    let hold = json!({"item": "sku-1", "qty": 3, "ttl_ms": 60000, "request_id": "h-1"});
    assert_eq!(post(&c, &format!("{base}/shop/holds"), hold).await.0, 200);
    let mut lines = Vec::new();
    for _ in 0..3 {
        lines.push(rx.recv_timeout(wait).expect("a line per change"));
    }
    assert_eq!(
        lines,
        [
            "sku-1: stock 8 reserved 0 (seq 2: decrement 2 ok)",
            "sku-1: stock 10 reserved 0 (seq 3: increment 2 ok)",
            "sku-1: stock 7 reserved 3 (seq 4: hold 3 ok)",
        ]
    );
    // --max-events 3: it ends by itself, with success.
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < wait, "watch did not stop after 3 changes");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}
