fn main(){ let d = fjall::Database::builder("/tmp/bt-fjall").temporary(true).open().unwrap(); let k = d.keyspace("a", fjall::KeyspaceCreateOptions::default).unwrap(); k.insert("a","b").unwrap(); }
