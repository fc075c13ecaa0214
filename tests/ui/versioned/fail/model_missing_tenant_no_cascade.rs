use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use idem::Versioned;

diesel::table! {
    documents (tenant_id, document_id) {
        tenant_id -> Int8,
        document_id -> Int8,
        body -> Text,
        version -> Int8,
    }
}

// Without `tenant = ..` the derive cannot tell whether the statements below
// must name a tenant: the one error is the attribute's, whichever they do.
#[derive(Queryable, Selectable, Versioned)]
#[diesel(table_name = documents)]
#[versioned(version = version, key = document_id)]
struct Document {
    tenant_id: i64,
    document_id: i64,
    body: String,
    version: i64,
}

async fn read(conn: &mut AsyncPgConnection) -> Result<String, idem::VersionedError> {
    let with_tenant = Document::find(7).tenant(1).load(conn).await?;
    let without = Document::find(7).load(conn).await?;
    Ok(with_tenant.body + &without.body)
}

fn main() {}
