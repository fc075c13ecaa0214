//! The versioned UPDATE is prepared once per connection and reused.

use super::*;

#[derive(QueryableByName, Debug)]
struct Prepared {
    #[diesel(sql_type = Text)]
    statement: String,
    /// How often the server ran it (PostgreSQL 14+ counts plans per execution).
    #[diesel(sql_type = BigInt)]
    runs: i64,
}

/// The UPDATEs prepared on this connection, with how often each ran.
async fn prepared_updates(conn: &mut AsyncPgConnection) -> Vec<(String, i64)> {
    diesel::sql_query(
        "SELECT statement, generic_plans + custom_plans AS runs FROM pg_prepared_statements \
         WHERE statement LIKE 'UPDATE %' ORDER BY statement",
    )
    .load::<Prepared>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|p| (p.statement, p.runs))
    .collect()
}

#[tokio::test]
async fn the_update_is_prepared_once_per_connection() {
    let (_db, mut conn) = setup().await;
    doc(1, 1, "draft").insert(&mut conn).await.unwrap();
    doc(1, 2, "draft").insert(&mut conn).await.unwrap();
    for (id, version) in [(1, 0), (1, 1), (2, 0)] {
        Document::update(id)
            .tenant(1)
            .expect_version(version)
            .set(&Edit {
                body: json!(version),
            })
            .execute(&mut conn)
            .await
            .unwrap();
    }
    // A conflict goes through the same statement.
    Document::update(1)
        .tenant(1)
        .expect_version(0)
        .set(&Edit { body: json!(0) })
        .execute(&mut conn)
        .await
        .unwrap_err();

    let updates = prepared_updates(&mut conn).await;
    assert_eq!(
        updates,
        vec![(
            "UPDATE \"documents\" SET \"body\" = $1, \"version\" = \"version\" + 1 \
             WHERE (((\"documents\".\"tenant_id\" = $2) AND (\"documents\".\"document_id\" = $3)) \
             AND (\"documents\".\"version\" = $4)) \
             RETURNING \"documents\".\"tenant_id\", \"documents\".\"document_id\", \"documents\".\"body\", \
             \"documents\".\"status\", \"documents\".\"version\""
                .to_owned(),
            4
        )]
    );

    // A guarded transition has one more predicate, so one more statement; reused as well.
    for id in [1, 2] {
        let version = Document::find(id)
            .tenant(1)
            .load(&mut conn)
            .await
            .unwrap()
            .version;
        Document::update(id)
            .tenant(1)
            .expect_version(version)
            .expect_state("draft".into())
            .set(&SetStatus {
                status: "published".into(),
            })
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let updates = prepared_updates(&mut conn).await;
    assert_eq!(updates.len(), 2, "{updates:#?}");
    assert_eq!(updates[0].1, 4, "{updates:#?}");
    assert!(
        updates[1].0.contains("AND (\"documents\".\"status\" = $5)"),
        "{updates:#?}"
    );
    assert_eq!(updates[1].1, 2, "{updates:#?}");
}
