//! The manual: the README and the book under `docs/` (mdBook's layout) hang together.
//! Every page of `docs/src` is in `SUMMARY.md`, every page the summary names exists,
//! and every relative link of the README and the book (included files too, from where
//! they live) reaches a file, and its `#anchor` a heading of the page it names. mdBook
//! itself need not be installed: headings become anchors as mdBook and GitHub make them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.md` file under `dir`.
fn pages(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(pages(&path));
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// The targets of the markdown links (`[text](target)`) in `line`.
fn links(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        match after.find(')') {
            Some(end) => {
                out.push(&after[..end]);
                rest = &after[end..];
            }
            None => break,
        }
    }
    out
}

/// A heading's anchor: its text without links' targets and code marks, lower case,
/// spaces as `-`, other punctuation dropped.
fn anchor(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](target)` keeps its text.
    while let Some(open) = rest.find("](") {
        text.push_str(&rest[..open]);
        rest = rest[open..]
            .find(')')
            .map_or("", |end| &rest[open + end + 1..]);
    }
    text.push_str(rest);
    text.trim()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The file's text with `{{#include path}}` lines replaced by the files they name, and
/// each included file, with the folder its links are relative to.
fn expand(path: &Path) -> Vec<(String, PathBuf)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let dir = path.parent().unwrap().to_path_buf();
    let mut parts = vec![(String::new(), dir.clone())];
    for line in text.lines() {
        match line
            .trim()
            .strip_prefix("{{#include ")
            .and_then(|l| l.strip_suffix("}}"))
        {
            Some(included) => {
                let target = dir.join(included.trim());
                assert!(
                    target.exists(),
                    "{}: includes {}",
                    path.display(),
                    target.display()
                );
                parts.extend(expand(&target));
                parts.push((String::new(), dir.clone()));
            }
            None => {
                let last = parts.last_mut().unwrap();
                last.0.push_str(line);
                last.0.push('\n');
            }
        }
    }
    parts
}

/// The anchors of the page at `path`, includes expanded.
fn anchors(path: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (text, _) in expand(path) {
        for line in prose(&text) {
            let hashes = line.chars().take_while(|c| *c == '#').count();
            if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
                out.insert(anchor(&line[hashes + 1..]));
            }
        }
    }
    out
}

#[test]
fn every_page_is_in_the_summary_and_the_summary_names_only_pages() {
    let src = root().join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let named: BTreeSet<PathBuf> = prose(&summary)
        .into_iter()
        .flat_map(links)
        .map(|l| src.join(l))
        .collect();
    for page in &named {
        assert!(
            page.exists(),
            "SUMMARY.md names {}, which is missing",
            page.display()
        );
    }
    for page in pages(&src) {
        if page.file_name().is_some_and(|n| n == "SUMMARY.md") {
            continue;
        }
        assert!(
            named.contains(&page),
            "{} is not in SUMMARY.md",
            page.display()
        );
    }
    assert!(root().join("docs/book.toml").exists());
}

#[test]
fn every_link_of_the_readme_and_the_book_reaches_its_file_and_heading() {
    let mut files = vec![root().join("README.md")];
    files.extend(pages(&root().join("docs/src")));
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let own = anchors(file);
        for (text, dir) in expand(file) {
            for target in prose(&text).into_iter().flat_map(links) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, fragment) = target.split_once('#').unwrap_or((target, ""));
                let page = if path.is_empty() {
                    None
                } else {
                    let resolved = dir.join(path);
                    if !resolved.exists() {
                        broken.push(format!("{}: {target}: no such file", file.display()));
                        continue;
                    }
                    Some(resolved)
                };
                if fragment.is_empty() {
                    continue;
                }
                let known = match &page {
                    None => own.contains(fragment),
                    Some(p) if p.extension().is_some_and(|e| e == "md") => {
                        anchors(p).contains(fragment)
                    }
                    Some(_) => true,
                };
                if !known {
                    broken.push(format!("{}: {target}: no such heading", file.display()));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the parser right?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_is_a_door_not_the_manual() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines; the manual goes in the book"
    );
    // The test command CI runs is the README's.
    assert!(
        readme.contains("\nscripts/test.sh\n"),
        "the test command is gone"
    );
}

#[test]
fn headings_become_anchors_as_mdbook_makes_them() {
    assert_eq!(
        anchor("The shop's push stream (server-sent events)"),
        "the-shops-push-stream-server-sent-events"
    );
    assert_eq!(
        anchor("Who a key is: `GET /v1/whoami`"),
        "who-a-key-is-get-v1whoami"
    );
    assert_eq!(anchor("[Link](x.md) text"), "link-text");
}
