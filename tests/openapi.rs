//! The OpenAPI contract, against the real binary: `/openapi.json` is an
//! OpenAPI 3 document with every route the server serves, each with its method, path
//! parameters, role and body schemas, every schema it names defined; `/docs` renders it.

mod common;

use common::*;
use serde_json::Value;

/// Every `$ref` in `v` resolves in `doc`.
fn refs_resolve(doc: &Value, v: &Value, at: &str) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get("$ref") {
                let name = r.strip_prefix("#/components/schemas/").unwrap_or(r);
                assert!(
                    doc["components"]["schemas"].get(name).is_some(),
                    "{at}: {r} is not defined"
                );
            }
            for (k, v) in m {
                refs_resolve(doc, v, &format!("{at}.{k}"));
            }
        }
        Value::Array(a) => a.iter().for_each(|v| refs_resolve(doc, v, at)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_has_every_route_the_server_serves() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let (status, doc) = get(&c, &server.url("/openapi.json")).await;
    assert_eq!(status, 200);
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3."),
        "{}",
        doc["openapi"]
    );
    let mut ids = std::collections::HashSet::new();
    for (method, path, id, _) in nrtxn_api::ROUTES {
        let op = &doc["paths"][*path][*method];
        assert_eq!(
            op["operationId"], *id,
            "{method} {path} is not in the contract"
        );
        assert!(ids.insert(*id), "operationId {id} twice");
        // Its path parameters, each required.
        let declared: Vec<&str> = op["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["in"] == "path")
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        let in_path: Vec<&str> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
            .collect();
        assert_eq!(declared, in_path, "{method} {path}");
        assert!(op["x-nrtxn-role"].is_string(), "{method} {path}");
        assert!(op["responses"]["200"].is_object(), "{method} {path}");
        // Served: the router answers it (a placeholder for each parameter), never with
        // its "no such route".
        let concrete: String = path
            .split('/')
            .map(|s| if s.starts_with('{') { "x" } else { s })
            .collect::<Vec<_>>()
            .join("/");
        let m = reqwest::Method::from_bytes(method.to_ascii_uppercase().as_bytes()).unwrap();
        let body = (m != reqwest::Method::GET).then(|| "{}".to_string());
        if *id == "streamEvents" {
            // A stream never ends: its headers say it is served.
            let res = c.get(server.url(&concrete)).send().await.unwrap();
            assert_ne!(res.status().as_u16(), 404, "{method} {path} is not served");
            continue;
        }
        let (_, answer) = call(&c, m, &server.url(&concrete), body).await;
        assert_ne!(
            answer["detail"], "no such route",
            "{method} {path} is not served"
        );
    }
    // Every operation in the contract is a route: nothing documented that is not served.
    let documented: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p.as_object().unwrap().len())
        .sum();
    assert_eq!(documented, nrtxn_api::ROUTES.len());
    refs_resolve(&doc, &doc["paths"], "paths");
    // Roles as the access-key gate has them.
    assert_eq!(
        doc["paths"]["/v1/shops/{shop}/txns"]["post"]["x-nrtxn-role"],
        "seller"
    );
    assert_eq!(
        doc["paths"]["/v1/shops/{shop}/items"]["put"]["x-nrtxn-role"],
        "operator"
    );
    assert_eq!(doc["paths"]["/healthz"]["get"]["x-nrtxn-role"], "open");
    // Returns: a transaction may name the sale it returns, and its outcome may
    // be a refused return; a seller's free increment is the 403.
    let txn = &doc["components"]["schemas"]["Txn"]["properties"];
    assert_eq!(txn["return_of"]["type"], "string", "{txn}");
    let statuses = &doc["components"]["schemas"]["Outcome"]["properties"]["status"]["enum"];
    assert!(
        statuses
            .as_array()
            .unwrap()
            .contains(&Value::from("return_refused")),
        "{statuses}"
    );
    let forbidden = doc["paths"]["/v1/shops/{shop}/txns"]["post"]["responses"]["403"]
        ["description"]
        .as_str()
        .unwrap();
    assert!(forbidden.contains("return_of"), "{forbidden}");

    // `/docs` runs under the dashboard's Content-Security-Policy: its script is a file of
    // this server's, nothing inline, and no type is sniffed.
    let res = c.get(server.url("/docs")).send().await.unwrap();
    let csp = res.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("script-src 'self'"),
        "{csp}"
    );
    assert_eq!(res.headers()["x-content-type-options"], "nosniff");
    let page = res.text().await.unwrap();
    assert!(page.contains("/openapi.json") && page.contains(r#"<script src="/docs.js">"#));
    assert!(
        !page.contains("<script>") && !page.contains("<style>"),
        "nothing inline"
    );
    for asset in ["/docs.js", "/docs.css"] {
        let res = c.get(server.url(asset)).send().await.unwrap();
        assert_eq!(res.status().as_u16(), 200, "{asset}");
        assert_eq!(res.headers()["x-content-type-options"], "nosniff");
    }

    // A path served with other methods answers 405 and says which; an unknown one 404.
    let res = c
        .delete(server.url("/v1/shops/s/txns"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 405);
    assert_eq!(res.headers()["allow"], "POST");
    let (status, _) = get(&c, &server.url("/v1/shops/s/nothing-here")).await;
    assert_eq!(status, 404);
}
