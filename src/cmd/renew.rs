//! `leasectl renew --target T --token TOK [--ttl DUR]`: extends a lease taken by `acquire` —
//! between steps nothing else renews it. 76 when the token no longer holds the target.

use anyhow::Result;

use crate::cli::{DbArgs, RenewArgs};
use crate::exit::Exit;
use crate::store::leases;

pub async fn run(db: &DbArgs, args: RenewArgs) -> Result<Exit> {
    if args
        .ttl
        .is_some_and(|t| t < std::time::Duration::from_millis(100))
    {
        return Err(crate::error::usage("--ttl is too short (at least 100ms)"));
    }
    let db = super::connect(db).await?;
    let renewed = leases::renew(&db.client, &db.schema, &args.target, args.token, args.ttl).await?;
    match renewed {
        Some((fence, ttl)) => {
            crate::info!(
                "renewed '{}' (fence {}) for {}",
                args.target,
                crate::fmt::fence(fence),
                crate::fmt::duration(ttl)
            );
            Ok(Exit::Code(0))
        }
        None => {
            let why = leases::why_not_held(&db.client, &db.schema, &args.target, args.token);
            crate::say!("{}", why.await?);
            Ok(Exit::LeaseLost)
        }
    }
}
