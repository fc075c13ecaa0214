use diesel_async::AsyncPgConnection;
use idem::Versioned;

// A tuple struct cannot say which column each field is: one error, at its
// fields, and none for the read below.
#[derive(Versioned)]
#[diesel(table_name = documents)]
#[versioned(tenant = tenant_id, key = document_id)]
struct Document(i64, i64, String, i64);

async fn read(conn: &mut AsyncPgConnection) {
    let _ = Document::find(7).tenant(1).load(conn).await;
}

fn main() {}
