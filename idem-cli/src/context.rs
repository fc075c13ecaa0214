//! What every command needs: its result, the database pool, and a page of
//! a listing.

use std::error::Error as StdError;

use idem_runtime::operate::Page;
use idem_runtime::pool::{build_pool_with, Pool, PoolConfig};

use crate::args::{Cli, PageArgs};

/// A command's result: any error is printed and ends the process with 1.
pub type Result<T> = std::result::Result<T, Box<dyn StdError>>;

/// The page a listing's `--limit` and `--offset` ask for.
pub fn page(p: &PageArgs) -> Page {
    Page {
        limit: p.limit,
        offset: p.offset,
    }
}

/// A small pool on `--database-url` (or `DATABASE_URL`).
pub fn pool(cli: &Cli) -> Result<Pool> {
    let url = cli
        .database_url
        .as_deref()
        .filter(|u| !u.is_empty())
        .ok_or("no database: give --database-url or set DATABASE_URL")?;
    let config = PoolConfig {
        max_size: 2,
        ..PoolConfig::default()
    };
    Ok(build_pool_with(url, &config)?)
}
