use std::sync::Arc;

use std::io;

use super::frame::sqlstate;
use super::*;

fn message(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![kind];
    m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
    m.extend_from_slice(body);
    m
}

fn error(code: &[u8; 5]) -> Vec<u8> {
    let mut body = b"SERROR\0C".to_vec();
    body.extend_from_slice(code);
    body.extend_from_slice(b"\0Mboom\0\0");
    message(b'E', &body)
}

fn observed() -> Observed<()> {
    Observed::new((), Arc::new(Wire::default()))
}

#[test]
fn a_failed_transaction_and_its_cause_are_read_one_byte_at_a_time() {
    let mut o = observed();
    let mut stream = message(b'Z', b"T");
    stream.extend(message(b'D', &[7; 300]));
    stream.extend(error(b"55P03"));
    stream.extend(message(b'Z', b"E"));
    // A later refusal in the failed transaction does not replace the cause.
    stream.extend(error(b"25P02"));
    stream.extend(message(b'Z', b"E"));
    for byte in stream.chunks(1) {
        o.read(byte);
    }
    assert!(o.wire.unfinished());
    assert_eq!(o.wire.abort().map(|r| r.code), Some(*b"55P03"));
    // COMMIT of a failed transaction: the server says ROLLBACK.
    o.read(&message(b'C', b"ROLLBACK\0"));
    o.read(&message(b'Z', b"I"));
    assert_eq!(o.wire.rollbacks(), 1);
    assert!(!o.wire.unfinished());
    // The cause is kept past the rollback, for the loop to read.
    assert_eq!(o.wire.abort().map(|r| r.code), Some(*b"55P03"));
}

#[test]
fn a_rollback_to_a_savepoint_clears_the_failure() {
    let mut o = observed();
    o.read(&message(b'Z', b"T"));
    let mut stream = error(b"22012");
    stream.extend(message(b'Z', b"E"));
    stream.extend(message(b'C', b"ROLLBACK\0"));
    stream.extend(message(b'Z', b"T"));
    o.read(&stream);
    assert!(!o.wire.unfinished());
    assert_eq!(o.wire.abort(), None);
}

#[test]
fn requests_are_counted_from_the_startup_message_on() {
    let mut o = observed();
    // Startup (untyped), then a Parse/Bind/Execute/Sync and a Query.
    let mut out = 12u32.to_be_bytes().to_vec();
    out.extend_from_slice(&[0, 3, 0, 0, 0, 0, 0, 0]);
    out.extend(message(b'P', b"\0SELECT 1\0\0\0"));
    out.extend(message(b'S', b""));
    out.extend(message(b'Q', b"COMMIT\0"));
    for chunk in out.chunks(3) {
        o.written(chunk);
    }
    assert_eq!(o.wire.state().sent.len(), 2);
    let still_owed = tokio::time::Duration::from_millis(1);
    o.read(&message(b'Z', b"T"));
    assert!(!block_on(o.wire.idle(still_owed)));
    o.read(&message(b'Z', b"I"));
    assert!(block_on(o.wire.idle(still_owed)));
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn transaction_control_is_counted() {
    let mut o = observed();
    o.read(&message(b'C', b"BEGIN\0"));
    o.read(&message(b'Z', b"T"));
    let begun = o.wire.marks();
    // A savepoint rolled back: no transaction ended.
    o.read(&message(b'C', b"ROLLBACK\0"));
    o.read(&message(b'Z', b"T"));
    assert_eq!(o.wire.marks().since(begun), None);
    // COMMIT AND CHAIN: committed, still in a transaction.
    o.read(&message(b'C', b"COMMIT\0"));
    o.read(&message(b'Z', b"T"));
    assert_eq!(o.wire.marks().since(begun), Some(true));
    // A ROLLBACK then a BEGIN in one simple query: ended, nothing kept.
    let before = o.wire.marks();
    o.read(&message(b'C', b"ROLLBACK\0"));
    o.read(&message(b'C', b"BEGIN\0"));
    o.read(&message(b'Z', b"T"));
    assert_eq!(o.wire.marks().since(before), Some(false));
    // Ended by the server: idle.
    let before = o.wire.marks();
    o.read(&message(b'Z', b"I"));
    assert_eq!(o.wire.marks().since(before), Some(false));
}

#[test]
fn a_fatal_error_ends_the_connection() {
    let mut o = observed();
    o.read(&message(b'Z', b"T"));
    assert!(!o.wire.closed());
    o.read(&message(b'E', b"SFATAL\0VFATAL\0C57P01\0Mterminating\0\0"));
    assert!(o.wire.closed() && o.wire.unfinished());
    assert_eq!(o.wire.pending().map(|r| r.code), Some(*b"57P01"));
}

#[test]
fn sqlstate_is_the_c_field() {
    assert_eq!(sqlstate(&error(b"40P01")[5..]), Some(*b"40P01"));
    assert_eq!(sqlstate(b"SERROR\0\0"), None);
    assert_eq!(sqlstate(b"Cabc"), None);
}

fn data_row(columns: &[Option<&[u8]>]) -> Vec<u8> {
    let mut body = (columns.len() as u16).to_be_bytes().to_vec();
    for column in columns {
        match column {
            Some(value) => {
                body.extend_from_slice(&(value.len() as i32).to_be_bytes());
                body.extend_from_slice(value);
            }
            None => body.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    message(b'D', &body)
}

/// A connection past its startup message, as the framer sees it.
fn started() -> Observed<Vec<u8>> {
    let mut o = Observed::new(Vec::new(), Arc::new(Wire::default()));
    o.written(&8u32.to_be_bytes());
    o.written(&[0, 3, 0, 0]);
    o
}

/// What tokio-postgres reads of `answers`, delivered one byte at a time.
fn seen(o: &mut Observed<Vec<u8>>, answers: &[u8]) -> Vec<u8> {
    let mut seen = Vec::new();
    for byte in answers.chunks(1) {
        let mut chunk = byte.to_vec();
        let dropped = o.read(&chunk);
        let kept = stream::compact(&mut chunk, &dropped);
        seen.extend_from_slice(&chunk[..kept]);
    }
    seen
}

/// A unit of two statements, the first parsed under a name.
fn unit() -> Vec<u8> {
    let mut unit = message(b'P', b"idem_a_v1\0SELECT $1\0\0\0");
    for _ in 0..2 {
        unit.extend(message(b'B', b"\0idem_a_v1\0\0\0\0\0\0\0"));
        unit.extend(message(b'E', b"\0\0\0\0\0"));
    }
    unit.extend(message(b'S', b""));
    unit
}

fn block_on_write(o: &mut Observed<Vec<u8>>, bytes: &[u8]) -> io::Result<usize> {
    use tokio::io::AsyncWriteExt;
    block_on(async {
        let n = o.write(bytes).await?;
        o.flush().await?;
        Ok(n)
    })
}

#[test]
fn the_unit_replaces_the_query_behind_what_precedes_it() {
    let mut o = started();
    o.inner.clear();
    o.wire
        .ride(b"COMMIT".to_vec(), unit(), vec![Some("idem_a_v1")]);
    // A Close and a Sync of a dropped statement, then COMMIT, in one write.
    let mut out = message(b'C', b"Ss7\0");
    out.extend(message(b'S', b""));
    out.extend(message(b'Q', b"COMMIT\0"));
    assert_eq!(block_on_write(&mut o, &out).unwrap(), out.len());
    let mut expected = message(b'C', b"Ss7\0");
    expected.extend(message(b'S', b""));
    expected.extend(unit());
    assert_eq!(o.inner, expected);
    // Two requests counted (the Sync and the unit's), as written.
    assert_eq!(o.wire.state().sent.len(), 2);
    // Taken once: the next query goes out as it is.
    o.inner.clear();
    let next = message(b'Q', b"COMMIT\0");
    block_on_write(&mut o, &next).unwrap();
    assert_eq!(o.inner, next);
}

#[test]
fn the_unit_waits_past_a_message_split_across_writes() {
    let mut o = started();
    o.inner.clear();
    o.wire.ride(b"COMMIT".to_vec(), unit(), Vec::new());
    let parse = message(b'P', b"\0SELECT 1\0\0\0");
    // Half a Parse: written as it is, the unit still waits.
    block_on_write(&mut o, &parse[..4]).unwrap();
    let mut rest = parse[4..].to_vec();
    rest.extend(message(b'S', b""));
    rest.extend(message(b'Q', b"COMMIT\0"));
    let mut written = 0;
    while written < rest.len() {
        written += block_on_write(&mut o, &rest[written..]).unwrap();
    }
    let mut expected = parse.clone();
    expected.extend(message(b'S', b""));
    expected.extend(unit());
    assert_eq!(o.inner, expected);
}

#[test]
fn no_query_goes_out_without_its_unit() {
    // The start of a Query whose rest is not in this write.
    let mut o = started();
    o.wire.ride(b"COMMIT".to_vec(), unit(), Vec::new());
    let commit = message(b'Q', b"COMMIT\0");
    let err = block_on_write(&mut o, &commit[..7]).expect_err("refused");
    assert!(err.to_string().contains("before anything commits"), "{err}");
    assert!(o.wire.closed());
    assert!(!o.wire.released_savepoint());
    // A Query other than the one the unit replaces.
    let mut o = started();
    o.inner.clear();
    o.wire.ride(b"COMMIT".to_vec(), unit(), Vec::new());
    let other = message(b'Q', b"RELEASE SAVEPOINT diesel_savepoint_1\0");
    let err = block_on_write(&mut o, &other).expect_err("refused");
    assert!(
        err.to_string().contains("other than the one expected"),
        "{err}"
    );
    assert!(o.wire.closed());
    assert!(o.inner.is_empty(), "nothing written");
    // What a savepoint the body left open sends: told apart (see
    // `Tx::commit_with`), until the ride is put down.
    assert!(o.wire.released_savepoint());
    o.wire.unride();
    assert!(!o.wire.released_savepoint());
}

#[test]
fn the_units_answer_reads_as_a_simple_querys_with_its_rows_kept() {
    let mut o = started();
    // A request of diesel's own still owed its answer (extended: its
    // ParseComplete and BindComplete are tokio-postgres's).
    o.written(&message(b'S', b""));
    o.wire
        .ride(b"BEGIN; SELECT 1".to_vec(), unit(), vec![Some("idem_a_v1")]);
    block_on_write(&mut o, &message(b'Q', b"BEGIN; SELECT 1\0")).unwrap();
    let mut theirs = message(b'1', b"");
    theirs.extend(message(b'2', b""));
    theirs.extend(data_row(&[Some(b"earlier")]));
    theirs.extend(message(b'C', b"SELECT 1\0"));
    theirs.extend(message(b'Z', b"I"));
    let mut ours = message(b'1', b"");
    ours.extend(message(b'2', b""));
    ours.extend(data_row(&[Some(b"a"), None]));
    ours.extend(data_row(&[Some(b""), Some(&[7; 5000])]));
    ours.extend(message(b'C', b"SELECT 2\0"));
    ours.extend(message(b'N', b"SNOTICE\0Mhi\0\0"));
    ours.extend(message(b'2', b""));
    ours.extend(message(b'C', b"SELECT 0\0"));
    ours.extend(message(b'Z', b"T"));
    let mut answers = theirs.clone();
    answers.extend(&ours);
    // The unit's ParseComplete and BindComplete are taken out; all else
    // passes, one byte at a time as a socket may deliver it.
    let mut expected = theirs;
    expected.extend(data_row(&[Some(b"a"), None]));
    expected.extend(data_row(&[Some(b""), Some(&[7; 5000])]));
    expected.extend(message(b'C', b"SELECT 2\0"));
    expected.extend(message(b'N', b"SNOTICE\0Mhi\0\0"));
    expected.extend(message(b'C', b"SELECT 0\0"));
    expected.extend(message(b'Z', b"T"));
    assert_eq!(seen(&mut o, &answers), expected);
    assert_eq!(o.wire.prepared("idem_a_v1"), (true, 0));
    assert_eq!(
        o.wire.unride().expect("answered").expect("readable"),
        vec![
            Answer {
                tag: b"SELECT 2".to_vec(),
                rows: vec![
                    vec![Some(b"a".to_vec()), None],
                    vec![Some(Vec::new()), Some(vec![7; 5000])],
                ],
            },
            Answer {
                tag: b"SELECT 0".to_vec(),
                rows: vec![],
            },
        ]
    );
    // Disarmed: later answers pass whole, and no row is kept.
    let later = [message(b'1', b""), data_row(&[Some(b"later")])].concat();
    assert_eq!(seen(&mut o, &later), later);
    assert_eq!(o.wire.unride(), None);
}

#[test]
fn an_unanswered_unit_yields_nothing_and_a_malformed_row_an_error() {
    let mut o = started();
    o.wire.ride(b"SELECT 1".to_vec(), unit(), Vec::new());
    block_on_write(&mut o, &message(b'Q', b"SELECT 1\0")).unwrap();
    o.read(&message(b'2', b""));
    o.read(&data_row(&[Some(b"1")]));
    assert_eq!(o.wire.unride(), None, "no ReadyForQuery yet");
    o.read(&message(b'Z', b"T"));
    o.wire.ride(b"SELECT 1".to_vec(), unit(), Vec::new());
    block_on_write(&mut o, &message(b'Q', b"SELECT 1\0")).unwrap();
    // A column longer than the row.
    o.read(&message(b'D', b"\0\x01\0\0\0\x09ab"));
    o.read(&message(b'Z', b"T"));
    assert_eq!(o.wire.unride(), Some(Err(MalformedRow)));
}

#[test]
fn a_statement_counts_as_prepared_once_its_parse_is_answered() {
    let mut o = started();
    let wire = Arc::clone(&o.wire);
    wire.ride(
        b"BEGIN".to_vec(),
        unit(),
        vec![None, Some("idem_a_v1"), Some("idem_b_v1")],
    );
    block_on_write(&mut o, &message(b'Q', b"BEGIN\0")).unwrap();
    o.read(&message(b'1', b""));
    o.read(&message(b'1', b""));
    assert_eq!(wire.prepared("idem_a_v1"), (true, 0));
    assert_eq!(
        wire.prepared("idem_b_v1"),
        (false, 0),
        "its Parse is not answered yet"
    );
    // A failure before the last Parse was answered: it is not prepared.
    o.read(&error(b"55P03"));
    o.read(&message(b'Z', b"E"));
    wire.unride();
    assert_eq!(wire.prepared("idem_b_v1"), (false, 0));
    // A ParseComplete of the application's own is not idem's.
    o.written(&message(b'S', b""));
    o.read(&message(b'1', b""));
    o.read(&message(b'Z', b"E"));
    assert_eq!(wire.prepared("idem_b_v1"), (false, 0));
    // A body's DEALLOCATE of one of them (the tag does not say which), or
    // DEALLOCATE ALL, or DISCARD ALL: all are to be prepared again, under a
    // new generation of names.
    for (tag, generation) in [
        (&b"DEALLOCATE\0"[..], 1),
        (b"DEALLOCATE ALL\0", 2),
        (b"DISCARD ALL\0", 3),
    ] {
        o.read(&message(b'C', tag));
        assert_eq!(wire.prepared("idem_a_v1"), (false, generation));
    }
}
