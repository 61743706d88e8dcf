//! A shop's own small HTTP server on loopback, for the calls nrtxn makes to a shop (its
//! stock alerts): every call's signature header and JSON body is recorded, and each is
//! answered with the status set by the test.

use std::io::Write;
use std::net::TcpListener;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::read_http_request;

/// One call: its `X-Nrtxn-Signature`, its body as sent, and the status it was answered.
#[derive(Clone, Debug)]
pub struct Call {
    pub signature: String,
    pub body: String,
    pub status: u16,
}

impl Call {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).expect("a JSON body")
    }
}

pub struct Receiver {
    pub url: String,
    status: Arc<AtomicU16>,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Receiver {
    /// Listens on an ephemeral loopback port; answers `200` until told otherwise.
    pub fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/alerts", listener.local_addr().unwrap());
        let status = Arc::new(AtomicU16::new(200));
        let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
        let (s, c) = (status.clone(), calls.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let (s, c) = (s.clone(), c.clone());
                std::thread::spawn(move || {
                    let Some((headers, body)) = read_http_request(&stream) else {
                        return;
                    };
                    let signature = headers
                        .into_iter()
                        .find(|(k, _)| k == "x-nrtxn-signature")
                        .map(|(_, v)| v)
                        .unwrap_or_default();
                    let status = s.load(Ordering::SeqCst);
                    c.lock().unwrap().push(Call {
                        signature,
                        body: String::from_utf8(body).unwrap(),
                        status,
                    });
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    );
                });
            }
        });
        Receiver { url, status, calls }
    }

    /// Answers every call from now on with `status`.
    pub fn answer(&self, status: u16) {
        self.status.store(status, Ordering::SeqCst);
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits (up to `within`) until `done` holds of the calls so far, and returns them.
    pub async fn wait_for(&self, within: Duration, done: impl Fn(&[Call]) -> bool) -> Vec<Call> {
        let until = Instant::now() + within;
        loop {
            let calls = self.calls();
            if done(&calls) {
                return calls;
            }
            assert!(
                Instant::now() < until,
                "waited {within:?}; calls so far: {calls:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
