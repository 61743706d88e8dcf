"""Reads nrtxn's MongoDB journal with pymongo (a client nrtxn did not write) and checks
the documented fields, types and indexes. Usage: mongo_schema.py URI (database in the
path). Exits non-zero with a message on the first mismatch."""

import sys

import pymongo

uri = sys.argv[1]
client = pymongo.MongoClient(uri, serverSelectionTimeoutMS=5000)
db = client.get_default_database()

FIELDS = {
    "shop": str, "item": str, "seq": (int, type(None)), "prev_seq": (int, type(None)),
    "request_key": (str, type(None)), "op": str, "qty": int, "status": str,
    "reason": (str, type(None)), "stock_before": (int, type(None)),
    "stock_after": (int, type(None)), "reserved_after": (int, type(None)),
    "submitted_at": int, "completed_at": int, "seller": (str, type(None)),
    "buyer": (str, type(None)), "remarks": (str, type(None)), "batch": int, "node": int,
    # xxh3-64 of the request's op, item, quantity and TTL, as a signed 64-bit integer.
    "fingerprint": int,
}
# Only documents of requests read from a partitioned log (Kafka) carry these: the
# partition, the offset and the epoch of the partition's lease they were written under.
LOG_FIELDS = {"partition": int, "offset": int, "epoch": int}

docs = list(db.journal.find())
for d in docs:
    for field, kind in FIELDS.items():
        assert field in d, f"journal document lacks {field}: {d}"
        assert isinstance(d[field], kind), f"{field} is {type(d[field])}: {d}"
    for field, kind in LOG_FIELDS.items():
        if "partition" in d:
            assert isinstance(d.get(field), kind), f"{field} of a log entry: {d}"
    assert d["op"] in ("decrement", "increment", "load", "sold_out", "low_stock", "back_in_stock"), d
    assert d["status"] in ("ok", "insufficient_stock", "unknown_item", "expired", "limit_exceeded"), d
    if d["seq"] is not None:
        assert d["prev_seq"] == d["seq"] - 1, d
        assert d["stock_after"] >= 0, d

# Sequences are gapless per item and keys unique per shop.
seqs = {}
for d in docs:
    if d["seq"] is not None:
        seqs.setdefault((d["shop"], d["item"]), []).append(d["seq"])
for key, s in seqs.items():
    assert sorted(s) == list(range(1, len(s) + 1)), (key, s)
keys = [(d["shop"], d["request_key"]) for d in docs if d["request_key"] is not None]
assert len(keys) == len(set(keys)), keys

statuses = sorted(d["status"] for d in docs)
assert statuses.count("insufficient_stock") == 1 and statuses.count("unknown_item") == 1, statuses

indexes = {i["name"]: i for i in db.journal.list_indexes()}
key_index = indexes["shop_request_key_unique"]
assert list(key_index["key"].items()) == [("shop", 1), ("request_key", 1)], key_index
assert key_index["unique"] and "partialFilterExpression" in key_index, key_index
seq_index = indexes["shop_item_seq_unique"]
assert list(seq_index["key"].items()) == [("shop", 1), ("item", 1), ("seq", 1)], seq_index
assert seq_index["unique"], seq_index
offset_index = indexes["partition_offset"]
assert list(offset_index["key"].items()) == [("partition", 1), ("offset", 1)], offset_index
return_index = indexes["shop_return_of"]
assert list(return_index["key"].items()) == [("shop", 1), ("return_of", 1)], return_index
assert "partialFilterExpression" in return_index, return_index
relay_index = indexes["node_1_batch_1"]
assert list(relay_index["key"].items()) == [("node", 1), ("batch", 1)], relay_index

item_indexes = {i["name"]: i for i in db.items.list_indexes()}
assert item_indexes["shop_item_unique"]["unique"], item_indexes
for it in db.items.find():
    for field in ("shop", "item", "stock", "reserved", "seq"):
        assert field in it, it
a = db.items.find_one({"shop": "s1", "item": "a"})
assert (a["stock"], a["seq"]) == (6, 4), a  # 3 - 2, one refused, + 5

# The duplicate-key rule really holds on the server.
try:
    db.journal.insert_one({**{k: docs[1][k] for k in FIELDS}, "shop": docs[1]["shop"]})
except pymongo.errors.DuplicateKeyError:
    pass
else:
    sys.exit("a second document with the same seq or request key was accepted")

print(f"journal: {len(docs)} documents checked")
