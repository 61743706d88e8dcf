//! The write and read concerns the journal asks for: majority, on disk, unless the URI
//! names its own (then kept, and what it gives up said at start).

/// Makes the journal's writes acknowledged only once a majority of the replica set has
/// them in its on-disk journal (`w: "majority", j: true`), unless the URI asks for a
/// write concern of its own; then it is kept, and what it gives up is returned, to be
/// said at start. Why: an outcome is answered once its transaction commits. With `w: 1`
/// the commit is acknowledged by the primary alone, and a primary that fails over
/// before a secondary has it takes the decision with it (the new primary never saw it,
/// and the old one rolls it back): an answered sale would be lost, its stock sold again.
/// Without `j` a majority may hold it in memory only. The server's default is majority
/// since MongoDB 5.0, but not every deployment's: nrtxn says what it needs rather than
/// inherit it. Every write of the journal is in a transaction, or takes the database's
/// write concern (`update_all`): this one setting covers them all.
pub fn durable_write_concern(options: &mut mongodb::options::ClientOptions) -> Option<String> {
    use mongodb::options::{Acknowledgment, WriteConcern};
    let Some(given) = &options.write_concern else {
        options.write_concern = Some(
            WriteConcern::builder()
                .w(Acknowledgment::Majority)
                .journal(true)
                .build(),
        );
        return None;
    };
    let majority = matches!(given.w, Some(Acknowledgment::Majority) | None);
    let journaled = given.journal != Some(false);
    (!majority || !journaled).then(|| {
        format!(
            "the MongoDB URI asks for write concern {given:?}: the journal's commits are then \
             acknowledged before a majority of the replica set has them on disk, and an \
             answered decision can be lost if the primary fails over. Leave w and journal \
             out of the URI (nrtxn then asks for w=majority, journal=true) unless the \
             replica set has one member"
        )
    })
}

/// Sets the client's read concern to `majority` unless the URI names one (`readConcernLevel`),
/// and returns what a weaker one gives up, to be said at start. Why: what nrtxn answers
/// from a read (a poll's outcome, an item's stock, what a node taking over a partition
/// rebuilds from) must not be rolled back by a failover. A `local` read on a primary can
/// see a write that a majority does not hold yet; if that primary then fails over, the
/// write is rolled back, and the answer (or the takeover's state) names a decision that
/// never happened. Every read of the journal's client inherits this setting, inside
/// transactions too.
pub fn durable_read_concern(options: &mut mongodb::options::ClientOptions) -> Option<String> {
    use mongodb::options::{ReadConcern, ReadConcernLevel};
    let Some(given) = &options.read_concern else {
        options.read_concern = Some(ReadConcern::majority());
        return None;
    };
    let durable = matches!(
        given.level,
        ReadConcernLevel::Majority | ReadConcernLevel::Linearizable
    );
    (!durable).then(|| {
        format!(
            "the MongoDB URI asks for read concern {:?}: polls, item reads and a takeover \
             may then see a write that a failover rolls back. Leave readConcernLevel out of \
             the URI (nrtxn then reads with majority)",
            given.level
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{durable_read_concern, durable_write_concern};
    use mongodb::options::{Acknowledgment, ClientOptions, ReadConcernLevel};

    async fn parsed(uri: &str) -> (ClientOptions, Option<String>) {
        let mut options = ClientOptions::parse(uri).await.unwrap();
        let warning = durable_write_concern(&mut options);
        (options, warning)
    }

    #[tokio::test]
    async fn without_one_in_the_uri_the_journal_asks_for_majority_on_disk() {
        let (options, warning) = parsed("mongodb://127.0.0.1:1/nrtxn?directConnection=true").await;
        let wc = options.write_concern.expect("set");
        assert_eq!(wc.w, Some(Acknowledgment::Majority));
        assert_eq!(wc.journal, Some(true));
        assert_eq!(warning, None);
    }

    #[tokio::test]
    async fn a_weaker_write_concern_in_the_uri_is_kept_and_said_at_start() {
        for uri in [
            "mongodb://127.0.0.1:1/?w=1",
            "mongodb://127.0.0.1:1/?w=majority&journal=false",
        ] {
            let (options, warning) = parsed(uri).await;
            assert_ne!(
                options.write_concern.as_ref().unwrap().journal,
                Some(true),
                "{uri}: kept as given"
            );
            let warning = warning.unwrap_or_else(|| panic!("{uri}: no warning"));
            assert!(warning.contains("can be lost"), "{warning}");
        }
        let (options, warning) = parsed("mongodb://127.0.0.1:1/?w=majority&journal=true").await;
        assert_eq!(
            options.write_concern.unwrap().w,
            Some(Acknowledgment::Majority)
        );
        assert_eq!(warning, None);
    }

    #[tokio::test]
    async fn reads_ask_for_majority_unless_the_uri_names_a_level_which_is_kept_and_said() {
        let mut options = ClientOptions::parse("mongodb://127.0.0.1:1/nrtxn")
            .await
            .unwrap();
        assert_eq!(durable_read_concern(&mut options), None);
        assert_eq!(
            options.read_concern.expect("set").level,
            ReadConcernLevel::Majority
        );
        let mut options = ClientOptions::parse("mongodb://127.0.0.1:1/?readConcernLevel=local")
            .await
            .unwrap();
        let warning = durable_read_concern(&mut options).expect("a warning");
        assert!(warning.contains("rolls back"), "{warning}");
        assert_eq!(
            options.read_concern.expect("kept").level,
            ReadConcernLevel::Local
        );
    }
}
