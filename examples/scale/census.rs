//! What the database says happened: counted by the server, never by the
//! processes that did it.

/// The counts of the last line, and the hot account's books.
#[derive(Debug)]
pub struct Census {
    /// Effect rows.
    pub effects: i64,
    /// Effect rows beyond the first of their key.
    pub duplicate_effects: i64,
    /// Keys acknowledged to the client with no effect row.
    pub lost: i64,
    /// The hot account's balance and version.
    pub hot_balance: i64,
    /// The hot account's version: one per committed write.
    pub hot_version: i64,
    /// Sum and count of the hot effects, which the balance and version must match.
    pub hot_effects_sum: i64,
    /// Number of hot effects.
    pub hot_effects: i64,
}

impl Census {
    /// The hot account's balance and version are exactly what its effects say.
    pub fn hot_books_balance(&self) -> bool {
        self.hot_balance == self.hot_effects_sum && self.hot_version == self.hot_effects
    }
}

/// Count, on a direct connection to the database at `url`, given the keys
/// the client saw acknowledged.
pub async fn take(
    url: &str,
    acknowledged: &[String],
) -> Result<Census, Box<dyn std::error::Error>> {
    let client = idem_testing::connect(url).await?;
    let scalar = |sql: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(sql, &[])
                .await
                .map(|row| row.get::<_, i64>(0))
        }
    };
    let effects = scalar("SELECT count(*) FROM scale_effects").await?;
    let duplicate_effects = scalar(
        "SELECT coalesce(sum(n - 1), 0)::bigint FROM \
         (SELECT count(*) AS n FROM scale_effects GROUP BY key HAVING count(*) > 1) AS d",
    )
    .await?;
    let lost: i64 = client
        .query_one(
            "SELECT count(*) FROM unnest($1::text[]) AS k(key) \
             WHERE NOT EXISTS (SELECT 1 FROM scale_effects e WHERE e.key = k.key)",
            &[&acknowledged],
        )
        .await?
        .get(0);
    let account = client
        .query_one(
            "SELECT balance, version FROM scale_accounts WHERE id = 1",
            &[],
        )
        .await?;
    let hot = client
        .query_one(
            "SELECT coalesce(sum(amount), 0)::bigint, count(*) FROM scale_effects WHERE kind = 'hot'",
            &[],
        )
        .await?;
    Ok(Census {
        effects,
        duplicate_effects,
        lost,
        hot_balance: account.get(0),
        hot_version: account.get(1),
        hot_effects_sum: hot.get(0),
        hot_effects: hot.get(1),
    })
}

/// Server connections open to database `name` now.
pub async fn server_connections(
    admin_url: &str,
    name: &str,
) -> Result<i64, Box<dyn std::error::Error>> {
    let client = idem_testing::connect(admin_url).await?;
    Ok(client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
            &[&name],
        )
        .await?
        .get(0))
}
