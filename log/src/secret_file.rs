//! Files that hold secrets or their hashes (the access keys' store, the shops' check-back
//! settings with their signing secrets, backups of them) are readable by their owner
//! only: another account on the machine must not read a signing secret, nor take the
//! keys' hashes away to guess at them offline.

use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Owner read and write, nothing for others.
pub const FILE_MODE: u32 = 0o600;
/// Owner only, for a folder of such files (a backup).
pub const DIR_MODE: u32 = 0o700;

/// Makes `path` an owner-only file before SQLite opens it: created empty with
/// [`FILE_MODE`] if missing (an empty file is a valid new database, and SQLite gives its
/// `-wal` and `-shm` files the database file's mode), tightened to it if it exists (a
/// data dir made by an older version).
pub fn prepare(path: &Path) -> std::io::Result<()> {
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => tighten(path),
        Err(e) => Err(e),
    }
}

/// Sets an existing file (or folder, with [`DIR_MODE`]) to owner-only.
pub fn tighten(path: &Path) -> std::io::Result<()> {
    let mode = if path.is_dir() { DIR_MODE } else { FILE_MODE };
    std::fs::set_permissions(path, Permissions::from_mode(mode))
}

/// Creates the folder `path` (and its parents) with [`DIR_MODE`] for the folder itself.
pub fn create_dir(path: &Path) -> std::io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)?;
    tighten(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn new_and_existing_files_end_owner_only() {
        let dir = std::env::temp_dir().join(format!("nrtxn-secret-file-{}", std::process::id()));
        create_dir(&dir).unwrap();
        assert_eq!(mode(&dir), DIR_MODE);
        let new = dir.join("new.sqlite");
        prepare(&new).unwrap();
        assert_eq!(mode(&new), FILE_MODE);
        let old = dir.join("old.sqlite");
        std::fs::write(&old, b"x").unwrap();
        std::fs::set_permissions(&old, Permissions::from_mode(0o644)).unwrap();
        prepare(&old).unwrap();
        assert_eq!(mode(&old), FILE_MODE);
        assert_eq!(
            std::fs::read(&old).unwrap(),
            b"x",
            "an existing file is kept"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
