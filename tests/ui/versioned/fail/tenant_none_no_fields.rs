use diesel_async::AsyncPgConnection;
use idem::Versioned;

// A model without fields has no key and no version column: one error, at the
// empty braces, and the read below adds none of its own.
#[derive(Versioned)]
#[diesel(table_name = empties)]
#[versioned(tenant = none)]
struct Empty {}

async fn read(conn: &mut AsyncPgConnection) {
    let _ = Empty::find(7).load(conn).await;
}

fn main() {}
