//! Reading a shop: the item list, page by page, on the embedded journal and on
//! MongoDB, through the real binary over HTTP.

mod common;

use common::*;
use serde_json::{json, Value};

/// Loads `names` with stock = their index, in calls of at most 10,000 items.
async fn load_names(c: &reqwest::Client, server: &Server, shop: &str, names: &[String]) {
    for chunk in names.chunks(10_000) {
        let items: Vec<Value> = chunk
            .iter()
            .map(|n| json!({ "item": n, "stock": n.len() as i64 }))
            .collect();
        let (status, body) = call(
            c,
            reqwest::Method::PUT,
            &server.url(&format!("/v1/shops/{shop}/items")),
            Some(json!({ "items": items }).to_string()),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
}

/// Every page of the shop's list, following `next`: the items' names in the order read,
/// and every item as listed.
async fn read_all(
    c: &reqwest::Client,
    server: &Server,
    shop: &str,
    limit: Option<usize>,
) -> (Vec<String>, Vec<Value>) {
    let mut after: Option<String> = None;
    let (mut names, mut items) = (Vec::new(), Vec::new());
    let mut pages = 0;
    loop {
        let mut url = server.url(&format!("/v1/shops/{shop}/items?"));
        if let Some(n) = limit {
            url.push_str(&format!("limit={n}&"));
        }
        if let Some(a) = &after {
            url.push_str(&format!("after={}", urlencode(a)));
        }
        let (status, body) = get(c, &url).await;
        assert_eq!(status, 200, "{body}");
        let page = body["items"].as_array().unwrap();
        assert!(page.len() <= limit.unwrap_or(100), "{} items", page.len());
        for it in page {
            names.push(it["item"].as_str().unwrap().to_string());
            items.push(it.clone());
        }
        pages += 1;
        assert!(pages < 10_000, "no end to the pages");
        match &body["next"] {
            Value::Null => return (names, items),
            Value::String(n) => {
                assert_eq!(Some(n.as_str()), names.last().map(String::as_str));
                after = Some(n.clone());
            }
            other => panic!("next: {other}"),
        }
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Names of several lengths and scripts, and internal ones (`~...`) among them.
fn names(n: usize) -> (Vec<String>, Vec<String>) {
    let shown: Vec<String> = (0..n)
        .map(|i| match i % 4 {
            0 => format!("sku-{i:05}"),
            1 => format!("A{i}"),
            2 => format!("é-{i}"),
            _ => format!("z {i}"),
        })
        .collect();
    let internal: Vec<String> = (0..5).map(|i| format!("~order:{i}")).collect();
    (shown, internal)
}

async fn pages_through_every_item(flags: &[&str], n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), flags);
    let c = client();
    let (shown, internal) = names(n);
    let mut all: Vec<String> = shown.iter().chain(&internal).cloned().collect();
    all.reverse();
    load_names(&c, &server, "shop", &all).await;
    // Another shop's items are not this shop's.
    load(&c, &server, "other", &[("sku-00000", 1), ("B", 1)]).await;
    // A sale shows in the list.
    let (status, sold) = post(
        &c,
        &server.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "sku-00000", "qty": 3, "request_id": "sale-1"}),
    )
    .await;
    assert_eq!((status, &sold["status"]), (200, &json!("ok")), "{sold}");

    let mut want = shown.clone();
    want.sort(); // bytewise, as Rust compares strings
    for limit in [None, Some(1000), Some(7)] {
        let (got, items) = read_all(&c, &server, "shop", limit).await;
        assert_eq!(got.len(), want.len(), "limit {limit:?}");
        assert_eq!(got, want, "limit {limit:?}");
        for it in &items {
            assert_eq!(it["shop"], "shop");
            let name = it["item"].as_str().unwrap();
            // Loaded with stock = the name's length; sku-00000 (9) sold 3 since.
            let want_stock = name.len() as i64 - if name == "sku-00000" { 3 } else { 0 };
            assert_eq!(it["stock"], want_stock, "{it}");
            assert_eq!(it["seq"], if name == "sku-00000" { 2 } else { 1 }, "{it}");
        }
    }
    // After the last item, and a shop with no items: an empty page, no next.
    let last = want.last().unwrap();
    let (_, body) = get(
        &c,
        &server.url(&format!("/v1/shops/shop/items?after={}", urlencode(last))),
    )
    .await;
    assert_eq!(body, json!({"items": [], "next": null}));
    let (_, body) = get(&c, &server.url("/v1/shops/empty/items")).await;
    assert_eq!(body, json!({"items": [], "next": null}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_item_list_pages_through_every_item_in_order_without_internal_ones() {
    pages_through_every_item(&[], 2_345).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_item_list_pages_through_every_item_on_mongodb() {
    let Some(uri) = mongo_uri("itemlist") else {
        return;
    };
    pages_through_every_item(&["--mongo-uri", &uri], 150).await;
    drop_database(&uri).await;
}

/// On MongoDB a page reads each item's snapshot (`items`), then the journal's entries
/// from the snapshot's seq on: the list shows the entries past the snapshots, and an
/// altered one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_item_list_on_mongodb_reads_past_the_snapshots_and_refuses_altered_entries() {
    use mongodb::bson::{doc, Document};
    let Some(uri) = mongo_uri("itemsnap") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--mongo-uri", &uri]);
    let c = client();
    load(&c, &server, "shop", &[("a", 10), ("b", 10)]).await;
    let db = mongodb::Client::with_uri_str(&uri)
        .await
        .unwrap()
        .default_database()
        .unwrap();
    let snapshots = db.collection::<Document>("items");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    // Both snapshots written: b's is then its last entry, a's is behind the sales below.
    while snapshots
        .count_documents(doc! { "shop": "shop", "seq": 1_i64 })
        .await
        .unwrap()
        < 2
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no snapshots of a and b"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for k in ["k1", "k2"] {
        let body = json!({"seller": "s", "item": "a", "qty": 2, "request_id": k});
        let (status, res) = post(&c, &server.url("/v1/shops/shop/txns"), body).await;
        assert_eq!((status, &res["status"]), (200, &json!("ok")), "{res}");
    }
    let (status, body) = get(&c, &server.url("/v1/shops/shop/items")).await;
    assert_eq!(status, 200, "{body}");
    let got: Vec<(Value, Value, Value)> = body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|it| (it["item"].clone(), it["stock"].clone(), it["seq"].clone()))
        .collect();
    assert_eq!(
        got,
        [
            (json!("a"), json!(6), json!(3)),
            (json!("b"), json!(10), json!(1))
        ]
    );
    // The last entry of a, its quantity altered: the page is refused, not served.
    db.collection::<Document>("journal")
        .update_one(
            doc! { "shop": "shop", "item": "a", "seq": 3_i64 },
            doc! { "$set": { "qty": 5_i64 } },
        )
        .await
        .unwrap();
    let (status, body) = get(&c, &server.url("/v1/shops/shop/items")).await;
    assert_eq!(status, 503, "an altered entry was listed: {body}");
    drop(server);
    drop_database(&uri).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_limit_or_after_gets_400_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=-1", "limit"),
        ("limit=ten", "limit"),
        ("limit=1.5", "limit"),
        ("after=a%2Fb", "after"),
        (&format!("after={}", "x".repeat(129)), "after"),
        ("colour=red", "colour"),
    ] {
        let (status, body) = get(&c, &server.url(&format!("/v1/shops/s/items?{query}"))).await;
        assert_eq!(status, 400, "{query}: {body}");
        let detail = body["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(&format!("{field}:")),
            "{query}: {detail}"
        );
    }
    let (status, _) = get(&c, &server.url("/v1/shops/s/items?limit=1000&after=a")).await;
    assert_eq!(status, 200);
    // An empty `after` (a client's first page with its variable unset) is the first page.
    load(&c, &server, "s", &[("a", 1), ("b", 1)]).await;
    let (status, page) = get(&c, &server.url("/v1/shops/s/items?after=&limit=1")).await;
    assert_eq!(
        (status, &page["items"][0]["item"]),
        (200, &serde_json::json!("a")),
        "{page}"
    );
}
