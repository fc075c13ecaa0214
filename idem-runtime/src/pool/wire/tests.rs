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

#[test]
fn the_rows_of_the_captured_request_are_kept_and_no_others() {
    let mut o = started();
    // A request still owed its answer when the capture is armed.
    o.written(&message(b'Q', b"SELECT 'earlier'\0"));
    o.wire.ride(None, true, Vec::new());
    o.written(&message(b'Q', b"BEGIN; SELECT 1; SELECT 2\0"));
    let mut answers = message(b'T', b"\0\x01");
    answers.extend(data_row(&[Some(b"earlier")]));
    answers.extend(message(b'Z', b"I"));
    answers.extend(message(b'C', b"BEGIN\0"));
    answers.extend(message(b'T', b"\0\x01"));
    answers.extend(data_row(&[Some(b"first result")]));
    // Only the last result is kept: its rows, NULLs and empty values included.
    answers.extend(message(b'T', b"\0\x02"));
    answers.extend(data_row(&[Some(b"a"), None]));
    answers.extend(data_row(&[Some(b""), Some(&[7; 5000])]));
    answers.extend(message(b'C', b"SELECT 2\0"));
    answers.extend(message(b'Z', b"T"));
    // Byte by byte, as a socket may deliver it.
    for byte in answers.chunks(1) {
        o.read(byte);
    }
    let rows = o.wire.unride().expect("answered").expect("readable");
    assert_eq!(
        rows,
        vec![
            vec![Some(b"a".to_vec()), None],
            vec![Some(Vec::new()), Some(vec![7; 5000])],
        ]
    );
    // Disarmed: later rows are not kept.
    o.read(&data_row(&[Some(b"later")]));
    assert_eq!(o.wire.unride(), None);
}

#[test]
fn an_unanswered_capture_yields_nothing_and_a_malformed_row_an_error() {
    let mut o = started();
    o.wire.ride(None, true, Vec::new());
    o.written(&message(b'Q', b"SELECT 1\0"));
    o.read(&message(b'T', b"\0\x01"));
    o.read(&data_row(&[Some(b"1")]));
    assert_eq!(o.wire.unride(), None, "no ReadyForQuery yet");
    o.read(&message(b'Z', b"T"));
    o.wire.ride(None, true, Vec::new());
    o.written(&message(b'Q', b"SELECT 1\0"));
    o.read(&message(b'T', b"\0\x01"));
    // A column longer than the row.
    o.read(&message(b'D', b"\0\x01\0\0\0\x09ab"));
    o.read(&message(b'Z', b"T"));
    assert_eq!(o.wire.unride(), Some(Err(MalformedRow)));
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
fn a_prefix_rides_in_the_next_query_behind_what_precedes_it() {
    let mut o = started();
    o.inner.clear();
    o.wire.ride(
        Some(b"INSERT INTO t VALUES (1)".to_vec()),
        false,
        Vec::new(),
    );
    // A Close and a Sync of a dropped statement, then COMMIT, in one write.
    let mut out = message(b'C', b"Ss7\0");
    out.extend(message(b'S', b""));
    out.extend(message(b'Q', b"COMMIT\0"));
    assert_eq!(block_on_write(&mut o, &out).unwrap(), out.len());
    let mut expected = message(b'C', b"Ss7\0");
    expected.extend(message(b'S', b""));
    expected.extend(message(b'Q', b"INSERT INTO t VALUES (1); COMMIT\0"));
    assert_eq!(o.inner, expected);
    // Two requests counted (the Sync and the Query), as written.
    assert_eq!(o.wire.state().sent.len(), 2);
    // Taken once: the next query goes out as it is.
    o.inner.clear();
    let next = message(b'Q', b"SELECT 1\0");
    block_on_write(&mut o, &next).unwrap();
    assert_eq!(o.inner, next);
    assert_eq!(o.wire.unride(), None);
}

#[test]
fn a_prefix_waits_past_a_message_split_across_writes() {
    let mut o = started();
    o.inner.clear();
    o.wire
        .ride(Some(b"SELECT 'riding'".to_vec()), false, Vec::new());
    let parse = message(b'P', b"\0SELECT 1\0\0\0");
    // Half a Parse: written as it is, the prefix still waits.
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
    expected.extend(message(b'Q', b"SELECT 'riding'; COMMIT\0"));
    assert_eq!(o.inner, expected);
}

#[test]
fn a_prefix_never_lets_a_query_out_without_it() {
    let mut o = started();
    o.wire.ride(
        Some(b"INSERT INTO t VALUES (1)".to_vec()),
        false,
        Vec::new(),
    );
    // The start of a Query whose rest is not in this write.
    let commit = message(b'Q', b"COMMIT\0");
    let err = block_on_write(&mut o, &commit[..7]).expect_err("refused");
    assert!(err.to_string().contains("before anything commits"), "{err}");
    assert!(o.wire.closed());
}

#[test]
fn a_statement_counts_as_prepared_once_its_prepare_is_answered() {
    let mut o = started();
    let wire = Arc::clone(&o.wire);
    wire.ride(None, true, vec!["idem_a_v1", "idem_b_v1"]);
    o.written(&message(
        b'Q',
        b"BEGIN; PREPARE ..; PREPARE ..; EXECUTE ..\0",
    ));
    o.read(&message(b'C', b"BEGIN\0"));
    o.read(&message(b'C', b"PREPARE\0"));
    assert_eq!(wire.prepared("idem_a_v1"), (true, 0));
    assert_eq!(
        wire.prepared("idem_b_v1"),
        (false, 0),
        "its PREPARE is not answered yet"
    );
    // The second PREPARE answered, then a later statement fails: both stay
    // prepared (PREPARE is not undone by a rollback).
    o.read(&message(b'C', b"PREPARE\0"));
    o.read(&error(b"55P03"));
    o.read(&message(b'Z', b"E"));
    wire.unride();
    assert_eq!(wire.prepared("idem_b_v1"), (true, 0));
    // A PREPARE of the application's own is not idem's.
    o.read(&message(b'C', b"PREPARE\0"));
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
        assert_eq!(wire.prepared("idem_b_v1"), (false, generation));
    }
}

#[test]
fn the_capture_is_the_simple_query_not_a_sync_written_before_it() {
    let mut o = started();
    o.wire.ride(None, true, Vec::new());
    // A Close and Sync of a dropped statement go out in the same write.
    let mut out = message(b'C', b"Ss3\0");
    out.extend(message(b'S', b""));
    out.extend(message(b'Q', b"BEGIN; SELECT 'mine'\0"));
    o.written(&out);
    // The Sync's answer first, then the query's.
    let mut answers = message(b'3', b"");
    answers.extend(message(b'Z', b"I"));
    answers.extend(message(b'C', b"BEGIN\0"));
    answers.extend(message(b'T', b"\0\x01"));
    answers.extend(data_row(&[Some(b"mine")]));
    answers.extend(message(b'Z', b"T"));
    o.read(&answers);
    assert_eq!(
        o.wire.unride(),
        Some(Ok(vec![vec![Some(b"mine".to_vec())]]))
    );
}
