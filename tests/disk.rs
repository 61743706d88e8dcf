//! A full disk. The campaign's disk-full case (`scripts/faults_disk.py`, as
//! root on a tmpfs) fills a real disk under load; here, without root, the start's check
//! is met by asking for more free space than any disk has. As root (CI), the floor is
//! checked on a small disk of its own: a tmpfs the test mounts.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const MIB: u64 = 1024 * 1024;

/// A tmpfs mounted for one test, unmounted when dropped.
struct SmallDisk {
    at: PathBuf,
}

impl SmallDisk {
    /// Mounts a tmpfs of `size_mb` at `at`, or says why it cannot (not root, no mount).
    fn mount(at: &Path, size_mb: u64) -> Result<SmallDisk, String> {
        std::fs::create_dir_all(at).map_err(|e| e.to_string())?;
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_mb}m"), "tmpfs"])
            .arg(at)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(SmallDisk {
            at: at.to_path_buf(),
        })
    }

    fn free(&self) -> u64 {
        let st = rustix::fs::statvfs(&self.at).expect("statvfs");
        st.f_bavail * st.f_frsize
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.at)
            .status();
    }
}

/// The least free space seen on a disk, read every 2 ms until stopped, and what each
/// file held then and at the reading before (which file took the room).
struct FreeSampler {
    least: Arc<AtomicU64>,
    files: Arc<Mutex<String>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FreeSampler {
    fn start(disk: &SmallDisk) -> FreeSampler {
        let at = disk.at.clone();
        let least = Arc::new(AtomicU64::new(u64::MAX));
        let files = Arc::new(Mutex::new(String::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, f, s) = (least.clone(), files.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut before = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let now = file_blocks(&at);
                if let Ok(st) = rustix::fs::statvfs(&at) {
                    let free = st.f_bavail * st.f_frsize;
                    if free < l.fetch_min(free, Ordering::Relaxed) {
                        *f.lock().unwrap() = now
                            .iter()
                            .map(|(name, bytes)| {
                                let was = before.iter().find(|(n, _)| n == name).map_or(0, |b| b.1);
                                format!("{name} {bytes} ({:+})", *bytes as i64 - was as i64)
                            })
                            .collect::<Vec<_>>()
                            .join(", ");
                    }
                }
                before = now;
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        FreeSampler {
            least,
            files,
            stop,
            thread: Some(thread),
        }
    }

    /// The least free space seen, and each file's bytes then (with their change since the
    /// reading before).
    fn least(&mut self) -> (u64, String) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        let files = self.files.lock().unwrap().clone();
        (self.least.load(Ordering::Relaxed), files)
    }
}

/// The bytes each file under `at` holds on the disk (its blocks), by path.
fn file_blocks(at: &Path) -> Vec<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut dirs = vec![at.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => dirs.push(entry.path()),
                Ok(m) => {
                    let name = entry
                        .path()
                        .strip_prefix(at)
                        .unwrap_or(&entry.path())
                        .display()
                        .to_string();
                    out.push((name, m.blocks() * 512));
                }
                Err(_) => {}
            }
        }
    }
    out
}

/// A batch of 200 sales of one unit each, over 50 items, with random request keys (the
/// views' key index is written at random, as with real keys).
async fn sell(c: &reqwest::Client, server: &Server, n: &mut u64) -> (u16, Value) {
    sell_n(c, server, n, 200).await
}

/// A batch of `count` sales, as [`sell`].
async fn sell_n(c: &reqwest::Client, server: &Server, n: &mut u64, count: usize) -> (u16, Value) {
    let txns: Vec<Value> = (0..count)
        .map(|_| {
            *n += 1;
            let key = format!("{:016x}-{n}", rand_u64(*n));
            json!({"seller": "s", "item": format!("i{}", *n % 50), "qty": 1,
                   "op": "decrement", "request_id": key})
        })
        .collect();
    post(
        c,
        &server.url("/v1/shops/s/txns/batch"),
        json!({ "txns": txns }),
    )
    .await
}

/// A well-mixed number from `n` (splitmix64): keys that land all over the key index.
fn rand_u64(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_own_writes_keep_the_disk_floor_and_writes_come_back_once_room_is_made() {
    const FLOOR_MB: u64 = 8;
    let dir = tempfile::tempdir().unwrap();
    let disk = match SmallDisk::mount(&dir.path().join("disk"), 64) {
        Ok(disk) => disk,
        Err(why) => {
            eprintln!(
                "skipped: the disk floor needs a small disk of its own, and a tmpfs cannot \
                 be mounted here ({why}); CI runs this as root"
            );
            return;
        }
    };
    let mut sampler = FreeSampler::start(&disk);
    let server = Server::start_data_at(
        dir.path(),
        &disk.at.join("data"),
        &["--disk-free-min-mb", &FLOOR_MB.to_string()],
    );
    let c = client();
    let items: Vec<(String, i64)> = (0..50).map(|i| (format!("i{i}"), 1_000_000_000)).collect();
    let items: Vec<(&str, i64)> = items.iter().map(|(i, s)| (i.as_str(), *s)).collect();
    load(&c, &server, "s", &items).await;

    // Another program fills the disk, leaving the floor and 6 MiB.
    let filler_path = disk.at.join("filler");
    let filler = std::fs::File::create(&filler_path).unwrap();
    let fill = disk.free() - (FLOOR_MB + 6) * MIB;
    rustix::fs::fallocate(&filler, rustix::fs::FallocateFlags::empty(), 0, fill).unwrap();
    drop(filler);

    // The server's writes use the room left until they are refused.
    let mut n = 0;
    let started = Instant::now();
    let mut taken = 0;
    let refused = loop {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no write refused after {taken} batches taken"
        );
        match sell(&c, &server, &mut n).await {
            (200, _) => taken += 1,
            (503, body) => break body,
            other => panic!("unexpected answer while the disk fills: {other:?}"),
        }
    };
    assert_eq!(refused["error"], "disk_full", "{}", refused["error"]);
    assert!(taken > 0, "refused before any write was taken");
    // Writes go on for 3 s at the floor: what was under way (the views, their
    // checkpoints) is written in the room the server kept, a WAL cut back gives some
    // back, and new writes are refused, or taken while that room lasts.
    let at_floor = Instant::now();
    while at_floor.elapsed() < Duration::from_secs(3) {
        let (status, body) = sell(&c, &server, &mut n).await;
        assert!(
            status == 200 || (status == 503 && body["error"] == "disk_full"),
            "unexpected answer at the floor: {status} {}",
            body["error"]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Room is made: writes are taken again, without a restart.
    std::fs::remove_file(&filler_path).unwrap();
    let freed = Instant::now();
    loop {
        let (status, body) = sell(&c, &server, &mut n).await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{}", body["error"]);
        assert!(
            freed.elapsed() < Duration::from_secs(10),
            "writes still refused 10 s after room was made: {}",
            body["detail"]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..5 {
        let (status, body) = sell(&c, &server, &mut n).await;
        assert_eq!(status, 200, "{}", body["error"]);
    }
    // An item written before the disk filled is still read from the views.
    let (status, _) = get(&c, &server.url("/v1/shops/s/items/i1")).await;
    assert_eq!(status, 200);

    // Killed, and started again with the floor and 3 MiB free: recovery (the views
    // catch up with the log) writes within the floor too, and the server gets ready.
    drop(server);
    let filler = std::fs::File::create(&filler_path).unwrap();
    let fill = disk.free() - (FLOOR_MB + 3) * MIB;
    rustix::fs::fallocate(&filler, rustix::fs::FallocateFlags::empty(), 0, fill).unwrap();
    drop(filler);
    let server = Server::start_data_at(
        dir.path(),
        &disk.at.join("data"),
        &["--disk-free-min-mb", &FLOOR_MB.to_string()],
    );
    wait_ready(&c, &server).await;
    // A sale is taken (what recovery was granted is given back as its checkpoint lands).
    let started = Instant::now();
    loop {
        let (status, body) = sell_n(&c, &server, &mut n, 1).await;
        if status == 200 {
            break;
        }
        assert!(
            status == 503 && started.elapsed() < Duration::from_secs(10),
            "after a start with the floor and 3 MiB free: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (least, files) = sampler.least();
    eprintln!(
        "least free space while the server wrote: {:.2} MiB (floor {FLOOR_MB} MiB)",
        least as f64 / MIB as f64
    );
    assert!(
        least >= FLOOR_MB * MIB,
        "free space went to {:.2} MiB, below the {FLOOR_MB} MiB floor; the files then: {files}",
        least as f64 / MIB as f64
    );
    // Every views transaction stayed within the room it asked for.
    let said = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(
        !said.contains("past its bound"),
        "{}",
        said.lines()
            .find(|l| l.contains("past its bound"))
            .unwrap_or_default()
    );
}

#[test]
fn a_start_on_a_disk_below_the_free_minimum_is_refused_saying_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    // 1 TiB free asked for: more than this machine's disk has.
    let (status, stderr) = serve_expecting_exit(
        dir.path(),
        &["--listen", "127.0.0.1:0", "--disk-free-min-mb", "1048576"],
    );
    assert!(!status.success(), "exit status {status:?}");
    let said = stderr.lines().last().unwrap_or_default();
    assert!(
        said.contains("is full")
            && said.contains("less than the 1048576.0 MiB")
            && said.contains("--disk-free-min-mb")
            && said.contains("Free space on that disk")
            && said.contains("then start again"),
        "{stderr}"
    );
    // Refused before anything is written: not even the data dir is made.
    assert!(!dir.path().join("data").exists());
}
