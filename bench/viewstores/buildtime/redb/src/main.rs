fn main(){ let _ = redb::Database::create("/tmp/bt.redb").unwrap(); }
