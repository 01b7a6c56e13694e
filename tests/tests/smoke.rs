//! Smoke test of the harness on each major: a pgoutput slot decodes one committed
//! insert as Begin, Relation, Insert (carrying the inserted values), Commit.

use trellara_tests::{ClusterOptions, Major, test_cluster};

const VALUE: &str = "hello from trellara";

#[test]
fn smoke_pg15() {
    smoke(Major::Pg15);
}

#[test]
fn smoke_pg16() {
    smoke(Major::Pg16);
}

#[test]
fn smoke_pg17() {
    smoke(Major::Pg17);
}

#[test]
fn smoke_pg18() {
    smoke(Major::Pg18);
}

fn smoke(major: Major) {
    let Some(cluster) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    assert_eq!(cluster.major(), major);
    assert_eq!(
        Major::from_server_version_num(cluster.server_version_num()),
        Some(major),
        "server_version_num {} is not {major}",
        cluster.server_version_num()
    );
    assert_eq!(cluster.psql_value("SHOW wal_level"), "logical");

    cluster.psql(
        "CREATE TABLE smoke (id int PRIMARY KEY, val text NOT NULL);
         CREATE PUBLICATION p FOR TABLE smoke;",
    );
    cluster.psql("SELECT pg_create_logical_replication_slot('s', 'pgoutput')");
    cluster.psql(&format!("INSERT INTO smoke VALUES (42, '{VALUE}')"));

    let mut client = cluster.connect();
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, \
             'proto_version', '1', 'publication_names', 'p')",
            &[],
        )
        .unwrap_or_else(|err| {
            panic!(
                "{major}: reading the slot failed: {err}\n{}",
                cluster.log_contents()
            )
        });
    let messages: Vec<Vec<u8>> = rows.iter().map(|row| row.get(0)).collect();
    let kinds: String = messages
        .iter()
        .map(|m| m.first().map_or('?', |&b| char::from(b)))
        .collect();
    assert_eq!(
        kinds, "BRIC",
        "{major}: pgoutput message kinds (Begin, Relation, Insert, Commit expected)"
    );

    let relation = Relation::parse(&messages[1]).expect("well-formed Relation message");
    assert_eq!(
        (relation.namespace.as_str(), relation.name.as_str()),
        ("public", "smoke")
    );
    let insert = &messages[2];
    assert!(
        insert.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
        "{major}: Insert message does not carry {VALUE:?}: {insert:?}"
    );
    let (relid, columns) = parse_insert(insert).expect("well-formed Insert message");
    assert_eq!(relid, relation.id, "Insert names the Relation's oid");
    assert_eq!(
        columns,
        [Some("42".to_owned()), Some(VALUE.to_owned())],
        "{major}: decoded insert columns"
    );
    println!(
        "smoke: {major} ({}) decoded {kinds}",
        cluster.server_version()
    );
}

/// The parts of a pgoutput Relation message this test checks.
struct Relation {
    id: u32,
    namespace: String,
    name: String,
}

impl Relation {
    /// `'R' relid:u32 namespace:cstr name:cstr ...`
    fn parse(msg: &[u8]) -> Option<Relation> {
        let mut r = Reader(msg);
        (r.u8()? == b'R').then_some(())?;
        Some(Relation {
            id: r.u32()?,
            namespace: r.cstr()?,
            name: r.cstr()?,
        })
    }
}

/// `'I' relid:u32 'N' ncols:u16 (kind:u8 ['t' len:u32 bytes])*` -> (relid, text columns)
fn parse_insert(msg: &[u8]) -> Option<(u32, Vec<Option<String>>)> {
    let mut r = Reader(msg);
    (r.u8()? == b'I').then_some(())?;
    let relid = r.u32()?;
    (r.u8()? == b'N').then_some(())?;
    let ncols = r.u16()?;
    let mut columns = Vec::new();
    for _ in 0..ncols {
        columns.push(match r.u8()? {
            b'n' => None,
            b't' => {
                let len = usize::try_from(r.u32()?).ok()?;
                Some(String::from_utf8(r.take(len)?.to_vec()).ok()?)
            }
            _ => return None,
        });
    }
    r.0.is_empty().then_some((relid, columns))
}

/// A bounds-checked big-endian reader.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1)?.first().copied()
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    fn cstr(&mut self) -> Option<String> {
        let end = self.0.iter().position(|&b| b == 0)?;
        let s = String::from_utf8(self.take(end)?.to_vec()).ok()?;
        self.take(1)?;
        Some(s)
    }
}
