//! The CLI's admin commands that only call the API: a tenant's keys and the scrape tokens of
//! `GET /metrics`.

use crate::client::Client;
use crate::print_json;
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Mint an API key (usable as E2B_API_KEY too); prints only the key, shown this once.
    Create {
        #[arg(long, default_value = "default")]
        tenant: String,
        /// What the key is for (shown by `key ls`).
        #[arg(long, default_value = "")]
        name: String,
        /// Spell it `e2b_<hex>`, the shape e2b SDKs 2.26 to 2.5x require of E2B_API_KEY.
        #[arg(long)]
        e2b: bool,
    },
    /// List a tenant's keys (never the keys themselves).
    Ls {
        #[arg(long, default_value = "default")]
        tenant: String,
    },
    /// Revoke a key by its id (`key ls`): its next call gets 401.
    Revoke {
        id: String,
        #[arg(long, default_value = "default")]
        tenant: String,
    },
}

#[derive(Subcommand)]
pub enum ScrapeTokenCommand {
    /// Mint a scrape token; prints only the token, shown this once. Prometheus presents it as
    /// a bearer token (`authorization: {credentials: <token>}` in its scrape config).
    Create {
        /// What the token is for (shown by `scrape-token ls`).
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List the scrape tokens (never the tokens themselves).
    Ls,
    /// Revoke a scrape token by its id (`scrape-token ls`): its next scrape gets 401.
    Rm { id: String },
}

pub fn keys(admin: &Client, command: KeyCommand) -> anyhow::Result<()> {
    match command {
        KeyCommand::Create { tenant, name, e2b } => {
            let k = admin.json(
                "POST",
                &format!("/v1/admin/tenants/{tenant}/keys"),
                Some(json!({"name": name, "e2b": e2b})),
            )?;
            println!("{}", k["key"].as_str().unwrap_or_default());
        }
        KeyCommand::Ls { tenant } => {
            print_json(&admin.json("GET", &format!("/v1/admin/tenants/{tenant}/keys"), None)?)
        }
        KeyCommand::Revoke { id, tenant } => {
            admin.json("DELETE", &format!("/v1/admin/tenants/{tenant}/keys/{id}"), None)?;
            eprintln!("revoked {id}");
        }
    }
    Ok(())
}

pub fn scrape_tokens(admin: &Client, command: ScrapeTokenCommand) -> anyhow::Result<()> {
    match command {
        ScrapeTokenCommand::Create { name } => {
            let t = admin.json("POST", "/v1/admin/scrape-tokens", Some(json!({ "name": name })))?;
            println!("{}", t["token"].as_str().unwrap_or_default());
        }
        ScrapeTokenCommand::Ls => print_json(&admin.json("GET", "/v1/admin/scrape-tokens", None)?),
        ScrapeTokenCommand::Rm { id } => {
            admin.json("DELETE", &format!("/v1/admin/scrape-tokens/{id}"), None)?;
            eprintln!("revoked {id}");
        }
    }
    Ok(())
}
