fn main(){ let c = rusqlite::Connection::open_in_memory().unwrap(); c.execute_batch("create table t(x)").unwrap(); }
