//! What an attacker without a key, or one on the same machine, must not get, through the
//! real binary: the open mode answers only this machine's names (DNS rebinding),
//! `--metrics-listen` follows protected mode, the key commands do not invent a store,
//! secrets at rest are owner-only, and a restore never brings back a revoked key
//! unless asked to.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;
use serde_json::json;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

#[tokio::test]
async fn without_keys_a_loopback_server_answers_only_requests_for_this_machines_names() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let port = server.base.rsplit(':').next().unwrap().to_string();
    let url = server.url("/v1/shops/s/items/a");
    for host in [
        "localhost",
        &format!("localhost:{port}"),
        "127.0.0.1",
        "[::1]",
    ] {
        let res = c.get(&url).header("host", host).send().await.unwrap();
        assert_eq!(
            res.status().as_u16(),
            404,
            "Host {host}: served (no such item)"
        );
    }
    // A page whose name was rebound to 127.0.0.1 sends its own name.
    for host in ["evil.example", &format!("evil.example:{port}"), "10.0.0.1"] {
        let res = c
            .post(server.url("/v1/shops/s/txns"))
            .header("host", host)
            .json(&json!({"item": "a", "op": "increment", "qty": 5}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), 421, "Host {host}");
        let body: serde_json::Value = res.json().await.unwrap();
        assert!(
            body["detail"].as_str().unwrap().contains("DNS rebinding"),
            "{body}"
        );
    }
    let (status, _) = get(&c, &url).await;
    assert_eq!(status, 404, "nothing of the refused calls was applied");

    // Once keys are checked, the key is the guard: any name passes with one.
    let admin = create_key_in(&dir.path().join("data"), None, "admin");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let res = c
            .get(&url)
            .header("host", "shop.example")
            .bearer_auth(&admin)
            .send()
            .await
            .unwrap();
        if res.status().as_u16() == 404 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the key was not taken within 10 s: {}",
            res.status()
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn the_keyless_metrics_listener_follows_protected_mode() {
    let dir = tempfile::tempdir().unwrap();
    let (status, stderr) = serve_expecting_exit(dir.path(), &["--metrics-listen", "0.0.0.0:0"]);
    assert!(!status.success());
    assert!(
        stderr.contains("metrics_listen") && stderr.contains("--insecure-no-auth"),
        "{stderr}"
    );
    // On loopback it serves, to this machine's names only.
    let server = Server::start(dir.path(), &["--metrics-listen", "127.0.0.1:0"]);
    let metrics = server
        .stdout
        .lock()
        .unwrap()
        .iter()
        .find_map(|l| l.strip_prefix("nrtxn metrics on ").map(str::to_string))
        .expect("the metrics address is printed");
    let c = client();
    let res = c.get(&metrics).send().await.unwrap();
    assert_eq!(res.status().as_u16(), 200);
    let res = c
        .get(&metrics)
        .header("host", "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 421);
}

#[test]
fn keys_list_and_revoke_on_a_data_dir_that_does_not_exist_fail_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir");
    let m = missing.to_str().unwrap();
    for args in [
        vec!["keys", "list", "--data-dir", m],
        vec!["keys", "list", "--all", "--data-dir", m],
        vec!["keys", "revoke", "abc", "--data-dir", m],
    ] {
        let out = nrtxn(&args);
        assert!(!out.status.success(), "{args:?}: {out:?}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("does not exist") && stderr.contains("--data-dir"),
            "{args:?}: {stderr}"
        );
        assert!(!missing.exists(), "{args:?} created the data dir");
    }
    // An existing folder with no store is refused the same way, and left as it was.
    std::fs::create_dir(&missing).unwrap();
    let out = nrtxn(&["keys", "list", "--data-dir", m]);
    assert!(!out.status.success(), "{out:?}");
    assert!(text(&out.stderr).contains("keys.sqlite"), "{out:?}");
    assert_eq!(std::fs::read_dir(&missing).unwrap().count(), 0);
}

#[tokio::test]
async fn secrets_at_rest_are_owner_only_and_a_restore_brings_keys_back_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let admin = create_key_in(&data, None, "admin");
    let leaked = create_key_in(&data, Some("acme"), "seller");
    let server = Server::start(dir.path(), &[]);
    let c = client();
    // A check-back setting, so the backup has one to bring back.
    let res = c
        .put(server.url("/v1/shops/acme/settings"))
        .bearer_auth(&admin)
        .json(&json!({"check_url": "https://checks.example/nrtxn"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 200, "{:?}", res.text().await);
    for f in ["keys.sqlite", "checks.sqlite", "stream-cursor.key"] {
        assert_eq!(mode(&data.join(f)), 0o600, "{f}");
    }

    let backup = dir.path().join("backup");
    let out = nrtxn(&[
        "backup",
        "--data-dir",
        data.to_str().unwrap(),
        "--to",
        backup.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(mode(&backup), 0o700);
    // The push stream's cursor key too: cursors handed out before stay good.
    for f in ["keys.sqlite", "checks.sqlite", "stream-cursor.key"] {
        assert_eq!(mode(&backup.join(f)), 0o600, "backup's {f}");
    }
    // The leaked key is revoked after the backup was taken.
    let out = nrtxn(&[
        "keys",
        "revoke",
        leaked.split('_').nth(1).unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");

    let restore = |name: &str, keys_from: &str| {
        let to = dir.path().join(name);
        let out = nrtxn(&[
            "restore",
            "--from",
            backup.to_str().unwrap(),
            "--data-dir",
            to.to_str().unwrap(),
            "--keys-from",
            keys_from,
        ]);
        assert!(out.status.success(), "{out:?}");
        (to, text(&out.stderr))
    };
    // By default no key comes back, and the restore says so.
    let (plain, said) = restore("plain", "none");
    assert!(!plain.join("keys.sqlite").exists());
    assert!(said.contains("2 active keys were not restored"), "{said}");
    assert!(said.contains("check-back settings were restored"), "{said}");
    // From the backup: every key it holds, each printed; the revoked one is active again
    // there, which is why it is only done when asked.
    let (_, said) = restore("from-backup", "backup");
    assert_eq!(said.matches("restored key").count(), 2, "{said}");
    // From the data dir being replaced: its revocation holds.
    let (current, said) = restore("current", data.to_str().unwrap());
    assert_eq!(said.matches("restored key").count(), 1, "{said}");
    assert_eq!(mode(&current.join("keys.sqlite")), 0o600);
    assert_eq!(mode(&current.join("checks.sqlite")), 0o600);
    assert_eq!(
        std::fs::read(current.join("stream-cursor.key")).unwrap(),
        std::fs::read(data.join("stream-cursor.key")).unwrap(),
        "the same cursor key"
    );
    drop(server);

    let restored_dir = tempfile::tempdir().unwrap();
    std::fs::rename(&current, restored_dir.path().join("data")).unwrap();
    let server = Server::start(restored_dir.path(), &[]);
    let item = server.url("/v1/shops/acme/items/a");
    let res = c.get(&item).bearer_auth(&leaked).send().await.unwrap();
    assert_eq!(res.status().as_u16(), 401, "the revoked key stays revoked");
    let res = c.get(&item).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(res.status().as_u16(), 404, "the admin key works");
    let res = c
        .get(server.url("/v1/shops/acme/settings"))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    let settings: serde_json::Value = res.json().await.unwrap();
    assert_eq!(
        settings["check_url"], "https://checks.example/nrtxn",
        "the check-back settings came back: {settings}"
    );
}
